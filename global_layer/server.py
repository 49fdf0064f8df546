"""`symphony global`: every region's entry to the global layer in one process, entry r on
`scheduler.port + r` (symphony.regions), until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import signal

from aiohttp import web

from global_layer.entry import Entry
from global_layer.policies import make_region_policy
from global_layer.read_deadline import ReadDeadlines
from global_layer.residency_admin import SharedTopology, global_state_path
from symphony.config import SymphonyConfig
from symphony.control_state import ControlFile
from symphony.logs import get_logger
from symphony.regions import RegionTopology
from symphony.residency_rules import known_tenants

log = get_logger(__name__)


def make_entries(config: SymphonyConfig, topology: RegionTopology) -> list[Entry]:
    # Each entry its own policy: what a stateful one learns is what its entry sent (SkyWalker's
    # per-balancer tree).
    # One set of residency rules for all of them, the admin API's kept across restarts.
    shared = SharedTopology(topology, ControlFile(global_state_path(config)))
    shared.restore(known_tenants(config.scheduler.api_keys))
    return [Entry(config, topology, name, make_region_policy(config.regions.policy), shared) for name in topology.names]


class EntryServer:
    """One entry listening: its aiohttp runner behind a server whose connections have a deadline on
    sending each request (`scheduler.request_read_timeout_s`, global_layer.read_deadline)."""

    def __init__(self, runner: web.AppRunner, server: asyncio.Server) -> None:
        self.runner, self.server = runner, server

    async def close(self) -> None:
        self.server.close()  # no new connections; the runner's cleanup ends the open ones
        await self.runner.cleanup()


async def start_entry(entry: Entry, host: str, port: int) -> EntryServer:
    """Serve `entry` on host:port, as `symphony global` does."""
    deadlines = ReadDeadlines(entry.config.scheduler.request_read_timeout_s, entry.count_read_timeout)
    app = entry.app()
    app.middlewares.append(deadlines.middleware)
    # handler_cancellation: a client that leaves before its answer began cancels the relay, and with
    # it the request upstream.
    # keepalive_timeout: aiohttp's own default (3630 s) would hold an idle client's connection for an
    # hour; the schedulers' keep_alive_s applies here too.
    runner = web.AppRunner(
        app, access_log=None, handler_cancellation=True, keepalive_timeout=entry.config.scheduler.keep_alive_s
    )
    await runner.setup()
    assert runner.server is not None
    try:
        server = await asyncio.get_running_loop().create_server(
            deadlines.protocol_factory(runner.server), host, port, reuse_address=True
        )
    except BaseException:  # the port taken: the entry's probes and sessions, started, go too
        await runner.cleanup()
        raise
    return EntryServer(runner, server)


async def serve_entries(config: SymphonyConfig, topology: RegionTopology) -> None:
    servers: list[EntryServer] = []
    try:
        for region in make_entries(config, topology):
            port = config.scheduler.port + topology.region(region.region).index
            servers.append(await start_entry(region, config.scheduler.host, port))
        log.info("global layer up", regions=",".join(topology.names), policy=config.regions.policy)
        stopped = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stopped.set)
        await stopped.wait()
    finally:
        for server in servers:
            await server.close()
