"""The served models' tokenizers: which directory each served model name's is in, and loading one.

`scheduler.tokenizer` is the tokenizer of the model the `[engine]` section describes, served under
`engine.served_model_name` (else the model directory's name, as `symphony.models.resolve_model`
names it): "auto" (the default) is that model's own directory when the scheduler runs the local
cluster (no `scheduler.node_addresses`: `engine.model`, or SmolLM2 from `symphony model fetch`), a
path names a directory, "" means none. `scheduler.tokenizers` adds "served_name=path" entries for
other models a cluster serves. A model without one gets no token ids.

A tokenizer is loaded as vLLM loads it (transformers' AutoTokenizer, left truncation side) from
local files only: nothing is downloaded, whatever the directory holds. Texts are tokenized by
`scheduler.piece_encoder` where the tokenizer allows it and it agrees with the tokenizer on the
load-time probes, else by the tokenizer as vLLM calls it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from scheduler.incremental import Boundaries, encode
from scheduler.piece_encoder import PieceEncoder
from scheduler.prompt_render import chat_prompt
from scheduler.prompts import NoTokenIds
from symphony.config import SymphonyConfig
from symphony.logs import get_logger
from symphony.models import default_model_dir

log = get_logger(__name__)


class TokenizerUnavailable(RuntimeError):
    """The directory holds no usable tokenizer; the message says why."""


def tokenizer_dirs(config: SymphonyConfig) -> dict[str, Path]:
    """Served model name -> tokenizer directory, from `scheduler.tokenizer` and `.tokenizers`."""
    sc, engine = config.scheduler, config.engine
    model_dir = Path(engine.model).expanduser().resolve() if engine.model else default_model_dir(config.home_path)
    served = engine.served_model_name or model_dir.name
    dirs: dict[str, Path] = {}
    if sc.tokenizer == "auto":
        if not sc.node_addresses:
            dirs[served] = model_dir
    elif sc.tokenizer:
        dirs[served] = Path(sc.tokenizer).expanduser().resolve()
    for entry in sc.tokenizers:
        name, _, path = entry.partition("=")
        dirs[name] = Path(path).expanduser().resolve()
    return dirs


@dataclass
class ModelTokenizer:
    """One served model's tokenizer. Not thread-safe (transformers sets truncation per call): only
    the scheduler's tokenizer thread uses it."""

    name: str
    path: Path
    tokenizer: Any  # a transformers fast tokenizer
    boundaries: Boundaries | None  # None: every prompt is tokenized whole
    special_tokens_added: int  # ids the post-processor adds with add_special_tokens (BOS, EOS, ...)
    max_token_id: int  # the largest id vLLM accepts (the tokenizer's or the model's vocabulary)
    pieces: PieceEncoder | None = None  # None: every text goes through the tokenizer itself

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The ids vLLM tokenizes `text` into."""
        if self.pieces is not None and (not add_special_tokens or self.special_tokens_added == 0):
            return self.pieces.encode(text)
        return self.encode_whole(text, add_special_tokens)

    def encode_whole(self, text: str, add_special_tokens: bool) -> list[int]:
        """The ids vLLM tokenizes `text` into: the tokenizer called as vLLM calls it."""
        ids: list[int] = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        return ids

    def check_ids(self, ids: np.ndarray) -> None:
        """Raise NoTokenIds("invalid_input") unless vLLM accepts every id of `ids` (uint32)."""
        if len(ids) and int(ids.max()) > self.max_token_id:
            raise NoTokenIds("invalid_input", f"Token id {int(ids.max())} is out of vocabulary")


def load_model_tokenizer(name: str, path: Path) -> ModelTokenizer:
    """Load and check `path`'s tokenizer (seconds: the first one imports transformers)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only, even where a file names a hub repo
    from transformers import AutoTokenizer

    if not path.is_dir():
        raise TokenizerUnavailable(f"{path} is not a directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(path), local_files_only=True, trust_remote_code=False, truncation_side="left"
        )
    except Exception as exc:
        raise TokenizerUnavailable(f"cannot load a tokenizer from {path}: {exc}") from None
    if not getattr(tokenizer, "is_fast", False) or getattr(tokenizer, "backend_tokenizer", None) is None:
        raise TokenizerUnavailable(f"{path}'s tokenizer is not a fast (tokenizers) one")
    post = tokenizer.backend_tokenizer.post_processor
    boundaries, why = Boundaries.of(tokenizer)
    model = ModelTokenizer(
        name,
        path,
        tokenizer,
        boundaries,
        post.num_special_tokens_to_add(False) if post is not None else 0,
        max(max(tokenizer.get_vocab().values()), tokenizer.vocab_size - 1, _model_vocab_size(path) - 1),
    )
    pieces, pieces_why = PieceEncoder.of(tokenizer)
    if pieces is not None:
        model.pieces = pieces
        pieces_why = _pieces_check(model)
        if pieces_why:
            model.pieces = None
    if pieces_why:
        log.info("tokenizer: texts tokenized by the tokenizer itself", model=name, reason=pieces_why)
    if boundaries is not None:
        why = _self_check(model)
        if why:
            model.boundaries = None
    if why:
        log.warning("tokenizer: every prompt tokenized whole", model=name, reason=why)
    return model


def _model_vocab_size(path: Path) -> int:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) else 0


# Where word splits go wrong if they do: contractions, runs of spaces before words and at the end,
# digits, symbols, control characters, added tokens at the edges and side by side, non-ASCII text.
_PIECE_PROBES = [
    "Hello world! It's 2024: don't, I'll, we've, they're, she'd, I'm. A1b2c3 12345678 3.14159",
    "  two spaces,   three;\tTab\t\tnew\n\nlines\r\n end   ",
    "x\x00\x01\x0b\x0c\x1c\x1f\x7f !!! ??? ... --- '' \"\" {[()]} @#$%^&*_+=|\\~`<> 'S 'T 'LL",
    "caf\u00e9 \u6771\u4eac na\u00efve \U0001f600 \u00a0\u2003x\u3000y \u0301",
]


def _pieces_check(model: ModelTokenizer) -> str:
    """Tokenize the probes, and them joined with added tokens between and around them, both ways;
    "" when the piece encoder and the tokenizer agree on every one."""
    assert model.pieces is not None
    added = model.pieces.added_tokens
    joined = "".join(f"{a}{p}{a}{a}" for a, p in zip(added * len(_PIECE_PROBES), _PIECE_PROBES, strict=False))
    for text in [*_PIECE_PROBES, joined]:
        if model.pieces.encode(text) != model.encode_whole(text, False):
            return f"the piece encoder differs from the tokenizer on {text[:40]!r}"
    return ""


def _self_check(model: ModelTokenizer) -> str:
    """Tokenize a growing, edited conversation both ways; "" when the two agree on every turn."""
    turns = [
        "Hello! Can you help me?",
        "Sure \u2014 what do you need?\n\n  Ask away.",
        "Translate 'caf\u00e9' and '\u6771\u4eac' for me, please.",
        "  Leading spaces, trailing tab\t",
    ]
    messages: list[dict[str, str]] = [{"role": "system", "content": "Be brief."}]
    previous = None
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        for generation_prompt in (True, False):
            try:
                body = {"messages": messages, "add_generation_prompt": generation_prompt}
                prompt = chat_prompt(model.tokenizer, body)
            except NoTokenIds:  # no chat template: the turns joined by the end-of-sequence token
                separator = model.tokenizer.eos_token or ""
                prompt_text = separator.join(f"{m['role']}: {m['content']}" for m in messages)
                add_special = True
            else:
                prompt_text, add_special = prompt.text, prompt.add_special_tokens
            got, _ = encode(model.encode, model.boundaries, model.name, prompt_text, add_special, previous)
            want = model.encode_whole(prompt_text, add_special)
            if not np.array_equal(got.ids, np.array(want, dtype=np.int64)):
                return f"incremental tokenization differs from whole on the self-check's turn {i}"
            previous = got
        messages.append({"role": "assistant", "content": f"Answer {i}: {text[::-1]}"})
    return ""
