"""The event-loop watchdog reports a loop that stopped turning, once, with how long it stood."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from symphony.loop_watchdog import LoopWatchdog


async def _wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true in time"
        await asyncio.sleep(0.02)


def test_a_blocked_loop_is_reported_once_with_its_length() -> None:
    async def run() -> LoopWatchdog:
        watchdog = LoopWatchdog(threshold_s=0.15, beat_s=0.03)
        watchdog.start()
        try:
            await asyncio.sleep(0)  # the heartbeat task takes its first turn
            time.sleep(0.6)  # noqa: ASYNC251 - the fault under test: a blocking call on the loop
            await _wait_for(lambda: watchdog.stalls >= 1)
        finally:
            await watchdog.stop()
        return watchdog

    watchdog = asyncio.run(run())
    assert watchdog.stalls == 1
    assert 0.5 <= watchdog.longest_s < 2.0


def test_the_threshold_must_exceed_the_heartbeat() -> None:
    with pytest.raises(ValueError, match="threshold"):
        LoopWatchdog(threshold_s=0.05, beat_s=0.05)
