"""Supervise one child process: start, readiness, crash restarts with back-off, clean stop.

Used by the node manager for its vLLM engine and by `symphony up` for the scheduler and the node
managers, so every level of the process tree stops the same way and leaves nothing behind:

- each child leads its own process group (Ctrl-C in a terminal reaches only `symphony up`, which then
  stops children in order) and gets PDEATHSIG, so a killed parent never leaves orphans;
- stopping is SIGTERM to the leader, then SIGTERM and SIGKILL to the whole group;
- POSIX shared memory (/dev/shm) mapped by the child's process tree (its group, and descendants
  that lead groups of their own: a node manager's engine) is recorded while it runs (when it is
  ready, then every `shm_scan_interval_s` where set: node managers, whose engines start late) and
  unlinked after it exits, because a SIGKILLed vLLM cannot clean its own segments, nor can a
  SIGKILLed node manager clean its engine's; segments the supervisor maps itself (the node
  manager's DRAM arena, which the engine's worker attaches) are the supervisor's, not leaks.
  A segment made between two scans (a crashed child's tree cannot be walked any more) is found
  another way: Python multiprocessing's own files (`sem.mp-*` semaphores, `psm_*` shared memory,
  what vLLM makes), this user's, created while the child ran and at least ORPHAN_GRACE_S before
  the sweep, that no process maps or holds open once the child's group is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from symphony.logs import get_logger
from symphony.shm_files import orphaned_shm, shm_mapped_by_pids

log = get_logger(__name__)

_MAX_LOG_BYTES = 64 * 1024 * 1024


class ProcessState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5  # consecutive crashes tolerated before FAILED
    backoff_s: float = 1.0  # first delay; doubles per consecutive crash
    backoff_max_s: float = 30.0
    stable_after_s: float = 120.0  # a run at least this long resets the consecutive count

    def delay(self, consecutive_crashes: int) -> float:
        return min(self.backoff_s * 2 ** max(consecutive_crashes - 1, 0), self.backoff_max_s)


ReadyProbe = Callable[[], Awaitable[bool]]
StateListener = Callable[["ManagedProcess"], None]


class ManagedProcess:
    """One supervised child. `start()` returns at once; `wait_ready()` and `stop()` are awaitable."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        *,
        log_path: Path,
        ready_probe: ReadyProbe,
        env: dict[str, str] | None = None,
        policy: RestartPolicy | None = None,
        startup_timeout_s: float = 300.0,
        stop_timeout_s: float = 20.0,
        probe_interval_s: float = 0.25,
        liveness_interval_s: float = 2.0,
        liveness_timeout_s: float = 30.0,
        on_state_change: StateListener | None = None,
        nice: int = 0,
        shm_scan_interval_s: float = 0.0,
        death_signal: int = signal.SIGTERM,
    ) -> None:
        self.name = name
        # What the child gets when this process dies without stopping it (symphony.pdeathsig_exec).
        self.death_signal = death_signal
        # How often a READY child's shared memory is recorded again (0: only when it becomes ready).
        self.shm_scan_interval_s = shm_scan_interval_s
        self.nice = nice  # 0..19; the child's whole session runs at it (see symphony.pdeathsig_exec)
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.policy = policy or RestartPolicy()
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._probe = ready_probe
        self._probe_interval_s = probe_interval_s
        self._liveness_interval_s = liveness_interval_s
        self.liveness_timeout_s = liveness_timeout_s
        self._listener = on_state_change
        self.state = ProcessState.STARTING
        self.restarts = 0
        self.last_error = ""
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._state_changed = asyncio.Event()
        self._shm_paths: set[str] = set()
        # Groups of its descendants that lead their own (a node manager's engine), as last walked:
        # they die of their death signal after the child, and their files are swept once they have.
        self._child_groups: set[int] = set()
        self._spawned_at: float | None = None  # wall-clock time of the last spawn (orphaned_shm)

    # -- public -------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc and self._proc.returncode is None else None

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError(f"{self.name} already started")
        self._task = asyncio.create_task(self._supervise(), name=f"supervise-{self.name}")

    async def wait_ready(self, timeout_s: float | None = None) -> bool:
        """True once READY; False if it FAILED, was stopped, or the timeout passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.state not in (ProcessState.READY, ProcessState.FAILED, ProcessState.STOPPED):
            self._state_changed.clear()
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._state_changed.wait(), remaining)
        return self.state is ProcessState.READY

    async def stop(self) -> None:
        """Stop supervising, terminate the process group, clean its shared memory. Idempotent."""
        self._stopping.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._terminate()
        self._set_state(ProcessState.STOPPED)

    async def kill_for_test(self, sig: int = signal.SIGKILL) -> None:
        """Deliver `sig` to the running leader (fault injection for tests and drills)."""
        if self._proc is not None and self._proc.returncode is None:
            os.kill(self._proc.pid, sig)

    # -- supervision loop ---------------------------------------------------------------------
    async def _supervise(self) -> None:
        consecutive_crashes = 0
        while not self._stopping.is_set():
            started = time.monotonic()
            self._set_state(ProcessState.STARTING)
            try:
                self._proc = await self._spawn()
            except OSError as exc:
                self.last_error = f"could not start {self.argv[0]}: {exc}"
                log.error("process spawn failed", process=self.name, error=str(exc))
                self._set_state(ProcessState.FAILED)
                return
            outcome = await self._wait_until_ready_or_exit()
            if outcome == "ready":
                self._record_shm()
                self._set_state(ProcessState.READY)
                log.debug(
                    "process ready",
                    process=self.name,
                    pid=self._proc.pid,
                    startup_s=round(time.monotonic() - started, 1),
                )
                outcome = await self._wait_exit_or_stop()
            if self._stopping.is_set():
                return
            if outcome == "timeout":
                self.last_error = f"not ready within {self.startup_timeout_s:.0f}s"
            elif outcome == "hung":
                self.last_error = f"stopped answering its health probe for {self.liveness_timeout_s:.0f}s"
            else:
                self.last_error = self._describe_exit()
            # Unroutable from this moment, not only once the leftovers are cleaned up.
            self._set_state(ProcessState.RESTARTING)
            await self._terminate()
            if time.monotonic() - started >= self.policy.stable_after_s:
                consecutive_crashes = 0
            consecutive_crashes += 1
            if consecutive_crashes > self.policy.max_restarts:
                log.error(
                    "process failed, restart budget exhausted",
                    process=self.name,
                    restarts=self.restarts,
                    error=self.last_error,
                )
                self._set_state(ProcessState.FAILED)
                return
            delay = self.policy.delay(consecutive_crashes)
            self.restarts += 1
            log.warning(
                "process crashed, restarting",
                process=self.name,
                error=self.last_error,
                restart=self.restarts,
                backoff_s=delay,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)

    async def _spawn(self) -> asyncio.subprocess.Process:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.log_path.exists() and self.log_path.stat().st_size > _MAX_LOG_BYTES:
            self.log_path.replace(self.log_path.with_suffix(self.log_path.suffix + ".1"))
        with self.log_path.open("ab") as log_file:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
            log_file.write(f"\n===== {stamp} start #{self.restarts + 1}: {' '.join(self.argv)}\n".encode())
            log_file.flush()
            # Through symphony.pdeathsig_exec (not a preexec_fn): the child dies with us, and no
            # Python code runs between fork and exec (see that module for why that matters).
            niceness = ["--nice", str(self.nice)] if self.nice else []
            if self.death_signal != signal.SIGTERM:
                niceness += ["--death-signal", str(int(self.death_signal))]
            self._spawned_at = time.time()  # wall clock, as a file's ctime: what the sweep compares
            return await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "symphony.pdeathsig_exec",
                str(os.getpid()),
                *niceness,
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )

    async def _wait_until_ready_or_exit(self) -> str:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        exited = asyncio.ensure_future(self._proc.wait())
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            while time.monotonic() < deadline:
                with contextlib.suppress(Exception):
                    if await asyncio.wait_for(self._probe(), timeout=max(self._probe_interval_s * 4, 1.0)):
                        return "ready"
                done, _ = await asyncio.wait(
                    {exited, stopping}, timeout=self._probe_interval_s, return_when=asyncio.FIRST_COMPLETED
                )
                if exited in done:
                    return "exited"
                if stopping in done:
                    return "stopped"
            return "timeout"
        finally:
            for fut in (exited, stopping):
                if not fut.done():
                    fut.cancel()

    async def _wait_exit_or_stop(self) -> str:
        """While READY: return "exited", "stopped", or "hung" when the probe kept failing too long."""
        assert self._proc is not None
        exited = asyncio.ensure_future(self._proc.wait())
        stopping = asyncio.ensure_future(self._stopping.wait())
        last_ok = last_scan = time.monotonic()
        try:
            while True:
                done, _ = await asyncio.wait(
                    {exited, stopping}, timeout=self._liveness_interval_s, return_when=asyncio.FIRST_COMPLETED
                )
                if exited in done:
                    return "exited"
                if stopping in done:
                    return "stopped"
                ok = False
                with contextlib.suppress(Exception):
                    ok = await asyncio.wait_for(self._probe(), timeout=self._liveness_interval_s * 2)
                now = time.monotonic()
                if self.shm_scan_interval_s and now - last_scan >= self.shm_scan_interval_s:
                    # Descendants map segments after the child is ready (an engine starting), and a
                    # SIGKILLed tree can no longer be read: record them while it lives. A walk of
                    # /proc and of large maps files: off the event loop.
                    last_scan = now
                    await asyncio.to_thread(self._record_shm)
                if ok:
                    last_ok = now
                elif now - last_ok > self.liveness_timeout_s:
                    return "hung"
        finally:
            for fut in (exited, stopping):
                if not fut.done():
                    fut.cancel()

    def _describe_exit(self) -> str:
        assert self._proc is not None
        code = self._proc.returncode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited with {code}"
        tail = self.log_tail()
        return f"{how}; last output: {tail}" if tail else how

    def log_tail(self, max_lines: int = 3, max_bytes: int = 4096) -> str:
        try:
            with self.log_path.open("rb") as fh:
                fh.seek(max(0, self.log_path.stat().st_size - max_bytes))
                lines = [ln.strip() for ln in fh.read().decode(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return " | ".join(lines[-max_lines:])[-600:]

    # -- stopping and cleaning ----------------------------------------------------------------
    async def _terminate(self) -> None:
        proc = self._proc
        if proc is None:
            return
        pgid = proc.pid  # leader of its own session: pgid == pid
        self._record_shm()
        if proc.returncode is None:
            _signal_pid(proc.pid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), self.stop_timeout_s)
        # The leader may be gone while its children (vLLM's EngineCore, workers) linger.
        if _group_alive(pgid):
            _signal_group(pgid, signal.SIGTERM)
            await _wait_group_gone(pgid, timeout_s=min(5.0, self.stop_timeout_s))
        if _group_alive(pgid) or proc.returncode is None:
            _signal_group(pgid, signal.SIGKILL)
            await _wait_group_gone(pgid, timeout_s=5.0)
        with contextlib.suppress(ProcessLookupError):
            await proc.wait()
        deadline = time.monotonic() + 5.0  # only waited for: a pgid may have been reused since
        for group in self._child_groups:
            await _wait_group_gone(group, timeout_s=max(0.0, deadline - time.monotonic()))
        self._child_groups.clear()
        self._unlink_shm()
        # Forget it: its pid (and process group id) may be reused by an unrelated process later, which
        # a second _terminate (stop() after a crash) must never signal.
        self._proc = None

    def _record_shm(self) -> None:
        # Only while the child is not reaped: until then its pid cannot be reused, so the tree walked
        # is its own (an exited, unreaped child's descendants have been reparented away from it).
        proc = self._proc
        if proc is not None and proc.returncode is None:
            tree = process_tree(proc.pid)
            self._shm_paths |= shm_mapped_by_pids(tree)
            # Merged, and pruned of groups gone: a walk just after the child died (killed, not yet
            # reaped) finds its descendants reparented, and must not forget them.
            found = {g for g in map(_pgid, tree) if g is not None and g != proc.pid}
            self._child_groups = {g for g in self._child_groups | found if _group_alive(g)}

    def _unlink_shm(self) -> None:
        # Checked at unlink time, not when recorded: the supervisor may map a segment after the child did.
        ours = shm_mapped_by_pids([os.getpid()])
        if self._spawned_at is not None:
            self._shm_paths |= orphaned_shm(self._spawned_at)
        for path in sorted(self._shm_paths - ours):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                log.info("removed leaked shared memory", process=self.name, path=path)
        self._shm_paths.clear()

    def _set_state(self, state: ProcessState) -> None:
        if state is self.state:
            return
        self.state = state
        self._state_changed.set()
        if self._listener is not None:
            self._listener(self)


def _signal_pid(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def proc_stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the parenthesised command name (which may hold spaces):
    state ppid pgrp ..., utime and stime at 11 and 12. None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().decode(errors="replace")
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()


def pid_running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has)."""
    fields = proc_stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is pgid."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = proc_stat_fields(entry.name)
        if fields is not None and len(fields) >= 3 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def process_tree(pid: int) -> list[int]:
    """Live processes of `pid`'s process group and every live descendant of `pid` (also those in
    groups or sessions of their own), from one walk of /proc."""
    children: dict[int, list[int]] = {}
    tree: set[int] = set()  # the live members of its group
    alive: set[int] = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = proc_stat_fields(entry.name)
        if fields is None or len(fields) < 3 or fields[0] == "Z":
            continue
        child = int(entry.name)
        alive.add(child)
        children.setdefault(int(fields[1]), []).append(child)
        if int(fields[2]) == pid:
            tree.add(child)
    seen, todo = {pid}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):  # every child listed is alive
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return sorted(tree | (seen & alive))


def _group_alive(pgid: int) -> bool:
    return bool(group_members(pgid))


async def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    # Grandchildren are not ours to wait() on, so /proc is the only place their exit shows.
    while _group_alive(pgid) and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
