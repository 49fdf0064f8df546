"""One node manager per SSD directory (node_manager.kv_runtime.SsdLock): a second holder is refused
until the first lets go, and a child process never inherits the hold."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from node_manager.kv_runtime import SsdDirectoryInUse, SsdLock
from tests.helpers import wait_until


def _free(directory: Path) -> bool:
    try:
        SsdLock(directory).release()
        return True
    except SsdDirectoryInUse:
        return False


def test_a_second_holder_is_refused_until_the_first_lets_go(tmp_path: Path) -> None:
    directory = tmp_path / "kv" / "node-0"
    first = SsdLock(directory)  # creates the directory
    with pytest.raises(SsdDirectoryInUse, match="node-0 is in use by another node manager"):
        SsdLock(directory)
    assert [p.name for p in directory.iterdir()] == [".lock"]
    first.release()
    first.release()  # twice: nothing more
    SsdLock(directory).release()


def test_a_child_process_does_not_keep_the_directory(tmp_path: Path) -> None:
    lock = SsdLock(tmp_path)
    # Even with every descriptor left open across the fork, exec closes this one (O_CLOEXEC).
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], close_fds=False)
    try:
        lock.release()
        # Free again once the child's exec has closed its copy (the kernel closes O_CLOEXEC
        # descriptors just after it lets the parent run on): the child keeps none.
        wait_until(lambda: _free(tmp_path), 5, "the child to hold no copy of the lock")
        assert child.poll() is None  # while it still runs
    finally:
        child.kill()
        child.wait()
