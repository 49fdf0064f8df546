"""Helpers shared by the test suites (imported as tests.helpers)."""

from __future__ import annotations

import asyncio
import hashlib
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
