"""Python multiprocessing's files in /dev/shm that no process holds any more: what a process
killed with SIGKILL (a vLLM engine, a node manager) leaves behind, found by reading every process's
maps and open fds (`symphony.process` sweeps them after a child exits; the fault bench counts them).
"""

from __future__ import annotations

import contextlib
import os
import time

_SHM_DIR = "/dev/shm/"
_MULTIPROCESSING_SHM = ("sem.mp-", "psm_")  # Python's names for POSIX semaphores and shared memory
# A file younger than this is left alone: another live process may have made it and not mapped it
# yet (shm_open, then ftruncate, then mmap).
ORPHAN_GRACE_S = 1.0


def orphaned_shm(since: float, directory: str = _SHM_DIR) -> set[str]:
    """Paths of Python multiprocessing's shared-memory files in `directory` owned by this user,
    created (ctime) at or after `since` (wall-clock seconds) and before ORPHAN_GRACE_S ago, that no
    process maps or holds open. Reads every process's maps and fds only when there is a candidate.
    A process whose maps cannot be read (another user's; from a user namespace, every one outside
    it) is taken to hold none of them: a namespace's own /dev/shm keeps that true there."""
    latest = time.time() - ORPHAN_GRACE_S
    candidates = set()
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if not entry.name.startswith(_MULTIPROCESSING_SHM):
                continue
            with contextlib.suppress(OSError):
                info = entry.stat(follow_symlinks=False)
                if info.st_uid == os.getuid() and since <= info.st_ctime <= latest:
                    candidates.add(entry.path)
    if not candidates:
        return set()
    pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    return candidates - shm_mapped_by_pids(pids) - _shm_open_by_pids(pids)


def _shm_open_by_pids(pids: list[int]) -> set[str]:
    paths = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith(_SHM_DIR):
                        paths.add(target.removesuffix(" (deleted)"))
    return paths


def shm_mapped_by_pids(pids: list[int]) -> set[str]:
    paths: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as fh:
                for line in fh:
                    idx = line.find(_SHM_DIR)
                    if idx >= 0:
                        paths.add(line[idx:].strip().removesuffix(" (deleted)"))
        except OSError:
            continue
    return {p for p in paths if "/" not in p[len(_SHM_DIR) :]}
