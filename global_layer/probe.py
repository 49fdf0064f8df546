"""An entry's view of one region: its scheduler's `/summary`, read every probe interval through the
way the entry reaches that region (across regions: the WAN link, so a far region's view is older)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Mapping

import aiohttp

from global_layer.held import HeldSessions
from global_layer.views import RegionView
from symphony.logs import get_logger
from symphony.region_load import RegionLoad, SessionDelta

log = get_logger(__name__)

# A region with no summary for this long may have lost the KV its feed named (nodes restarted or
# replaced): its sessions stop being offered as a move's source, and the feed starts afresh when
# the region answers again. Long against a probe period, so a region that is only briefly
# unreachable (a stopped scheduler whose nodes still serve pulls) keeps it.
HELD_KEPT_DOWN_S = 60.0


class RegionProbe:
    """Up while a summary arrived within `down_after_s` and none of the entry's requests failed to
    reach the region since the last one. One probe in flight at a time, each bounded by
    `down_after_s`."""

    def __init__(
        self,
        name: str,
        base_url: str,
        session: aiohttp.ClientSession,
        *,
        interval_s: float,
        down_after_s: float,
        clock: Callable[[], float] = time.monotonic,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """`headers`: sent with each /summary request (the cluster's internal token, which the
        scheduler asks for once keys are set)."""
        self.name = name
        self.headers = dict(headers or {})
        self.base_url = base_url
        self.session = session
        self.interval_s = interval_s
        self.down_after_s = down_after_s
        self.clock = clock
        self.load: RegionLoad | None = None
        self.held = HeldSessions()  # the sessions the region holds KV of, from its feed
        self.last_ok_at = -math.inf  # clock() when the last summary that arrived was asked for
        self.failed_at = -math.inf  # clock() when a request last failed to reach the region
        self.probes = 0
        self.probe_errors = 0
        self.last_error = ""
        self._task: asyncio.Task[None] | None = None

    def view(self) -> RegionView:
        """Up: a summary arrived lately, after the last failure, and names a ready node (a region
        whose engines are all down would only answer 503)."""
        now = self.clock()
        fresh = now - self.last_ok_at <= self.down_after_s and self.last_ok_at > self.failed_at
        return RegionView(self.name, fresh and self.load is not None and self.load.ready_nodes > 0, self.load)

    def silent_for(self) -> float:
        """Seconds since the last summary that arrived was asked for (inf before the first): the
        region's silence alone, whatever requests to it did meanwhile."""
        return self.clock() - self.last_ok_at

    def mark_unreachable(self, why: str) -> None:
        """A request could not reach the region: it takes no more until a probe gets through."""
        self.failed_at = self.clock()
        self.last_error = why

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"probe-{self.name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def probe_once(self) -> None:
        self.probes += 1
        # A summary counts from when it was asked for: one asked before a request failed to reach
        # the region says nothing about the region since.
        asked_at = self.clock()
        try:
            timeout = aiohttp.ClientTimeout(total=self.down_after_s)
            query = {"since": str(self.held.seq), "epoch": self.held.epoch}
            async with self.session.get(
                self.base_url + "/summary", params=query, timeout=timeout, headers=self.headers
            ) as response:
                if response.status != 200:
                    raise ValueError(f"/summary answered {response.status}")
                body = await response.json()
                if not isinstance(body, dict):
                    raise ValueError("/summary is not a JSON object")
                load = RegionLoad.from_json(body)
                delta = SessionDelta.from_json(body["sessions"]) if "sessions" in body else None
        except (aiohttp.ClientError, TimeoutError, ValueError, TypeError) as exc:
            self.probe_errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.debug("region probe failed", region=self.name, error=self.last_error)
            if len(self.held) and self.clock() - self.last_ok_at > HELD_KEPT_DOWN_S:
                log.info("forgetting a silent region's sessions", region=self.name, sessions=len(self.held))
                self.held = HeldSessions(self.held.max_sessions)
            return
        self.load = load
        if delta is not None:
            self.held.apply(delta)
        self.last_ok_at = asked_at

    async def _run(self) -> None:
        while True:
            started = self.clock()
            try:
                await self.probe_once()
            except Exception as exc:  # a probe must never stop for good: the region would stay down
                self.probe_errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("region probe failed unexpectedly", region=self.name, error=self.last_error)
            await asyncio.sleep(max(0.0, self.interval_s - (self.clock() - started)))
