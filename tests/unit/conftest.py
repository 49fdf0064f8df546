"""Fixtures shared by the unit tests of the KV store and its page stream."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from uuid import uuid4

import pytest

from node_manager.kv.store import TieredStore
from node_manager.kv.store_config import StoreConfig
from symphony.kv_geometry import KVGeometry
from tests.helpers import TEST_MODEL
from tests.unit.kv_store_support import GEOMETRY, TIMEOUT, MakeStore


@pytest.fixture
def ssd_dir(tmp_path: Path) -> Path:
    return tmp_path / "ssd"


@pytest.fixture
def make_store(ssd_dir: Path) -> Iterator[MakeStore]:
    stores: list[TieredStore] = []

    def make(
        *,
        hbm_pages: int = 16,
        dram_pages: int = 64,
        ssd_bytes: int = 4 << 20,
        directory: Path | None = None,
        geometry: KVGeometry = GEOMETRY,
        **overrides: object,
    ) -> TieredStore:
        config = StoreConfig(
            hbm_bytes=hbm_pages * geometry.page_bytes,
            dram_bytes=dram_pages * geometry.page_bytes,
            ssd_bytes=ssd_bytes,
            ssd_dir=directory or ssd_dir,
            arena_name=f"symphony-test-{uuid4().hex[:8]}",
            **{"model": TEST_MODEL, **overrides},
        )  # type: ignore[arg-type]
        store = TieredStore(geometry, config)
        stores.append(store)
        return store

    yield make
    for store in stores:
        if not store.closed:
            store.close(flush_timeout=TIMEOUT)
        assert not store.dram.path.exists(), "close() must remove the shared-memory arena"
        assert not store.block_index.path.exists(), "close() must remove the block index"
