"""The simulator's clock: one heap of timed actions. Several simulated clusters (the regions of
`eval.sim.regions`) share one, so that their events interleave in time order."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventLoop:
    def __init__(self) -> None:
        self.now_ms = 0.0  # the time of the action running now (simulated milliseconds)
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()  # ties run in the order they were scheduled
        self.stopped = False

    def at(self, time_ms: float, action: Callable[[], None]) -> None:
        """Run `action` at `time_ms`, not before the current time (nothing, once stopped)."""
        if not self.stopped:
            heapq.heappush(self._events, (max(time_ms, self.now_ms), next(self._order), action))

    def stop(self) -> None:
        """Drop every action still to run, and any scheduled later: `run` returns once the running
        one is done."""
        self.stopped = True
        self._events.clear()

    def run(self) -> None:
        """Until no action is left."""
        while self._events and not self.stopped:
            self.now_ms, _, action = heapq.heappop(self._events)
            action()
