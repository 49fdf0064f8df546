"""A real etcd for the tests that need coordination: Debian's etcd-server (`make etcd` installs it),
one member on loopback ports of its own, its data in a directory the caller gives."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from eval.child_process import stop_child
from symphony.local_etcd import etcd_argv, etcd_binary
from tests.helpers import free_port_run, wait_until

STARTUP_TIMEOUT_S = 30.0


@contextmanager
def running_etcd(directory: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """(client URL, process) of an etcd serving from `directory`, stopped on exit."""
    try:
        binary = etcd_binary()
    except FileNotFoundError as exc:
        raise AssertionError(str(exc)) from None
    base = free_port_run(2)
    client = f"http://127.0.0.1:{base}"
    directory.mkdir(parents=True, exist_ok=True)
    log = (directory / "etcd.log").open("wb")
    argv = etcd_argv(binary, directory / "data", "127.0.0.1", base, name="test")
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def healthy() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"etcd exited with {process.returncode}: see {directory / 'etcd.log'}")
        try:
            return httpx.get(client + "/health", timeout=1).json().get("health") == "true"
        except (httpx.HTTPError, ValueError):
            return False

    try:
        wait_until(healthy, STARTUP_TIMEOUT_S, "etcd to be healthy", interval_s=0.1)
        yield client, process
    finally:
        stop_child(process, log)  # SIGTERM, then SIGKILL; nothing sent to one that has exited
