"""Event-loop stall watchdog: say when a process's asyncio loop stopped turning, and where it was.

A node manager answers the scheduler's status polls on its event loop; a loop blocked for longer
than the scheduler's `node_down_after_ms` makes a healthy node look down, and its sessions are then
routed away and recomputed. The watchdog makes such stalls visible: a heartbeat task stamps the
time on every turn of the loop, and a daemon thread that finds the stamp too old logs one warning
per stall with the loop thread's innermost frames. When the watchdog thread itself woke late, the
whole process was starved (no CPU, or a thread holding the GIL) rather than the loop alone.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback

from symphony.logs import get_logger

log = get_logger(__name__)

STACK_FRAMES = 6  # innermost frames of each thread logged per stall
# Innermost frames of a thread that is waiting, not running: not logged.
_PARKED = frozenset(
    {
        "wait",
        "_wait_for_tstate_lock",
        "get",
        "select",
        "poll",
        "accept",
        "sleep",
        "_worker",
        "recv",
        "recv_into",
        "readinto",
        "read",
    }
)


class LoopWatchdog:
    def __init__(self, threshold_s: float = 0.25, beat_s: float = 0.05) -> None:
        if beat_s <= 0 or threshold_s <= beat_s:
            raise ValueError("the stall threshold must exceed the heartbeat period, both positive")
        self.threshold_s = threshold_s
        self.beat_s = beat_s
        self.stalls = 0  # stalls seen (each logged once)
        self.longest_s = 0.0
        self._last_beat = time.monotonic()
        self._stop = threading.Event()
        self._beat_task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._loop_thread_id = 0

    def start(self) -> None:
        """Start watching the running loop (call from a coroutine on it)."""
        self._loop_thread_id = threading.get_ident()
        self._last_beat = time.monotonic()
        self._beat_task = asyncio.get_running_loop().create_task(self._beat())
        self._thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        if self._beat_task is not None:
            self._beat_task.cancel()
            await asyncio.gather(self._beat_task, return_exceptions=True)
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    async def _beat(self) -> None:
        while True:
            self._last_beat = time.monotonic()
            await asyncio.sleep(self.beat_s)

    def _watch(self) -> None:
        stall_started: float | None = None  # the beat the current stall began after (one report each)
        where = ""
        woke_late_s = 0.0
        while not self._stop.is_set():
            asked = time.monotonic()
            self._stop.wait(self.beat_s)
            now = time.monotonic()
            last = self._last_beat
            lag = now - last
            if lag > self.threshold_s + self.beat_s:
                if stall_started != last:
                    stall_started = last
                    where = self._stacks()
                woke_late_s = max(woke_late_s, now - asked - self.beat_s)
                continue
            if stall_started is not None:  # the loop turned again: report the stall once, whole
                stalled_s = last - stall_started
                self.stalls += 1
                self.longest_s = max(self.longest_s, stalled_s)
                log.warning(
                    "event loop stalled",
                    ms=round(stalled_s * 1000),
                    watchdog_late_ms=round(woke_late_s * 1000),
                    where=where,
                )
                stall_started, woke_late_s = None, 0.0

    def _stacks(self) -> str:
        """The loop thread's innermost frames, then those of every other thread that is not
        parked in a wait: a loop that sits in select() past its timer is waiting for the GIL, and
        the thread holding it is among these."""
        names = {t.ident: t.name for t in threading.enumerate()}
        parts = []
        for ident, frame in sys._current_frames().items():
            if ident == threading.get_ident():
                continue
            frames = traceback.extract_stack(frame)[-STACK_FRAMES:]
            if ident != self._loop_thread_id and frames and frames[-1].name in _PARKED:
                continue
            stack = " < ".join(f"{f.name}@{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in reversed(frames))
            label = "loop" if ident == self._loop_thread_id else names.get(ident, str(ident))
            parts.append(f"[{label}] {stack}")
        return " | ".join(parts)
