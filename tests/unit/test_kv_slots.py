"""Slot storage: row copies (coalesced runs and scattered rows) and the DRAM arena's /dev/shm check."""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from node_manager.kv import slots
from node_manager.kv.slots import DramArena, SlotAllocator, consecutive_runs, copy_rows
from symphony.kv_geometry import KVGeometry

GEOMETRY = KVGeometry(num_layers=2, kv_heads=1, head_size=4, block_size=4)


@pytest.mark.parametrize(
    "dst_rows, src_rows",
    [
        ([0, 1, 2, 3], [4, 5, 6, 7]),  # one run: a slice copy
        ([7, 0, 5, 2, 3], [0, 1, 2, 3, 4]),  # scattered: gather + scatter
        ([2, 3, 0, 1], [6, 7, 1, 2]),  # two runs
    ],
)
def test_copy_rows_places_every_row(dst_rows: list[int], src_rows: list[int]) -> None:
    src = torch.arange(8 * 3, dtype=torch.int64).view(8, 3)
    dst = torch.full((8, 3), -1, dtype=torch.int64)
    copy_rows(dst, dst_rows, src, src_rows)
    for d, s in zip(dst_rows, src_rows, strict=True):
        assert torch.equal(dst[d], src[s])
    untouched = set(range(8)) - set(dst_rows)
    assert all(bool((dst[r] == -1).all()) for r in untouched)


def test_allocator_is_all_or_nothing() -> None:
    allocator = SlotAllocator(4)
    assert allocator.allocate(3) == [0, 1, 2]  # consecutive slots keep copies as single runs
    assert allocator.allocate(2) is None and allocator.free == 1
    allocator.release([1])
    assert sorted(allocator.allocate(2) or []) == [1, 3]


def test_arena_refuses_more_than_dev_shm_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.statvfs

    class Tiny:
        f_bavail, f_frsize = 1, 4096

    monkeypatch.setattr(slots.os, "statvfs", lambda path: Tiny() if str(path) == "/dev/shm" else real(path))
    name = f"symphony-test-{uuid.uuid4().hex[:8]}"
    with pytest.raises(OSError, match=r"kv\.dram_bytes"):
        DramArena(name, GEOMETRY, 1 << 20)
    assert not Path("/dev/shm", name).exists()


def test_attached_arena_sees_the_owners_writes() -> None:
    name = f"symphony-test-{uuid.uuid4().hex[:8]}"
    owner = DramArena(name, GEOMETRY, 16 * GEOMETRY.page_bytes)
    try:
        owner.pages[3].fill_(42)
        reader = DramArena.attach(name, GEOMETRY, 16 * GEOMETRY.page_bytes)
        assert bool((reader.pages[3] == 42).all())
        reader.close()
        assert Path("/dev/shm", name).exists()  # a reader never unlinks the owner's arena
    finally:
        owner.close()
    assert not Path("/dev/shm", name).exists()


def _mapping_kib(address: int, field: str) -> int:
    """`field` (kB) of this process's mapping that holds `address`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, stop = (int(bound, 16) for bound in head.split("-"))
                inside = start <= address < stop
            elif inside and head == f"{field}:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def _dirty_kib(arena: DramArena) -> int:
    address = arena.pages.data_ptr()
    return _mapping_kib(address, "Shared_Dirty") + _mapping_kib(address, "Private_Dirty")


@pytest.mark.parametrize("advice_known", [True, False])
def test_arena_pages_are_mapped_for_writing_when_created(monkeypatch: pytest.MonkeyPatch, advice_known: bool) -> None:
    """Pages mapped for reading only (MAP_POPULATE on a shared mapping) still cost each page's first
    write; the owner's mapping must hold every page dirty, i.e. writable, before any save. Without
    MADV_POPULATE_WRITE (an older kernel answers EINVAL) the arena touches each page itself."""
    if not advice_known:
        monkeypatch.setattr(slots, "_MADV_POPULATE_WRITE", 0x7FFF)  # no such advice: EINVAL
    name = f"symphony-test-{uuid.uuid4().hex[:8]}"
    arena = DramArena(name, GEOMETRY, 256 * GEOMETRY.page_bytes)
    try:
        size_kib = arena.pages.numel() * 8 // 1024
        assert _dirty_kib(arena) >= size_kib
    finally:
        arena.close()


def test_arena_that_cannot_be_allocated_says_so_and_leaves_no_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """/dev/shm filling up between the free-space check and the allocation (another process)."""

    def no_memory(mapping: object, *, write: bool, required: bool) -> None:
        raise OSError(errno.EFAULT, "Bad address")

    monkeypatch.setattr(slots, "_populate", no_memory)
    name = f"symphony-test-{uuid.uuid4().hex[:8]}"
    with pytest.raises(OSError, match=r"DRAM arena in /dev/shm \(Bad address\); lower kv\.dram_bytes"):
        DramArena(name, GEOMETRY, 16 * GEOMETRY.page_bytes)
    assert not Path("/dev/shm", name).exists()


def test_attached_arena_is_mapped_before_its_first_read() -> None:
    name = f"symphony-test-{uuid.uuid4().hex[:8]}"
    owner = DramArena(name, GEOMETRY, 256 * GEOMETRY.page_bytes)
    try:
        reader = DramArena.attach(name, GEOMETRY, 256 * GEOMETRY.page_bytes)
        size_kib = reader.pages.numel() * 8 // 1024
        assert _mapping_kib(reader.pages.data_ptr(), "Rss") >= size_kib
        reader.close()
    finally:
        owner.close()


def test_copy_rows_refuses_mismatched_row_lists() -> None:
    src = torch.zeros(4, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="3 destination rows for 2 source rows"):
        copy_rows(src.clone(), [0, 1, 2], src, [0, 1])


@pytest.mark.parametrize(
    ("slots", "runs"),
    [
        ([], []),
        ([7], [(0, 1)]),
        ([3, 4, 5], [(0, 3)]),
        ([3, 4, 9, 10, 2], [(0, 2), (2, 4), (4, 5)]),
        ([5, 4], [(0, 1), (1, 2)]),  # descending slots are not a run
    ],
)
def test_consecutive_runs_split_where_slots_stop_counting_up(slots: list[int], runs: list[tuple[int, int]]) -> None:
    assert consecutive_runs(slots) == runs
    assert consecutive_runs(np.array(slots, dtype=np.int64)) == runs  # arrays take the general path
