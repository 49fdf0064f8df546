"""Requests held back by selective pushing: while every node has requests waiting, a new request
waits here rather than in one engine's queue, so it starts on whichever node frees up first.
The order and the bound are `scheduler.decisions.HeldQueue`'s (FIFO within a priority tier, higher
tiers first; a full queue answers 429); this adds the waiting, with a deadline (then 503), so
nothing waits forever."""

from __future__ import annotations

import asyncio

from scheduler.decisions import HeldQueue, QueueFull
from symphony.priority import Priority

__all__ = ["PushQueue", "QueueFull"]


class PushQueue:
    def __init__(self, max_waiting: int) -> None:
        self._held: HeldQueue[asyncio.Future[None]] = HeldQueue(max_waiting)

    @property
    def max_waiting(self) -> int:
        return self._held.max_waiting

    def __len__(self) -> int:
        return len(self._held)

    def waiting(self, priority: Priority) -> int:
        return self._held.waiting(priority)

    def ahead_of(self, priority: Priority) -> bool:
        return self._held.ahead_of(priority)

    async def wait(self, priority: Priority, timeout_s: float, *, front: bool = False) -> bool:
        """Wait for a turn to try the nodes again: True when woken, False when `timeout_s` passed.
        `front`: a request woken before that found no room again keeps its place at the head.
        Raises QueueFull when a newcomer finds the queue full."""
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._held.push(turn, priority, front=front)
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
            self._held.remove(turn, priority)

    def wake(self, count: int) -> int:
        """Let up to `count` waiters try again, highest tier first, oldest first; returns how many."""
        woken = 0
        while woken < count and (turn := self._held.pop()) is not None:
            if not turn.done():
                turn.set_result(None)
                woken += 1
        return woken
