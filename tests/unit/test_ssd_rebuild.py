"""At start the SSD tier deletes only segments that fail the format's checks; one it cannot read at
all (an I/O error: its bytes never judged) is moved aside to a bounded quarantine, not deleted."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from node_manager.kv import ssd_tier
from node_manager.kv.segments import SegmentEntry
from node_manager.kv.ssd_tier import QUARANTINE_DIR, SsdTier
from tests.helpers import TEST_MODEL
from tests.unit.kv_store_support import PAGE, MakeStore, metric, save_session, segment_files


def _write(tier: SsdTier, n: int) -> Path:
    seq, _ = tier.reserve(tier.segment_bytes(1))
    entries = [SegmentEntry(bytes([n]) * 16, 0, n)]
    tier.write(seq, entries, [memoryview(bytes([n]) * PAGE)])
    return tier.commit(seq, entries).path


def test_unreadable_segments_are_quarantined_and_damaged_ones_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = SsdTier(tmp_path, PAGE, 1 << 20, TEST_MODEL)
    good, unreadable, damaged = (_write(first, n) for n in range(3))
    damaged.write_bytes(b"\0" * 64)  # its header fails the format's checks
    real_read = SsdTier._read_header

    def read(self: SsdTier, path: Path) -> object:
        if path == unreadable:
            raise OSError(errno.EIO, "Input/output error")
        return real_read(self, path)

    monkeypatch.setattr(SsdTier, "_read_header", read)
    report = SsdTier(tmp_path, PAGE, 1 << 20, TEST_MODEL).rebuild()
    assert (report.damaged, report.quarantined) == (1, 1)
    assert [location.seq for _, location, _, _ in report.pages] == [int(good.stem.split("-")[1])]
    assert not damaged.exists() and not unreadable.exists()
    (aside,) = (tmp_path / QUARANTINE_DIR).iterdir()
    assert aside.name.startswith(unreadable.stem) and aside.stat().st_size == good.stat().st_size  # kept whole


def test_the_quarantine_keeps_the_newest_few(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ssd_tier, "MAX_QUARANTINED", 2)
    tier = SsdTier(tmp_path, PAGE, 1 << 20, TEST_MODEL)
    paths = [_write(tier, n) for n in range(4)]

    def unreadable(self: SsdTier, path: Path) -> object:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(SsdTier, "_read_header", unreadable)
    report = SsdTier(tmp_path, PAGE, 1 << 20, TEST_MODEL).rebuild()
    # A whole unreadable disk is not moved (nor deleted) past the bound: two aside, two in place.
    assert report.quarantined == 4 and report.pages == []
    first_aside = sorted(p.name for p in (tmp_path / QUARANTINE_DIR).iterdir())
    left = [path for path in paths if path.exists()]
    assert len(first_aside) == 2 and len(left) == 2
    # The next start moves those two; the quarantine keeps the newest arrivals, whatever their age.
    assert SsdTier(tmp_path, PAGE, 1 << 20, TEST_MODEL).rebuild().quarantined == 2
    now_aside = sorted(p.name for p in (tmp_path / QUARANTINE_DIR).iterdir())
    assert not set(now_aside) & set(first_aside)  # the earlier arrivals went, whatever their files' age
    assert {name.rsplit("-", 1)[0] for name in now_aside} == {path.stem for path in left}
    assert not any(path.exists() for path in paths)


def test_a_store_counts_the_segments_it_set_aside(
    make_store: MakeStore, ssd_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rebuild's quarantine shows in the node's metrics, beside the damaged segments."""
    first = make_store()
    save_session(first, "s", 2, seed=1, flush_each=True)
    first.close()
    files = segment_files(ssd_dir)
    assert len(files) >= 2
    read_header = SsdTier._read_header

    def unreadable_first(self: SsdTier, path: Path) -> object:
        if path == files[0]:
            raise OSError(errno.EIO, "Input/output error")  # the fault: one file the disk cannot read
        return read_header(self, path)

    monkeypatch.setattr(SsdTier, "_read_header", unreadable_first)
    store = make_store()
    assert metric(store, "symphony_kv_ssd_segments_quarantined_total") == 1
    assert metric(store, "symphony_kv_ssd_segments_damaged_total") == 0
    assert (ssd_dir / QUARANTINE_DIR).is_dir() and not files[0].exists()
