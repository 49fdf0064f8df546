"""Helpers shared by the test suites (imported as tests.helpers)."""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
import time
from collections.abc import Awaitable, Callable, Sequence

from eval.ports import free_port, free_port_run  # noqa: F401 - the suites take them from here
from symphony.kv_addressing import BlockKey, ModelFingerprint

# The model fingerprint of stores that serve no real model (unit tests of the store and its peers).
TEST_MODEL = ModelFingerprint(hashlib.sha256(b"symphony-test-model").digest())
OTHER_MODEL = ModelFingerprint(hashlib.sha256(b"symphony-test-other-model").digest())


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    """Poll a condition (never a fixed sleep standing in for it); fail with `what` on timeout."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


async def async_wait_until(
    predicate: Callable[[], bool | Awaitable[bool]], timeout_s: float, what: str, interval_s: float = 0.02
) -> None:
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


class EmitRecorder:
    """An engine event subscriber's emit that keeps the (kind, keys) calls it got; thread-safe (the
    subscriber's thread calls it, the test reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[tuple[str, list[BlockKey]]] = []

    def __call__(self, kind: str, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            self._calls.append((kind, list(keys)))

    @property
    def calls(self) -> list[tuple[str, list[BlockKey]]]:
        with self._lock:
            return list(self._calls)

    def keys(self, kind: str) -> list[BlockKey]:
        """Every key emitted as `kind`, in order."""
        return [key for k, keys in self.calls if k == kind for key in keys]

    def clear(self) -> None:
        with self._lock:
            self._calls.clear()


async def idle_connection_reused(url: str, path: str, idle_s: float, timeout_s: float = 10.0) -> list[bytes]:
    """GET `path` of `url` (http://host:port) on one connection, idle `idle_s` (the stimulus: the
    time a client's pool keeps it), then GET it again on the same connection: the status lines of
    the answers, or b"" for one the server closed the connection before sending."""
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    statuses: list[bytes] = []
    try:
        for pause in (0.0, idle_s):
            await asyncio.sleep(pause)
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
            except (asyncio.IncompleteReadError, ConnectionError):
                statuses.append(b"")
                break
            length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
            assert length, head  # an answer of known length: the next starts after it
            await asyncio.wait_for(reader.readexactly(int(length[1])), timeout_s)
            statuses.append(head.split(b"\r\n", 1)[0])
    finally:
        writer.close()
    return statuses


async def closed_after(reader: asyncio.StreamReader, timeout_s: float) -> float:
    """Seconds until the server closes the connection `reader` reads (what it sends meanwhile read
    away); TimeoutError past `timeout_s`."""
    started = time.monotonic()
    async with asyncio.timeout(timeout_s):
        while await reader.read(4096):
            pass
    return time.monotonic() - started


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A TCP handler that writes back whatever it reads, until the end of its input."""
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()
