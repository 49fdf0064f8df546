"""node_manager.kv.write_behind: every saved page reaches SSD behind the save, within the SSD tier's
capacity; a write the tier refuses leaves the pages in DRAM; a foreground transfer holds writes off."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from node_manager.kv.loader import LayerResult
from node_manager.kv.pages import Tier
from node_manager.kv.segments import parse_header
from symphony.kv_geometry import KVGeometry
from tests.helpers import wait_until
from tests.unit.kv_store_support import (
    LAYERS,
    PAGE,
    TIMEOUT,
    MakeStore,
    all_true,
    hold_ssd_writes,
    load_rows,
    metric,
    none_true,
    page_data,
    save_session,
    segment_files,
    tokens,
)


def test_demote_keeps_pages_not_yet_on_ssd(make_store: MakeStore, monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store(hbm_pages=0)
    gate = hold_ssd_writes(store, monkeypatch)
    save_session(store, "a", 1, seed=32)
    assert store.demote("acme", "a", Tier.DRAM) == 0  # DRAM holds the only copy until the write lands
    assert all_true(store.residency("acme", "a")[Tier.DRAM])
    gate.set()
    assert store.write_behind.flush(TIMEOUT)
    assert store.demote("acme", "a", Tier.DRAM) == LAYERS
    assert metric(store, "symphony_kv_last_copy_dropped_total", reason="demoted") == 0


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


def test_a_disk_found_full_evicts_older_segments_and_the_write_lands(
    make_store: MakeStore, ssd_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills behind the tier's back (its statvfs said there was room): the write that gets
    ENOSPC, its partial file removed, evicts the oldest segments and is written again."""
    store = make_store(hbm_pages=0)
    save_session(store, "old", 1, seed=40, flush_each=True)  # one segment per layer
    assert store.write_behind.flush(TIMEOUT)
    before = segment_files(ssd_dir)
    assert before and all_true(store.residency("acme", "old")[Tier.SSD])
    real_file = store.ssd._write_file
    full_once: list[Path] = []

    def fills(path: Path, *args: object) -> None:
        if not full_once:
            full_once.append(path)
            path.write_bytes(b"part of a segment")  # as far as it got
            raise OSError(errno.ENOSPC, "No space left on device")
        real_file(path, *args)

    monkeypatch.setattr(store.ssd, "_write_file", fills)
    data = save_session(store, "new", 1, seed=41, flush_each=True)
    assert store.write_behind.flush(TIMEOUT)
    assert full_once and not full_once[0].exists()  # the part written went
    assert not store.write_behind.degraded
    assert metric(store, "symphony_kv_save_degraded_total", reason="ssd_full") == 0
    assert metric(store, "symphony_kv_evictions_total", tier="SSD", reason="disk_full") >= 1
    assert all_true(store.residency("acme", "new")[Tier.SSD])
    gone = set(before) - set(segment_files(ssd_dir))
    assert gone and len(gone) < len(before)  # older segments made the room, no more than it needed
    assert not list(ssd_dir.glob("*.tmp"))
    tensors, results = load_rows(store, "new", 1)
    assert all(r.failed == () for r in results)
    assert all(torch.equal(tensors[layer], data[layer]) for layer in range(LAYERS))


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


def test_write_behind_waits_for_a_foreground_transfer_within_its_bound(make_store: MakeStore) -> None:
    blocks = 6
    held = make_store(dram_pages=256, write_behind_max_delay_s=60.0)  # the queue stays under a quarter of DRAM
    with held.write_behind.foreground_transfer():
        save_session(held, "s", blocks, seed=11)
        wait_until(lambda: held.stats()["write_behind_held"] == 1, TIMEOUT, "the write-behind to hold off")
        assert held.stats()["write_queue"] == blocks * LAYERS  # nothing persisted while the transfer runs
    wait_until(
        lambda: held.stats()["write_queue"] == 0 and held.pinned_pages() == 0,
        TIMEOUT,
        "the write-behind to go once the transfer ended",
    )
    flushed = make_store(dram_pages=256, write_behind_max_delay_s=60.0)
    with flushed.write_behind.foreground_transfer():
        save_session(flushed, "s", blocks, seed=12)
        wait_until(lambda: flushed.stats()["write_behind_held"] == 1, TIMEOUT, "the write-behind to hold off")
        assert flushed.write_behind.flush(TIMEOUT)  # a flush never waits on the transfer
    hasty = make_store(dram_pages=256, write_behind_max_delay_s=0.05)
    with hasty.write_behind.foreground_transfer():
        save_session(hasty, "s", blocks, seed=13)
        wait_until(
            lambda: hasty.stats()["write_queue"] == 0 and hasty.pinned_pages() == 0,
            TIMEOUT,
            "the write-behind to go after its bounded delay",
        )
