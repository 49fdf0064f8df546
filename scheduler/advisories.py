"""Pending advisories: which node a session's next request must go to. Bounded by size and TTL."""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

SessionKey = tuple[str, str]  # (tenant, session id): sessions never collide across tenants


@dataclass(frozen=True, slots=True)
class Advisory:
    session: SessionKey
    kind: str  # "typing" | "predecessor"
    node_id: str
    created_at: float
    expected_arrival_ms: int | None
    expires_at: float


class AdvisoryTable:
    """LRU-bounded map session -> pending advisory; an entry lives until used, replaced or expired."""

    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries <= 0:
            raise ValueError("max_entries must be positive")
        self._entries: OrderedDict[SessionKey, Advisory] = OrderedDict()
        self._max_entries = max_entries
        self._ttl_s = ttl_s
        self._clock = clock
        self.evicted = 0  # dropped to stay within max_entries before being used
        self.expired = 0
        # Requests announced but not yet arrived, per node: routing counts them as load about to land.
        self.pending_by_node: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, session: SessionKey, kind: str, node_id: str, expected_arrival_ms: int | None) -> Advisory:
        now = self._clock()
        # The TTL counts from when the request is expected, so a far-ahead agent hint stays valid.
        lead_s = (expected_arrival_ms or 0) / 1000.0
        advisory = Advisory(session, kind, node_id, now, expected_arrival_ms, now + lead_s + self._ttl_s)
        self._remove(session)
        self._entries[session] = advisory
        self.pending_by_node[node_id] += 1
        self._purge(now)
        while len(self._entries) > self._max_entries:
            self._remove(next(iter(self._entries)))
            self.evicted += 1
        return advisory

    def take(self, session: SessionKey) -> Advisory | None:
        """Remove and return the session's advisory if it has not expired."""
        advisory = self._remove(session)
        if advisory is None:
            return None
        if advisory.expires_at < self._clock():
            self.expired += 1
            return None
        return advisory

    def _purge(self, now: float) -> None:
        # Entries are in insertion order; expiry is nearly so, which makes a front sweep cheap and
        # good enough: anything it misses is caught by take() or pushed out by the size bound.
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.expires_at >= now:
                break
            self._remove(oldest.session)
            self.expired += 1

    def _remove(self, session: SessionKey) -> Advisory | None:
        advisory = self._entries.pop(session, None)
        if advisory is not None:
            self.pending_by_node[advisory.node_id] -= 1
            if self.pending_by_node[advisory.node_id] <= 0:
                del self.pending_by_node[advisory.node_id]
        return advisory
