"""node_manager.kv.store: the tiered store's front: sessions, the directory rebuilt from SSD at start,
capacity, eviction order and demotion, and its configuration."""

from __future__ import annotations

import struct
from pathlib import Path
from uuid import uuid4

import pytest
import torch

from node_manager.kv.errors import InvalidRequest, SessionNotFound
from node_manager.kv.pages import Priority, Tier
from node_manager.kv.segments import MIN_READ_VERSION, TMP_SUFFIX
from node_manager.kv.store import TieredStore
from node_manager.kv.store_config import StoreConfig
from tests.helpers import TEST_MODEL
from tests.unit.kv_store_support import (
    GEOMETRY,
    LAYERS,
    TIMEOUT,
    MakeStore,
    all_true,
    flip_bits,
    load_rows,
    locate_page,
    metric,
    none_true,
    page_data,
    save_session,
    segment_files,
    tokens,
)

# ---- sessions ------------------------------------------------------------------------------------


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


def test_tenants_are_those_with_registered_sessions_and_a_new_one_is_signalled(make_store: MakeStore) -> None:
    store = make_store(max_sessions=2)
    sessions = store.sessions
    assert sessions.tenants() == []
    start = sessions.tenant_generation()
    sessions.put("acme", "s1", tokens(1))
    sessions.put("acme", "s2", tokens(1))
    after_acme = sessions.tenant_generation()
    assert after_acme == start + 1  # acme's second session is no news
    assert sessions.tenants() == ["acme"]
    sessions.put("acme", "s1", tokens(2))  # an extended history is no news either
    assert sessions.tenant_generation() == after_acme
    sessions.put("globex", "g1", tokens(1))  # forgets acme's least recent session (s2), not acme
    assert sessions.tenant_generation() == after_acme + 1
    assert sorted(sessions.tenants()) == ["acme", "globex"]
    sessions.put("globex", "g2", tokens(1))  # forgets acme's last session: acme is gone
    assert sessions.tenants() == ["globex"]
    sessions.put("acme", "s3", tokens(1))  # acme back: news again
    assert sessions.tenant_generation() == after_acme + 2
    assert sorted(sessions.tenants()) == ["acme", "globex"]


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


# ---- restart: the directory rebuilt from SSD -----------------------------------------------------


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
            fh.write(struct.pack("<H", MIN_READ_VERSION - 1))

    second = make_store()
    assert metric(second, "symphony_kv_ssd_segments_damaged_total") == (change == "flipped-entry-table")
    assert not path.exists()
    second.sessions.put("acme", "s1", tokens(1, base=0))
    _, results = load_rows(second, "s1", 1)
    assert results[0].failed == (0,)


# ---- capacity, eviction and demotion -------------------------------------------------------------


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


def test_repeated_loads_do_not_grow_the_deferred_recency_queue(make_store: MakeStore) -> None:
    store = make_store(hbm_pages=0, dram_pages=4 * LAYERS)
    save_session(store, "s1", 2, seed=52)
    for _ in range(50):
        load_rows(store, "s1", 2)
    assert len(store.touches) <= 2, "the same session resumed again must reuse its recency batch"


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


# ---- configuration -------------------------------------------------------------------------------


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
