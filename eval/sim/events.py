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

    def at(self, time_ms: float, action: Callable[[], None]) -> None:
        """Run `action` at `time_ms` (one in the past runs next, at the current time's turn)."""
        heapq.heappush(self._events, (time_ms, next(self._order), action))

    def stop(self) -> None:
        """Drop every action still to run: `run` returns once the running one is done."""
        self._events.clear()

    def run(self) -> None:
        """Until no action is left."""
        while self._events:
            self.now_ms, _, action = heapq.heappop(self._events)
            action()
