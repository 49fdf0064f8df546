"""eval.child_process: a benchmark's helper process is stopped, by force when it ignores SIGTERM."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from eval import child_process


def _spawn(setup: str, log_path: Path) -> tuple[subprocess.Popen[bytes], object]:
    """A child that runs `setup`, says "up", then sleeps."""
    log = log_path.open("wb")
    script = f"import time; {setup}; print('up', flush=True); time.sleep(60)"
    return subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT), log


def _wait_up(log_path: Path) -> None:
    deadline = time.monotonic() + 30
    while "up" not in log_path.read_text():
        assert time.monotonic() < deadline, "child never started"
        time.sleep(0.01)  # polling a starting child process's output


def test_a_child_is_terminated_and_its_log_closed(tmp_path: Path) -> None:
    process, log = _spawn("pass", tmp_path / "a.log")
    _wait_up(tmp_path / "a.log")
    child_process.stop_child(process, log)  # type: ignore[arg-type]
    assert process.returncode == -15 and log.closed  # type: ignore[attr-defined]


def test_a_child_ignoring_sigterm_is_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(child_process, "STOP_TIMEOUT_S", 0.5)
    process, log = _spawn("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)", tmp_path / "b.log")
    _wait_up(tmp_path / "b.log")
    child_process.stop_child(process, log)  # type: ignore[arg-type]
    process.wait(10)
    assert process.returncode == -9
