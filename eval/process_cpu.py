"""CPU time the benchmark's own cluster processes spent, by role.

On a CPU host every part of the cluster computes on the same cores: the engines' forward passes,
and the node managers' data movement (SSD write-behind, peer pulls, checksums). A policy that moves
more KV pays for it in the engines' time, so a benchmark comparing policies reports where the
CPU went while each ran (Linux /proc; empty elsewhere).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from symphony.process import proc_stat_fields

_PROC = Path("/proc")
ROLES = ("engine", "node_manager", "scheduler")


def _role(pid: str) -> str | None:
    try:
        argv = (_PROC / pid / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    command = b" ".join(argv[:6])
    if b"symphony.cli node" in command:
        return "node_manager"
    if b"symphony.cli scheduler" in command:
        return "scheduler"
    if b"vllm" in command or command.startswith(b"VLLM::"):  # the server, its engine core and workers
        return "engine"
    return None


def cpu_seconds_by_role(root: int | None = None) -> dict[str, float]:
    """User + system CPU seconds of the live processes under `root` (default: this process), summed
    by role (`ROLES`); a process that exited meanwhile is not counted."""
    if not _PROC.is_dir():
        return {}
    parents: dict[str, str] = {}
    times: dict[str, float] = {}
    ticks = os.sysconf("SC_CLK_TCK")
    for entry in _PROC.iterdir():
        if entry.name.isdigit() and (fields := proc_stat_fields(entry.name)) is not None:
            parents[entry.name] = fields[1]
            times[entry.name] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    children: dict[str, list[str]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    totals = dict.fromkeys(ROLES, 0.0)
    stack = list(children.get(str(root or os.getpid()), []))
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        if (role := _role(pid)) is not None:
            totals[role] += times[pid]
    return totals


def cpu_seconds_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {role: round(after.get(role, 0.0) - before.get(role, 0.0), 2) for role in after}


def wait_until_quiet(
    max_busy_cores: float = 0.25, window_s: float = 0.5, timeout_s: float = 30.0, root: int | None = None
) -> float:
    """Wait until the cluster processes under `root` used less than `max_busy_cores` of CPU over
    `window_s` (vLLM's workers busy-poll for a second after their last step, and a node manager
    writes a turn's pages behind it); returns the seconds waited. Raises TimeoutError after
    `timeout_s`: a cluster that never goes quiet is busy with something no benchmark started."""
    started = time.monotonic()
    before = sum(cpu_seconds_by_role(root).values())
    while True:
        time.sleep(window_s)  # one sampling window of the processes' CPU time
        after = sum(cpu_seconds_by_role(root).values())
        if after - before < max_busy_cores * window_s:
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"the cluster kept {(after - before) / window_s:.2f} cores busy for {timeout_s:.0f} s")
        before = after
