"""An entry's view of one region: its scheduler's `/summary`, read every probe interval through the
way the entry reaches that region (across regions: the WAN link, so a far region's view is older)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable

import aiohttp

from global_layer.policies import RegionView
from symphony.logs import get_logger
from symphony.region_load import RegionLoad

log = get_logger(__name__)


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
    ) -> None:
        self.name = name
        self.base_url = base_url
        self.session = session
        self.interval_s = interval_s
        self.down_after_s = down_after_s
        self.clock = clock
        self.load: RegionLoad | None = None
        self.last_ok_at = -math.inf  # clock() when the last summary arrived
        self.failed_at = -math.inf  # clock() when a request last failed to reach the region
        self.probes = 0
        self.probe_errors = 0
        self.last_error = ""
        self._task: asyncio.Task[None] | None = None

    def view(self) -> RegionView:
        now = self.clock()
        up = now - self.last_ok_at <= self.down_after_s and self.last_ok_at > self.failed_at
        return RegionView(self.name, up, self.load)

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
        try:
            timeout = aiohttp.ClientTimeout(total=self.down_after_s)
            async with self.session.get(self.base_url + "/summary", timeout=timeout) as response:
                if response.status != 200:
                    raise ValueError(f"/summary answered {response.status}")
                load = RegionLoad.from_json(await response.json())
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self.probe_errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.debug("region probe failed", region=self.name, error=self.last_error)
            return
        self.load = load
        self.last_ok_at = self.clock()

    async def _run(self) -> None:
        while True:
            started = self.clock()
            await self.probe_once()
            await asyncio.sleep(max(0.0, self.interval_s - (self.clock() - started)))
