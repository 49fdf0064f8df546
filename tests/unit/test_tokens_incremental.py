"""scheduler.incremental: a session's prompt tokenized from its previous one gives exactly the ids
of tokenizing it whole, on real (small, trained here) tokenizers and on SmolLM2's where prepared."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.incremental import Boundaries, Encoded, SessionTokenCache, common_prefix_length, encode
from scheduler.prompt_render import chat_prompt
from scheduler.tokenizer_load import ModelTokenizer, load_model_tokenizer
from tests.tokenizer_support import PARTS_TEMPLATE, TEXT, conversations, make_tokenizer, smollm2_dir

KINDS = ["byte_level", "metaspace", "parts", "smollm2"]
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module", params=KINDS)
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ModelTokenizer:
    kind = request.param
    if kind == "smollm2":
        path = smollm2_dir()
        if path is None:
            pytest.skip("SmolLM2 is not prepared (symphony model fetch)")
    elif kind == "parts":
        path = make_tokenizer(tmp_path_factory.mktemp(kind), template=PARTS_TEMPLATE)
    else:
        path = make_tokenizer(tmp_path_factory.mktemp(kind), kind=kind)
    loaded = load_model_tokenizer(kind, path)
    assert loaded.boundaries is not None, f"{kind}: incremental tokenization is off"
    return loaded


def whole(tokenizer: ModelTokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    return list(tokenizer.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def run_turns(tokenizer: ModelTokenizer, texts: list[str], add_special_tokens: bool = False) -> list[str]:
    """Tokenize successive prompts as one session does; check each against the whole; the modes."""
    previous: Encoded | None = None
    modes = []
    for text in texts:
        encoded, mode = encode(tokenizer.encode, tokenizer.boundaries, "m", text, add_special_tokens, previous)
        assert encoded.ids.tolist() == whole(tokenizer, text, add_special_tokens), (mode, text)
        assert encoded.ids.dtype == np.dtype("<u4") and not encoded.ids.flags.writeable
        previous = encoded
        modes.append(mode)
    return modes


@PROPERTY
@given(turns=conversations(), generation_prompt=st.booleans())
def test_a_conversations_turns_tokenized_incrementally_equal_whole(
    tokenizer: ModelTokenizer, turns: list[list[dict[str, Any]]], generation_prompt: bool
) -> None:
    texts = [
        chat_prompt(tokenizer.tokenizer, {"messages": m, "add_generation_prompt": generation_prompt}).text
        for m in turns
    ]
    run_turns(tokenizer, texts)


@PROPERTY
@given(first=TEXT, kept=st.integers(0, 200), rest=TEXT, add_special_tokens=st.booleans())
def test_any_edit_of_a_text_tokenized_from_the_old_one_equals_whole(
    tokenizer: ModelTokenizer, first: str, kept: int, rest: str, add_special_tokens: bool
) -> None:
    first = f"<|im_start|>user\n{first}<|im_end|>\n<|im_start|>assistant\n"
    run_turns(tokenizer, [first, first[:kept] + rest, first + rest], add_special_tokens)


def test_a_growing_conversation_is_tokenized_from_its_previous_turn(tokenizer: ModelTokenizer) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    texts = []
    for i in range(5):
        messages.append({"role": "user", "content": f"Question {i}: caf\u00e9?"})
        texts.append(chat_prompt(tokenizer.tokenizer, {"messages": messages}).text)
        messages.append({"role": "assistant", "content": f"Answer {i}."})
    assert run_turns(tokenizer, texts + texts[-1:]) == ["full"] + ["incremental"] * 4 + ["unchanged"]


def test_special_tokens_a_post_processor_adds_turn_the_incremental_path_off(tmp_path: Path) -> None:
    tokenizer = load_model_tokenizer("bos", make_tokenizer(tmp_path, bos_post_processor=True))
    assert tokenizer.boundaries is not None and tokenizer.special_tokens_added == 1
    texts = ["<|im_start|>user\nhi<|im_end|>\n", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>user\nmore"]
    assert run_turns(tokenizer, texts, add_special_tokens=True) == ["full", "full"]
    assert run_turns(tokenizer, texts, add_special_tokens=False) == ["full", "incremental"]


def test_another_model_or_flag_starts_over() -> None:
    """A session's previous prompt only counts for the same model and add_special_tokens."""
    previous = Encoded("m", False, "ab", np.array([1], dtype="<u4"), np.array([1]), np.array([1]))
    calls: list[tuple[str, bool]] = []

    def fake(text: str, special: bool) -> list[int]:
        calls.append((text, special))
        return [1, 2]

    boundaries = Boundaries({"a": 1}, 0)
    assert encode(fake, boundaries, "other", "ab", False, previous)[1] == "full"
    assert encode(fake, boundaries, "m", "ab", True, previous)[1] == "full"
    assert encode(fake, boundaries, "m", "ab", False, previous)[1] == "unchanged"
    assert calls == [("ab", False), ("ab", True)]


@pytest.mark.parametrize(
    ("added", "why"),
    [
        (["<a>", "<a>b"], "contains"),
        (["ab|", "|cd"], "overlap"),
        (["xx"], "overlap"),  # "xxx" holds two overlapping occurrences
    ],
)
def test_added_tokens_that_can_overlap_turn_the_incremental_path_off(added: list[str], why: str) -> None:
    from scheduler.incremental import _overlap

    assert why in _overlap(["<|im_start|>", *added])
    assert _overlap(["<|im_start|>", "<|im_end|>", "<|endoftext|>"]) == ""


def test_a_tokenizer_with_overlapping_added_tokens_is_tokenized_whole(tmp_path: Path) -> None:
    tokenizer = load_model_tokenizer("overlap", make_tokenizer(tmp_path, added=["<a>", "<a>b"]))
    assert tokenizer.boundaries is None
    assert run_turns(tokenizer, ["<|im_start|>x<a>b", "<|im_start|>x<a>bc"]) == ["full", "full"]


@settings(max_examples=300, deadline=None)
@given(a=st.text(alphabet="ab\u00e9", max_size=40), b=st.text(alphabet="ab\u00e9", max_size=40))
def test_common_prefix_length_is_the_shared_prefix(a: str, b: str) -> None:
    n = common_prefix_length(a, b)
    assert a[:n] == b[:n]
    assert n == min(len(a), len(b)) or a[n] != b[n]


def _entry(tokens: int) -> Encoded:
    return Encoded("m", False, "x" * tokens, np.zeros(tokens, dtype="<u4"), np.zeros(0), np.zeros(0))


def test_the_session_cache_keeps_the_most_recently_used_within_its_bounds() -> None:
    cache = SessionTokenCache(max_sessions=3, max_tokens=100)
    for key in "abc":
        cache.put(key, _entry(10))
    assert cache.get("a") is not None  # "a" is now the most recently used
    cache.put("d", _entry(10))
    assert cache.get("b") is None and len(cache) == 3 and cache.tokens == 30
    cache.put("e", _entry(75))  # a fourth session: the least recently used one goes
    assert [k for k in "acde" if cache.get(k) is not None] == ["a", "d", "e"] and cache.tokens == 95
    cache.put("f", _entry(20))  # over both bounds: "a" goes for the sessions, "d" for the tokens
    assert [k for k in "adef" if cache.get(k) is not None] == ["e", "f"] and cache.tokens == 95
    cache.put("e", _entry(5))  # replacing counts the new size only
    assert cache.tokens == 25
    cache.put("huge", _entry(101))  # longer than the whole bound: not kept, nothing evicted for it
    assert cache.get("huge") is None and len(cache) == 2 and cache.tokens == 25
    cache.put("f", _entry(101))  # a session's oversized prompt replaces its old one: it goes too
    assert cache.get("f") is None and len(cache) == 1 and cache.tokens == 5
