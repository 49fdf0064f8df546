"""The SSD tier on a real, small filesystem (a 4 MiB tmpfs), saved to three times its size
(`tests/integration/small_disk.py` runs the store in a mount namespace of its own; any user may
make one). No save may raise; the tier keeps off a full disk, giving way to a file from outside;
with no headroom, a write that meets ENOSPC evicts and writes again, or is degraded and counted;
and after a restart every session found loads byte for byte, the newest kept, the oldest gone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("small-disk")
    out = work / "report.json"
    namespace = ["unshare", "--user", "--map-root-user", "--mount"]
    done = subprocess.run(
        [*namespace, sys.executable, "-m", "tests.integration.small_disk", str(work / "mounts"), str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(out.read_text()))


def _newest_suffix(phase: dict[str, Any]) -> list[int]:
    """The sessions a restart found (whole or in part), checked to be the newest ones: eviction
    went oldest first. Returns their numbers."""
    found = sorted(int(name[1:]) for name in phase["exact_after_restart"] + phase["partial_after_restart"])
    assert found == list(range(phase["sessions_saved"] - len(found), phase["sessions_saved"])), found
    partial = [int(name[1:]) for name in phase["partial_after_restart"]]
    assert partial in ([], [found[0]]), "only the oldest kept session may have lost pages"
    return found


@pytest.mark.parametrize("name", ["headroom", "filled", "no_headroom"])
def test_no_save_fails_and_a_restart_finds_the_newest_sessions_intact(report: dict[str, Any], name: str) -> None:
    phase = report[name]
    assert phase["errors"] == []
    assert phase["sessions_saved"] * phase["session_bytes"] >= 3 * phase["fs_bytes"]  # far past the disk
    assert phase["wrong_after_restart"] == []  # no page of another session or a torn write served
    found = _newest_suffix(phase)
    assert found[-1] == phase["sessions_saved"] - 1
    # The tier used the disk it had, less its headroom and the file from outside (a segment's slack).
    room = phase["fs_bytes"] - phase["headroom_bytes"] - phase["filler_bytes"]
    assert len(phase["exact_after_restart"]) * phase["session_bytes"] >= 0.7 * room
    assert phase["tier_peak_bytes"] + phase["filler_bytes"] <= phase["fs_bytes"]


@pytest.mark.parametrize("name", ["headroom", "filled"])
def test_with_headroom_no_write_meets_a_full_disk(report: dict[str, Any], name: str) -> None:
    assert report[name]["degraded_pages"] == {"ssd_full": 0, "ssd_error": 0, "dram_full": 0}
