"""The served models' tokenizers: which directory each served model name's is in, and loading one.

`scheduler.tokenizer` is the tokenizer of the model the `[engine]` section describes, served under
`engine.served_model_name` (else the model directory's name, as `symphony.models.resolve_model`
names it): "auto" (the default) is that model's own directory when the scheduler runs the local
cluster (no `scheduler.node_addresses`: `engine.model`, or SmolLM2 from `symphony model fetch`), a
path names a directory, "" means none. `scheduler.tokenizers` adds "served_name=path" entries for
other models a cluster serves. A model without one gets no token ids.

A tokenizer is loaded as vLLM loads it (transformers' AutoTokenizer, left truncation side) from
local files only: nothing is downloaded, whatever the directory holds.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from scheduler.incremental import Boundaries, encode
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

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
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
            want = model.encode(prompt_text, add_special)
            if not np.array_equal(got.ids, np.array(want, dtype=np.int64)):
                return f"incremental tokenization differs from whole on the self-check's turn {i}"
            previous = got
        messages.append({"role": "assistant", "content": f"Answer {i}: {text[::-1]}"})
    return ""
