"""The order of requests held back by selective pushing, shared by the scheduler
(`scheduler.push_queue`) and the simulator (`eval.sim.cluster`).

Higher priority tiers go first. Within a tier, tenants share turns by weight: start-time fair
queueing (Goyal et al., SIGCOMM'96) with every request one unit of work. A tenant's request is tagged
`start = max(V, the finish of its previous queued request)` and `finish = start + 1 / weight`; the
next turn goes to the smallest start (oldest first on a tie), and V, the tier's virtual time, becomes
that start. A tenant flooding the queue therefore waits behind its own requests, not in front of
another tenant's: with equal weights the tenants alternate, with weights 2 and 1 the first gets two
turns for each of the second's. One tenant alone gets FIFO. A request put back at the head of its
tier (`front`: it was woken but found no room) goes before every other request of that tier.

Bounds: `max_waiting` requests in all (a newcomer beyond raises QueueFull), a tenant's own
`max_queued` of its quotas, and `max_wait_s`: a newcomer that would wait longer, by the rate slots
free up that its pusher gives, raises Overloaded (`scheduler.admission`). A request put back always
gets its place. State is kept only for
tenants with requests waiting: a tenant whose lane empties starts again at V (it gains at most one
turn's credit).

Pure: no I/O, no clocks, no asyncio; not thread-safe (the scheduler's event loop, or the simulator,
is its only user).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from scheduler.admission import Overloaded, admit
from scheduler.routing import PRIORITY_RANK
from symphony.priority import PRIORITIES, Priority
from symphony.tenancy import DEFAULT_TENANT
from symphony.tenant_quotas import TenantLimits, TenantQuotas

T = TypeVar("T")

__all__ = ["HeldQueue", "Overloaded", "QueueFull"]

_EVEN = TenantLimits()  # weight 1, no bound of its own


class QueueFull(Exception):
    """No room for a newcomer: the whole queue ("queue_full"), or the tenant's share of it
    ("tenant_queue_full"), is full."""

    def __init__(self, message: str, code: str = "queue_full") -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Tier(Generic[T]):
    front: deque[tuple[T, str]] = field(default_factory=deque)  # put back: before every lane, FIFO
    lanes: dict[str, deque[tuple[float, int, T]]] = field(default_factory=dict)  # (start, seq, item)
    finish: dict[str, float] = field(default_factory=dict)  # last queued request's finish, per lane
    vtime: float = 0.0
    size: int = 0


class HeldQueue(Generic[T]):
    def __init__(self, max_waiting: int, quotas: TenantQuotas | None = None, max_wait_s: float = math.inf) -> None:
        """`quotas`: each tenant's weight and `max_queued` (0: only `max_waiting` bounds it); None:
        every tenant weighs 1, with no bound of its own. `max_wait_s`: admission's bound (inf: none)."""
        if max_waiting <= 0 or not max_wait_s > 0:
            raise ValueError(f"max_waiting {max_waiting} and max_wait_s {max_wait_s} must be positive")
        self.max_waiting = max_waiting
        self.max_wait_s = max_wait_s
        self._quotas = quotas
        self._tiers: dict[Priority, _Tier[T]] = {p: _Tier() for p in PRIORITIES}
        self._per_tenant: Counter[str] = Counter()
        self._seq = itertools.count()

    def __len__(self) -> int:
        return sum(t.size for t in self._tiers.values())

    def waiting(self, priority: Priority) -> int:
        return self._tiers[priority].size

    def waiting_of(self, tenant: str) -> int:
        """The tenant's requests waiting, in every tier."""
        return self._per_tenant[tenant]

    def ahead_of(self, priority: Priority) -> bool:
        """Whether a request of `priority` arriving now has others to wait behind (same or higher
        tier): it must not take a node that frees up before them."""
        return any(self._tiers[p].size for p in PRIORITIES[PRIORITY_RANK[priority] :])

    def ahead(self, priority: Priority, tenant: str = DEFAULT_TENANT) -> int:
        """How many waiting requests a newcomer of `priority` from `tenant`, pushed now, would leave
        after: every request of a higher tier, its tier's put-back requests, and its tier's requests
        tagged to start no later than it (all of the tenant's own). Taken in tag order, a lane's
        head always being its smallest tag, so this is exact for the queue as it stands; requests
        that arrive later may still go ahead of it (a higher tier, a tenant with less waiting).
        O(tenants waiting x log(lane length))."""
        count = sum(self._tiers[p].size for p in PRIORITIES[PRIORITY_RANK[priority] + 1 :])
        tier = self._tiers[priority]
        start = max(tier.vtime, tier.finish.get(tenant, tier.vtime))
        count += len(tier.front)
        for lane in tier.lanes.values():
            count += bisect.bisect_right(lane, start, key=lambda entry: entry[0])
        return count

    def push(
        self, item: T, priority: Priority, tenant: str = DEFAULT_TENANT, *, front: bool = False, slots_per_s: float = 0
    ) -> None:
        """Queue `item`; a newcomer (not `front`) may raise QueueFull, or Overloaded when it would
        wait past `max_wait_s` with slots freeing at `slots_per_s` (0: not known, admitted)."""
        tier = self._tiers[priority]
        if front:
            tier.front.append((item, tenant))
        else:
            if len(self) >= self.max_waiting:
                raise QueueFull(f"{self.max_waiting} requests are waiting for a node already")
            limits = self._quotas.limits(tenant) if self._quotas is not None else _EVEN
            if limits.max_queued and self._per_tenant[tenant] >= limits.max_queued:
                raise QueueFull(
                    f"tenant {tenant!r} has {limits.max_queued} requests waiting for a node already (its limit)",
                    "tenant_queue_full",
                )
            if slots_per_s > 0 and self.max_wait_s < math.inf:
                verdict = admit(self.ahead(priority, tenant), slots_per_s, self.max_wait_s)
                if not verdict.admitted:
                    raise Overloaded(verdict.wait_s or 0.0, verdict.retry_after_s)
            start = max(tier.vtime, tier.finish.get(tenant, tier.vtime))
            tier.finish[tenant] = start + 1.0 / limits.weight
            tier.lanes.setdefault(tenant, deque()).append((start, next(self._seq), item))
        tier.size += 1
        self._per_tenant[tenant] += 1

    def pop(self) -> T | None:
        """The next to try: the highest tier's put-back requests first, then its fairest lane's
        oldest; None when empty."""
        for priority in reversed(PRIORITIES):
            tier = self._tiers[priority]
            if tier.front:
                item, tenant = tier.front.popleft()
                self._taken(tier, tenant)
                return item
            if tier.lanes:
                tenant = min(tier.lanes, key=lambda t: tier.lanes[t][0][:2])
                lane = tier.lanes[tenant]
                start, _, item = lane.popleft()
                tier.vtime = start
                if not lane:
                    self._drop_lane(tier, tenant)
                self._taken(tier, tenant)
                return item
        return None

    def take(self, count: int) -> list[T]:
        """The next `count` to try (fewer if fewer wait), in order."""
        taken: list[T] = []
        while len(taken) < count and (item := self.pop()) is not None:
            taken.append(item)
        return taken

    def remove(self, item: T, priority: Priority, tenant: str = DEFAULT_TENANT) -> None:
        """Drop `item` (it gave up) if it still waits. Its lane's later requests keep their tags; a
        tenant's newest request giving up costs it no turn."""
        tier = self._tiers[priority]
        for index, (held, owner) in enumerate(tier.front):
            if held is item and owner == tenant:
                del tier.front[index]
                self._taken(tier, tenant)
                return
        lane = tier.lanes.get(tenant)
        if lane is None:
            return
        for index, (start, _, held) in enumerate(lane):
            if held is item:
                del lane[index]
                if not lane:
                    self._drop_lane(tier, tenant)
                elif index == len(lane):  # its newest: the next one starts where this one did
                    tier.finish[tenant] = start
                self._taken(tier, tenant)
                return

    def _drop_lane(self, tier: _Tier[T], tenant: str) -> None:
        del tier.lanes[tenant]
        del tier.finish[tenant]
        if not tier.lanes:
            tier.vtime = 0.0  # nothing tagged waits: start over (tags stay small)

    def _taken(self, tier: _Tier[T], tenant: str) -> None:
        tier.size -= 1
        self._per_tenant[tenant] -= 1
        if not self._per_tenant[tenant]:
            del self._per_tenant[tenant]
