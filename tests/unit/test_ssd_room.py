"""The SSD tier holds at most its capacity and at most what its disk has room for beyond the
headroom: a disk that fills from outside (or one smaller than the capacity) shrinks the tier by
evicting its oldest segments, rather than failing writes with ENOSPC."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from node_manager.kv.segments import SegmentEntry
from node_manager.kv.ssd_tier import SsdFullError, SsdTier
from tests.helpers import TEST_MODEL
from tests.unit.kv_store_support import PAGE

PAGES = 8  # per segment
HEADROOM = 1000


class _Disk:
    """A filesystem's free bytes as the test sets them (the tier's statvfs, injected)."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.failing = False

    def __call__(self, _directory: Path) -> int:
        if self.failing:
            raise OSError("statvfs failed")
        return self.free


def _fill(tier: SsdTier, segments: int) -> list[int]:
    seqs = []
    for n in range(segments):
        seq, evicted = tier.reserve(tier.segment_bytes(PAGES))
        assert evicted == []
        entries = [SegmentEntry(bytes([n, i]) * 8, 0, i) for i in range(PAGES)]
        tier.commit(seq, entries)
        seqs.append(seq)
    return seqs


def test_a_disk_filling_from_outside_shrinks_the_tier_oldest_first(tmp_path: Path) -> None:
    disk = _Disk(free=1 << 30)
    tier = SsdTier(tmp_path, PAGE, 1 << 20, TEST_MODEL, headroom_bytes=HEADROOM, disk_free=disk)
    size = tier.segment_bytes(PAGES)
    seqs = _fill(tier, 4)
    assert tier.room_bytes() == 1 << 20  # plenty of disk: the capacity governs
    # Someone else fills the disk: room for one segment beyond the headroom, no more.
    disk.free = HEADROOM + size - 1
    _, evicted = tier.reserve(size)
    assert [s.seq for s in evicted] == [seqs[0]]  # the least recently used went
    assert tier.used_bytes <= 4 * size + disk.free - HEADROOM
    tier.release_reservation(size)
    # A disk with nothing free: a segment plus the headroom must go first (each deleted frees its
    # bytes), the oldest unpinned ones; with every one pinned (reads under way) nothing can.
    disk.free = 0
    tier.segments[seqs[1]].pins = 1
    _, evicted = tier.reserve(size)
    assert [s.seq for s in evicted] == [seqs[2], seqs[3]][: len(evicted)] and evicted
    assert sum(s.file_bytes for s in evicted) >= size + HEADROOM
    tier.release_reservation(size)
    for segment in tier.segments.values():
        segment.pins = 1
    with pytest.raises(SsdFullError):
        tier.reserve(size)


def test_a_disk_that_cannot_be_read_leaves_the_capacity_in_charge(tmp_path: Path) -> None:
    disk = _Disk(free=0)
    disk.failing = True
    tier = SsdTier(tmp_path, PAGE, 1 << 20, TEST_MODEL, headroom_bytes=HEADROOM, disk_free=disk)
    assert tier.room_bytes() == 1 << 20
    _fill(tier, 2)


def test_a_disk_short_of_the_capacity_is_reported_at_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tier = SsdTier(tmp_path, PAGE, 1 << 30, TEST_MODEL, headroom_bytes=HEADROOM, disk_free=_Disk(free=1 << 20))
    with caplog.at_level(logging.WARNING, logger="node_manager.kv.ssd_tier"):
        tier.rebuild()
    assert "short of its capacity" in caplog.text
    assert tier.room_bytes() == (1 << 20) - HEADROOM
