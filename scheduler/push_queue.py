"""Requests held back by selective pushing: while every node has requests waiting, a new request
waits here rather than in one engine's queue, so it starts on whichever node frees up first.
FIFO within a priority tier, higher tiers first; bounded (a full queue answers 429) and every wait
has a deadline (then 503), so nothing waits forever."""

from __future__ import annotations

import asyncio
from collections import deque

from scheduler.routing import PRIORITIES, PRIORITY_RANK


class QueueFull(Exception):
    pass


class PushQueue:
    def __init__(self, max_waiting: int) -> None:
        if max_waiting <= 0:
            raise ValueError("max_waiting must be positive")
        self.max_waiting = max_waiting
        self._waiters: dict[str, deque[asyncio.Future[None]]] = {p: deque() for p in PRIORITIES}

    def __len__(self) -> int:
        return sum(len(q) for q in self._waiters.values())

    def waiting(self, priority: str) -> int:
        return len(self._waiters[priority])

    def ahead_of(self, priority: str) -> bool:
        """Whether a request of `priority` arriving now has others to wait behind (same or higher
        tier): it must not take a node that frees up before them."""
        rank = PRIORITY_RANK[priority]
        return any(self._waiters[p] for p in PRIORITIES[rank:])

    async def wait(self, priority: str, timeout_s: float, *, front: bool = False) -> bool:
        """Wait for a turn to try the nodes again: True when woken, False when `timeout_s` passed.
        `front`: a request woken before that found no room again keeps its place at the head."""
        if not front and len(self) >= self.max_waiting:  # a re-queued request keeps its place
            raise QueueFull(f"{self.max_waiting} requests are waiting for a node already")
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._waiters[priority]
        if front:
            queue.appendleft(turn)
        else:
            queue.append(turn)
        woken = False
        try:
            await asyncio.wait_for(asyncio.shield(turn), timeout_s)
            woken = True
            return True
        except TimeoutError:
            return False
        finally:
            if not woken and turn.done() and not turn.cancelled():
                self.wake(1)  # woken just as it gave up (timeout, client gone): the next waiter goes
            if not turn.done():
                turn.cancel()
            if turn in queue:
                queue.remove(turn)

    def wake(self, count: int) -> int:
        """Let up to `count` waiters try again, highest tier first, oldest first; returns how many."""
        woken = 0
        for priority in reversed(PRIORITIES):
            queue = self._waiters[priority]
            while queue and woken < count:
                turn = queue.popleft()
                if not turn.done():
                    turn.set_result(None)
                    woken += 1
        return woken
