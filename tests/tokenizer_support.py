"""Tokenizers and conversations for the tests of the scheduler's token ids (scheduler.tokens).

Small real tokenizers are trained here in milliseconds (the `tokenizers` library), saved as model
directories and loaded through transformers as the scheduler loads a served model's, so the unit
tests need no model files. SmolLM2's own (prepared by `symphony model fetch`) is used where present.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from symphony.config import default_home
from symphony.models import default_model_dir, verify_prepared_model

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A template that reads content as parts (vLLM then passes every message's content as a list).
PARTS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% for part in m['content'] %}{{ part['text'] }}|{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "caf\u00e9 \u6771\u4eac na\u00efve r\u00e9sum\u00e9 \u00fcber stra\u00dfe",
    "hello world, how are you? I am fine, thanks!",
    "def f(x):\n    return x + 1\n\n",
    "  leading and trailing spaces  \t tabs\n\nnew lines",
] * 20
# Llama 3's split (a `Split` pre-tokenizer before a byte-level one without its own regex).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def make_tokenizer(
    directory: Path,
    *,
    kind: str = "byte_level",
    template: str = CHATML,
    bos_post_processor: bool = False,
    added: list[str] | None = None,
) -> Path:
    """Train a small BPE tokenizer and save it as a model directory. `kind`: "byte_level" (GPT-2
    style, as SmolLM2), "split_byte_level" (Llama 3 style: its split, then bytes) or "metaspace"
    (SentencePiece style, a normalizer and a prefix space on the first piece only).
    `bos_post_processor`: encoding with special tokens adds <|im_start|> first."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<|endoftext|>" if kind == "metaspace" else None))
    if kind == "metaspace":
        tokenizer.normalizer = normalizers.NFKC()
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
        alphabet: list[str] = sorted({ch for text in CORPUS for ch in text} | set(string.printable) | {"\u2581"})
    elif kind == "split_byte_level":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS + (added or []), initial_alphabet=alphabet)
    tokenizer.train_from_iterator(CORPUS, trainer)
    if bos_post_processor:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<|im_start|> $A", pair="<|im_start|> $A $B", special_tokens=[("<|im_start|>", 1)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", unk_token="<|endoftext|>", pad_token="<|im_end|>"
    )
    fast.chat_template = template
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(directory))
    return directory


def smollm2_dir() -> Path | None:
    """SmolLM2's model directory when `symphony model fetch` prepared it, else None."""
    path = default_model_dir(default_home())
    return path if (path / "tokenizer.json").is_file() and not verify_prepared_model(path) else None


# -- conversations ---------------------------------------------------------------------------------
_FRAGMENTS = st.sampled_from(
    [
        "hello",
        " world",
        "caf\u00e9",
        "\u6771\u4eac",
        "\U0001f600",
        "  ",
        "\n",
        "\t",
        "<|im_end|>",
        "<|im_start|>",
        "<|im",
        "end|>",
        "x",
        "1234",
        "'s",
        " The",
        "\u0301",
        "\r\n",
    ]
)
TEXT = st.one_of(
    st.lists(_FRAGMENTS, max_size=8).map("".join),
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30),
)
_CONTENT = st.one_of(
    TEXT,
    st.lists(st.builds(lambda t: {"type": "text", "text": t}, TEXT), min_size=1, max_size=3),
)


@st.composite
def conversations(draw: st.DrawFn, max_turns: int = 5) -> list[list[dict[str, Any]]]:
    """A conversation as the prompts of its successive turns: each turn usually adds the assistant's
    answer and a new user message to the last, sometimes edits or drops earlier messages, and may
    start with a system prompt."""
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(_CONTENT)})
    messages.append({"role": "user", "content": draw(_CONTENT)})
    turns = [list(messages)]
    for _ in range(draw(st.integers(1, max_turns))):
        action = draw(st.sampled_from(["grow", "grow", "grow", "edit", "drop", "same"]))
        if action == "edit" and messages:
            i = draw(st.integers(0, len(messages) - 1))
            messages[i] = {**messages[i], "content": draw(_CONTENT)}
        elif action == "drop" and len(messages) > 1:
            del messages[draw(st.integers(0, len(messages) - 2))]
        elif action != "same":
            messages += [{"role": "assistant", "content": draw(_CONTENT)}, {"role": "user", "content": draw(_CONTENT)}]
        turns.append(list(messages))
    return turns
