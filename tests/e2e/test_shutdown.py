"""SIGTERM to `symphony up` stops every process it started and leaves no shared memory behind.

The cluster is the test's own to stop (`taken_cluster`): the shared one, which no later test sees
again, or a new one."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import psutil
import pytest

from tests.e2e.conftest import LiveCluster

pytestmark = pytest.mark.e2e


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigterm_stops_everything(taken_cluster: LiveCluster) -> None:
    tree = psutil.Process(taken_cluster.process.pid).children(recursive=True)
    names = " ".join(p.name() for p in tree)
    assert len(tree) >= 2 + 2 + 1 + 2 * 3, f"scheduler, 2 node managers, 2 engines with their workers: {names}"
    shm = set()
    for proc in tree:
        try:
            shm |= {Path(m.path) for m in proc.memory_maps() if m.path.startswith("/dev/shm/")}
        except psutil.Error:
            continue

    taken_cluster.process.send_signal(signal.SIGTERM)
    assert taken_cluster.process.wait(timeout=120) == 0
    left = [(p.pid, p.name()) for p in tree if _alive(p.pid)]
    assert not left, f"processes left behind: {left}"
    assert not [p for p in shm if p.exists()], "shared memory left behind"
    assert "stopped." in taken_cluster.output.read_text()
    port = int(taken_cluster.url.rsplit(":", 1)[1])
    with socket.socket() as sock, pytest.raises(ConnectionRefusedError):
        sock.connect(("127.0.0.1", port))  # nothing listens on the scheduler's port any more
