"""node_manager.kv.load_plan: the three load paths (layer by layer, wholly from DRAM, wholly from SSD):
sources chosen, faults confined to their layer or page, and every pin released."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from node_manager.kv.loader import LayerwiseLoad, RowTarget
from node_manager.kv.memory_load import MemoryLoad
from node_manager.kv.pages import Tier
from node_manager.kv.ssd_load import SsdLoad
from node_manager.kv.store import TieredStore
from tests.unit.kv_store_support import (
    GEOMETRY,
    LAYERS,
    SENTINEL,
    TIMEOUT,
    WORDS,
    MakeStore,
    flip_bits,
    load_rows,
    locate_page,
    metric,
    reopen_with_a_flipped_page,
    save_session,
    tokens,
)

# ---- the general path, layer by layer ------------------------------------------------------------


def test_one_layer_served_from_hbm_and_dram_across_lanes(make_store: MakeStore) -> None:
    """Blocks 0-3 promoted to HBM, 4-7 only in DRAM: each layer's stripes mix sources and rows."""
    store = make_store(hbm_pages=4 * LAYERS, dram_pages=8 * LAYERS)
    data = save_session(store, "s1", 8, seed=41)
    promoted = store.loads.promote("acme", "s1", 0, 4, tier=Tier.HBM).wait_all(TIMEOUT)
    assert all(r.failed == () for r in promoted)
    rows = [7, 6, 5, 4, 3, 2, 1, 0]
    tensors, results = load_rows(store, "s1", 8, rows=rows)
    assert all(r.by_tier == {Tier.HBM: 4, Tier.DRAM: 4} and r.failed == () for r in results)
    for layer in range(LAYERS):
        assert torch.equal(tensors[layer], data[layer].flip(0))


def test_a_layer_whose_planning_fails_is_reported_and_the_rest_still_load(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store(hbm_pages=LAYERS)
    data = save_session(store, "s1", 2, seed=43)
    # Block 0 also in HBM: a load of mixed sources, planned layer by layer (not the DRAM-only path).
    assert all(r.failed == () for r in store.loads.promote("acme", "s1", 0, 1, tier=Tier.HBM).wait_all(TIMEOUT))
    plan_layer = store.loads.planner.plan_rows_layer

    def failing(handle: LayerwiseLoad, layer: int, *rest: object) -> object:
        if layer == 1:
            raise RuntimeError("injected planning fault")
        return plan_layer(handle, layer, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(store.loads.planner, "plan_rows_layer", failing)
    tensors = [torch.full((2, GEOMETRY.page_words), SENTINEL, dtype=torch.int64) for _ in range(LAYERS)]
    handle = store.loads.into_rows("acme", "s1", target=RowTarget(tensors, [0, 1]))
    with pytest.raises(RuntimeError, match="injected"):
        handle.layer_ready(1).result(TIMEOUT)
    for layer in (0, *range(2, LAYERS)):
        assert handle.layer_ready(layer).result(TIMEOUT).failed == ()
        assert torch.equal(tensors[layer], data[layer])
    assert store.write_behind.flush(TIMEOUT), "the failed layer's in-flight slot was never returned"
    assert store.pinned_pages() == 0


def test_a_consumer_cancelling_its_wait_does_not_stall_the_load(make_store: MakeStore) -> None:
    """A gRPC client that goes away cancels the future it awaited; the load must still finish,
    resolve the other layers and release every pin and in-flight slot."""
    store = make_store()
    data = save_session(store, "s1", 2, seed=47)
    tensors = [torch.full((2, GEOMETRY.page_words), SENTINEL, dtype=torch.int64) for _ in range(LAYERS)]
    handle = store.loads.into_rows("acme", "s1", target=RowTarget(tensors, [0, 1]))
    cancelled = [layer for layer in range(LAYERS) if handle.layer_ready(layer).cancel()]
    for layer in range(LAYERS):
        if layer not in cancelled:
            assert handle.layer_ready(layer).result(TIMEOUT).failed == ()
            assert torch.equal(tensors[layer], data[layer])
    assert store.write_behind.flush(TIMEOUT), "an in-flight slot leaked"
    assert store.pinned_pages() == 0


def test_flipped_byte_on_ssd_is_detected_and_never_served(make_store: MakeStore, ssd_dir: Path) -> None:
    second, data = reopen_with_a_flipped_page(make_store, ssd_dir, "s1", 2, seed=9, bad=(1, 2, 13, 0x10))
    tensors, results = load_rows(second, "s1", 2)
    for layer in range(LAYERS):
        if layer == 2:
            assert results[layer].failed == (1,)
            assert results[layer].loaded == 1
            assert torch.equal(tensors[layer][0], data[layer][0])
            assert not torch.equal(tensors[layer][1], data[layer][1])
        else:
            assert results[layer].failed == ()
            assert torch.equal(tensors[layer], data[layer])
    assert metric(second, "symphony_kv_load_errors_total", reason="checksum") == 1
    assert metric(second, "symphony_kv_last_copy_dropped_total", reason="corrupt") == 1
    assert not second.residency("acme", "s1")[Tier.SSD][2][1]

    misses_before = metric(second, "symphony_kv_load_misses_total")
    tensors, results = load_rows(second, "s1", 2)
    assert results[2].failed == (1,)
    assert all(results[layer].failed == () for layer in (0, 1, 3))
    assert metric(second, "symphony_kv_load_misses_total") == misses_before + 1  # missing now, not re-read
    assert metric(second, "symphony_kv_load_errors_total", reason="checksum") == 1
    assert bool((tensors[2][1] == SENTINEL).all())


def test_failed_row_never_holds_the_corrupt_bytes(make_store: MakeStore, ssd_dir: Path) -> None:
    """A block reported as failed must not leave the corrupt page's bytes in the caller's row: a read
    straight into the caller's row clears it, a staged read never copies it."""
    first = make_store()
    save_session(first, "s1", 2, seed=10, base=0)
    bad_key = first.sessions.get("acme", "s1").blocks.block_keys[0]
    first.close()
    path, offset = locate_page(ssd_dir, bad_key, layer=1)
    flip_bits(path, offset, 0xFF)

    second = make_store()
    second.sessions.put("acme", "s1", tokens(2, base=0))
    tensors, results = load_rows(second, "s1", 2)
    assert results[1].failed == (0,)
    assert results[1].loaded == 0
    assert metric(second, "symphony_kv_load_errors_total", reason="checksum") == 1
    row = tensors[1][0]
    assert bool((row == 0).all()) or bool((row == SENTINEL).all()), "the corrupt page was left in the row"


# ---- loads wholly from DRAM (`MemoryLoad`) -------------------------------------------------------


def test_a_dram_load_layer_whose_copy_fails_is_reported_and_the_rest_still_load(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DRAM-only path (`MemoryLoad`): a failed copy fails its layer only, and the load still
    releases every pin and in-flight slot."""
    store = make_store()
    data = save_session(store, "s1", 2, seed=59)
    copy = MemoryLoad._copy

    def failing(self: MemoryLoad, position: int) -> None:
        if self.prepared.order[position] == 1:
            raise RuntimeError("injected copy fault")
        copy(self, position)

    monkeypatch.setattr(MemoryLoad, "_copy", failing)
    tensors, results = load_rows(store, "s1", 2)
    assert results[1].failed == (0, 1) and results[1].loaded == 0
    for layer in (0, *range(2, LAYERS)):
        assert results[layer].failed == () and results[layer].by_tier == {Tier.DRAM: 2}
        assert torch.equal(tensors[layer], data[layer])
    assert store.write_behind.flush(TIMEOUT), "the load's in-flight slots were never returned"
    assert store.pinned_pages() == 0


@pytest.mark.parametrize("layout", ["scattered-rows", "strided-tensors"])
def test_a_dram_load_into_scattered_rows_or_strided_tensors(make_store: MakeStore, layout: str) -> None:
    """Rows out of order take one copy per run; tensors that are views with a wider row stride (a
    slice of a bigger buffer) cannot be copied into by plain address arithmetic and must still be right."""
    store = make_store()
    data = save_session(store, "s1", 4, seed=61)
    if layout == "scattered-rows":
        rows = [5, 0, 1, 3]
        tensors = [torch.full((6, WORDS), SENTINEL, dtype=torch.int64) for _ in range(LAYERS)]
    else:
        rows = [0, 1, 2, 3]
        tensors = [torch.full((4, 2 * WORDS), SENTINEL, dtype=torch.int64)[:, WORDS:] for _ in range(LAYERS)]
    results = store.loads.into_rows("acme", "s1", target=RowTarget(tensors, rows)).wait_all(TIMEOUT)
    assert all(r.failed == () and r.by_tier == {Tier.DRAM: 4} for r in results)
    for layer in range(LAYERS):
        assert torch.equal(tensors[layer][rows], data[layer])
        untouched = [row for row in range(tensors[layer].shape[0]) if row not in rows]
        assert bool((tensors[layer][untouched] == SENTINEL).all())


def test_dram_load_with_scattered_rows_releases_every_pin(make_store: MakeStore) -> None:
    """A load held wholly in DRAM is planned and pinned as one: rows out of order still land right,
    the pins hold while it runs (eviction cannot take its pages) and all go when it is done."""
    store = make_store(hbm_pages=0, dram_pages=4 * LAYERS)
    data = save_session(store, "s1", 4, seed=51)
    assert store.write_behind.flush(TIMEOUT)
    assert store.pinned_pages() == 0
    rows = [3, 0, 2, 1]
    tensors, results = load_rows(store, "s1", 4, rows=rows)
    assert all(r.failed == () and r.by_tier == {Tier.DRAM: 4} and r.loaded == 4 for r in results)
    for layer in range(LAYERS):
        for block, row in enumerate(rows):
            assert torch.equal(tensors[layer][row], data[layer][block])
    assert store.write_behind.flush(TIMEOUT) and store.pinned_pages() == 0
    assert metric(store, "symphony_kv_load_hits_total", tier="DRAM") == 4 * LAYERS


@pytest.mark.parametrize("order", [[3, 1], [2, 0, 3, 1]], ids=["subset", "permuted"])
def test_dram_load_of_chosen_layers_in_any_order(make_store: MakeStore, order: list[int]) -> None:
    """The whole-load DRAM plan selects its layers' columns (or whole rows when every layer comes):
    each chosen layer lands, the others stay untouched, every layer resolves and no pin is left."""
    store = make_store(hbm_pages=0, dram_pages=4 * LAYERS)
    data = save_session(store, "s1", 3, seed=54)
    _load_chosen_layers_and_check(store, data, order, Tier.DRAM)


def _load_chosen_layers_and_check(store: TieredStore, data: list[torch.Tensor], order: list[int], source: Tier) -> None:
    """Load layers `order` of session "s1" (3 blocks, all held in `source`): each chosen layer lands,
    the others stay untouched, every layer resolves and no pin is left."""
    tensors = [torch.full((3, WORDS), SENTINEL, dtype=torch.int64) for _ in range(LAYERS)]
    results = store.loads.into_rows("acme", "s1", target=RowTarget(tensors, [0, 1, 2]), layers=order).wait_all(TIMEOUT)
    for layer in range(LAYERS):
        if layer in order:
            assert results[layer].by_tier == {source: 3} and torch.equal(tensors[layer], data[layer])
        else:
            assert results[layer].loaded == 0 and bool((tensors[layer] == SENTINEL).all())
    assert store.write_behind.flush(TIMEOUT) and store.pinned_pages() == 0


# ---- loads wholly from SSD (`SsdLoad`) -----------------------------------------------------------


def _restarted_with(make_store: MakeStore, num_blocks: int, seed: int) -> tuple[TieredStore, list[torch.Tensor]]:
    """A store whose only copy of session "s1" is on SSD: saved by a first store, rebuilt by a second."""
    first = make_store()
    data = save_session(first, "s1", num_blocks, seed=seed, base=0)
    first.close()
    second = make_store()
    second.sessions.put("acme", "s1", tokens(num_blocks, base=0))
    return second, data


def _no_layer_planning(store: TieredStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the load falls back to the general path, which plans layer by layer."""

    def planned(*_: object) -> None:
        raise AssertionError("an SSD-only load was planned layer by layer")

    monkeypatch.setattr(store.loads.planner, "plan_rows_layer", planned)


def test_ssd_only_load_is_planned_once_lands_in_scattered_rows_and_releases_every_pin(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, data = _restarted_with(make_store, 4, seed=71)
    _no_layer_planning(store, monkeypatch)
    rows = [5, 0, 3, 1]
    tensors, results = load_rows(store, "s1", 4, rows=rows)
    assert all(r.failed == () and r.loaded == 4 and r.by_tier == {Tier.SSD: 4} for r in results)
    for layer in range(LAYERS):
        for block, row in enumerate(rows):
            assert torch.equal(tensors[layer][row], data[layer][block])
        assert bool((tensors[layer][[2, 4]] == SENTINEL).all())
    assert store.pinned_pages() == 0
    assert store.write_behind.flush(TIMEOUT), "the load's in-flight slots were never returned"
    assert metric(store, "symphony_kv_load_hits_total", tier="SSD") == 4 * LAYERS


@pytest.mark.parametrize("order", [[2], [3, 1], [2, 0, 3, 1]], ids=["one", "subset", "permuted"])
def test_ssd_only_load_of_chosen_layers_in_any_order(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch, order: list[int]
) -> None:
    store, data = _restarted_with(make_store, 3, seed=73)
    _no_layer_planning(store, monkeypatch)
    _load_chosen_layers_and_check(store, data, order, Tier.SSD)


def test_ssd_only_load_with_a_short_segment_fails_those_pages_and_loads_the_rest(
    make_store: MakeStore, ssd_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A segment cut short (a read error): the pages it can no longer supply fail as io errors, rows
    of failed blocks never keep partial bytes, the copies are dropped and no pin is left."""
    first = make_store()
    data = save_session(first, "s1", 2, seed=75, base=0, flush_each=True)  # a segment per layer
    key = first.sessions.get("acme", "s1").blocks.block_keys[0]
    first.close()
    store = make_store()
    store.sessions.put("acme", "s1", tokens(2, base=0))
    _no_layer_planning(store, monkeypatch)
    path, offset = locate_page(ssd_dir, key, layer=2)
    os.truncate(path, offset + 100)
    tensors, results = load_rows(store, "s1", 2)
    assert results[2].failed == (0, 1) and results[2].loaded == 0
    assert bool((tensors[2] == 0).all())
    for layer in (0, 1, 3):
        assert results[layer].failed == () and torch.equal(tensors[layer], data[layer])
    assert metric(store, "symphony_kv_load_errors_total", reason="io_error") == 2
    assert not any(store.residency("acme", "s1")[Tier.SSD][2])
    assert store.pinned_pages() == 0 and store.write_behind.flush(TIMEOUT)


def test_ssd_only_load_layer_that_raises_is_reported_and_the_rest_still_load(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, data = _restarted_with(make_store, 2, seed=77)
    read_layer = SsdLoad._read_layer

    def failing(self: SsdLoad, position: int) -> list[object]:
        if self.prepared.order[position] == 1:
            raise RuntimeError("injected read fault")
        return read_layer(self, position)  # type: ignore[return-value]

    monkeypatch.setattr(SsdLoad, "_read_layer", failing)
    tensors, results = load_rows(store, "s1", 2)
    assert results[1].failed == (0, 1) and results[1].loaded == 0 and bool((tensors[1] == 0).all())
    for layer in (0, 2, 3):
        assert results[layer].failed == () and torch.equal(tensors[layer], data[layer])
    assert store.pinned_pages() == 0 and store.write_behind.flush(TIMEOUT)


def test_cancelled_ssd_only_load_skips_the_layers_not_started(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, data = _restarted_with(make_store, 2, seed=79)
    reading, release = threading.Event(), threading.Event()
    read_layer = SsdLoad._read_layer

    def held_first(self: SsdLoad, position: int) -> list[object]:
        if position == 0:
            reading.set()
            assert release.wait(TIMEOUT)
        return read_layer(self, position)  # type: ignore[return-value]

    monkeypatch.setattr(SsdLoad, "_read_layer", held_first)
    tensors = [torch.full((2, WORDS), SENTINEL, dtype=torch.int64) for _ in range(LAYERS)]
    handle = store.loads.into_rows("acme", "s1", target=RowTarget(tensors, [0, 1]))
    assert reading.wait(TIMEOUT)
    handle.cancel()
    release.set()
    results = handle.wait_all(TIMEOUT)
    assert results[0].failed == () and torch.equal(tensors[0], data[0])  # started before the cancel
    for layer in range(1, LAYERS):
        assert results[layer].loaded == 0 and bool((tensors[layer] == SENTINEL).all())
    assert store.pinned_pages() == 0 and store.write_behind.flush(TIMEOUT)
