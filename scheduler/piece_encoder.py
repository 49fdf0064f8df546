"""Byte-level BPE tokenization with the model's ids cached per pre-tokenized word: the ids of the
tokenizer's own `encode`, several times cheaper.

A fast (`tokenizers`) byte-level BPE tokenizer (GPT-2's family: SmolLM2, Llama 3, Qwen 2, ...) turns
a text into ids in three steps: it extracts the occurrences of its added tokens (one id each), splits
each piece of text between them into words with a regular expression (the pre-tokenizer), and runs
BPE on each word's bytes alone (the model). `tokenizers` spends ~1 µs a token on this, most of it
building the offsets and alignments of the `Encoding` it returns, which nobody here reads. This
module runs the same steps itself: the split with Python's `re` (in C), the model's ids of each word
from a bounded cache, or from the tokenizer's own BPE model (`model.tokenize`) the first time. Long
pieces of text between added tokens (a chat template's messages: a system prompt many sessions
share, a document) are cached whole as well, least recently used out first, bounded by count and
characters.

Why the ids are the tokenizer's, for a tokenizer `PieceEncoder.of` accepts:
1. Added tokens: as `incremental.Boundaries.of` requires (none strips, matches single words,
   overlaps or contains another), every occurrence is extracted, and scanning the text for them
   left to right finds exactly those; each piece between two is tokenized on its own.
2. The split: the tokenizer's own pattern (GPT-2's, which `ByteLevel(use_regex=True)` applies, or a
   `Split` pattern before `ByteLevel(use_regex=False)`), with the gaps between matches kept as
   words, as `Split(behavior="isolated")` keeps them. Regular-expression engines agree on ASCII
   text only: Oniguruma's Unicode tables (`tokenizers`) and Python's are of different versions. So
   non-ASCII text is tokenized by the tokenizer itself: under GPT-2's pattern, the stretch around
   it between two *cut points*; under a `Split` pattern, the whole piece. A cut point is an ASCII
   whitespace character after a character that is not whitespace: no word of GPT-2's pattern
   holds whitespace after anything else (only its optional leading space, and whitespace runs), and
   it looks ahead one character at most, never behind, so the words of the text before a cut point
   and after it are those of the whole text.
3. The model: each word's bytes, mapped to characters as `ByteLevel` maps them, go to the
   tokenizer's own BPE model, which sees nothing but the word (no dropout).
4. Nothing else changes ids: no normalizer, no prefix space, no post-processor tokens (the caller
   uses the tokenizer when special tokens are to be added), no truncation or padding set.
`tokenizer_load` also compares the two on probe texts when it loads a tokenizer.

Not thread-safe (the cache): one thread, the scheduler's tokenizer thread, owns it.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_WORDS = 100_000  # cached words; beyond, the oldest go first
MAX_WORD_CHARS = 64  # longer words (rare: long runs of spaces, digits, symbols) are not cached
MIN_SEGMENT_CHARS = 1_000  # pieces between added tokens this long or longer are cached whole ...
MAX_SEGMENTS = 1_024  # ... this many of them at most ...
MAX_SEGMENT_CHARS = 4_000_000  # ... holding this many characters in all (none over a tenth of it)
# GPT-2's split, which `ByteLevel(use_regex=True)` applies (tokenizers' pre_tokenizers/byte_level.rs:
# 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+), as it reads on ASCII text,
# where \p{L} is [A-Za-z], \p{N} [0-9] and \s [\t\n\v\f\r ]. Every character matches one of its
# alternatives, so it leaves no gaps between its matches.
_GPT2_ASCII = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+", re.ASCII)
_NON_ASCII = re.compile(r"[^\x00-\x7f]+")
# Cut points (module docstring, 2): ASCII whitespace after a character that is whitespace to no
# regular-expression engine (Unicode's White_Space, U+180E that was, Python's \x1c-\x1f, U+200B, U+FEFF).
_CUT = re.compile(
    r"(?<=[^\t\n\x0b\x0c\r\x1c-\x20\x85\xa0\u1680\u180e\u2000-\u200b\u2028\u2029\u202f\u205f\u3000\ufeff])"
    r"[\t\n\x0b\x0c\r ]"
)


class PieceEncoder:
    """`encode(text)`: the ids `backend.encode(text, add_special_tokens=False)` gives."""

    def __init__(self, backend: Any, added: dict[str, int], split: Any, gpt2: bool) -> None:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        self._backend = backend
        self._model = backend.model
        self._added = added
        # No added token is a prefix of another (Boundaries.of): the alternatives' order is moot.
        self._added_pattern = re.compile("|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)))
        self._split = split  # a compiled pattern (`re` or `regex`), exact on ASCII text
        self._gpt2 = gpt2  # GPT-2's pattern: no gaps between its matches, cut points around non-ASCII text
        self._byte_chars: dict[int, str] = bytes_to_unicode()  # byte -> the character standing for it
        self._words: dict[str, tuple[int, ...]] = {}
        self._segments: dict[str, tuple[int, ...]] = {}  # least recently used first
        self._segment_chars = 0
        self.segment_hits = 0
        self.slow_chars = 0  # characters tokenized by the tokenizer itself (around non-ASCII ones)

    @classmethod
    def of(cls, tokenizer: Any) -> tuple[PieceEncoder | None, str]:
        """A PieceEncoder for a transformers fast tokenizer that meets the module docstring's
        conditions, or None and why not."""
        from scheduler.incremental import Boundaries

        boundaries, why = Boundaries.of(tokenizer)
        if boundaries is None:
            return None, why
        backend = tokenizer.backend_tokenizer
        if backend.normalizer is not None:
            return None, "the tokenizer has a normalizer"
        if backend.truncation is not None or backend.padding is not None:
            return None, "the tokenizer truncates or pads"
        model = backend.model
        plain = not (model.dropout or model.continuing_subword_prefix or model.end_of_word_suffix)
        if type(model).__name__ != "BPE" or not plain:
            return None, "not a plain BPE model"
        pre_tokenizer = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer else {}
        split = _split_pattern(pre_tokenizer)
        if split is None:
            return None, "not a byte-level pre-tokenizer without a prefix space"
        added = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.content}
        return cls(backend, added, split, gpt2=split is _GPT2_ASCII), ""

    def __len__(self) -> int:
        return len(self._words)

    @property
    def added_tokens(self) -> list[str]:
        return list(self._added)

    def forget_segments(self) -> None:
        """Drop the long pieces cached whole (a benchmark timing new text clears them)."""
        self._segments.clear()
        self._segment_chars = 0

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        start = 0
        for match in self._added_pattern.finditer(text):
            if match.start() > start:
                self._segment(text[start : match.start()], ids)
            ids.append(self._added[match.group()])
            start = match.end()
        if start < len(text):
            self._segment(text[start:] if start else text, ids)
        return ids

    def _segment(self, piece: str, ids: list[int]) -> None:
        """Append the ids of `piece`, a text with no added token in it: cached whole if it is long."""
        if not MIN_SEGMENT_CHARS <= len(piece) <= MAX_SEGMENT_CHARS // 10:
            self._piece(piece, ids)
            return
        cached = self._segments.pop(piece, None)
        if cached is not None:
            self.segment_hits += 1
        else:
            own: list[int] = []
            self._piece(piece, own)
            cached = tuple(own)
            self._segment_chars += len(piece)
        self._segments[piece] = cached  # now the most recently used
        while self._segment_chars > MAX_SEGMENT_CHARS or len(self._segments) > MAX_SEGMENTS:
            oldest = next(iter(self._segments))
            self._segment_chars -= len(oldest)
            del self._segments[oldest]
        ids += cached

    def _piece(self, piece: str, ids: list[int]) -> None:
        """Append the ids of `piece`, a text with no added token in it."""
        if piece.isascii():
            self._ascii(piece, ids)
        elif not self._gpt2:
            self._slow(piece, ids)
        else:
            done = 0  # piece[:done] is tokenized; `done` is 0 or a cut point
            for run in _NON_ASCII.finditer(piece):
                if run.start() < done:
                    continue  # inside the stretch just tokenized
                left = done
                for cut in _CUT.finditer(piece, done, run.start()):
                    left = cut.start()
                after = _CUT.search(piece, run.end())
                right = after.start() if after is not None else len(piece)
                if left > done:
                    self._ascii(piece[done:left], ids)
                self._slow(piece[left:right], ids)
                done = right
            if done < len(piece):
                self._ascii(piece[done:], ids)

    def _slow(self, text: str, ids: list[int]) -> None:
        self.slow_chars += len(text)
        ids += self._backend.encode(text, add_special_tokens=False).ids

    def _ascii(self, text: str, ids: list[int]) -> None:
        cached = self._words.get
        for word in self._words_of(text):
            word_ids = cached(word)
            if word_ids is None:
                word_ids = self._bpe(word)
            ids += word_ids

    def _words_of(self, text: str) -> list[str]:
        if self._gpt2:
            words: list[str] = self._split.findall(text)
            return words
        words, end = [], 0
        for match in self._split.finditer(text):
            if match.start() > end:
                words.append(text[end : match.start()])
            if match.end() > match.start():
                words.append(match.group())
            end = match.end()
        if end < len(text):
            words.append(text[end:])
        return words

    def _bpe(self, word: str) -> tuple[int, ...]:
        chars = "".join([self._byte_chars[b] for b in word.encode()])
        word_ids = tuple(token.id for token in self._model.tokenize(chars))
        if len(word) <= MAX_WORD_CHARS:
            if len(self._words) >= MAX_WORDS:
                del self._words[next(iter(self._words))]
            self._words[word] = word_ids
        return word_ids


def _split_pattern(pre_tokenizer: dict[str, Any]) -> Any:
    """The split of a byte-level pre-tokenizer this module reproduces, compiled; else None."""
    if pre_tokenizer.get("type") == "ByteLevel":
        if pre_tokenizer.get("add_prefix_space") or not pre_tokenizer.get("use_regex", True):
            return None
        return _GPT2_ASCII
    parts = pre_tokenizer.get("pretokenizers", []) if pre_tokenizer.get("type") == "Sequence" else []
    if len(parts) != 2:
        return None
    split, byte_level = parts
    if (
        split.get("type") != "Split"
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or byte_level.get("type") != "ByteLevel"
        or byte_level.get("add_prefix_space")
        or byte_level.get("use_regex", True)
    ):
        return None
    pattern = split.get("pattern", {})
    if "String" in pattern:
        return re.compile(re.escape(pattern["String"]))
    import regex  # transformers' own dependency: \p{...} classes, possessive quantifiers

    try:
        return regex.compile(pattern["Regex"]) if "Regex" in pattern else None
    except regex.error:
        return None
