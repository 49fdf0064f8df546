"""Requests held back by selective pushing: while every node has requests waiting, a new request
waits here rather than in one engine's queue, so it starts on whichever node frees up first.
The order and the bounds are `scheduler.held_queue.HeldQueue`'s (higher tiers first, tenants taking
turns by weight within a tier; a full queue, or a tenant's full share of it, answers 429); this adds
the waiting, with a deadline (then 503), so nothing waits forever."""

from __future__ import annotations

import asyncio

from scheduler.held_queue import HeldQueue, QueueFull
from symphony.priority import Priority
from symphony.tenancy import DEFAULT_TENANT
from symphony.tenant_quotas import TenantQuotas

__all__ = ["PushQueue", "QueueFull"]


class PushQueue:
    def __init__(self, max_waiting: int, quotas: TenantQuotas | None = None) -> None:
        self._held: HeldQueue[asyncio.Future[None]] = HeldQueue(max_waiting, quotas)

    @property
    def max_waiting(self) -> int:
        return self._held.max_waiting

    def __len__(self) -> int:
        return len(self._held)

    def waiting(self, priority: Priority) -> int:
        return self._held.waiting(priority)

    def ahead_of(self, priority: Priority) -> bool:
        return self._held.ahead_of(priority)

    def waiting_of(self, tenant: str) -> int:
        return self._held.waiting_of(tenant)

    async def wait(
        self, priority: Priority, timeout_s: float, tenant: str = DEFAULT_TENANT, *, front: bool = False
    ) -> bool:
        """Wait for a turn to try the nodes again: True when woken, False when `timeout_s` passed.
        `front`: a request woken before that found no room again keeps its place at the head.
        Raises QueueFull when a newcomer finds the queue full."""
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._held.push(turn, priority, tenant, front=front)
        woken = False
        try:
            await asyncio.wait_for(asyncio.shield(turn), timeout_s)
            woken = True
            return True
        except TimeoutError:
            return False
        finally:
            if turn.done() and not turn.cancelled():  # `wake` took it out of the queue
                if not woken:
                    self.wake(1)  # woken just as it gave up (timeout, client gone): the next waiter goes
            else:
                turn.cancel()
                self._held.remove(turn, priority, tenant)

    def wake(self, count: int) -> int:
        """Let up to `count` waiters try again, in the queue's order; returns how many."""
        woken = 0
        while woken < count and (turn := self._held.pop()) is not None:
            if not turn.done():
                turn.set_result(None)
                woken += 1
        return woken
