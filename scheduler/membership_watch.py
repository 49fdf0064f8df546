"""A scheduler's nodes from etcd's member list (symphony.membership), with cluster.etcd_endpoints:
every `scheduler.membership_poll_ms` it reads the members of its region (those registered with
region "" in a one-region cluster), joins those that registered and has leave those whose lease
ended (they stopped renewing, or stopped and revoked it).

Contracts:
- Nodes given in configuration (`scheduler.node_addresses`) are never removed: only members it
  joined itself.
- etcd unreachable or answering errors: nothing changes. The nodes followed keep being polled and
  routed to by their own status; the failure is logged when it starts and when it ends, and
  counted (`symphony_membership_read_failures_total`).
- One read at a time, on a worker thread (the etcd client is synchronous; each call has its
  deadline), so a slow etcd never blocks the event loop. Joins and leaves run on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable

from scheduler.metrics import SchedulerMetrics
from symphony.etcd_client import EtcdClient, EtcdError
from symphony.logs import get_logger
from symphony.membership import members

log = get_logger(__name__)


class MembershipWatch:
    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        region: str,
        interval_s: float,
        *,
        join: Callable[[str], Awaitable[bool]],
        leave: Callable[[str], Awaitable[None]],
        metrics: SchedulerMetrics,
        static: Iterable[str] = (),
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.region = region
        self.interval_s = interval_s
        self._join = join  # follow the node at an address; False if it could not be (already, or full)
        self._leave = leave  # stop following the node at an address
        self.metrics = metrics
        self.static = frozenset(static)
        self.joined: set[str] = set()  # addresses this watch joined and has not had leave
        self.failing = ""  # the last read's error while reads fail; "" once one succeeds
        self._task: asyncio.Task[None] | None = None

    async def step(self) -> None:
        """Read the member list once and apply it."""
        try:
            found = await asyncio.to_thread(members, self.client, self.prefix)
        except EtcdError as exc:
            self.metrics.membership_read_failures.inc()
            if not self.failing:
                log.warning("membership not read: nodes stay as they are", error=str(exc))
            self.failing = str(exc)
            return
        if self.failing:
            log.info("membership read again")
            self.failing = ""
        wanted = {m.address for m in found if m.region == self.region} - self.static
        for address in sorted(wanted - self.joined):
            if await self._join(address):
                self.joined.add(address)
                self.metrics.membership_changes.labels("join").inc()
        for address in sorted(self.joined - wanted):
            await self._leave(address)
            self.joined.discard(address)
            self.metrics.membership_changes.labels("leave").inc()

    async def _run(self) -> None:
        while True:
            try:
                await self.step()
            except Exception:  # a bug must not end membership for good
                log.exception("membership step failed")
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="membership")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        # A read in flight finishes on its thread within the client's deadline; its result is dropped.
        await asyncio.to_thread(self.client.close)
