"""Requests held back by selective pushing: while every node has requests waiting, a new request
waits here rather than in one engine's queue, so it starts on whichever node frees up first.
The order and the bounds are `scheduler.held_queue.HeldQueue`'s (higher tiers first, tenants taking
turns by weight within a tier; a full queue, or a tenant's full share of it, answers 429; a newcomer
that would wait past `max_wait_s`, 503: `scheduler.admission`); this adds the waiting, with a
deadline (then 503), so nothing waits forever.

Wake-ups: `wake_for(rooms)` lets as many waiters go as there are rooms, less those woken already
that have not yet taken theirs (`woken`): a woken waiter resumes only at a later turn of the event
loop, and every node status and every request's end asks again meanwhile. Waking one per ask would
wake several for one room; all but one would find none and wait again at the head of the queue,
where they go before every tenant's newcomers (the tenants' turns lost) and count in every
newcomer's expected wait (admission refusing what it need not)."""

from __future__ import annotations

import asyncio
import math
import time

from scheduler.errors import ApiError, overloaded_error, queue_timeout_error
from scheduler.held_queue import HeldQueue, Overloaded, QueueFull
from scheduler.metrics import SchedulerMetrics
from symphony.priority import Priority
from symphony.tenancy import DEFAULT_TENANT
from symphony.tenant_quotas import TenantQuotas

__all__ = ["Overloaded", "PushQueue", "QueueFull"]


class PushQueue:
    def __init__(
        self,
        max_waiting: int,
        quotas: TenantQuotas | None = None,
        max_wait_s: float = math.inf,
        timeout_s: float = math.inf,
        metrics: SchedulerMetrics | None = None,
    ) -> None:
        """`max_wait_s`: admission's bound (`scheduler.max_queue_wait_s`); `timeout_s`: the longest
        a request waits in all (`scheduler.queue_timeout_s`), for `wait_for_room`'s errors."""
        self._held: HeldQueue[asyncio.Future[None]] = HeldQueue(max_waiting, quotas, max_wait_s)
        self.timeout_s = timeout_s
        self.metrics = metrics if metrics is not None else SchedulerMetrics()
        self.woken = 0  # waiters woken (their turn's future set) that have not resumed yet

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
        self,
        priority: Priority,
        timeout_s: float,
        tenant: str = DEFAULT_TENANT,
        front: bool = False,
        slots_per_s: float = 0.0,
    ) -> bool:
        """Wait for a turn to try the nodes again: True when woken, False when `timeout_s` passed.
        `front`: a request woken before that found no room again keeps its place at the head.
        Raises QueueFull when a newcomer finds the queue full, Overloaded when it would wait past
        `max_wait_s` with engine slots freeing at `slots_per_s` (0: not known)."""
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._held.push(turn, priority, tenant, front=front, slots_per_s=slots_per_s)
        woken = False
        try:
            await asyncio.wait_for(asyncio.shield(turn), timeout_s)
            woken = True
            return True
        except TimeoutError:
            return False
        finally:
            if turn.done() and not turn.cancelled():  # `wake` took it out of the queue
                self.woken -= 1  # resumed (or gave up): its wake-up is spent
                if not woken:
                    self.wake(1)  # woken just as it gave up (timeout, client gone): the next waiter goes
            else:
                turn.cancel()
                self._held.remove(turn, priority, tenant)

    async def wait_for_room(
        self, priority: Priority, tenant: str, wait_until: float, requeued: bool, slots_per_s: float
    ) -> None:
        """`wait` until woken, as the scheduler answers its clients: raises ApiError 503
        (`queue_timeout`) once `time.monotonic()` passes `wait_until`, 503 (`overloaded`, with
        Retry-After) for a newcomer refused by admission, 429 for a full queue or tenant's share."""
        remaining = wait_until - time.monotonic()
        if remaining <= 0:
            raise queue_timeout_error(self.timeout_s)
        self.metrics.queued.inc()
        if requeued:
            self.metrics.requeued.inc()
        started = time.perf_counter()
        try:
            woken = await self.wait(priority, remaining, tenant, requeued, slots_per_s)
            # Waits that were let in only (a refusal, which waited for nothing, is not one).
            self.metrics.queue_wait.labels(priority).observe(time.perf_counter() - started)
        except Overloaded as exc:
            self.metrics.overloaded.labels(priority).inc()
            raise overloaded_error(exc.wait_s, self._held.max_wait_s, exc.retry_after_s) from None
        except QueueFull as exc:
            raise ApiError(429, f"{exc}; retry later", code=exc.code) from None
        finally:
            self.metrics.queued.dec()
        if not woken:
            raise queue_timeout_error(self.timeout_s)

    def wake(self, count: int) -> int:
        """Let up to `count` waiters try again, in the queue's order; returns how many."""
        woken = 0
        while woken < count and (turn := self._held.pop()) is not None:
            if not turn.done():
                turn.set_result(None)
                woken += 1
        self.woken += woken
        return woken

    def wake_for(self, rooms: int) -> int:
        """Let waiters go for `rooms` rooms open now, less the waiters woken already that have not
        yet taken theirs (module docstring); returns how many."""
        return self.wake(rooms - self.woken)
