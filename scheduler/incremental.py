"""Tokenizing a session's growing prompt without starting from the beginning every turn.

A conversation's next prompt repeats the previous one and adds to it. The previous turn's text and
ids are kept per session (`SessionTokenCache`, bounded by sessions and by tokens, least recently
used first out); the next text is cut at the last *boundary* inside the part both texts share, the
ids up to it are reused, and only the rest is tokenized.

A boundary is the end of an occurrence of one of the tokenizer's added tokens (the chat template's
`<|im_start|>`, `<|im_end|>`, ...). Why the result equals tokenizing the whole text, for a fast
(`tokenizers`) tokenizer that meets `Boundaries.of`'s conditions:

1. Before anything else the tokenizer extracts the occurrences of its non-normalized added tokens,
   each becoming one id, and tokenizes each piece of text between them on its own (normalizer,
   pre-tokenizer and model run per piece). Nothing merges across an occurrence.
2. Which occurrences it extracts is local when no added token overlaps another or itself (no proper
   suffix of one is a prefix of one) and none contains another: every occurrence is then extracted,
   and the extraction of a text cut right after an occurrence is that of the two parts.
3. The rest is tokenized with the boundary token in front (`<|im_start|>` + rest) and that token's
   id dropped, so the rest's first piece follows an added token, at a non-zero offset, as it does
   in the whole text (a Metaspace `prepend_scheme="first"` pre-tokenizer, for one, looks at that).
4. Special tokens a post-processor adds (BOS, EOS) would not be where they belong: such tokenizers
   are tokenized incrementally only without `add_special_tokens`.

Lstrip, rstrip or single-word added tokens, overlapping ones, or `split_special_tokens` turn the
incremental path off for a tokenizer (every turn is tokenized whole). The ids of each occurrence are
also checked where a text is tokenized: a text whose added-token ids do not line up with its
occurrences gets no boundaries, so the next turn starts from the previous one's last good boundary.
"""

from __future__ import annotations

import re
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from symphony.kv_addressing import token_array

Encode = Callable[[str, bool], list[int]]  # (text, add_special_tokens) -> ids
Mode = Literal["full", "incremental", "unchanged"]
_EMPTY = np.zeros(0, dtype=np.int64)
_MAX_ADDED_TOKEN_CHARS = 4_000_000  # the overlap check's work bound (sum of squared token lengths)


def read_only(ids: list[int] | np.ndarray) -> np.ndarray:
    """Token ids as the read-only little-endian uint32 array block keys are computed from."""
    return token_array(ids)


@dataclass(frozen=True, slots=True)
class Encoded:
    """A text and its ids, with its boundaries: after the occurrence ending at character
    `char_ends[i]` come the ids from `token_ends[i]` on."""

    model: str
    add_special_tokens: bool
    text: str
    ids: np.ndarray  # read-only '<u4'
    char_ends: np.ndarray
    token_ends: np.ndarray


class Boundaries:
    """A tokenizer's added tokens as cut points (the conditions are the module docstring's)."""

    def __init__(self, tokens: dict[str, int], special_tokens_added: int) -> None:
        self.id_of = tokens
        self.text_of = {i: t for t, i in tokens.items()}
        self.ids = np.array(sorted(tokens.values()), dtype=np.int64)
        # No token is a prefix of another (checked), so the first alternative that matches is the one.
        self._pattern = re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))
        self.special_tokens_added = special_tokens_added

    @classmethod
    def of(cls, tokenizer: Any) -> tuple[Boundaries | None, str]:
        """The tokenizer's boundaries, or None and why they cannot be used."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or not getattr(tokenizer, "is_fast", False):
            return None, "not a fast tokenizer"
        if getattr(tokenizer, "split_special_tokens", False):
            return None, "split_special_tokens is on"
        has_normalizer = backend.normalizer is not None
        first_pass: dict[str, int] = {}
        for token_id, token in tokenizer.added_tokens_decoder.items():
            if token.lstrip or token.rstrip or token.single_word:
                return None, f"added token {token.content!r} strips whitespace or matches single words"
            if not (token.normalized and has_normalizer) and token.content:
                first_pass[token.content] = token_id
        problem = _overlap(list(first_pass))
        if problem:
            return None, problem
        # The unknown token's id also stands for text the model cannot spell: no cut point.
        cuts = {text: i for text, i in first_pass.items() if text != tokenizer.unk_token}
        if not cuts:
            return None, "no added tokens to cut at"
        post = backend.post_processor
        added = post.num_special_tokens_to_add(False) if post is not None else 0
        return cls(cuts, added), ""

    def incremental(self, add_special_tokens: bool) -> bool:
        return not add_special_tokens or self.special_tokens_added == 0

    def marks(self, text: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Character and token ends of the added-token occurrences in `text` tokenized as `ids`;
        none when the occurrences and the ids do not line up one for one."""
        found = [(m.end(), self.id_of[m.group()]) for m in self._pattern.finditer(text)]
        positions = np.flatnonzero(np.isin(ids, self.ids))
        if len(positions) != len(found) or not np.array_equal(
            ids[positions].astype(np.int64), np.array([i for _, i in found], dtype=np.int64)
        ):
            return _EMPTY, _EMPTY
        return np.array([c for c, _ in found], dtype=np.int64), positions.astype(np.int64) + 1


def _overlap(tokens: list[str]) -> str:
    """Why `tokens` could overlap or contain one another in a text ("" when they cannot)."""
    if sum(len(t) ** 2 for t in tokens) > _MAX_ADDED_TOKEN_CHARS:
        return "too many or too long added tokens to check"
    known = set(tokens)
    prefixes = {t[:i] for t in tokens for i in range(1, len(t) + 1)}
    for token in tokens:
        for start in range(1, len(token)):
            if token[start:] in prefixes:
                return f"added token {token!r} can overlap another"
        for start in range(len(token)):
            for end in range(start + 1, len(token) + 1):
                if (start, end) != (0, len(token)) and token[start:end] in known:
                    return f"added token {token!r} contains another"
    return ""


def common_prefix_length(a: str, b: str) -> int:
    """How many leading characters `a` and `b` share (compared in C, halving the span)."""
    n = min(len(a), len(b))
    if a.startswith(b[:n]) if len(a) > len(b) else b.startswith(a):
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if b.startswith(a[low:middle], low):
            low = middle
        else:
            high = middle
    return low


def encode(
    encode_text: Encode,
    boundaries: Boundaries | None,
    model: str,
    text: str,
    add_special_tokens: bool,
    previous: Encoded | None,
) -> tuple[Encoded, Mode]:
    """`text`'s ids, from `previous` (the session's last prompt) where its boundaries allow."""
    usable = boundaries is not None and boundaries.incremental(add_special_tokens)
    if (
        usable
        and previous is not None
        and previous.model == model
        and previous.add_special_tokens == add_special_tokens
    ):
        if previous.text == text:
            return previous, "unchanged"
        assert boundaries is not None
        shared = common_prefix_length(previous.text, text)
        i = int(np.searchsorted(previous.char_ends, shared, side="right")) - 1
        if i >= 0:
            cut, kept = int(previous.char_ends[i]), int(previous.token_ends[i])
            boundary = boundaries.text_of[int(previous.ids[kept - 1])]
            rest = _array(encode_text(boundary + text[cut:], False))
            if len(rest) and int(rest[0]) == boundaries.id_of[boundary]:
                chars, tokens = boundaries.marks(boundary + text[cut:], rest)
                ids = np.concatenate((previous.ids[:kept], rest[1:]))
                return (
                    Encoded(
                        model,
                        add_special_tokens,
                        text,
                        read_only(ids),
                        np.concatenate((previous.char_ends[: i + 1], chars[1:] - len(boundary) + cut)),
                        np.concatenate((previous.token_ends[: i + 1], tokens[1:] - 1 + kept)),
                    ),
                    "incremental",
                )
    ids = _array(encode_text(text, add_special_tokens))
    chars, tokens = boundaries.marks(text, ids) if usable and boundaries is not None else (_EMPTY, _EMPTY)
    return Encoded(model, add_special_tokens, text, ids, chars, tokens), "full"


def _array(ids: list[int]) -> np.ndarray:
    return np.frombuffer(array("I", ids).tobytes(), dtype="<u4") if ids else read_only([])


class SessionTokenCache:
    """The last prompt of each session, least recently used out first beyond `max_sessions` entries
    or `max_tokens` ids in all (a prompt longer than `max_tokens` alone is not kept). Not
    thread-safe: one thread (the tokenizer's) owns it."""

    def __init__(self, max_sessions: int, max_tokens: int) -> None:
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self.tokens = 0
        self._entries: OrderedDict[Hashable, Encoded] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> Encoded | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: Hashable, entry: Encoded) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.tokens -= len(old.ids)
        if len(entry.ids) > self.max_tokens:
            return
        self._entries[key] = entry
        self.tokens += len(entry.ids)
        while len(self._entries) > self.max_sessions or self.tokens > self.max_tokens:
            _, dropped = self._entries.popitem(last=False)
            self.tokens -= len(dropped.ids)
