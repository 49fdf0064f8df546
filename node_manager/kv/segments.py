"""The SSD tier's file format: one *segment* file holds a batch of pages written together.

    [fixed header][entry × count][pad to 4 KiB][page 0][page 1]...

Every entry names its page (block key, layer, and whether the block is a partial tail: the layer
field's top bit) and carries the page's checksum, its keyed MAC (`pages.PageMac`); the fixed header
names the model the pages belong to (its fingerprint, `symphony.model_identity`) and the MAC's key
(its id), and carries a checksum of those and the entry table. A segment is written to
`seg-<seq>.tmp`, fsynced, then renamed to `seg-<seq>.kvseg`, so a reader (or a restart) sees a
whole segment or none: a writer killed with -9 leaves at most a `.tmp`, which the index rebuild
deletes. Pages of a save are written in layer order, so a layer-wise load of a session reads each
segment front to back.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from node_manager.kv.pages import KEY_ID_BYTES
from symphony.kv_addressing import BLOCK_KEY_BYTES, FINGERPRINT_BYTES, BlockKey, ModelFingerprint

MAGIC = b"SYMKVSG1"
# 2: page checksums are one-shot xxh3 seeded by (key, layer) (`pages.page_checksum`); a version 1
# segment's checksums would fail every read, so the index rebuild drops such segments.
# 3: the header names the model fingerprint, and block keys hang off it; a version 2 segment's
# pages may be another model's (nothing said whose), so the rebuild drops them too.
# 4: an entry's layer field has the partial-tail flag in its top bit (block events never name
# tails). Version 3 segments are still read, every entry taken for a full block's.
# 5: an entry's checksum is the page's keyed MAC (`pages.PageMac`), and the header names the MAC's
# key (`key_id`); a version 4 segment's xxh3 checksums would fail every read, so the rebuild drops it.
VERSION = 5
MIN_READ_VERSION = 5
_TAIL_BIT = 1 << 31
ALIGN = 4096
SUFFIX = ".kvseg"
TMP_SUFFIX = ".tmp"
# magic, version, reserved, page_bytes, count, seq, header_len, reserved, crc, model fingerprint, key id
_FIXED = struct.Struct(f"<8sHHIIQIIQ{FINGERPRINT_BYTES}s{KEY_ID_BYTES}s")
_VERSION_AT = struct.Struct("<8sH")  # what every version's header starts with
_ENTRY = struct.Struct(f"<{BLOCK_KEY_BYTES}sIQ")  # block key, layer, page MAC


class SegmentFormatError(ValueError):
    """A segment file is not one we wrote, or its header is damaged."""


class OutdatedSegment(SegmentFormatError):
    """A whole segment in an older format than this code reads (its pages cannot be verified)."""


@dataclass(frozen=True, slots=True)
class SegmentEntry:
    block_key: BlockKey
    layer: int
    checksum: int
    tail: bool = False  # the block is a partial tail (`kv_addressing.tail_key`)


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    seq: int
    page_bytes: int
    header_len: int
    model: ModelFingerprint  # whose KV the pages are
    entries: tuple[SegmentEntry, ...]
    key_id: bytes  # the key of the entries' MACs (`PageMac.key_id`)

    @property
    def owner(self) -> bytes:
        """Who may load the pages: a node of this model whose MAC key is this one."""
        return self.model + self.key_id

    def page_offset(self, index: int) -> int:
        return self.header_len + index * self.page_bytes

    @property
    def file_bytes(self) -> int:
        return self.header_len + len(self.entries) * self.page_bytes


def segment_name(seq: int) -> str:
    return f"seg-{seq:016x}{SUFFIX}"


def header_length(count: int) -> int:
    raw = _FIXED.size + count * _ENTRY.size
    return (raw + ALIGN - 1) // ALIGN * ALIGN


def encode_header(
    seq: int, page_bytes: int, model: ModelFingerprint, entries: list[SegmentEntry], key_id: bytes
) -> bytes:
    if len(model) != FINGERPRINT_BYTES:
        raise ValueError(f"a model fingerprint is {FINGERPRINT_BYTES} bytes, got {len(model)}")
    if len(key_id) != KEY_ID_BYTES:
        raise ValueError(f"a key id is {KEY_ID_BYTES} bytes, got {len(key_id)}")
    table = b"".join(_ENTRY.pack(e.block_key, e.layer | (_TAIL_BIT if e.tail else 0), e.checksum) for e in entries)
    length = header_length(len(entries))
    fixed = _FIXED.pack(
        MAGIC,
        VERSION,
        0,
        page_bytes,
        len(entries),
        seq,
        length,
        0,
        xxhash.xxh3_64_intdigest(model + key_id + table),
        model,
        key_id,
    )
    return (fixed + table).ljust(length, b"\x00")


def fixed_header_size() -> int:
    return _FIXED.size


def decode_header(prefix: bytes) -> tuple[int, int]:
    """Parse the fixed part: returns (count, header_len) so the caller can read the entry table."""
    if len(prefix) >= _VERSION_AT.size:
        # Checked before the size: an older format's fixed header is shorter than this one's.
        magic, version = _VERSION_AT.unpack_from(prefix)
        if magic != MAGIC:
            raise SegmentFormatError("not a Symphony KV segment (bad magic)")
        if version < MIN_READ_VERSION:
            raise OutdatedSegment(f"segment format version {version} predates {MIN_READ_VERSION}")
        if version > VERSION:
            raise SegmentFormatError(f"segment format version {version} is not {VERSION}")
    if len(prefix) < _FIXED.size:
        raise SegmentFormatError("file shorter than a segment header")
    _, _, _, _, count, _, header_len, _, _, _, _ = _FIXED.unpack_from(prefix)
    if header_len != header_length(count):
        raise SegmentFormatError("inconsistent header length")
    return count, header_len


def parse_header(data: bytes) -> SegmentHeader:
    count, header_len = decode_header(data)
    if len(data) < _FIXED.size + count * _ENTRY.size:
        raise SegmentFormatError("truncated entry table")
    _, _, _, page_bytes, _, seq, _, _, table_crc, model, key_id = _FIXED.unpack_from(data)
    table = data[_FIXED.size : _FIXED.size + count * _ENTRY.size]
    if xxhash.xxh3_64_intdigest(model + key_id + table) != table_crc:
        raise SegmentFormatError("entry table checksum mismatch")
    entries = tuple(
        SegmentEntry(BlockKey(key), layer & ~_TAIL_BIT, crc, bool(layer & _TAIL_BIT))
        for key, layer, crc in _ENTRY.iter_unpack(table)
    )
    return SegmentHeader(seq, page_bytes, header_len, ModelFingerprint(model), entries, key_id)
