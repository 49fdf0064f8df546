"""A real etcd for the tests that need coordination: Debian's etcd-server (`make etcd` installs it),
one member on loopback ports of its own, its data in a directory the caller gives."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from eval.child_process import stop_child
from tests.helpers import free_port_run, wait_until

STARTUP_TIMEOUT_S = 30.0


@contextmanager
def running_etcd(directory: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """(client URL, process) of an etcd serving from `directory`, stopped on exit."""
    binary = shutil.which("etcd")
    assert binary, "etcd is not installed: `make etcd` installs Debian's etcd-server"
    base = free_port_run(2)
    client, peer = f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"
    directory.mkdir(parents=True, exist_ok=True)
    log = (directory / "etcd.log").open("wb")
    urls = ["--listen-client-urls", client, "--advertise-client-urls", client]
    urls += ["--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"test={peer}"]
    process = subprocess.Popen(
        [binary, "--name", "test", "--data-dir", str(directory / "data"), *urls, "--log-level", "warn"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )

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
