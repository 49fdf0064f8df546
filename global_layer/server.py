"""`symphony global`: every region's entry to the global layer in one process, entry r on
`scheduler.port + r` (symphony.regions), until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import signal

from aiohttp import web

from global_layer.entry import Entry
from global_layer.policies import make_region_policy
from global_layer.residency_admin import SharedTopology
from symphony.config import SymphonyConfig
from symphony.logs import get_logger
from symphony.regions import RegionTopology

log = get_logger(__name__)


def make_entries(config: SymphonyConfig, topology: RegionTopology) -> list[Entry]:
    # Each entry its own policy: what a stateful one learns is what its entry sent (SkyWalker's
    # per-balancer tree).
    shared = SharedTopology(topology)  # one set of residency rules for all of them
    return [Entry(config, topology, name, make_region_policy(config.regions.policy), shared) for name in topology.names]


async def serve_entries(config: SymphonyConfig, topology: RegionTopology) -> None:
    runners: list[web.AppRunner] = []
    try:
        for region in make_entries(config, topology):
            # handler_cancellation: a client that leaves before its answer began cancels the relay,
            # and with it the request upstream.
            runner = web.AppRunner(region.app(), access_log=None, handler_cancellation=True)
            await runner.setup()
            runners.append(runner)
            port = config.scheduler.port + topology.region(region.region).index
            await web.TCPSite(runner, config.scheduler.host, port).start()
        log.info("global layer up", regions=",".join(topology.names), policy=config.regions.policy)
        stopped = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stopped.set)
        await stopped.wait()
    finally:
        for runner in runners:
            await runner.cleanup()
