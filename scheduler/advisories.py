"""Pending advisories: which node a session's next request must go to. Bounded by size and TTL."""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from scheduler.validation import AdvisoryRequest

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
    """LRU-bounded map session -> pending advisory; an entry lives until used, replaced or expired.

    Expiry is tracked in a heap because lifetimes differ (a predecessor hint an hour ahead must not
    shield the typing advisories behind it); heap entries of advisories already used or replaced are
    skipped when they surface, and the heap is rebuilt if such leftovers pile up.
    """

    def __init__(
        self,
        max_entries: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_drop: Callable[[str], None] | None = None,
    ) -> None:
        if max_entries <= 0:
            raise ValueError("max_entries must be positive")
        self._entries: OrderedDict[SessionKey, Advisory] = OrderedDict()
        self._expiry: list[tuple[float, int, SessionKey, Advisory]] = []
        self._seq = itertools.count()
        self._max_entries = max_entries
        self._ttl_s = ttl_s
        self._clock = clock
        self._on_drop = on_drop  # called with "expired" or "evicted" for each advisory never used
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
        heapq.heappush(self._expiry, (advisory.expires_at, next(self._seq), session, advisory))
        self.purge(now)
        while len(self._entries) > self._max_entries:
            self._remove(next(iter(self._entries)))
            self._dropped("evicted")
        if len(self._expiry) > 2 * self._max_entries:
            self._expiry = [(a.expires_at, next(self._seq), key, a) for key, a in self._entries.items()]
            heapq.heapify(self._expiry)
        return advisory

    def take(self, session: SessionKey) -> Advisory | None:
        """Remove and return the session's advisory if it has not expired."""
        advisory = self._remove(session)
        if advisory is None:
            return None
        if advisory.expires_at < self._clock():
            self._dropped("expired")
            return None
        return advisory

    def purge(self, now: float | None = None) -> None:
        """Drop every expired advisory (routing calls this before reading pending_by_node)."""
        now = self._clock() if now is None else now
        while self._expiry and self._expiry[0][0] < now:
            _, _, session, advisory = heapq.heappop(self._expiry)
            if self._entries.get(session) is advisory:  # else used or replaced already
                self._remove(session)
                self._dropped("expired")

    def _dropped(self, reason: str) -> None:
        if reason == "expired":
            self.expired += 1
        else:
            self.evicted += 1
        if self._on_drop is not None:
            self._on_drop(reason)

    def _remove(self, session: SessionKey) -> Advisory | None:
        advisory = self._entries.pop(session, None)
        if advisory is not None:
            self.pending_by_node[advisory.node_id] -= 1
            if self.pending_by_node[advisory.node_id] <= 0:
                del self.pending_by_node[advisory.node_id]
        return advisory


def advisory_reply(advisory: AdvisoryRequest, node_id: str | None, expires_in_ms: float) -> dict[str, object]:
    """The 202 body of `POST /v1/advisories`: the advised node (None: the policy ignores advisories)."""
    return {
        "object": "advisory",
        "session_id": advisory.session_id,
        "kind": advisory.kind,
        "node": node_id,
        "expected_arrival_ms": advisory.expected_arrival_ms,
        "expires_in_ms": int(expires_in_ms),
    }
