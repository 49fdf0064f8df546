"""node_manager.kv.ingest: saves into DRAM (`save_layer`), what they keep and what they refuse."""

from __future__ import annotations

import pytest
import torch

from node_manager.kv.errors import InvalidRequest
from node_manager.kv.pages import Tier
from tests.unit.kv_store_support import (
    LAYERS,
    SENTINEL,
    TIMEOUT,
    WORDS,
    MakeStore,
    all_true,
    hold_ssd_writes,
    load_rows,
    metric,
    page_data,
    save_session,
    tokens,
)


def test_partial_save_reports_missing_blocks(make_store: MakeStore) -> None:
    store = make_store()
    store.sessions.put("acme", "s1", tokens(3))
    data = page_data(3, seed=3)
    for layer in range(LAYERS):
        assert store.ingest.save_layer("acme", "s1", layer, 0, data[layer][:1]).result(TIMEOUT) == 1
        assert store.ingest.save_layer("acme", "s1", layer, 2, data[layer][2:]).result(TIMEOUT) == 1
    tensors, results = load_rows(store, "s1", 3)
    for layer in range(LAYERS):
        assert results[layer].failed == (1,)
        assert results[layer].loaded == 1  # the contiguous prefix
        assert torch.equal(tensors[layer][0], data[layer][0])
        assert torch.equal(tensors[layer][2], data[layer][2])
        assert bool((tensors[layer][1] == SENTINEL).all())
    assert metric(store, "symphony_kv_load_misses_total") == LAYERS


def test_save_degrades_when_dram_is_full_of_unpersisted_pages(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store(hbm_pages=0, dram_pages=LAYERS)
    gate = hold_ssd_writes(store, monkeypatch)
    save_session(store, "a", 1, seed=29)  # fills DRAM; the pages stay pinned until written
    store.sessions.put("acme", "b", tokens(1, base=77_000))
    assert store.ingest.save_layer("acme", "b", 0, 0, page_data(1, seed=30)[0]).result(TIMEOUT) == 0
    assert metric(store, "symphony_kv_save_degraded_total", reason="dram_full") == 1
    gate.set()
    assert store.write_behind.flush(TIMEOUT)
    assert all_true(store.residency("acme", "a")[Tier.SSD])


@pytest.mark.parametrize("layer", [-1, LAYERS, 100])
def test_layer_out_of_range(make_store: MakeStore, layer: int) -> None:
    store = make_store()
    store.sessions.put("acme", "s1", tokens(1))
    with pytest.raises(InvalidRequest, match="layer"):
        store.ingest.save_layer("acme", "s1", layer, 0, page_data(1, seed=1)[0])


@pytest.mark.parametrize(
    "pages",
    [
        torch.zeros(1, WORDS - 1, dtype=torch.int64),
        torch.zeros(1, WORDS + 1, dtype=torch.int64),
        torch.zeros(1, WORDS, dtype=torch.float64),
        torch.zeros(1, WORDS, dtype=torch.int32),
        torch.zeros(1, 2, WORDS // 2, dtype=torch.int64),
        torch.zeros((), dtype=torch.int64),
    ],
    ids=["narrow", "wide", "float64", "int32", "3d", "scalar"],
)
def test_wrong_tensor_shape_or_dtype(make_store: MakeStore, pages: torch.Tensor) -> None:
    store = make_store()
    store.sessions.put("acme", "s1", tokens(1))
    with pytest.raises(InvalidRequest):
        store.ingest.save_layer("acme", "s1", 0, 0, pages)
    assert store.stats()["pages"] == 0


@pytest.mark.parametrize(("first_block", "count"), [(0, 3), (1, 2), (2, 1), (-1, 1)])
def test_save_block_range_beyond_session(make_store: MakeStore, first_block: int, count: int) -> None:
    store = make_store()
    store.sessions.put("acme", "s1", tokens(2, tail=3))  # 2 full blocks; the tail is not storable
    with pytest.raises(InvalidRequest, match="blocks"):
        store.ingest.save_layer("acme", "s1", 0, first_block, torch.zeros(count, WORDS, dtype=torch.int64))
