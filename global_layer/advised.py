"""Where each advised session's request should go: the region its advisory went to (its KV moving
there, its node chosen). Bounded by count (least recently advised out) and by age."""

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

    def get(self, session: str) -> str | None:
        """The region of the session's advisory, if one came within `ttl_s` (taken: a request
        follows its advisory once)."""
        held = self._regions.pop(session, None)
        if held is None or self.clock() - held[1] > self.ttl_s:
            return None
        return held[0]
