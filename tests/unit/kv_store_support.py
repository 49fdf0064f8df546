"""Shared by the KV store's unit tests: a small page geometry, session data and a store factory."""

from __future__ import annotations

from collections.abc import Callable

import torch

from node_manager.kv.pages import Priority
from node_manager.kv.store import TieredStore
from symphony.kv_geometry import KVGeometry

GEOMETRY = KVGeometry(num_layers=4, kv_heads=1, head_size=4, block_size=4)  # 64-byte pages of 8 int64 words
PAGE = GEOMETRY.page_bytes
WORDS = GEOMETRY.page_words
BLOCK = GEOMETRY.block_size
LAYERS = GEOMETRY.num_layers
SENTINEL = -0x5A5A5A5A5A5A5A5A
TIMEOUT = 10.0

assert PAGE == 64 and WORDS == 8

MakeStore = Callable[..., TieredStore]


def tokens(num_blocks: int, base: int = 1000, tail: int = 0, block_size: int = BLOCK) -> list[int]:
    return list(range(base, base + num_blocks * block_size + tail))


def page_data(num_blocks: int, seed: int, geometry: KVGeometry = GEOMETRY) -> list[torch.Tensor]:
    """Per layer, [num_blocks, page_words] int64 of random (seeded, never SENTINEL-filled) words."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(-(2**62), 2**62, (num_blocks, geometry.page_words), generator=generator, dtype=torch.int64)
        for _ in range(geometry.num_layers)
    ]


def save_session(
    store: TieredStore,
    session: str,
    num_blocks: int,
    seed: int,
    *,
    tenant: str = "acme",
    base: int | None = None,
    priority: Priority | None = None,
    layers: list[int] | None = None,
    flush_each: bool = False,
) -> list[torch.Tensor]:
    store.sessions.put(
        tenant,
        session,
        tokens(num_blocks, base if base is not None else seed * 10_000, block_size=store.geometry.block_size),
        priority,
    )
    data = page_data(num_blocks, seed, store.geometry)
    for layer in range(store.geometry.num_layers) if layers is None else layers:
        kept = store.ingest.save_layer(tenant, session, layer, 0, data[layer]).result(TIMEOUT)
        assert kept == num_blocks
        if flush_each:
            assert store.write_behind.flush(TIMEOUT)
    return data
