"""Names shared by every part of the KV store: tiers, priorities, page ids and page checksums."""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence

import xxhash

from symphony.kv_addressing import BlockKey
from symphony.priority import PRIORITIES
from symphony.priority import Priority as SessionPriority
from symphony.rpc import kv_pb2

PageId = tuple[BlockKey, int]  # (block key, layer)


class Tier(enum.IntEnum):
    """Fastest first. The names match the gRPC enum (TIER_HBM, ...)."""

    HBM = 1
    DRAM = 2
    SSD = 3


class Priority(enum.IntEnum):
    """The store's view of a session's tier (`symphony.priority.Priority`, same ranks): an int, so
    eviction can order by it. Higher values keep their KV in fast tiers longer."""

    LOW = 0
    NORMAL = 1
    HIGH = 2

    @classmethod
    def of(cls, tier: SessionPriority) -> Priority:
        return cls(tier.rank)

    @property
    def tier(self) -> SessionPriority:
        return PRIORITIES[self.value]

    @property
    def proto(self) -> kv_pb2.Priority:
        """The `symphony.v1.Priority` value."""
        return self.tier.proto

    @classmethod
    def from_proto(cls, value: int) -> Priority | None:
        """None for PRIORITY_UNSPECIFIED or an unknown value."""
        tier = SessionPriority.from_proto(value)
        return None if tier is None else cls.of(tier)

    @classmethod
    def parse(cls, name: str) -> Priority:
        return cls.of(SessionPriority.parse(name))


_LAYER = struct.Struct("<I")


def _page_seed(block_key: BlockKey, layer: int) -> int:
    return xxhash.xxh3_64_intdigest(block_key + _LAYER.pack(layer))


def page_checksum(block_key: BlockKey, layer: int, data: bytes | memoryview) -> int:
    """xxh3-64 of the page's bytes, seeded by a hash of (key, layer): a page copied to the wrong key or
    layer fails the check as surely as a flipped bit does. One-shot, not a streaming digest fed the
    key, layer and bytes, which is slower (docs/design-notes.md#page-checksums), and every SSD read
    and peer transfer checksums each page it delivers.
    `run_checksums` hashes runs of pages the same way (a test holds the two equal)."""
    return xxhash.xxh3_64_intdigest(data, _page_seed(block_key, layer))


def run_checksums(block_keys: Sequence[BlockKey], layer: int, data: memoryview, page_bytes: int) -> list[int]:
    """`page_checksum` of `len(block_keys)` pages of one layer lying back to back in `data`, with
    the per-page work cut to the hashing itself (the peer stream checksums every page it receives)."""
    if not block_keys:
        return []
    layer_bytes = _LAYER.pack(layer)
    digest = xxhash.xxh3_64_intdigest
    return [
        digest(data[offset : offset + page_bytes], digest(key + layer_bytes))
        for offset, key in zip(range(0, len(block_keys) * page_bytes, page_bytes), block_keys, strict=True)
    ]
