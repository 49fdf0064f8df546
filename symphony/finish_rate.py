"""How fast a region's requests finish: a count over a sliding window, for the wait of a request
that finds every engine full (it starts when one of the running requests ends).

Pure: the caller passes the time (milliseconds on its own monotonic clock). Bounded: a fixed ring
of buckets, whatever the rate.
"""

from __future__ import annotations

import math

DEFAULT_WINDOW_MS = 5_000.0
DEFAULT_BUCKETS = 10


class FinishRate:
    """Requests finished per second over the last `window_ms` (the window's part since the first
    event, early on: the rate is not diluted by time before anything ran, and at least one bucket).
    Once anything has finished, a window with none reads as one: the rate is below one a window,
    which keeps a stalled region's wait long rather than unknown.

    Not thread-safe: one owner (the scheduler's event loop, the simulator's loop)."""

    def __init__(self, window_ms: float = DEFAULT_WINDOW_MS, buckets: int = DEFAULT_BUCKETS) -> None:
        if not window_ms > 0 or buckets < 1:
            raise ValueError(f"a window of {window_ms} ms in {buckets} buckets")
        self.window_ms = window_ms
        self.bucket_ms = window_ms / buckets
        self._counts = [0] * buckets
        self._current = -1  # the bucket index (time // bucket_ms) the ring's newest slot holds
        self._first_ms: float | None = None

    def _advance(self, now_ms: float) -> int:
        index = math.floor(now_ms / self.bucket_ms)
        if index > self._current:
            for stale in range(max(self._current + 1, index - len(self._counts) + 1), index + 1):
                self._counts[stale % len(self._counts)] = 0
            self._current = index
        return index

    def finished(self, now_ms: float, count: int = 1) -> None:
        """`count` requests finished at `now_ms` (one earlier than the last counts in the newest bucket)."""
        if self._first_ms is None:
            self._first_ms = now_ms
        index = max(self._advance(now_ms), self._current)
        self._counts[index % len(self._counts)] += count

    def per_s(self, now_ms: float, since_ms: float | None = None) -> float:
        """Finishes per second over the window ending at `now_ms`; 0 before any. `since_ms`: over
        its part from the start of the bucket holding `since_ms` (its finishes and its time)."""
        if self._first_ms is None:
            return 0.0
        self._advance(now_ms)
        oldest = self._current - len(self._counts) + 1
        since = math.floor(since_ms / self.bucket_ms) * self.bucket_ms if since_ms is not None else -math.inf
        begin = max(oldest * self.bucket_ms, self._first_ms, since)
        first = max(oldest, math.floor(begin / self.bucket_ms))
        count = sum(self._counts[i % len(self._counts)] for i in range(first, self._current + 1))
        span_ms = max(now_ms - begin, self.bucket_ms)
        return max(count, 1) * 1000.0 / span_ms
