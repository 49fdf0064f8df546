"""node_manager.kv.store: the tiered KV store (HBM / DRAM arena / SSD segments) and its layer-wise API."""

from __future__ import annotations

import errno
import os
import struct
import threading
from pathlib import Path
from uuid import uuid4

import pytest
import torch

from node_manager.kv.errors import InvalidRequest, SessionNotFound
from node_manager.kv.loader import LayerResult, LayerwiseLoad, RowTarget
from node_manager.kv.memory_load import MemoryLoad
from node_manager.kv.pages import Priority, Tier
from node_manager.kv.segments import SUFFIX, TMP_SUFFIX, VERSION, parse_header
from node_manager.kv.ssd_load import SsdLoad
from node_manager.kv.store import TieredStore
from node_manager.kv.store_config import StoreConfig
from symphony.kv_geometry import KVGeometry
from tests.helpers import TEST_MODEL
from tests.unit.kv_store_support import (
    GEOMETRY,
    LAYERS,
    PAGE,
    SENTINEL,
    TIMEOUT,
    WORDS,
    MakeStore,
    page_data,
    save_session,
    tokens,
)


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


def all_true(grid: list[list[bool]]) -> bool:
    return all(all(row) for row in grid)


def none_true(grid: list[list[bool]]) -> bool:
    return not any(any(row) for row in grid)


# ---- save and load --------------------------------------------------------------------------------


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


def test_sessions_share_prefix_pages_within_a_tenant_only(make_store: MakeStore) -> None:
    store = make_store()
    data = save_session(store, "s1", 2, seed=4, base=500)
    store.sessions.put("acme", "s2", tokens(2, base=500, tail=3))  # same history, different session
    tensors, results = load_rows(store, "s2", 2)
    assert all(r.failed == () for r in results)
    assert all(torch.equal(tensors[layer], data[layer]) for layer in range(LAYERS))
    store.sessions.put("other-tenant", "s1", tokens(2, base=500))
    _, results = load_rows(store, "s1", 2, tenant="other-tenant")
    assert all(r.failed == (0, 1) and r.loaded == 0 for r in results)


def test_extending_a_session_keeps_saved_blocks(make_store: MakeStore) -> None:
    store = make_store()
    data = save_session(store, "s1", 2, seed=5, base=0)
    before = store.sessions.get("acme", "s1").blocks.block_keys
    record = store.sessions.put("acme", "s1", tokens(3, base=0))
    assert record.blocks.block_keys[:2] == before
    tensors, results = load_rows(store, "s1", 2)
    assert all(r.failed == () for r in results)
    assert all(torch.equal(tensors[layer], data[layer]) for layer in range(LAYERS))
    edited = tokens(3, base=0)
    edited[0] = 99_999  # an edited conversation: every key changes, nothing is found
    store.sessions.put("acme", "s1", edited)
    _, results = load_rows(store, "s1", 3)
    assert all(r.failed == (0, 1, 2) for r in results)


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


# ---- restart and SSD integrity ---------------------------------------------------------------------


def test_index_rebuild_serves_pages_from_ssd(make_store: MakeStore, ssd_dir: Path) -> None:
    first = make_store()
    data = save_session(first, "s1", 2, seed=8, base=0)
    keys = first.sessions.get("acme", "s1").blocks.block_keys
    first.close()
    assert segment_files(ssd_dir)

    second = make_store()
    assert second.stats()["pages"] == 2 * LAYERS
    assert second.stats()["ssd_pages"] == 2 * LAYERS
    with pytest.raises(SessionNotFound):
        second.sessions.get("acme", "s1")  # sessions are not persisted, pages are
    record = second.sessions.put("acme", "s1", tokens(2, base=0))
    assert record.blocks.block_keys == keys
    residency = second.residency("acme", "s1")
    assert all_true(residency[Tier.SSD]) and none_true(residency[Tier.DRAM]) and none_true(residency[Tier.HBM])
    tensors, results = load_rows(second, "s1", 2)
    for layer in range(LAYERS):
        assert results[layer].failed == ()
        assert results[layer].by_tier == {Tier.SSD: 2}
        assert torch.equal(tensors[layer], data[layer])
    assert metric(second, "symphony_kv_ssd_segments_damaged_total") == 0
    assert metric(second, "symphony_kv_load_hits_total", tier="SSD") == 2 * LAYERS


def test_flipped_byte_on_ssd_is_detected_and_never_served(make_store: MakeStore, ssd_dir: Path) -> None:
    first = make_store()
    data = save_session(first, "s1", 2, seed=9, base=0)
    bad_key = first.sessions.get("acme", "s1").blocks.block_keys[1]
    first.close()
    path, offset = locate_page(ssd_dir, bad_key, layer=2)
    flip_bits(path, offset + 13, 0x10)

    second = make_store()
    second.sessions.put("acme", "s1", tokens(2, base=0))
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


def test_leftover_tmp_segment_is_deleted_at_rebuild(make_store: MakeStore, ssd_dir: Path) -> None:
    first = make_store()
    kept = save_session(first, "kept", 1, seed=11, base=0)
    assert first.write_behind.flush(TIMEOUT)
    save_session(first, "torn", 1, seed=12, base=50_000)
    torn_key = first.sessions.get("acme", "torn").blocks.block_keys[0]
    first.close()
    # Turn every segment holding the second session into an interrupted write (whole contents, .tmp name).
    torn_paths = {locate_page(ssd_dir, torn_key, layer)[0] for layer in range(LAYERS)}
    kept_key_paths = {p for p in segment_files(ssd_dir) if p not in torn_paths}
    assert kept_key_paths
    for path in torn_paths:
        path.rename(path.with_suffix(TMP_SUFFIX))
    (ssd_dir / "seg-00000000000fffff.tmp").write_bytes(b"partial garbage")
    assert len(list(ssd_dir.glob(f"*{TMP_SUFFIX}"))) == len(torn_paths) + 1

    second = make_store()
    assert list(ssd_dir.glob(f"*{TMP_SUFFIX}")) == []
    assert second.stats()["pages"] == LAYERS
    assert metric(second, "symphony_kv_ssd_segments_damaged_total") == 0
    second.sessions.put("acme", "torn", tokens(1, base=50_000))
    assert none_true(second.residency("acme", "torn")[Tier.SSD])
    _, results = load_rows(second, "torn", 1)
    assert all(r.failed == (0,) for r in results)
    second.sessions.put("acme", "kept", tokens(1, base=0))
    tensors, results = load_rows(second, "kept", 1)
    assert all(r.failed == () for r in results)
    assert all(torch.equal(tensors[layer], kept[layer]) for layer in range(LAYERS))


@pytest.mark.parametrize("change", ["flipped-entry-table", "older-format"])
def test_a_segment_that_cannot_be_read_is_dropped_at_rebuild(make_store: MakeStore, ssd_dir: Path, change: str) -> None:
    """A damaged header and a segment of an older format both leave at the rebuild, and their pages
    are reported missing; only damage counts as damaged (an older format is an upgrade)."""
    first = make_store()
    save_session(first, "s1", 1, seed=13, base=0)
    key = first.sessions.get("acme", "s1").blocks.block_keys[0]
    first.close()
    path, _ = locate_page(ssd_dir, key, layer=0)
    if change == "flipped-entry-table":
        flip_bits(path, 90, 0x01)  # inside the entry table (after the 76-byte fixed header)
    else:
        with path.open("r+b") as fh:  # the version field follows the 8-byte magic
            fh.seek(8)
            fh.write(struct.pack("<H", VERSION - 1))

    second = make_store()
    assert metric(second, "symphony_kv_ssd_segments_damaged_total") == (change == "flipped-entry-table")
    assert not path.exists()
    second.sessions.put("acme", "s1", tokens(1, base=0))
    _, results = load_rows(second, "s1", 1)
    assert results[0].failed == (0,)


# ---- capacity -----------------------------------------------------------------------------------


def test_dram_eviction_is_lru_and_pages_stay_loadable_from_ssd(make_store: MakeStore) -> None:
    store = make_store(hbm_pages=0, dram_pages=2 * LAYERS)
    a = save_session(store, "a", 1, seed=20)
    assert store.write_behind.flush(TIMEOUT)
    b = save_session(store, "b", 1, seed=21)
    assert store.write_behind.flush(TIMEOUT)
    load_rows(store, "a", 1)  # a is now more recently used than b
    assert len(store.touches), "loads defer their recency update; the eviction below must still see it"
    c = save_session(store, "c", 1, seed=22)
    assert store.write_behind.flush(TIMEOUT)

    assert all_true(store.residency("acme", "a")[Tier.DRAM])
    assert none_true(store.residency("acme", "b")[Tier.DRAM])
    assert all_true(store.residency("acme", "b")[Tier.SSD])
    assert all_true(store.residency("acme", "c")[Tier.DRAM])
    assert metric(store, "symphony_kv_evictions_total", tier="DRAM", reason="capacity") == LAYERS
    assert metric(store, "symphony_kv_last_copy_dropped_total", reason="capacity") == 0
    assert store.stats()["dram_pages"] == 2 * LAYERS

    for name, data, tier in (("a", a, Tier.DRAM), ("b", b, Tier.SSD), ("c", c, Tier.DRAM)):
        tensors, results = load_rows(store, name, 1)
        assert all(r.failed == () and r.by_tier == {tier: 1} for r in results), name
        assert all(torch.equal(tensors[layer], data[layer]) for layer in range(LAYERS)), name


def _hold_ssd_writes(store: TieredStore, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make the write-behind wait (its pages stay pinned, DRAM-only) until the returned gate is set."""
    gate = threading.Event()
    real_write = store.ssd.write

    def held_write(*args: object, **kwargs: object) -> None:
        gate.wait(TIMEOUT)
        real_write(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(store.ssd, "write", held_write)
    return gate


def test_demote_drops_dram_copies_that_ssd_holds_and_keeps_pinned_ones(make_store: MakeStore) -> None:
    store = make_store(hbm_pages=0)
    data = save_session(store, "a", 2, seed=30)
    other = save_session(store, "b", 1, seed=31)
    assert store.write_behind.flush(TIMEOUT)
    held = store.pin_dram("acme", "a", 0, 1, [0])  # a page a load holds stays where it is
    assert store.demote("acme", "a", Tier.DRAM) == 2 * LAYERS - 1
    store.unpin_dram(held)
    dram = store.residency("acme", "a")[Tier.DRAM]
    assert dram[0] == [True, False] and not any(any(layer) for layer in dram[1:])
    assert all_true(store.residency("acme", "a")[Tier.SSD])
    assert all_true(store.residency("acme", "b")[Tier.DRAM]), "another session's pages are not touched"
    assert metric(store, "symphony_kv_evictions_total", tier="DRAM", reason="demoted") == 2 * LAYERS - 1
    assert metric(store, "symphony_kv_last_copy_dropped_total", reason="demoted") == 0
    for name, blocks, expected in (("a", 2, data), ("b", 1, other)):
        tensors, results = load_rows(store, name, blocks)
        assert all(r.failed == () for r in results)
        assert all(torch.equal(tensors[layer], expected[layer]) for layer in range(LAYERS))
    with pytest.raises(InvalidRequest):
        store.demote("acme", "a", Tier.SSD)
    with pytest.raises(SessionNotFound):
        store.demote("acme", "nobody", Tier.DRAM)


def test_demote_keeps_pages_not_yet_on_ssd(make_store: MakeStore, monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store(hbm_pages=0)
    gate = _hold_ssd_writes(store, monkeypatch)
    save_session(store, "a", 1, seed=32)
    assert store.demote("acme", "a", Tier.DRAM) == 0  # DRAM holds the only copy until the write lands
    assert all_true(store.residency("acme", "a")[Tier.DRAM])
    gate.set()
    assert store.write_behind.flush(TIMEOUT)
    assert store.demote("acme", "a", Tier.DRAM) == LAYERS
    assert metric(store, "symphony_kv_last_copy_dropped_total", reason="demoted") == 0


def test_dram_eviction_keeps_high_priority_pages_over_newer_normal_ones(make_store: MakeStore) -> None:
    store = make_store(hbm_pages=0, dram_pages=2 * LAYERS)
    save_session(store, "vip", 1, seed=23, priority=Priority.HIGH)
    assert store.write_behind.flush(TIMEOUT)
    save_session(store, "normal", 1, seed=24)
    assert store.write_behind.flush(TIMEOUT)
    save_session(store, "newest", 1, seed=25)
    assert store.write_behind.flush(TIMEOUT)
    assert all_true(store.residency("acme", "vip")[Tier.DRAM]), "the high-priority session was evicted first"
    assert none_true(store.residency("acme", "normal")[Tier.DRAM])
    assert all_true(store.residency("acme", "newest")[Tier.DRAM])


def test_low_priority_pages_go_before_older_normal_ones(make_store: MakeStore) -> None:
    store = make_store(hbm_pages=0, dram_pages=2 * LAYERS)
    save_session(store, "normal", 1, seed=26)
    assert store.write_behind.flush(TIMEOUT)
    save_session(store, "cheap", 1, seed=27)
    assert store.write_behind.flush(TIMEOUT)
    store.sessions.set_priority("acme", "cheap", Priority.LOW)
    save_session(store, "newest", 1, seed=28)
    assert store.write_behind.flush(TIMEOUT)
    assert all_true(store.residency("acme", "normal")[Tier.DRAM]), "set_priority(LOW) did not make pages go first"
    assert none_true(store.residency("acme", "cheap")[Tier.DRAM])


def test_save_degrades_when_dram_is_full_of_unpersisted_pages(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store(hbm_pages=0, dram_pages=LAYERS)
    gate = _hold_ssd_writes(store, monkeypatch)
    save_session(store, "a", 1, seed=29)  # fills DRAM; the pages stay pinned until written
    store.sessions.put("acme", "b", tokens(1, base=77_000))
    assert store.ingest.save_layer("acme", "b", 0, 0, page_data(1, seed=30)[0]).result(TIMEOUT) == 0
    assert metric(store, "symphony_kv_save_degraded_total", reason="dram_full") == 1
    gate.set()
    assert store.write_behind.flush(TIMEOUT)
    assert all_true(store.residency("acme", "a")[Tier.SSD])


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


def test_ssd_capacity_evicts_oldest_segments_and_counts_lost_pages(make_store: MakeStore) -> None:
    segment = 4096 + PAGE  # one page per segment: each save_layer of a 1-block session is flushed alone
    store = make_store(hbm_pages=0, dram_pages=3, ssd_bytes=2 * segment)
    data = page_data(1, seed=36)
    store.sessions.put("acme", "s1", tokens(1))

    def save(layer: int) -> None:
        assert store.ingest.save_layer("acme", "s1", layer, 0, data[layer]).result(TIMEOUT) == 1
        assert store.write_behind.flush(TIMEOUT)

    save(0)
    save(1)
    assert len(segment_files(store.ssd.directory)) == 2
    save(2)  # segment of layer 0 evicted from SSD; its DRAM copy remains
    residency = store.residency("acme", "s1")
    assert residency[Tier.SSD] == [[False], [True], [True], [False]]
    assert residency[Tier.DRAM] == [[True], [True], [True], [False]]
    assert metric(store, "symphony_kv_evictions_total", tier="SSD", reason="capacity") == 1
    assert metric(store, "symphony_kv_last_copy_dropped_total", reason="capacity") == 0
    assert store.stats()["ssd_bytes"] <= 2 * segment

    save(3)  # DRAM evicts layer 0 (its last copy); SSD evicts layer 1 (still in DRAM)
    residency = store.residency("acme", "s1")
    assert residency[Tier.DRAM] == [[False], [True], [True], [True]]
    assert residency[Tier.SSD] == [[False], [False], [True], [True]]
    assert metric(store, "symphony_kv_last_copy_dropped_total", reason="capacity") == 1
    assert len(segment_files(store.ssd.directory)) == 2

    tensors, results = load_rows(store, "s1", 1)
    assert results[0].failed == (0,)
    for layer in (1, 2, 3):
        assert results[layer].failed == ()
        assert torch.equal(tensors[layer], data[layer])


def test_ssd_write_failure_keeps_pages_in_dram(
    make_store: MakeStore, ssd_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store()
    real_write = store.ssd.write
    calls = []

    def full_disk(*args: object, **kwargs: object) -> None:
        calls.append(args)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store.ssd, "write", full_disk)
    data = save_session(store, "s1", 2, seed=37)
    assert store.write_behind.flush(TIMEOUT)
    assert calls
    assert store.write_behind.degraded
    assert metric(store, "symphony_kv_save_degraded_total", reason="ssd_full") == 2 * LAYERS
    assert segment_files(ssd_dir) == []
    assert store.stats()["ssd_bytes"] == 0  # the reservation was given back
    residency = store.residency("acme", "s1")
    assert all_true(residency[Tier.DRAM]) and none_true(residency[Tier.SSD])
    tensors, results = load_rows(store, "s1", 2)
    assert all(r.failed == () and r.by_tier == {Tier.DRAM: 2} for r in results)
    assert all(torch.equal(tensors[layer], data[layer]) for layer in range(LAYERS))

    monkeypatch.setattr(store.ssd, "write", real_write)  # the disk has room again
    save_session(store, "s2", 1, seed=38)
    assert store.write_behind.flush(TIMEOUT)
    assert not store.write_behind.degraded
    assert all_true(store.residency("acme", "s2")[Tier.SSD])


def test_other_ssd_errors_are_counted_separately(make_store: MakeStore, monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store()

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(store.ssd, "write", broken)
    save_session(store, "s1", 1, seed=39)
    assert store.write_behind.flush(TIMEOUT)
    assert metric(store, "symphony_kv_save_degraded_total", reason="ssd_error") == LAYERS
    assert metric(store, "symphony_kv_save_degraded_total", reason="ssd_full") == 0


ALIGNED = KVGeometry(num_layers=3, kv_heads=1, head_size=64, block_size=16)  # 4 KiB pages: O_DIRECT-able


def _reload_from_ssd(make_store: MakeStore, blocks: int, seed: int) -> tuple[list[torch.Tensor], list[LayerResult]]:
    """A fresh store on the same directory, loading `save_session`'s session "s1" (saved with `seed`)."""
    store = make_store(geometry=ALIGNED)
    store.sessions.put("acme", "s1", tokens(blocks, base=seed * 10_000, block_size=ALIGNED.block_size))
    return load_rows(store, "s1", blocks)


def test_page_aligned_segments_survive_a_restart_byte_for_byte(make_store: MakeStore, ssd_dir: Path) -> None:
    """4 KiB pages take the O_DIRECT path (where the file system allows it) with two writers."""
    assert ALIGNED.page_bytes == 4096
    first = make_store(geometry=ALIGNED, ssd_writers=2, segment_max_bytes=4 * 4096)
    data = save_session(first, "s1", 6, seed=41)
    first.close()
    assert len(segment_files(ssd_dir)) >= 5  # 18 pages in segments of at most 4
    tensors, results = _reload_from_ssd(make_store, 6, seed=41)
    assert all(r.failed == () and r.by_tier == {Tier.SSD: 6} for r in results)
    assert all(torch.equal(tensors[layer], data[layer]) for layer in range(ALIGNED.num_layers))


def test_refused_o_direct_falls_back_to_buffered_writes(
    make_store: MakeStore, ssd_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import node_manager.kv.ssd_tier as ssd_tier

    real_open = os.open
    direct_opens = []

    def no_direct_open(path: object, flags: int, *args: object) -> int:
        if flags & os.O_DIRECT:
            direct_opens.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")  # what tmpfs and some FUSE mounts answer
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(ssd_tier.os, "open", no_direct_open)
    first = make_store(geometry=ALIGNED, ssd_writers=1)
    data = save_session(first, "s1", 2, seed=42)
    assert first.write_behind.flush(TIMEOUT)
    save_session(first, "s2", 3, seed=43)  # later segments go straight to buffered writes
    assert first.write_behind.flush(TIMEOUT)
    assert len(direct_opens) == 1
    assert not first.write_behind.degraded
    assert metric(first, "symphony_kv_save_degraded_total", reason="ssd_error") == 0
    first.close()
    monkeypatch.undo()
    tensors, results = _reload_from_ssd(make_store, 2, seed=42)
    assert all(r.failed == () for r in results)
    assert all(torch.equal(tensors[layer], data[layer]) for layer in range(ALIGNED.num_layers))


def test_close_flushes_pending_writes(make_store: MakeStore, ssd_dir: Path) -> None:
    store = make_store()
    save_session(store, "s1", 2, seed=40)
    store.close()
    pages = sum(len(parse_header(p.read_bytes()).entries) for p in segment_files(ssd_dir))
    assert pages == 2 * LAYERS


# ---- bad input ----------------------------------------------------------------------------------


def test_unknown_session(make_store: MakeStore) -> None:
    store = make_store()
    store.sessions.put("acme", "s1", tokens(1))
    with pytest.raises(SessionNotFound):
        store.loads.promote("acme", "nope", tier=Tier.HBM)
    with pytest.raises(SessionNotFound):
        store.loads.promote("other", "s1", tier=Tier.HBM)  # sessions are per tenant
    with pytest.raises(SessionNotFound):
        store.ingest.save_layer("acme", "nope", 0, 0, page_data(1, seed=1)[0])
    with pytest.raises(SessionNotFound):
        store.residency("acme", "nope")
    with pytest.raises(SessionNotFound):
        store.sessions.set_priority("acme", "nope", Priority.HIGH)


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


@pytest.mark.parametrize("history", [[-1, 2, 3, 4], [2**32, 1, 2, 3]])
def test_bad_token_ids(make_store: MakeStore, history: list[int]) -> None:
    store = make_store()
    with pytest.raises(InvalidRequest):
        store.sessions.put("acme", "s1", history)
    with pytest.raises(SessionNotFound):
        store.sessions.get("acme", "s1")


def test_empty_names_and_oversized_history(make_store: MakeStore) -> None:
    store = make_store(max_session_tokens=8)
    with pytest.raises(InvalidRequest):
        store.sessions.put("", "s1", tokens(1))
    with pytest.raises(InvalidRequest):
        store.sessions.put("acme", "", tokens(1))
    with pytest.raises(InvalidRequest, match="max_session_tokens"):
        store.sessions.put("acme", "s1", tokens(3))


@pytest.mark.parametrize(("hbm", "dram", "ssd"), [(128, 64, 1024), (0, 2048, 1024), (-64, 0, 0), (64, 64, 0)])
def test_config_capacities_must_be_ordered(tmp_path: Path, hbm: int, dram: int, ssd: int) -> None:
    config = StoreConfig(
        hbm_bytes=hbm,
        dram_bytes=dram,
        ssd_bytes=ssd,
        ssd_dir=tmp_path,
        arena_name=f"symphony-test-{uuid4().hex[:8]}",
        model=TEST_MODEL,
    )
    with pytest.raises(ValueError, match="hbm_bytes <= dram_bytes <= ssd_bytes"):
        config.validate()
    with pytest.raises(ValueError):
        TieredStore(GEOMETRY, config)
    assert not (Path("/dev/shm") / config.arena_name).exists()


@pytest.mark.parametrize(
    "field",
    ["io_threads", "max_inflight_jobs", "segment_max_bytes", "ssd_writers", "max_sessions", "max_session_tokens"],
)
def test_config_counts_must_be_positive(tmp_path: Path, field: str) -> None:
    config = StoreConfig(
        hbm_bytes=0, dram_bytes=64, ssd_bytes=64, ssd_dir=tmp_path, arena_name="unused", model=TEST_MODEL, **{field: 0}
    )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=field):
        config.validate()


def test_valid_config_passes(tmp_path: Path) -> None:
    StoreConfig(
        hbm_bytes=0, dram_bytes=0, ssd_bytes=0, ssd_dir=tmp_path, arena_name="unused", model=TEST_MODEL
    ).validate()
    StoreConfig(
        hbm_bytes=64, dram_bytes=64, ssd_bytes=64, ssd_dir=tmp_path, arena_name="unused", model=TEST_MODEL
    ).validate()


def test_a_model_fingerprint_is_32_bytes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        StoreConfig(
            hbm_bytes=0, dram_bytes=0, ssd_bytes=0, ssd_dir=tmp_path, arena_name="unused", model=TEST_MODEL[:8]
        ).validate()  # type: ignore[arg-type]


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


def test_wait_all_times_out_while_a_layer_is_pending() -> None:
    handle = LayerwiseLoad(2, 0, 1)
    handle._finish(0, LayerResult(0, 1, ()))
    with pytest.raises(TimeoutError):
        handle.wait_all(0.05)
    handle._finish(1, LayerResult(1, 1, ()))
    assert [r.layer for r in handle.wait_all(TIMEOUT)] == [0, 1]


def test_repeated_loads_do_not_grow_the_deferred_recency_queue(make_store: MakeStore) -> None:
    store = make_store(hbm_pages=0, dram_pages=4 * LAYERS)
    save_session(store, "s1", 2, seed=52)
    for _ in range(50):
        load_rows(store, "s1", 2)
    assert len(store.touches) <= 2, "the same session resumed again must reuse its recency batch"


@pytest.mark.parametrize("layers", [[0, 0], [LAYERS], [-1]])
def test_load_rejects_repeated_or_unknown_layers(make_store: MakeStore, layers: list[int]) -> None:
    store = make_store()
    save_session(store, "s1", 1, seed=53)
    tensors = [torch.zeros(1, WORDS, dtype=torch.int64) for _ in range(LAYERS)]
    with pytest.raises(InvalidRequest, match="layers"):
        store.loads.into_rows("acme", "s1", target=RowTarget(tensors, [0]), layers=layers)
    assert store.write_behind.flush(TIMEOUT), "a rejected load must not hold an in-flight slot"


# ---- loads wholly from SSD (`SsdLoad`) ---------------------------------------------------------------


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
