"""Shared by the KV store's unit tests: a small page geometry, session data, a store factory's type,
and helpers that load, count and damage what a store holds."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from node_manager.kv.loader import LayerResult, RowTarget
from node_manager.kv.pages import Priority
from node_manager.kv.segments import SUFFIX, parse_header
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


def load_rows(
    store: TieredStore,
    session: str,
    num_blocks: int,
    *,
    tenant: str = "acme",
    first_block: int = 0,
    rows: list[int] | None = None,
) -> tuple[list[torch.Tensor], list[LayerResult]]:
    rows = list(range(num_blocks)) if rows is None else rows
    height = max(rows) + 1 if rows else 1
    tensors = [
        torch.full((height, store.geometry.page_words), SENTINEL, dtype=torch.int64)
        for _ in range(store.geometry.num_layers)
    ]
    handle = store.loads.into_rows(tenant, session, first_block, num_blocks, target=RowTarget(tensors, rows))
    return tensors, handle.wait_all(TIMEOUT)


def flip_bits(path: Path, offset: int, mask: int) -> None:
    """Damage one byte of a file on disk in place (XOR with `mask`)."""
    raw = bytearray(path.read_bytes())
    raw[offset] ^= mask
    path.write_bytes(bytes(raw))


def metric(store: TieredStore, name: str, **labels: str) -> float:
    value = store.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def segment_files(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"*{SUFFIX}"))


def locate_page(directory: Path, key: bytes, layer: int) -> tuple[Path, int]:
    """The segment file and byte offset holding page (key, layer)."""
    for path in segment_files(directory):
        data = path.read_bytes()
        header = parse_header(data)
        for index, entry in enumerate(header.entries):
            if entry.block_key == key and entry.layer == layer:
                return path, header.page_offset(index)
    raise AssertionError("page not found in any segment")


def reopen_with_a_flipped_page(
    make_store: MakeStore, ssd_dir: Path, session: str, num_blocks: int, seed: int, bad: tuple[int, int, int, int]
) -> tuple[TieredStore, list[torch.Tensor]]:
    """Save `session` (blocks from token 0), close the store, flip `mask` at byte `offset` of page
    (block, layer) on disk (`bad` = (block, layer, offset, mask)), and reopen it with the session
    registered again: the restarted store and the saved data."""
    block, layer, offset, mask = bad
    first = make_store()
    data = save_session(first, session, num_blocks, seed=seed, base=0)
    bad_key = first.sessions.get("acme", session).blocks.block_keys[block]
    first.close()
    path, at = locate_page(ssd_dir, bad_key, layer=layer)
    flip_bits(path, at + offset, mask)
    second = make_store()
    second.sessions.put("acme", session, tokens(num_blocks, base=0))
    return second, data


def all_true(grid: list[list[bool]]) -> bool:
    return all(all(row) for row in grid)


def none_true(grid: list[list[bool]]) -> bool:
    return not any(any(row) for row in grid)


def hold_ssd_writes(store: TieredStore, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make the write-behind wait (its pages stay pinned, DRAM-only) until the returned gate is set."""
    gate = threading.Event()
    real_write = store.ssd.write

    def held_write(*args: object, **kwargs: object) -> None:
        gate.wait(TIMEOUT)
        real_write(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(store.ssd, "write", held_write)
    return gate
