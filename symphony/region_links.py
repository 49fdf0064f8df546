"""The WAN of a multi-region cluster on one host: every cross-region connection goes through a
`WanLink` listener, and the listeners of one region pair share that pair's `LinkPipe` (its
bandwidth in each direction, its draws, its faults).

`RegionLinks` runs them all in one process (`symphony links`, which `symphony up --regions`
starts), with a small control API on `regions.link_port_base`:
- `GET /links`: each pair's figures, fault and counters (bytes per lane: "a>b" is what went
  from region a to region b; `kv_bytes`: what went to and from nodes, pulls of KV), and whose
  those bytes were (`tenant_bytes` per lane, `tenant_kv_bytes`, read from the traffic itself by
  `symphony.link_tenants`: the evidence that a residency rule held);
- `POST /links/{a}~{b}/fault` with `{"fault": "none|blackhole|partition", "extra_latency_ms": x}`:
  break or heal a pair's link (the reliability tests' network faults).

`region_address` says where a component of one region reaches a component of another: directly
within a region, through the pair's listener across regions.
"""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

from aiohttp import web

from symphony.api_errors import error_body
from symphony.config import SymphonyConfig
from symphony.link_sniff import Sniff
from symphony.link_tenants import http_tenant_of
from symphony.regions import PlannedLink, RegionTopology, node_index
from symphony.tenancy import TenantKeys, internal_token, observer_refusal
from symphony.wan_link import LinkFault, LinkPipe, WanLink

# A pair's control-API name: its two regions, sorted, joined by "~".
PAIR_SEPARATOR = "~"
MAX_CONTROL_BODY_BYTES = 4096


def pair_name(a: str, b: str) -> str:
    return PAIR_SEPARATOR.join(sorted((a, b)))


def lane_name(source: str, dest: str) -> str:
    return f"{source}>{dest}"


def scheduler_port(config: SymphonyConfig, topology: RegionTopology, region: str) -> int:
    return config.regions.scheduler_port_base + topology.region(region).index


def region_address(config: SymphonyConfig, topology: RegionTopology, source: str, dest: str) -> tuple[str, int]:
    """Where a component in region `source` reaches region `dest`'s scheduler: its own port within
    a region, the `source`>`dest` listener's across regions."""
    if source == dest:
        return config.scheduler.host, scheduler_port(config, topology, dest)
    return config.scheduler.host, _listener(config, topology, source, dest, "scheduler")


def remote_node_addresses(config: SymphonyConfig, topology: RegionTopology, source: str) -> dict[str, str]:
    """Where region `source` reaches every node of the other regions ("host:port" by node name):
    through its link listeners, the only way KV of one region reaches another."""
    host = config.scheduler.host
    return {
        planned.target: f"{host}:{planned.port}"
        for planned in topology.link_plan(config.regions.link_port_base)
        if planned.source == source and planned.target != "scheduler"
    }


def _listener(config: SymphonyConfig, topology: RegionTopology, source: str, dest: str, target: str) -> int:
    for planned in topology.link_plan(config.regions.link_port_base):
        if (planned.source, planned.dest, planned.target) == (source, dest, target):
            return planned.port
    raise KeyError((source, dest, target))


def _target_port(config: SymphonyConfig, topology: RegionTopology, planned: PlannedLink) -> int:
    if planned.target == "scheduler":
        return scheduler_port(config, topology, planned.dest)
    index = node_index(planned.target)
    assert index is not None, planned.target
    return config.node.grpc_port_base + index


class RegionLinks:
    """Every listener of the topology's link plan, and the control API. One event loop."""

    def __init__(self, config: SymphonyConfig, topology: RegionTopology, *, seed: int = 0) -> None:
        self.config = config
        self.topology = topology
        self.pipes: dict[str, LinkPipe] = {}
        self.listeners: list[tuple[PlannedLink, WanLink]] = []
        for i, (pair, shape) in enumerate(sorted(topology.links.items(), key=lambda item: sorted(item[0]))):
            self.pipes[pair_name(*pair)] = LinkPipe(shape, seed + i)
        host = config.scheduler.host
        secret = config.cluster.secret.encode()
        own = [internal_token(secret) if secret else "", config.scheduler.admin_token]
        tenant_of = http_tenant_of(TenantKeys(config.scheduler.api_keys), own)
        for planned in topology.link_plan(config.regions.link_port_base):
            pipe = self.pipes[pair_name(planned.source, planned.dest)]
            lanes = (lane_name(planned.source, planned.dest), lane_name(planned.dest, planned.source))
            link = WanLink(
                pipe.shape,
                config.node.host if planned.target != "scheduler" else host,
                _target_port(config, topology, planned),
                host=host,
                port=planned.port,
                pipe=pipe,
                lanes=lanes,
                attributor=lambda: Sniff(tenant_of),
            )
            self.listeners.append((planned, link))
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        for _, link in self.listeners:
            await link.start()
        app = web.Application(client_max_size=MAX_CONTROL_BODY_BYTES)
        app.router.add_get("/links", self._describe)
        app.router.add_post("/links/{pair}/fault", self._set_fault)
        self._runner = web.AppRunner(app, access_log=None, keepalive_timeout=self.config.scheduler.keep_alive_s)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.config.scheduler.host, self.config.regions.link_port_base).start()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        await asyncio.gather(*(link.close() for _, link in self.listeners))

    def describe(self) -> list[dict[str, Any]]:
        """Per pair: its figures, fault, and counters summed over its listeners."""
        out = []
        for name, pipe in self.pipes.items():
            lanes = dict.fromkeys(pipe.free_at, 0)
            tenant_lanes: dict[str, dict[str, int]] = {lane: {} for lane in lanes}
            tenant_kv: dict[str, int] = {}
            connections = refused = open_now = segments = lost = kv_bytes = sniff_errors = 0
            for planned, link in self.listeners:
                if link.pipe is not pipe:
                    continue
                if planned.target != "scheduler":  # to a node: pulls of KV
                    kv_bytes += sum(link.counters.bytes.values())
                for direction, lane in link.lanes.items():
                    lanes[lane] += link.counters.bytes[direction]
                    segments += link.counters.segments[direction]
                    lost += link.counters.lost[direction]
                    counts = link.counters.tenants.snapshot(direction)
                    _add(tenant_lanes[lane], counts)
                    if planned.target != "scheduler":
                        _add(tenant_kv, counts)
                sniff_errors += link.counters.tenants.sniff_errors
                connections += link.counters.connections
                refused += link.counters.refused
                open_now += link.open_connections
            shape = pipe.shape
            out.append(
                {
                    "pair": name,
                    "rtt_ms": shape.rtt_ms,
                    "bandwidth_mbps": shape.bandwidth_mbps,
                    "jitter_ms": shape.jitter_ms,
                    "loss": shape.loss,
                    "fault": pipe.fault.value,
                    "extra_latency_ms": pipe.extra_latency_ms,
                    "bytes": lanes,
                    "kv_bytes": kv_bytes,  # of them, to and from nodes (KV pulled across regions)
                    # Whose (symphony.link_tenants): per lane, by label, summing to "bytes"; of
                    # kv_bytes, by label; and connections the readers gave up on.
                    "tenant_bytes": tenant_lanes,
                    "tenant_kv_bytes": tenant_kv,
                    "sniff_errors": sniff_errors,
                    "segments": segments,
                    "lost": lost,
                    "connections": connections,
                    "open": open_now,
                    "refused": refused,
                }
            )
        return out

    def _refusal(self, request: web.Request) -> web.Response | None:
        """Tenants' byte counts and fault injection: for the admin or internal token once keys are set."""
        s = self.config.scheduler
        refused = observer_refusal(
            s.api_keys, s.admin_token, self.config.cluster.secret.encode(), request.headers.get("Authorization")
        )
        return None if refused is None else _error(refused[0], refused[1])

    async def _describe(self, request: web.Request) -> web.Response:
        if (refused := self._refusal(request)) is not None:
            return refused
        return web.json_response({"links": self.describe()})

    async def _set_fault(self, request: web.Request) -> web.Response:
        if (refused := self._refusal(request)) is not None:
            return refused
        pipe = self.pipes.get(request.match_info["pair"])
        if pipe is None:
            known = ", ".join(self.pipes)
            return _error(404, f"no link {request.match_info['pair']!r} (known: {known})")
        try:
            body = json.loads(await request.read())
            fault = LinkFault(body["fault"])
            extra = float(body.get("extra_latency_ms", 0.0))
            pipe.set_fault(fault, extra)
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"a fault is at most {MAX_CONTROL_BODY_BYTES} bytes of JSON")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            choices = "|".join(f.value for f in LinkFault)
            return _error(400, f'expected {{"fault": "{choices}", "extra_latency_ms": >= 0}}: {exc}')
        return web.json_response({"pair": request.match_info["pair"], "fault": fault.value, "extra_latency_ms": extra})


def _add(into: dict[str, int], counts: dict[str, int]) -> None:
    for label, n in counts.items():
        into[label] = into.get(label, 0) + n


def _error(status: int, message: str) -> web.Response:
    return web.json_response(error_body(status, message), status=status)


async def run_region_links(config: SymphonyConfig, topology: RegionTopology) -> None:
    """`symphony links`: serve every link until SIGINT or SIGTERM; says on stdout when up."""
    links = RegionLinks(config, topology)
    await links.start()
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopped.set)
    print(f"links up: {len(links.listeners)} listeners on {len(links.pipes)} region pairs", flush=True)
    try:
        await stopped.wait()
    finally:
        await links.close()
