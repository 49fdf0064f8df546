"""node_manager.kv.loads: loads into caller rows and promotions into a tier, layer by layer, and the
requests they refuse."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from node_manager.kv.errors import InvalidRequest
from node_manager.kv.loader import LayerResult, LayerwiseLoad, RowTarget
from node_manager.kv.pages import Tier
from symphony.kv_geometry import KVGeometry
from tests.unit.kv_store_support import (
    LAYERS,
    SENTINEL,
    TIMEOUT,
    WORDS,
    MakeStore,
    all_true,
    load_rows,
    metric,
    save_session,
    tokens,
)

# ---- into rows -----------------------------------------------------------------------------------


def test_save_then_load_into_rows_is_byte_identical(make_store: MakeStore) -> None:
    store = make_store()
    data = save_session(store, "s1", 3, seed=1)
    tensors, results = load_rows(store, "s1", 3)
    for layer in range(LAYERS):
        assert torch.equal(tensors[layer], data[layer])
        assert results[layer].layer == layer
        assert results[layer].failed == ()
        assert results[layer].loaded == 3
        assert results[layer].by_tier == {Tier.DRAM: 3}
    assert metric(store, "symphony_kv_load_hits_total", tier="DRAM") == 3 * LAYERS


def test_load_honours_row_mapping_and_block_range(make_store: MakeStore) -> None:
    store = make_store()
    data = save_session(store, "s1", 4, seed=2)
    tensors, results = load_rows(store, "s1", 2, first_block=1, rows=[5, 0])
    for layer in range(LAYERS):
        assert torch.equal(tensors[layer][5], data[layer][1])
        assert torch.equal(tensors[layer][0], data[layer][2])
        untouched = [r for r in range(6) if r not in (0, 5)]
        assert bool((tensors[layer][untouched] == SENTINEL).all())
        assert results[layer].failed == ()
        assert results[layer].loaded == 2


def test_layer_futures_resolve_in_layer_order(make_store: MakeStore) -> None:
    geometry = KVGeometry(num_layers=12, kv_heads=1, head_size=4, block_size=4)
    store = make_store(geometry=geometry, hbm_pages=0, dram_pages=256, io_threads=4)
    data = save_session(store, "s1", 8, seed=6)
    assert store.write_behind.flush(TIMEOUT)
    lock = threading.Lock()
    for attempt in range(20):
        tensors = [torch.full((8, geometry.page_words), SENTINEL, dtype=torch.int64) for _ in range(12)]
        handle = store.loads.into_rows("acme", "s1", target=RowTarget(tensors, list(range(8))))
        observed: list[tuple[int, list[bool]]] = []
        for layer in range(12):
            handle.layers[layer].add_done_callback(
                lambda _, layer=layer, handle=handle, observed=observed: record(handle, layer, observed, lock)
            )
        results = handle.wait_all(TIMEOUT)
        assert [r.layer for r in results] == list(range(12))
        assert sorted(layer for layer, _ in observed) == list(range(12)), attempt
        for layer, earlier in observed:
            assert all(earlier), f"layer {layer} resolved before an earlier layer (attempt {attempt})"
        # A completed layer's rows are already in place when its future resolves.
        assert all(torch.equal(tensors[layer], data[layer]) for layer in range(12))


def record(handle: LayerwiseLoad, layer: int, observed: list[tuple[int, list[bool]]], lock: threading.Lock) -> None:
    """Done-callback of layer `layer`: which earlier layers were already resolved at that moment."""
    earlier = [f.done() for f in handle.layers[:layer]]
    with lock:
        observed.append((layer, earlier))


def test_layerwise_load_orders_results_even_when_layers_finish_concurrently() -> None:
    """A thread that completed layer 0 may be preempted right after leaving the handle's lock and before
    resolving layer 0's future; meanwhile another thread completes layer 1. Layer 1 must still not
    resolve before layer 0 (the LayerwiseLoad contract)."""
    handle = LayerwiseLoad(num_layers=2, first_block=0, num_blocks=1)
    first = handle.layers[0]
    entered, release = threading.Event(), threading.Event()
    real_set_result = first.set_result

    def preempted_set_result(result: LayerResult) -> None:
        entered.set()
        release.wait(TIMEOUT)
        real_set_result(result)

    first.set_result = preempted_set_result  # type: ignore[method-assign]
    layer0_done_when_layer1_resolved: list[bool] = []
    handle.layers[1].add_done_callback(lambda _: layer0_done_when_layer1_resolved.append(first.done()))
    worker = threading.Thread(target=handle._finish, args=(0, LayerResult(0, 1, ())))
    worker.start()
    assert entered.wait(TIMEOUT)
    finisher = threading.Thread(target=handle._finish, args=(1, LayerResult(1, 1, ())))
    finisher.start()
    # Bounded: an implementation that makes this thread wait for layer 0 is released below.
    finisher.join(1.0)
    release.set()
    worker.join(TIMEOUT)
    finisher.join(TIMEOUT)
    assert handle.layers[0].result(TIMEOUT).layer == 0
    assert handle.layers[1].result(TIMEOUT).layer == 1
    assert layer0_done_when_layer1_resolved == [True], "layer 1's future resolved while layer 0's was pending"


def test_load_only_selected_layers(make_store: MakeStore) -> None:
    store = make_store()
    data = save_session(store, "s1", 2, seed=7)
    tensors = [torch.full((2, WORDS), SENTINEL, dtype=torch.int64) for _ in range(LAYERS)]
    results = store.loads.into_rows("acme", "s1", target=RowTarget(tensors, [0, 1]), layers=[2]).wait_all(TIMEOUT)
    assert torch.equal(tensors[2], data[2])
    assert results[2].loaded == 2
    for layer in (0, 1, 3):
        assert results[layer].loaded == 0
        assert bool((tensors[layer] == SENTINEL).all())


def test_wait_all_times_out_while_a_layer_is_pending() -> None:
    handle = LayerwiseLoad(2, 0, 1)
    handle._finish(0, LayerResult(0, 1, ()))
    with pytest.raises(TimeoutError):
        handle.wait_all(0.05)
    handle._finish(1, LayerResult(1, 1, ()))
    assert [r.layer for r in handle.wait_all(TIMEOUT)] == [0, 1]


# ---- promotions ----------------------------------------------------------------------------------


def test_promotion_to_hbm(make_store: MakeStore) -> None:
    store = make_store(hbm_pages=LAYERS, dram_pages=4 * LAYERS)
    data = save_session(store, "s1", 1, seed=31)
    assert store.write_behind.flush(TIMEOUT)
    results = store.loads.promote("acme", "s1", tier=Tier.HBM).wait_all(TIMEOUT)
    assert all(r.failed == () and r.loaded == 1 and r.by_tier == {Tier.DRAM: 1} for r in results)
    residency = store.residency("acme", "s1")
    assert all_true(residency[Tier.HBM]) and all_true(residency[Tier.DRAM])
    assert store.stats()["hbm_pages"] == LAYERS
    # Promoting again is a no-op that counts the pages as already there.
    again = store.loads.promote("acme", "s1", tier=Tier.HBM).wait_all(TIMEOUT)
    assert all(r.by_tier == {Tier.HBM: 1} and r.failed == () for r in again)
    tensors, results = load_rows(store, "s1", 1)
    assert all(r.by_tier == {Tier.HBM: 1} for r in results)
    assert all(torch.equal(tensors[layer], data[layer]) for layer in range(LAYERS))


def test_promotion_from_ssd_to_dram(make_store: MakeStore, ssd_dir: Path) -> None:
    first = make_store()
    data = save_session(first, "s1", 1, seed=32, base=0)
    first.close()
    second = make_store()
    second.sessions.put("acme", "s1", tokens(1, base=0))
    results = second.loads.promote("acme", "s1", tier=Tier.DRAM).wait_all(TIMEOUT)
    assert all(r.by_tier == {Tier.SSD: 1} and r.failed == () for r in results)
    assert all_true(second.residency("acme", "s1")[Tier.DRAM])
    tensors, results = load_rows(second, "s1", 1)
    assert all(r.by_tier == {Tier.DRAM: 1} for r in results)
    assert all(torch.equal(tensors[layer], data[layer]) for layer in range(LAYERS))


def test_hbm_yields_later_layers_first(make_store: MakeStore) -> None:
    store = make_store(hbm_pages=LAYERS, dram_pages=4 * LAYERS)
    save_session(store, "a", 1, seed=33)
    save_session(store, "b", 1, seed=34)
    assert store.write_behind.flush(TIMEOUT)
    store.loads.promote("acme", "a", tier=Tier.HBM).wait_all(TIMEOUT)
    assert store.residency("acme", "a")[Tier.HBM] == [[True]] * LAYERS

    results = store.loads.promote("acme", "b", tier=Tier.HBM, layers=[0]).wait_all(TIMEOUT)
    assert results[0].loaded == 1 and results[0].failed == ()
    assert store.residency("acme", "a")[Tier.HBM] == [[True], [True], [True], [False]]
    store.loads.promote("acme", "b", tier=Tier.HBM, layers=[1]).wait_all(TIMEOUT)
    assert store.residency("acme", "a")[Tier.HBM] == [[True], [True], [False], [False]]
    assert store.residency("acme", "b")[Tier.HBM] == [[True], [True], [False], [False]]
    assert metric(store, "symphony_kv_evictions_total", tier="HBM", reason="capacity") == 2
    # The evicted pages still live below HBM.
    assert all_true(store.residency("acme", "a")[Tier.DRAM])


def test_hbm_promotion_beyond_capacity_promotes_what_fits(make_store: MakeStore) -> None:
    store = make_store(hbm_pages=2, dram_pages=4 * LAYERS)
    save_session(store, "s1", 3, seed=35)
    results = store.loads.promote("acme", "s1", tier=Tier.HBM, layers=[0]).wait_all(TIMEOUT)
    assert results[0].loaded == 2
    assert results[0].failed == (2,)
    assert store.residency("acme", "s1")[Tier.HBM][0] == [True, True, False]


# ---- bad requests --------------------------------------------------------------------------------


@pytest.mark.parametrize(("first_block", "count"), [(0, 3), (3, None), (1, 2), (-1, 1), (0, -1)])
def test_load_block_range_beyond_session(make_store: MakeStore, first_block: int, count: int | None) -> None:
    store = make_store()
    store.sessions.put("acme", "s1", tokens(2, tail=3))
    with pytest.raises(InvalidRequest):
        store.loads.promote("acme", "s1", first_block, count, tier=Tier.DRAM)


def test_bad_load_targets(make_store: MakeStore) -> None:
    store = make_store()
    store.sessions.put("acme", "s1", tokens(2))
    tensors = [torch.zeros(2, WORDS, dtype=torch.int64) for _ in range(LAYERS)]
    with pytest.raises(InvalidRequest):
        store.loads.into_rows("acme", "s1", target=RowTarget(tensors, [0]))  # one row for two blocks
    with pytest.raises(InvalidRequest):
        store.loads.into_rows("acme", "s1", target=RowTarget(tensors[:-1], [0, 1]))  # a layer short
    with pytest.raises(InvalidRequest):
        store.loads.promote("acme", "s1", tier=Tier.SSD)


@pytest.mark.parametrize(
    ("rows", "height", "dtype", "words"),
    [
        ([0, 2], 2, torch.int64, WORDS),  # row 2 is past a 2-row tensor
        ([-1, 0], 2, torch.int64, WORDS),
        ([0, 1], 2, torch.int32, WORDS),
        ([0, 1], 2, torch.int64, WORDS - 1),
    ],
    ids=["row-past-end", "negative-row", "int32", "narrow"],
)
def test_row_target_outside_its_tensors_is_refused(
    make_store: MakeStore, rows: list[int], height: int, dtype: torch.dtype, words: int
) -> None:
    """Loads copy into destination rows by address: a row outside a tensor must never be written."""
    store = make_store()
    save_session(store, "s1", 2, seed=53)
    tensors = [torch.zeros(height, words, dtype=dtype) for _ in range(LAYERS)]
    with pytest.raises(InvalidRequest, match="row target"):
        store.loads.into_rows("acme", "s1", target=RowTarget(tensors, rows))
    assert store.write_behind.flush(TIMEOUT), "a refused load kept an in-flight slot"
    assert store.pinned_pages() == 0


@pytest.mark.parametrize("layers", [[0, 0], [LAYERS], [-1]])
def test_load_rejects_repeated_or_unknown_layers(make_store: MakeStore, layers: list[int]) -> None:
    store = make_store()
    save_session(store, "s1", 1, seed=53)
    tensors = [torch.zeros(1, WORDS, dtype=torch.int64) for _ in range(LAYERS)]
    with pytest.raises(InvalidRequest, match="layers"):
        store.loads.into_rows("acme", "s1", target=RowTarget(tensors, [0]), layers=layers)
    assert store.write_behind.flush(TIMEOUT), "a rejected load must not hold an in-flight slot"
