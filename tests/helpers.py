"""Helpers shared by the test suites (imported as tests.helpers)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable

# Symphony's default ports (scheduler, engines, node gRPC, KV metrics, a few nodes' worth): a test
# config that leaves some defaults in place would be refused as overlapping a free port picked here.
_DEFAULT_PORTS = frozenset([8000, *range(8100, 8108), *range(9300, 9308), *range(50051, 50059)])


def free_port() -> int:
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _DEFAULT_PORTS:
            return port


def free_port_run(count: int) -> int:
    """A base port such that base .. base+count-1 are all free right now."""
    for _ in range(200):
        base = free_port()
        if base + count > 65535 or any(base + offset in _DEFAULT_PORTS for offset in range(count)):
            continue
        socks = []
        try:
            for offset in range(count):
                sock = socket.socket()
                sock.bind(("127.0.0.1", base + offset))
                socks.append(sock)
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no run of {count} free ports found")


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    """Poll a condition (never a fixed sleep standing in for it); fail with `what` on timeout."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


async def async_wait_until(predicate: Callable[[], bool | Awaitable[bool]], timeout_s: float, what: str,
                           interval_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(interval_s)
