"""Where each advised session's request should go: the region its advisory moves its KV to. Bound
when the advisory goes, dropped when the region does not take it, and when a request of the
session has been served (anywhere): the next turn is ranked afresh. Bounded by count (least
recently advised out) and by age."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class AdvisedRegions:
    def __init__(self, max_sessions: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if max_sessions <= 0 or ttl_s <= 0:
            raise ValueError("max_sessions and ttl_s must be positive")
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.clock = clock
        self._regions: OrderedDict[str, tuple[str, float]] = OrderedDict()  # digest -> (region, when)

    def __len__(self) -> int:
        return len(self._regions)

    def put(self, session: str, region: str) -> None:
        self._regions[session] = (region, self.clock())
        self._regions.move_to_end(session)
        while len(self._regions) > self.max_sessions:
            self._regions.popitem(last=False)

    def peek(self, session: str) -> str | None:
        """The region of the session's advisory, if one went within `ttl_s`."""
        held = self._regions.get(session)
        if held is None:
            return None
        if self.clock() - held[1] > self.ttl_s:
            del self._regions[session]
            return None
        return held[0]

    def drop(self, session: str) -> None:
        self._regions.pop(session, None)
