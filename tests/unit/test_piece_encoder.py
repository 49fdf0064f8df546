"""scheduler.piece_encoder: word-cached byte-level BPE gives exactly the ids of the tokenizer itself
(called as vLLM calls it), on small tokenizers trained here and on SmolLM2's where prepared."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from scheduler import piece_encoder
from scheduler.piece_encoder import PieceEncoder
from scheduler.tokenizer_load import ModelTokenizer, load_model_tokenizer
from tests.tokenizer_support import TEXT, make_tokenizer, smollm2_dir

KINDS = ["byte_level", "split_byte_level", "smollm2"]
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# Where splits and cut points could go wrong: contractions in both cases, runs of whitespace of each
# kind, digit runs (Llama 3 groups three), symbols, control characters Python's \s counts and
# Oniguruma's does not, Unicode whitespace and letters, combining marks, emoji, added tokens whole
# and in part.
_FRAGMENTS = st.sampled_from(
    [
        "hello", " world", "The", " 's", "'S", "'ll", "'re", "don't", "x",
        " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\x0b", "\x0c",
        "1", "12", "1234567", " 3.14", "!", " ...", "?!", "--", "(", ")", "{}", "@#", "_", "`",
        "\x00", "\x1c", "\x1f", "\x7f",
        "caf\u00e9", " \u00e9", "\u6771\u4eac", "\U0001f600", "\u0301", "\u00a0", "\u3000", "\u2003",
        "\u180e", "\u200b", "\ufeff", "\u2019", " \u201c", "\u2014",
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im", "end|>",
    ]
)  # fmt: skip
_TEXTS = st.one_of(st.lists(_FRAGMENTS, max_size=24).map("".join), TEXT)


@pytest.fixture(scope="module", params=KINDS)
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ModelTokenizer:
    kind = request.param
    if kind == "smollm2":
        path = smollm2_dir()
        if path is None:
            pytest.skip("SmolLM2 is not prepared (symphony model fetch)")
    else:
        path = make_tokenizer(tmp_path_factory.mktemp(kind), kind=kind)
    loaded = load_model_tokenizer(kind, path)
    assert loaded.pieces is not None, f"{kind}: no piece encoder"
    return loaded


def whole(tokenizer: ModelTokenizer, text: str) -> list[int]:
    return list(tokenizer.tokenizer(text, add_special_tokens=False)["input_ids"])


@PROPERTY
@given(text=_TEXTS)
def test_any_text_gets_the_tokenizers_own_ids(tokenizer: ModelTokenizer, text: str) -> None:
    assert tokenizer.pieces is not None
    assert tokenizer.pieces.encode(text) == whole(tokenizer, text)
    assert tokenizer.encode(text, False) == whole(tokenizer, text)


@PROPERTY
@given(texts=st.lists(_TEXTS, min_size=2, max_size=6))
def test_words_cached_from_one_text_serve_the_next_exactly(tokenizer: ModelTokenizer, texts: list[str]) -> None:
    assert tokenizer.pieces is not None
    for text in [*texts, "".join(texts), *texts]:
        assert tokenizer.pieces.encode(text) == whole(tokenizer, text)


def test_non_ascii_text_costs_the_tokenizer_only_the_words_around_it(tokenizer: ModelTokenizer) -> None:
    pieces = tokenizer.pieces
    assert pieces is not None
    text = "plain words " * 50 + "a caf\u00e9 \u6771\u4eac here, " + "more plain words " * 50
    before = pieces.slow_chars
    assert pieces.encode(text) == whole(tokenizer, text)
    slow = pieces.slow_chars - before
    if tokenizer.name == "split_byte_level":
        assert slow == len(text)  # a Split pattern's pieces go whole
    else:
        assert 0 < slow <= len(" a caf\u00e9 \u6771\u4eac")


def test_the_word_cache_is_bounded_and_stays_exact(
    tokenizer: ModelTokenizer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(piece_encoder, "MAX_WORDS", 8)
    fresh = load_model_tokenizer("fresh", tokenizer.path)
    assert fresh.pieces is not None
    text = " ".join(f"word{i} w{i}x" for i in range(40))
    for _ in range(2):
        assert fresh.pieces.encode(text) == whole(tokenizer, text)
        assert len(fresh.pieces) <= 8
    long_word = "x" * (piece_encoder.MAX_WORD_CHARS + 1)
    assert fresh.pieces.encode(long_word) == whole(tokenizer, long_word)
    assert long_word not in fresh.pieces._words


def test_long_pieces_are_cached_whole_least_recently_used_out_first(
    tokenizer: ModelTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(piece_encoder, "MAX_SEGMENTS", 3)
    monkeypatch.setattr(piece_encoder, "MAX_SEGMENT_CHARS", 30 * piece_encoder.MIN_SEGMENT_CHARS)
    fresh = load_model_tokenizer("fresh", tokenizer.path)
    pieces = fresh.pieces
    assert pieces is not None
    size = piece_encoder.MIN_SEGMENT_CHARS
    system = ("You are a careful assistant. " * size)[:size]  # one piece between added tokens
    prompts = [f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nquestion {i}<|im_end|>\n" for i in range(6)]
    for i, prompt in enumerate(prompts):
        assert pieces.encode(prompt) == whole(tokenizer, prompt)
        assert pieces.segment_hits == i  # the shared system prompt, from the second prompt on
        # Others' long pieces come and go; the one in use stays (least recently used out first).
        other = f"<|im_start|>user\n{i} " + "w" * size + "<|im_end|>"
        assert pieces.encode(other) == whole(tokenizer, other)
    assert len(pieces._segments) <= 3
    assert sum(map(len, pieces._segments)) <= piece_encoder.MAX_SEGMENT_CHARS
    huge = "y " * piece_encoder.MAX_SEGMENT_CHARS  # over a tenth of the bound: not kept
    assert pieces.encode(huge) == whole(tokenizer, huge)
    assert huge not in pieces._segments and len(pieces._segments) > 0


def test_special_tokens_a_post_processor_adds_go_through_the_tokenizer(tmp_path: Path) -> None:
    loaded = load_model_tokenizer("bos", make_tokenizer(tmp_path, bos_post_processor=True))
    assert loaded.pieces is not None and loaded.special_tokens_added == 1
    text = "hello world"
    assert loaded.encode(text, True) == list(loaded.tokenizer(text, add_special_tokens=True)["input_ids"])
    assert loaded.encode(text, True)[0] == loaded.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert loaded.encode(text, False) == list(loaded.tokenizer(text, add_special_tokens=False)["input_ids"])


def test_tokenizers_it_cannot_reproduce_get_no_piece_encoder(tmp_path: Path) -> None:
    loaded = load_model_tokenizer("metaspace", make_tokenizer(tmp_path, kind="metaspace"))
    assert loaded.pieces is None
    encoder, why = PieceEncoder.of(loaded.tokenizer)
    assert encoder is None and "normalizer" in why
    text = "caf\u00e9 hello  world"
    assert loaded.encode(text, False) == list(loaded.tokenizer(text, add_special_tokens=False)["input_ids"])


# The split and the cut points checked word by word against the pre-tokenizer itself: a different
# split can give the same ids where the vocabulary has no merge across it, so ids alone miss it.
_ASCII_TEXTS = st.one_of(
    _TEXTS.map(lambda t: "".join(ch for ch in t if ch.isascii())),
    st.text(st.characters(max_codepoint=127), max_size=40),
)


def pre_tokenized(tokenizer: ModelTokenizer, text: str) -> list[str]:
    return [word for word, _ in tokenizer.tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)]


@PROPERTY
@given(text=_ASCII_TEXTS)
def test_ascii_text_splits_into_the_pre_tokenizers_words(tokenizer: ModelTokenizer, text: str) -> None:
    pieces = tokenizer.pieces
    assert pieces is not None
    as_chars = ["".join(pieces._byte_chars[b] for b in word.encode()) for word in pieces._words_of(text)]
    assert as_chars == pre_tokenized(tokenizer, text)


@PROPERTY
@given(text=_TEXTS)
@example(text="a\u3000  b")  # after Unicode whitespace: no cut point
@example(text="a\u00a0\t\tb\n\n")
def test_the_words_on_each_side_of_a_cut_point_are_the_whole_texts(tokenizer: ModelTokenizer, text: str) -> None:
    if tokenizer.name == "split_byte_level":
        return  # cut points are GPT-2's pattern's
    for cut in piece_encoder._CUT.finditer(text):
        i = cut.start()
        assert pre_tokenized(tokenizer, text[:i]) + pre_tokenized(tokenizer, text[i:]) == pre_tokenized(tokenizer, text)
