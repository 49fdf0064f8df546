"""The forms a request's prompt takes on its way to token ids, and the one way of having none.

`NoTokenIds.reason` labels `symphony_token_ids_missing`: "invalid_input" (vLLM refuses the request
too; the message says why, as vLLM would), "unsupported" (vLLM serves it but the scheduler cannot
reproduce its prompt), "no_tokenizer", "loading", "timeout", "busy", "error".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


class NoTokenIds(Exception):
    """The scheduler computes no token ids for this request, for `reason` (the module docstring's)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True, slots=True)
class Truncation:
    keep: int  # tokens kept
    side: Literal["left", "right"]
    explicit_side: bool  # the request named the side (vLLM then cuts after tokenizing, never inside)


@dataclass(frozen=True, slots=True)
class TextPrompt:
    text: str
    add_special_tokens: bool
    truncation: Truncation | None = None


@dataclass(frozen=True, slots=True)
class IdsPrompt:
    ids: list[int]
    truncation: Truncation | None = None
