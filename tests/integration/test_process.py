"""ManagedProcess against real child processes: readiness, crash restarts, budget, hangs, clean stop."""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from symphony import shm_files
from symphony.process import ManagedProcess, ProcessState, RestartPolicy, group_members, pid_running, proc_stat_fields
from tests.helpers import async_wait_until, free_port, wait_until

FAKE_CHILD = Path(__file__).with_name("fake_child.py")
FAST = RestartPolicy(max_restarts=3, backoff_s=0.01, backoff_max_s=0.05, stable_after_s=600)


def _health_probe(port: int):
    async def probe() -> bool:
        async with httpx.AsyncClient(timeout=0.5) as client:
            try:
                return (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200
            except httpx.HTTPError:
                return False

    return probe


def _process(
    tmp_path: Path, *child_args: str, port: int | None = None, policy: RestartPolicy = FAST, **kwargs: object
) -> ManagedProcess:
    port = port or free_port()
    argv = [sys.executable, str(FAKE_CHILD), "--port", str(port), *child_args]
    states: list[ProcessState] = []
    proc = ManagedProcess(
        "fake",
        argv,
        log_path=tmp_path / "fake.log",
        ready_probe=_health_probe(port),
        policy=policy,
        probe_interval_s=0.02,
        on_state_change=lambda p: states.append(p.state),
        **kwargs,
    )  # type: ignore[arg-type]
    proc.seen_states = states  # type: ignore[attr-defined]
    return proc


def _end_descendants(pidfile: Path, name: str) -> None:
    """After a stop: the child's descendants in a session of their own outlive it (a real engine
    dies with its node manager, by PDEATHSIG, which the fake child's does not arm): ours to end,
    with the files named `name` they made."""
    for pid in map(int, pidfile.read_text().split()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for path in _shm_files(name):
        path.unlink(missing_ok=True)


def _shm_files(prefix: str) -> list[Path]:
    return [p for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix)]


def _autogroup(pid: int) -> str | None:
    """`/proc/PID/autogroup`: "/autogroup-ID nice N", or None without autogroup scheduling."""
    try:
        return Path(f"/proc/{pid}/autogroup").read_text().strip()
    except FileNotFoundError:
        return None


async def test_becomes_ready_and_stop_kills_the_whole_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    proc = _process(tmp_path, "--grandchild", "--pidfile", str(pidfile), shm_scan_interval_s=0.05)
    proc.start()
    assert await proc.wait_ready(timeout_s=20)
    leader, grandchild = map(int, pidfile.read_text().split())
    assert proc.pid == leader
    assert os.getpgid(grandchild) == leader, "the grandchild shares the supervised process group"
    await proc.stop()
    assert proc.state is ProcessState.STOPPED
    assert not pid_running(leader) and not pid_running(grandchild)
    assert group_members(leader) == []


async def test_a_niced_child_lowers_its_whole_sessions_priority(tmp_path: Path) -> None:
    """Niceness alone does not weigh across sessions under autogroup scheduling, and a supervised
    child leads a session of its own: its autogroup must carry the niceness too."""
    proc = _process(tmp_path, nice=7)
    proc.start()
    try:
        assert await proc.wait_ready(timeout_s=20)
        pid = proc.pid
        assert pid is not None
        assert os.getsid(pid) == pid, "the child leads its own session"
        fields = proc_stat_fields(pid)
        assert fields is not None and int(fields[16]) == 7, "niceness (the 19th field of /proc/PID/stat)"
        child_group, our_group = _autogroup(pid), _autogroup(os.getpid())
        if child_group is not None:  # kernels without autogroup scheduling have no such file
            assert child_group.endswith("nice 7"), child_group
            assert our_group is not None and our_group != child_group, "ours is untouched"
    finally:
        await proc.stop()


async def test_crash_is_restarted_with_backoff_and_reported(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    proc = _process(tmp_path, "--pidfile", str(pidfile), shm_scan_interval_s=0.05)
    proc.start()
    try:
        assert await proc.wait_ready(timeout_s=20)
        first_pid = proc.pid
        assert first_pid is not None
        await proc.kill_for_test(signal.SIGKILL)
        await async_wait_until(
            lambda: proc.restarts == 1 and proc.state is ProcessState.READY, 20, "the restarted child to be ready"
        )
        assert proc.pid not in (None, first_pid)
        assert "SIGKILL" in proc.last_error
        assert ProcessState.RESTARTING in proc.seen_states  # type: ignore[attr-defined]
        assert len(pidfile.read_text().split()) == 2, "exactly one new child was started"
    finally:
        await proc.stop()


async def test_restart_budget_exhausted_means_failed(tmp_path: Path) -> None:
    proc = _process(
        tmp_path,
        "--exit-code",
        "3",
        policy=RestartPolicy(max_restarts=2, backoff_s=0.01, backoff_max_s=0.01, stable_after_s=600),
    )
    proc.start()
    assert not await proc.wait_ready(timeout_s=30)
    assert proc.state is ProcessState.FAILED
    assert proc.restarts == 2
    assert "exited with 3" in proc.last_error
    await proc.stop()


def test_backoff_doubles_up_to_the_cap() -> None:
    policy = RestartPolicy(max_restarts=10, backoff_s=0.5, backoff_max_s=3.0)
    assert [policy.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


async def test_never_ready_counts_as_a_failed_start(tmp_path: Path) -> None:
    proc = _process(
        tmp_path, "--never-ready", startup_timeout_s=0.5, policy=RestartPolicy(max_restarts=0, backoff_s=0.01)
    )
    proc.start()
    assert not await proc.wait_ready(timeout_s=20)
    assert proc.state is ProcessState.FAILED
    assert "not ready within" in proc.last_error
    await proc.stop()


async def test_hung_child_is_restarted(tmp_path: Path) -> None:
    flag = tmp_path / "unhealthy"
    proc = _process(tmp_path, "--unhealthy-flag", str(flag), liveness_interval_s=0.05, liveness_timeout_s=0.3)
    proc.start()
    try:
        assert await proc.wait_ready(timeout_s=20)
        flag.touch()  # from now on /health answers 503, though the process lives on
        await async_wait_until(lambda: proc.restarts >= 1, 20, "the hung child to be restarted")
        assert "health probe" in proc.last_error
    finally:
        await proc.stop()


async def test_shared_memory_of_a_killed_child_is_removed(tmp_path: Path) -> None:
    name = f"symphony-test-{os.getpid()}-{free_port()}"
    # Ignoring SIGTERM forces the SIGKILL path: the child never gets to clean up after itself.
    proc = _process(tmp_path, "--shm", name, "--ignore-term", stop_timeout_s=0.3)
    proc.start()
    assert await proc.wait_ready(timeout_s=20)
    created = _shm_files(name)
    assert len(created) == 1
    await proc.stop()
    assert not created[0].exists()


@contextlib.contextmanager
def _segments(name: str) -> Iterator[tuple[Path, Path, Path]]:
    """Beside the child: a multiprocessing-named file made before it starts; then, once asked, one
    made while it runs but mapped by this process, and one unmapped under another name."""
    before, mapped, other = (Path(f"/dev/shm/{n}") for n in (f"psm_{name}-before", f"psm_{name}-mapped", f"{name}-x"))
    before.write_bytes(b"\0" * 64)
    try:
        yield before, mapped, other
    finally:
        for path in (before, mapped, other):
            path.unlink(missing_ok=True)


@contextlib.contextmanager
def _mapped_while_running(mapped: Path, other: Path) -> Iterator[None]:
    mapped.write_bytes(b"\0" * 4096)
    other.write_bytes(b"\0" * 64)
    with mapped.open("r+b") as fh, mmap.mmap(fh.fileno(), 4096):
        yield


async def test_shared_memory_made_between_scans_is_swept_after_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A segment the child maps after its readiness scan, then a crash: the tree cannot be walked
    any more, so the sweep finds it (Python multiprocessing's name, this user's, made while the
    child ran, mapped by no one). Beside it, what is not the child's stays."""
    monkeypatch.setattr(shm_files, "ORPHAN_GRACE_S", 0.0)  # no file in this test is in mid-creation
    name = f"symphony-test-{os.getpid()}-{free_port()}"
    with _segments(name) as (before, mapped, other):
        proc = _process(tmp_path, "--late-shm", name)
        proc.start()
        try:
            assert await proc.wait_ready(timeout_s=20)
            with _mapped_while_running(mapped, other):
                await async_wait_until(lambda: len(_shm_files(f"psm_{name}.")) == 1, 20, "the late segment")
                (late,) = _shm_files(f"psm_{name}.")
                assert str(late) not in proc._shm_paths  # recorded by no scan
                await proc.kill_for_test(signal.SIGKILL)
                await async_wait_until(lambda: proc.restarts == 1, 20, "the restart")
                await async_wait_until(lambda: not _shm_files(f"psm_{name}."), 10, "the late segment to be swept")
                kept = [_shm_files(path.name) for path in (before, mapped, other)]
                assert kept == [[before], [mapped], [other]]
        finally:
            await proc.stop()
    assert not _shm_files(f"psm_{name}.")


async def test_shared_memory_is_removed_after_a_crash_before_restart(tmp_path: Path) -> None:
    name = f"symphony-test-{os.getpid()}-{free_port()}"
    proc = _process(tmp_path, "--shm", name)
    proc.start()
    try:
        assert await proc.wait_ready(timeout_s=20)
        first = _shm_files(name)
        assert len(first) == 1
        await proc.kill_for_test(signal.SIGKILL)
        await async_wait_until(lambda: proc.restarts == 1 and proc.state is ProcessState.READY, 20, "restart")
        assert not first[0].exists()
    finally:
        await proc.stop()
    assert not _shm_files(name)


@contextlib.contextmanager
def _mapped_here(path: Path) -> Iterator[mmap.mmap]:
    """A /dev/shm file this (supervising) process creates and maps, as the node manager its arena."""
    path.write_bytes(b"\x00" * 4096)
    try:
        with path.open("r+b") as fh, mmap.mmap(fh.fileno(), 0) as mapping:
            yield mapping
    finally:
        path.unlink(missing_ok=True)


async def test_shared_memory_of_a_killed_childs_own_child_is_removed(tmp_path: Path) -> None:
    """A node manager and its engine (a session of its own) both SIGKILLed: neither can clean up, and
    the engine's segments, mapped only after the node manager was ready, go with the node manager's
    crash, before its restart."""
    name = f"symphony-test-{os.getpid()}-{free_port()}"
    pidfile = tmp_path / "pids"
    proc = _process(tmp_path, "--session-shm", name, "--pidfile", str(pidfile), shm_scan_interval_s=0.05)
    proc.start()
    try:
        assert await proc.wait_ready(timeout_s=20)
        await async_wait_until(lambda: len(_shm_files(name)) == 1, 20, "the descendant's shared memory")
        (leaked,) = _shm_files(name)
        child, descendant = map(int, pidfile.read_text().split()[:2])
        assert os.getpgid(descendant) != os.getpgid(child)  # not in the group a stop signals
        await async_wait_until(lambda: str(leaked) in proc._shm_paths, 10, "the segment to be recorded")
        for pid in (descendant, child):
            os.kill(pid, signal.SIGKILL)
        await async_wait_until(lambda: proc.restarts == 1, 20, "the restart")
        assert not leaked.exists()
    finally:
        await proc.stop()
        _end_descendants(pidfile, name)


async def test_a_descendant_in_its_own_session_is_waited_for_before_the_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node manager killed, its engine (a session of its own) dying of its death signal a while
    later: the files the engine held until then are swept once it is gone, not left because it
    still held them at the node manager's exit. The file is made after the readiness scan, so
    only the sweep can find it."""
    monkeypatch.setattr(shm_files, "ORPHAN_GRACE_S", 0.0)  # no file in this test is in mid-creation
    name = f"psm_symphony-test-{os.getpid()}-{free_port()}"
    pidfile = tmp_path / "pids"
    proc = _process(tmp_path, "--session-shm", name, "--session-linger-s", "1.0", "--pidfile", str(pidfile))
    proc.start()
    try:
        assert await proc.wait_ready(timeout_s=20)
        await async_wait_until(lambda: len(_shm_files(name)) == 1, 20, "the descendant's shared memory")
        (held,) = _shm_files(name)
        assert str(held) not in proc._shm_paths  # recorded by no scan
        child, descendant = map(int, pidfile.read_text().split()[:2])
        os.kill(child, signal.SIGKILL)
        await async_wait_until(lambda: proc.restarts == 1, 20, "the restart")
        assert not pid_running(descendant)  # waited for
        assert not held.exists()
    finally:
        await proc.stop()
        _end_descendants(pidfile, name)


async def test_shared_memory_the_supervisor_maps_survives_the_childs_crash(tmp_path: Path) -> None:
    # The node manager's DRAM arena is mapped by both it and the vLLM worker: the worker's death is no
    # reason to delete the arena under the node manager and the restarted worker.
    ours = Path(f"/dev/shm/symphony-test-{os.getpid()}-{free_port()}-supervisor")
    name = f"symphony-test-{os.getpid()}-{free_port()}"
    with _mapped_here(ours):
        proc = _process(tmp_path, "--shm", name, "--attach-shm", str(ours))
        proc.start()
        try:
            assert await proc.wait_ready(timeout_s=20)
            childs = _shm_files(name)
            assert len(childs) == 1
            await proc.kill_for_test(signal.SIGKILL)
            await async_wait_until(lambda: proc.restarts == 1 and proc.state is ProcessState.READY, 20, "restart")
            assert not childs[0].exists()
            assert _shm_files(ours.name) == [ours]
        finally:
            await proc.stop()
        assert _shm_files(ours.name) == [ours]


async def test_start_twice_is_an_error(tmp_path: Path) -> None:
    proc = _process(tmp_path)
    proc.start()
    try:
        with pytest.raises(RuntimeError):
            proc.start()
    finally:
        await proc.stop()


@pytest.mark.parametrize("death", ["term", "kill"])
def test_child_dies_with_its_killed_supervisor(tmp_path: Path, death: str) -> None:
    """SIGTERM by default; SIGKILL when asked, which a child that ignores SIGTERM (as vLLM's HTTP
    server waiting on aborted requests in effect does) cannot outlive."""
    parent = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("supervising_parent.py")),
            str(free_port()),
            str(tmp_path / "child.log"),
            *(["kill"] if death == "kill" else []),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        assert pid_running(child_pid)
        parent.kill()  # SIGKILL: the supervisor gets no chance to stop its child
        parent.wait(10)
        wait_until(lambda: not pid_running(child_pid), 10, "the orphaned child to receive its death signal")
    finally:
        parent.kill()
