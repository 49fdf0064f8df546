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


NAMESPACE = ["unshare", "--user", "--map-root-user", "--mount"]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    probe = subprocess.run([*NAMESPACE, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:  # the host forbids user namespaces (a container's seccomp, AppArmor)
        pytest.skip(f"no user and mount namespaces here, so no private tmpfs: {probe.stderr.strip()}")
    work = tmp_path_factory.mktemp("small-disk")
    out = work / "report.json"
    namespace = NAMESPACE
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
    went oldest first. A session some of whose pages a full disk kept off the SSD (degraded, and
    counted) may be missing or partial anywhere. Returns the numbers found."""
    degraded = {int(name[1:]) for name in phase["degraded_sessions"]}
    found = sorted(int(name[1:]) for name in phase["exact_after_restart"] + phase["partial_after_restart"])
    assert found, "the restart found nothing"
    expected = [n for n in range(found[0], phase["sessions_saved"]) if n not in degraded]
    assert set(expected) <= set(found), (found, sorted(degraded))
    partial = {int(name[1:]) for name in phase["partial_after_restart"]}
    assert partial <= {found[0]} | degraded, "only the oldest kept session may have lost pages to eviction"
    return found


@pytest.mark.parametrize("name", ["headroom", "filled", "no_headroom"])
def test_no_save_fails_and_a_restart_finds_the_newest_sessions_intact(report: dict[str, Any], name: str) -> None:
    phase = report[name]
    assert phase["errors"] == []
    assert phase["sessions_saved"] * phase["session_bytes"] >= 3 * phase["fs_bytes"]  # far past the disk
    assert phase["wrong_after_restart"] == []  # no page of another session or a torn write served
    found = _newest_suffix(phase)
    newest = phase["sessions_saved"] - 1
    assert found[-1] == newest or f"s{newest}" in phase["degraded_sessions"]
    # The tier used the disk it had, less its headroom and the file from outside (a segment's slack).
    room = phase["fs_bytes"] - phase["headroom_bytes"] - phase["filler_bytes"]
    assert len(phase["exact_after_restart"]) * phase["session_bytes"] >= 0.6 * room
    assert phase["tier_peak_bytes"] + phase["filler_bytes"] <= phase["fs_bytes"]


@pytest.mark.parametrize("name", ["headroom", "filled"])
def test_with_headroom_no_write_meets_a_full_disk(report: dict[str, Any], name: str) -> None:
    assert report[name]["degraded_pages"] == {"ssd_full": 0, "ssd_error": 0, "dram_full": 0}
    assert report[name]["degraded_sessions"] == []
