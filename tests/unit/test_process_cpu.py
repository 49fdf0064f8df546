"""eval.process_cpu: CPU time of the benchmark's cluster processes, by role."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from eval.process_cpu import cpu_seconds_between, cpu_seconds_by_role, wait_until_quiet

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux /proc")

# A child that computes ~0.3 s and then idles, named in its command line as a node manager is.
_BUSY_THEN_IDLE = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\ntime.sleep(60)"


def test_a_child_process_cpu_time_is_counted_under_its_role() -> None:
    before = cpu_seconds_by_role()
    child = subprocess.Popen([sys.executable, "-c", _BUSY_THEN_IDLE, "symphony.cli node"])
    try:
        deadline = time.monotonic() + 30
        while (spent := cpu_seconds_between(before, cpu_seconds_by_role()))["node_manager"] < 0.25:
            assert time.monotonic() < deadline, f"the child's CPU time never showed: {spent}"
            time.sleep(0.05)  # polling /proc for the child's progress
        assert spent["engine"] == 0 and spent["scheduler"] == 0
    finally:
        child.kill()
        child.wait()


def test_waiting_for_a_quiet_cluster_ends_when_its_processes_stop_computing() -> None:
    spinning = subprocess.Popen([sys.executable, "-c", "while True: pass", "symphony.cli node"])
    try:
        with pytest.raises(TimeoutError, match="cores busy"):
            wait_until_quiet(max_busy_cores=0.25, window_s=0.2, timeout_s=0.5)
    finally:
        spinning.kill()
        spinning.wait()
    assert wait_until_quiet(max_busy_cores=0.25, window_s=0.2, timeout_s=10.0) < 10.0
