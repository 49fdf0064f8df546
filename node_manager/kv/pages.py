"""Names shared by every part of the KV store: tiers, priorities, page ids and page MACs."""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence

import blake3

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
KEY_ID_BYTES = 8
_MAC_CONTEXT = "symphony 2026-11-28 KV page MAC"  # BLAKE3 key derivation: this use of the secret only


class PageMac:
    """The keyed 64-bit tag every page carries: BLAKE3 in keyed mode over (block key, layer, bytes),
    under a key derived from the cluster's secret (`cluster.secret`). A page copied to the wrong key
    or layer fails its check as surely as a flipped bit; and a page made by someone without the
    secret (a fake peer, a forged `WritePages`, a file dropped into the SSD directory) fails it too,
    since only the cluster's processes can make a valid tag. With no secret the key is public: the
    tag still catches corruption, not forgery.

    `key_id` names the key without revealing it: segments record it, so a node started with another
    secret sets old segments aside instead of failing every read. Costs ~10 µs per 24 KiB page on the
    development host, ten times xxh3 (docs/design-notes.md#page-macs). Thread-safe: holds no state
    beyond the key."""

    def __init__(self, secret: bytes) -> None:
        self._key = blake3.blake3(secret, derive_key_context=_MAC_CONTEXT).digest()
        self.key_id = blake3.blake3(b"key id", key=self._key).digest(KEY_ID_BYTES)

    def tag(self, block_key: BlockKey, layer: int, data: bytes | memoryview) -> int:
        hasher = blake3.blake3(block_key + _LAYER.pack(layer), key=self._key)
        hasher.update(data)
        return int.from_bytes(hasher.digest(8), "little")

    def run_tags(self, block_keys: Sequence[BlockKey], layer: int, data: memoryview, page_bytes: int) -> list[int]:
        """`tag` of `len(block_keys)` pages of one layer lying back to back in `data`."""
        if not block_keys:
            return []
        tag = self.tag
        return [
            tag(key, layer, data[offset : offset + page_bytes])
            for offset, key in zip(range(0, len(block_keys) * page_bytes, page_bytes), block_keys, strict=True)
        ]
