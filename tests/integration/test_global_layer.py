"""A three-region cluster on loopback: the global layer's entries (global_layer.entry), the WAN links
between regions (symphony.region_links, real TCP relays), and a real scheduler per region (uvicorn)
in front of fake node managers and a fake engine. Checks where requests go (nearest, residency,
failover), that cross-region traffic takes its link's time, and the links' control API."""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import uvicorn

from eval.ports import free_port_run
from global_layer.entry import ABANDON_AFTER_DOWN, CLIENT_REGION_HEADER, REGION_HEADER, Entry
from global_layer.server import EntryServer, make_entries, start_entry
from scheduler.app import create_app
from symphony.cli import main
from symphony.config import CLIENT_POOL_KEEPALIVE_S, SymphonyConfig, dump_toml, load_config
from symphony.region_links import RegionLinks, remote_node_addresses
from symphony.region_load import RegionLoad, session_digest
from symphony.regions import RegionTopology
from symphony.tenancy import internal_headers
from tests.helpers import async_wait_until, closed_after
from tests.integration.fakes import FakeEngine, FakeNodeManager, ready_status

REGIONS = ["us-east:1", "eu-west:1", "ap-south:1"]
# Shorter than the public-cloud matrix, same order: the tests wait on these.
LINKS = ["us-east~eu-west:40:1000", "us-east~ap-south:100:1000", "eu-west~ap-south:60:1000"]
KEYS = ["acme:key-acme", "eu:key-eu"]
ADMIN = "admin-secret"
SECRET = "the regions' cluster secret"  # every process's: the entries read /summary with its token
OPS = internal_headers(SECRET)  # what reads /regions, /summary and /metrics (keys are set)
LOAD0 = RegionLoad(0, 0, 0, 0, 0, 0, 0.0)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@dataclass
class Regions:
    config: SymphonyConfig
    topology: RegionTopology
    links: RegionLinks
    entries: dict[str, Entry]
    schedulers: dict[str, tuple[uvicorn.Server, asyncio.Task[None]]] = field(default_factory=dict)
    nodes: dict[str, FakeNodeManager] = field(default_factory=dict)
    engine: FakeEngine = field(default_factory=FakeEngine)  # every region's nodes' engine

    def entry_url(self, region: str) -> str:
        return f"http://127.0.0.1:{self.config.scheduler.port + self.topology.region(region).index}"

    def fault(self, pair: str) -> str:
        """The links' control URL that sets `pair`'s fault."""
        return f"{self.links_url}/links/{pair}/fault"

    @property
    def links_url(self) -> str:
        return f"http://127.0.0.1:{self.config.regions.link_port_base}"

    async def stop_scheduler(self, region: str) -> None:
        server, task = self.schedulers.pop(region)
        server.should_exit = True
        await task

    async def all_up(self, entry: str, up: bool = True, regions: list[str] | None = None) -> None:
        names = regions or list(self.topology.names)

        def seen() -> bool:
            return all(self.entries[entry].probes[name].view().up is up for name in names)

        await async_wait_until(seen, 10, f"{entry} to see {names} {'up' if up else 'down'}")


def _ports() -> tuple[int, int, int]:
    """Three runs of free ports that do not overlap: entries, schedulers, links."""
    while True:
        entries, schedulers, links = free_port_run(3), free_port_run(3), free_port_run(13)
        used = [*range(entries, entries + 3), *range(schedulers, schedulers + 3), *range(links, links + 13)]
        if len(set(used)) == len(used):
            return entries, schedulers, links


@pytest.fixture
async def regions(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Regions]:
    """The three regions, the global layer on `regions.policy` "nearest" unless the test is marked
    `@pytest.mark.region_policy(name)`."""
    marker = request.node.get_closest_marker("region_policy")
    policy = marker.args[0] if marker else "nearest"
    entries_port, schedulers_port, links_port = _ports()
    regions_keys = {
        "layout": REGIONS,
        "links": LINKS,
        "residency": ["eu=eu-west"],
        "scheduler_port_base": schedulers_port,
        "link_port_base": links_port,
    }
    config = load_config(
        env={"SYMPHONY_HOME": str(tmp_path)},
        overrides={
            "scheduler": {"port": entries_port, "api_keys": KEYS, "connect_timeout_s": 1.0, "admin_token": ADMIN},
            "cluster": {"nodes": 3, "secret": SECRET, "tls": False},  # the fake nodes speak plaintext gRPC
            "kv": {"data_plane": "grpc"},
            # Down after 1.5 s without a summary: long enough that a loaded host (CI, a GIL-bound
            # thread in this process) does not read a live region as down between a test's steps.
            "regions": {**regions_keys, "probe_interval_ms": 20, "region_down_after_ms": 1500, "policy": policy},
        },
    )
    topology = config.topology()
    assert topology is not None
    engine = FakeEngine()
    await engine.start()
    nodes = []
    servers: list[EntryServer] = []
    links = RegionLinks(config, topology)
    cluster = Regions(config, topology, links, {}, engine=engine)
    try:
        for region in topology.regions:
            node = FakeNodeManager(ready_status(f"node-{region.index}", engine.url))
            await node.start()
            nodes.append(node)
            cluster.nodes[region.name] = node
            scheduler_config = load_config(
                env={"SYMPHONY_HOME": str(tmp_path)},
                overrides={
                    "scheduler": {
                        "port": entries_port,  # it listens on its region's port, as below
                        "node_addresses": [node.address],
                        "poll_interval_ms": 20,
                        "node_down_after_ms": 1500,
                        "api_keys": KEYS,
                        "admin_token": ADMIN,
                        "region": region.name,
                    },
                    "cluster": {"nodes": 3, "secret": SECRET, "tls": False},  # the fake nodes speak plaintext gRPC
                    "kv": {"data_plane": "grpc"},
                    "regions": regions_keys,
                },
            )
            app = create_app(scheduler_config)
            listen = scheduler_config.scheduler_listen_port
            assert listen == schedulers_port + region.index
            server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=listen, log_level="warning"))
            cluster.schedulers[region.name] = (server, asyncio.create_task(server.serve()))
        await links.start()
        for entry in make_entries(config, topology):
            cluster.entries[entry.region] = entry
            port = config.scheduler.port + topology.region(entry.region).index
            servers.append(await start_entry(entry, "127.0.0.1", port))  # as `symphony global` serves it
        for name in topology.names:
            await cluster.all_up(name)
            # Every region's node is ready in its scheduler.
        yield cluster
    finally:
        for server in servers:
            await server.close()
        await links.close()
        for name in list(cluster.schedulers):
            await cluster.stop_scheduler(name)
        for node in nodes:
            await node.stop()
        await engine.stop()


def _headers(key: str = "key-acme", **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **extra}


async def _chat(url: str, headers: dict[str, str], body: dict[str, object] | None = None) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.post(url + "/v1/chat/completions", json=body or CHAT, headers=headers)


async def test_nearest_serves_each_client_in_its_own_region(regions: Regions) -> None:
    for name in regions.topology.names:
        answer = await _chat(regions.entry_url(name), _headers())
        assert answer.status_code == 200, answer.text
        assert answer.headers[REGION_HEADER] == name
        assert answer.json()["choices"][0]["message"]["content"]
    assert all(regions.entries[name].served[name] == 1 for name in regions.topology.names)
    # Each entry reads every region's load from its scheduler's /summary.
    load = regions.entries["us-east"].probes["ap-south"].view().load
    assert load is not None and load.ready_nodes == load.idle_nodes == 1 and load.queued == 0


async def test_a_client_of_a_far_region_waits_out_its_link(regions: Regions) -> None:
    """The us-east entry sends an ap-south client's request to ap-south, over the us-east~ap-south
    link: the answer takes at least that link's round trip, and the bytes show on its lanes."""
    lanes_before = _lanes(regions.links.describe(), "ap-south~us-east")
    started = time.perf_counter()
    answer = await _chat(regions.entry_url("us-east"), _headers(**{CLIENT_REGION_HEADER: "ap-south"}))
    elapsed_ms = (time.perf_counter() - started) * 1000
    assert answer.status_code == 200 and answer.headers[REGION_HEADER] == "ap-south"
    assert elapsed_ms >= 100 * 0.9, f"{elapsed_ms:.0f} ms through a 100 ms link"
    lanes_after = _lanes(regions.links.describe(), "ap-south~us-east")
    request_bytes = lanes_after["us-east>ap-south"] - lanes_before["us-east>ap-south"]
    assert request_bytes >= len(b'"messages"'), "the request did not cross the us-east>ap-south lane"


def _lanes(described: list[dict[str, object]], pair: str) -> dict[str, int]:
    for link in described:
        if link["pair"] == pair:
            return dict(link["bytes"])  # type: ignore[call-overload]
    raise AssertionError(f"no link {pair}")


async def test_a_stream_is_relayed_chunk_by_chunk(regions: Regions) -> None:
    async with (
        httpx.AsyncClient(timeout=10) as client,
        client.stream(
            "POST",
            regions.entry_url("eu-west") + "/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers=_headers(),
        ) as answer,
    ):
        assert answer.status_code == 200
        assert answer.headers[REGION_HEADER] == "eu-west"
        body = b"".join([chunk async for chunk in answer.aiter_bytes()])
    assert body.rstrip().endswith(b"data: [DONE]")
    assert body.count(b"data: ") >= 2


async def test_residency_keeps_a_tenant_in_its_regions_and_refuses_when_they_are_down(regions: Regions) -> None:
    answer = await _chat(regions.entry_url("us-east"), _headers("key-eu"))
    assert answer.status_code == 200 and answer.headers[REGION_HEADER] == "eu-west"
    await regions.stop_scheduler("eu-west")
    await regions.all_up("us-east", up=False, regions=["eu-west"])
    refused = await _chat(regions.entry_url("us-east"), _headers("key-eu"))
    assert refused.status_code == 503
    error = refused.json()["error"]
    assert error["code"] == "no_allowed_region"
    assert "allowed: eu-west" in error["message"]
    assert regions.entries["us-east"].refusals["no_allowed_region"] == 1
    # Another tenant, at eu-west's own entry, goes to the nearest region still up.
    other = await _chat(regions.entry_url("eu-west"), _headers())
    assert other.status_code == 200 and other.headers[REGION_HEADER] == "us-east"


async def test_a_dead_regions_traffic_fails_over_with_no_client_error(regions: Regions) -> None:
    await regions.stop_scheduler("us-east")
    # At once, before any probe noticed: the refused connection moves the request on.
    answer = await _chat(regions.entry_url("us-east"), _headers())
    assert answer.status_code == 200
    assert answer.headers[REGION_HEADER] == "eu-west"  # next by round trip from us-east
    entry = regions.entries["us-east"]
    assert entry.failovers["us-east"] == 1
    assert entry.probes["us-east"].view().up is False
    # Later requests skip it without trying.
    again = await _chat(regions.entry_url("us-east"), _headers())
    assert again.headers[REGION_HEADER] == "eu-west" and entry.failovers["us-east"] == 1
    async with httpx.AsyncClient(timeout=5) as client:
        described = (await client.get(regions.entry_url("us-east") + "/regions", headers=OPS)).json()
    assert described["regions"]["us-east"]["up"] is False
    assert described["regions"]["eu-west"]["served"] == 2


async def test_a_partitioned_link_fails_over_to_the_next_region(regions: Regions) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        cut = await client.post(regions.fault("ap-south~us-east"), json={"fault": "partition"}, headers=OPS)
        assert cut.status_code == 200 and cut.json()["fault"] == "partition"
        answer = await _chat(regions.entry_url("us-east"), _headers(**{CLIENT_REGION_HEADER: "ap-south"}))
        assert answer.status_code == 200
        assert answer.headers[REGION_HEADER] == "eu-west"  # ap-south unreachable from us-east
        described = (await client.get(regions.links_url + "/links", headers=OPS)).json()["links"]
        assert {link["pair"]: link["fault"] for link in described}["ap-south~us-east"] == "partition"
        healed = await client.post(regions.fault("ap-south~us-east"), json={"fault": "none"}, headers=OPS)
        assert healed.status_code == 200
    await regions.all_up("us-east", regions=["ap-south"])
    answer = await _chat(regions.entry_url("us-east"), _headers(**{CLIENT_REGION_HEADER: "ap-south"}))
    assert answer.headers[REGION_HEADER] == "ap-south"


async def test_a_request_waiting_on_a_region_whose_link_goes_dark_fails_over(regions: Regions) -> None:
    """ap-south is running the request ("slow": no answer yet) when its link to us-east is
    blackholed. Once the entry's probe sees ap-south down, the request is abandoned there and
    sent to the next region: the client gets its answer, never an error."""
    slow = {**CHAT, "messages": [{"role": "user", "content": "slow"}]}
    ask = asyncio.create_task(_chat(regions.entry_url("us-east"), _headers(**{CLIENT_REGION_HEADER: "ap-south"}), slow))
    await async_wait_until(lambda: len(regions.engine.requests) == 1, 5, "ap-south's engine to get the request")
    async with httpx.AsyncClient(timeout=5) as client:
        dark = await client.post(regions.fault("ap-south~us-east"), json={"fault": "blackhole"}, headers=OPS)
        assert dark.status_code == 200
        await async_wait_until(lambda: len(regions.engine.requests) == 2, 8, "the request to be sent on")
        regions.engine.slow_done.set()
        answer = await ask
        assert answer.status_code == 200, answer.text
        assert answer.headers[REGION_HEADER] == "eu-west"
        assert regions.entries["us-east"].failovers["ap-south"] == 1
        assert regions.entries["us-east"].abandoned["ap-south"] == 1
        healed = await client.post(regions.fault("ap-south~us-east"), json={"fault": "none"}, headers=OPS)
        assert healed.status_code == 200
    await regions.all_up("us-east", regions=["ap-south"])


async def test_a_request_on_a_slow_region_that_still_answers_probes_is_kept(regions: Regions) -> None:
    slow = {**CHAT, "messages": [{"role": "user", "content": "slow"}]}
    started = time.monotonic()
    ask = asyncio.create_task(_chat(regions.entry_url("us-east"), _headers(**{CLIENT_REGION_HEADER: "ap-south"}), slow))
    probe = regions.entries["us-east"].probes["ap-south"]
    past = started + ABANDON_AFTER_DOWN * probe.down_after_s + probe.interval_s
    # ap-south answers its probes well past the time a silent region's request is abandoned.
    await async_wait_until(lambda: probe.last_ok_at > past, 10, "ap-south's summaries past the abandon time")
    assert len(regions.engine.requests) == 1
    regions.engine.slow_done.set()
    answer = await ask
    assert answer.status_code == 200 and answer.headers[REGION_HEADER] == "ap-south"
    assert regions.entries["us-east"].abandoned["ap-south"] == 0 and len(regions.engine.requests) == 1


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        ({CLIENT_REGION_HEADER: "mars", "Authorization": "Bearer key-acme"}, 400, "unknown_region"),
        ({"Authorization": "Bearer nope"}, 401, "invalid_api_key"),
        ({}, 401, "invalid_api_key"),
    ],
)
async def test_bad_requests_get_openai_style_errors(
    regions: Regions, headers: dict[str, str], status: int, code: str
) -> None:
    answer = await _chat(regions.entry_url("us-east"), headers)
    assert answer.status_code == status
    assert answer.json()["error"]["code"] == code


async def test_an_oversized_body_is_refused_and_bad_json_reaches_the_schedulers_validation(regions: Regions) -> None:
    limit = regions.config.scheduler.max_body_bytes
    async with httpx.AsyncClient(timeout=10) as client:
        big = await client.post(
            regions.entry_url("us-east") + "/v1/chat/completions", content=b"x" * (limit + 1), headers=_headers()
        )
        assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"
        broken = await client.post(
            regions.entry_url("us-east") + "/v1/chat/completions", content=b"{not json", headers=_headers()
        )
        assert broken.status_code == 400 and broken.headers[REGION_HEADER] == "us-east"
        assert broken.json()["error"]["type"] == "invalid_request_error"


async def test_the_links_control_api_refuses_bad_faults(regions: Regions) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        unknown = await client.post(regions.fault("mars~us-east"), json={"fault": "partition"}, headers=OPS)
        assert unknown.status_code == 404 and "known:" in unknown.json()["error"]["message"]
        for body in ({"fault": "melt"}, {"fault": "none", "extra_latency_ms": -1}, {}):
            bad = await client.post(regions.fault("ap-south~us-east"), json=body, headers=OPS)
            assert bad.status_code == 400, body
        listed = (await client.get(regions.links_url + "/links", headers=OPS)).json()["links"]
    assert sorted(link["pair"] for link in listed) == ["ap-south~eu-west", "ap-south~us-east", "eu-west~us-east"]
    assert all(link["fault"] == "none" for link in listed)


async def test_the_control_and_observation_apis_need_a_token_once_keys_are_set(regions: Regions) -> None:
    """Faults, the links' per-tenant bytes, the entries' /regions and the schedulers' /summary: a
    tenant's key does not reach them, nor does nothing; the admin or internal token does."""
    scheduler = f"http://127.0.0.1:{regions.config.regions.scheduler_port_base}"
    calls = [
        ("POST", regions.fault("ap-south~us-east")),
        ("GET", regions.links_url + "/links"),
        ("GET", regions.entry_url("us-east") + "/regions"),
        ("GET", scheduler + "/summary"),
        ("GET", scheduler + "/metrics"),
    ]
    async with httpx.AsyncClient(timeout=5) as client:
        for method, url in calls:
            for headers, status in (({}, 401), (_headers(), 403)):
                answer = await client.request(method, url, json={"fault": "partition"}, headers=headers)
                assert answer.status_code == status, (method, url, headers)
            admin = {"Authorization": f"Bearer {ADMIN}"}
            allowed = await client.request(method, url, json={"fault": "none"}, headers=admin)
            assert allowed.status_code == 200, (method, url)
        described = (await client.get(regions.links_url + "/links", headers=OPS)).json()["links"]
    assert all(link["fault"] == "none" for link in described)  # no refused call set a fault


@pytest.mark.region_policy("symphony")
async def test_a_sessions_next_turn_goes_back_to_the_region_holding_its_kv(regions: Regions) -> None:
    """Turn one of a session runs in eu-west (its client said so). The eu-west scheduler's feed
    tells the us-east entry that eu-west holds the session; turn two, from a us-east client, is
    sent there: 40 ms of round trip against recomputing ~2,000 tokens (0.364 ms each by the
    default profile) in us-east."""
    history = [{"role": "user", "content": "tell me a story " * 500}]
    first = await _chat(
        regions.entry_url("us-east"),
        _headers(**{CLIENT_REGION_HEADER: "eu-west", "X-Session-ID": "story"}),
        {**CHAT, "messages": history},
    )
    assert first.status_code == 200 and first.headers[REGION_HEADER] == "eu-west"
    probe = regions.entries["us-east"].probes["eu-west"]
    digest = session_digest("acme", "story")
    await async_wait_until(lambda: probe.held.tokens(digest) > 1_000, 10, "eu-west's feed to name the session")
    # ... and to show its first turn ended: a summary taken while it was in flight prices eu-west's
    # queue by a prefill of unknown size, which a loaded host can leave the entry holding.
    await async_wait_until(
        lambda: (probe.view().load or LOAD0).inflight == 0, 10, "eu-west's feed to show its turn ended"
    )
    second = await _chat(
        regions.entry_url("us-east"),
        _headers(**{"X-Session-ID": "story"}),
        {
            **CHAT,
            "messages": [*history, {"role": "assistant", "content": "once"}, {"role": "user", "content": "go on"}],
        },
    )
    assert second.status_code == 200 and second.headers[REGION_HEADER] == "eu-west"
    # A new session of the same client stays home.
    other = await _chat(regions.entry_url("us-east"), _headers(**{"X-Session-ID": "fresh"}))
    assert other.headers[REGION_HEADER] == "us-east"
    # No entry ever sees the session's id: the feed names it by digest.
    async with httpx.AsyncClient(timeout=5) as client:
        summary = (
            await client.get(f"http://127.0.0.1:{regions.config.regions.scheduler_port_base + 1}/summary", headers=OPS)
        ).json()
    assert "story" not in str(summary) and summary["sessions"]["held"][0][0] == digest


async def test_a_regional_scheduler_refuses_a_tenant_its_region_may_not_serve(regions: Regions) -> None:
    """Residency holds at every hop: a direct call to us-east's scheduler by an EU-only tenant."""
    us_east = f"http://127.0.0.1:{regions.config.regions.scheduler_port_base}"
    refused = await _chat(us_east, _headers("key-eu"))
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "residency" and "allowed: eu-west" in refused.json()["error"]["message"]
    assert (await _chat(us_east, _headers())).status_code == 200


async def test_undecodable_keys_and_broken_bodies_are_client_errors(regions: Regions) -> None:
    url = regions.entry_url("us-east") + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=10) as client:
        odd_key = await client.post(url, json=CHAT, headers={"Authorization": b"Bearer \xff\xfe"})
        assert odd_key.status_code == 401 and odd_key.json()["error"]["code"] == "invalid_api_key"
        not_gzip = await client.post(
            url, content=b"this is not gzip", headers={**_headers(), "Content-Encoding": "gzip"}
        )
        assert not_gzip.status_code == 400 and not_gzip.json()["error"]["code"] == "invalid_body"
        gzipped = await client.post(
            url,
            content=gzip.compress(json.dumps(CHAT).encode()),
            headers={**_headers(), "Content-Encoding": "gzip", "Content-Type": "application/json"},
        )
        assert gzipped.status_code == 200, gzipped.text


@pytest.mark.region_policy("symphony")
async def test_an_advisory_moves_a_sessions_kv_across_regions_and_its_request_follows(regions: Regions) -> None:
    """Session "story" ran in eu-west, whose node then gets a long queue. The advisory of its next
    turn, from a us-east client, goes to us-east: moving ~2,000 tokens over the 40 ms, 1 Gb/s link
    (~410 ms) beats both eu-west's queue and recomputing in us-east. The us-east scheduler asks its
    node to pull the session from eu-west's node through the us-east>eu-west link, and the request
    follows its advisory there."""
    history = [{"role": "user", "content": "tell me a story " * 500}]
    first = await _chat(
        regions.entry_url("us-east"),
        _headers(**{CLIENT_REGION_HEADER: "eu-west", "X-Session-ID": "story"}),
        {**CHAT, "messages": history},
    )
    assert first.headers[REGION_HEADER] == "eu-west"
    entry = regions.entries["us-east"]
    digest = session_digest("acme", "story")
    await async_wait_until(lambda: entry.probes["eu-west"].held.holder(digest) == "node-1", 10, "eu-west's feed")
    regions.nodes["eu-west"].status.num_requests_waiting = 20
    await async_wait_until(
        lambda: (entry.probes["eu-west"].view().load or LOAD0).queue_ms > 1_000, 10, "eu-west's queue to show"
    )
    async with httpx.AsyncClient(timeout=10) as client:
        advised = await client.post(
            regions.entry_url("us-east") + "/v1/advisories",
            json={"session_id": "story", "kind": "typing"},
            headers=_headers(),
        )
    assert advised.status_code == 202, advised.text
    assert advised.headers[REGION_HEADER] == "us-east" and entry.moves["us-east"] == 1
    link_to_node_1 = remote_node_addresses(regions.config, regions.topology, "us-east")["node-1"]
    pulls = regions.nodes["us-east"].kv.prefetches
    await async_wait_until(lambda: bool(pulls), 10, "the us-east node to be asked for the session")
    assert [p.source_peer for p in pulls] == [link_to_node_1]
    assert pulls[0].session.session_id == "story" and pulls[0].session.tenant == "acme"
    async with httpx.AsyncClient(timeout=5) as client:
        metrics = (
            await client.get(f"http://127.0.0.1:{regions.config.regions.scheduler_port_base}/metrics", headers=OPS)
        ).text
    assert 'symphony_prefetches_total{outcome="from_region"} 1.0' in metrics
    second = await _chat(
        regions.entry_url("us-east"),
        _headers(**{"X-Session-ID": "story"}),
        {
            **CHAT,
            "messages": [*history, {"role": "assistant", "content": "once"}, {"role": "user", "content": "go on"}],
        },
    )
    assert second.status_code == 200 and second.headers[REGION_HEADER] == "us-east"


async def test_a_client_cannot_name_a_kv_source(regions: Regions) -> None:
    """Only the entry says where an advisory's KV comes from: a client's header is dropped, and the
    regional scheduler refuses a source that is no node of another region."""
    async with httpx.AsyncClient(timeout=10) as client:
        via_entry = await client.post(
            regions.entry_url("us-east") + "/v1/advisories",
            json={"session_id": "s", "kind": "typing"},
            headers={**_headers(), "X-Symphony-KV-Source": "node-1:999"},
        )
        assert via_entry.status_code == 202
        us_east = f"http://127.0.0.1:{regions.config.regions.scheduler_port_base}"
        # Counted as the advisory is handled, before its answer: no move from another region began.
        metrics = await client.get(us_east + "/metrics", headers=OPS)
        assert metrics.status_code == 200 and "from_region" not in metrics.text
        for value, status in (("node-0:10", 400), ("evil:10", 400), ("node-1:x", 400), ("node-1:0", 400)):
            direct = await client.post(
                us_east + "/v1/advisories",
                json={"session_id": "s", "kind": "typing"},
                headers={**_headers(), "X-Symphony-KV-Source": value},
            )
            assert direct.status_code == status, (value, direct.text)
            assert direct.json()["error"]["param"] == "X-Symphony-KV-Source"


async def test_admin_residency_moves_a_tenant_at_every_hop_until_cleared(
    regions: Regions, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`symphony admin residency` sets the rule at each regional scheduler and the global layer:
    the tenant's next request goes where it may, a direct call elsewhere is refused, and clearing
    the rule puts it back."""
    config_file = tmp_path / "regions.toml"
    config_file.write_text(dump_toml(regions.config))
    cli = ["admin", "residency"]
    given = ["--config", str(config_file), "--tenant", "acme"]
    assert (await _chat(regions.entry_url("us-east"), _headers())).headers[REGION_HEADER] == "us-east"
    assert await asyncio.to_thread(main, [*cli, "set", *given, "--regions", "ap-south"]) == 0
    said = capsys.readouterr().out
    assert "may use ap-south (set at us-east scheduler, eu-west scheduler, ap-south scheduler, global layer)" in said
    # The command ran in a thread of this process and held the GIL while it parsed and loaded:
    # the entries' probes may have missed their deadline meanwhile. Wait until they see again.
    await regions.all_up("us-east")
    await regions.all_up("eu-west")
    moved = await _chat(regions.entry_url("us-east"), _headers())
    assert moved.status_code == 200 and moved.headers[REGION_HEADER] == "ap-south", moved.text
    # Set through one entry, it holds at every entry of the global layer.
    other_entry = await _chat(regions.entry_url("eu-west"), _headers())
    assert other_entry.status_code == 200 and other_entry.headers[REGION_HEADER] == "ap-south"
    us_east = f"http://127.0.0.1:{regions.config.regions.scheduler_port_base}"
    refused = await _chat(us_east, _headers())
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "residency"
    assert await asyncio.to_thread(main, [*cli, "list", "--config", str(config_file)]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert all(rules["acme"] == ["ap-south"] and rules["eu"] == ["eu-west"] for rules in listed.values())
    assert len(listed) == 4
    # A process that does not answer is named, and the others still take the change.
    await regions.stop_scheduler("eu-west")
    assert await asyncio.to_thread(main, [*cli, "clear", *given]) == 2
    said = capsys.readouterr()
    assert "eu-west scheduler at" in said.err and "unreachable" in said.err
    assert "set at us-east scheduler, ap-south scheduler, global layer" in said.out
    await regions.all_up("us-east", regions=["us-east", "ap-south"])
    back = await _chat(regions.entry_url("us-east"), _headers())
    assert back.headers[REGION_HEADER] == "us-east"
    assert (await _chat(us_east, _headers())).status_code == 200


async def test_residency_admin_refuses_bad_updates_and_callers(regions: Regions) -> None:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    urls = [regions.entry_url("eu-west"), f"http://127.0.0.1:{regions.config.regions.scheduler_port_base + 1}"]
    async with httpx.AsyncClient(timeout=5) as client:
        for url in urls:
            path = url + "/admin/v1/residency"
            body = {"tenant": "acme", "regions": ["eu-west"]}
            assert (await client.put(path, json=body)).status_code == 401
            assert (await client.put(path, json=body, headers=_headers())).status_code == 403  # a tenant key
            for bad, param in [
                ({"tenant": "acme", "regions": ["mars"]}, "regions"),
                ({"tenant": "acme", "regions": []}, "regions"),
                ({"tenant": "nobody", "regions": ["eu-west"]}, "tenant"),
                ({"tenant": {}, "regions": ["eu-west"]}, "tenant"),
            ]:
                answer = await client.put(path, json=bad, headers=admin)
                assert answer.status_code == 400, (url, bad, answer.text)
                assert answer.json()["error"]["param"] == param
            for body_bytes in (b"{not json", b"[" * 100_000, b"\xff\xfe"):
                broken = await client.put(path, content=body_bytes, headers=admin)
                assert broken.status_code == 400, (url, body_bytes[:8], broken.text)
                assert broken.json()["error"]["type"] == "invalid_request_error"
            huge = await client.put(path, content=b" " * (regions.config.scheduler.max_body_bytes + 1), headers=admin)
            assert huge.status_code == 413 and huge.json()["error"]["message"]
            rules = (await client.get(path, headers=admin)).json()["rules"]
            assert rules == {"eu": ["eu-west"]}  # nothing bad was kept


async def test_an_entry_closes_slow_clients_at_its_deadline_and_serves_the_rest(regions: Regions) -> None:
    """Slowloris at an entry: connections that send nothing, part of their headers or part of their
    body are closed after `scheduler.request_read_timeout_s`; a request sent in time whose answer
    takes longer than that (a slow engine) is served whole."""
    deadline_s = 0.5
    scheduler = dataclasses.replace(regions.config.scheduler, request_read_timeout_s=deadline_s)
    config = dataclasses.replace(regions.config, scheduler=scheduler)
    entry = make_entries(config, regions.topology)[0]
    port = free_port_run(1)
    server = await start_entry(entry, "127.0.0.1", port)
    try:
        await async_wait_until(lambda: entry.probes[entry.region].view().up, 10, "the entry to see its region")
        body = json.dumps(CHAT).encode()
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer key-acme\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode()
        )
        slow = [await asyncio.open_connection("127.0.0.1", port) for _ in range(30)]
        for n, (_, writer) in enumerate(slow):
            writer.write([b"", head[:20], head + body[:1]][n % 3])  # nothing, part of the headers, of the body
            await writer.drain()
        regions.engine.slow_done.clear()
        asyncio.get_running_loop().call_later(3 * deadline_s, regions.engine.slow_done.set)
        slow_answer = {**CHAT, "messages": [{"role": "user", "content": "slow"}]}
        started = time.monotonic()
        reply = await _chat(f"http://127.0.0.1:{port}", _headers(), slow_answer)
        assert reply.status_code == 200, reply.text
        assert time.monotonic() - started >= 2 * deadline_s  # longer than the deadline, not cut
        for reader, writer in slow:
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, nothing answered
            writer.close()
        assert entry.read_timeouts == 30
        assert (await _chat(f"http://127.0.0.1:{port}", _headers())).status_code == 200  # served as before

        # Each request on a kept-alive connection has its own deadline, from its first bytes: one sent
        # after most of a deadline's idling, its body a while behind its headers, is answered.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for idle_s in (0.0, 0.8 * deadline_s):
            await asyncio.sleep(idle_s)
            writer.write(head)
            await writer.drain()
            await asyncio.sleep(0.3 * deadline_s)
            writer.write(body)
            assert (await _read_answer(reader)).startswith(b"HTTP/1.1 200"), "a request sent in time was cut"
        writer.close()
        assert entry.read_timeouts == 30  # an idle connection is no slow client
    finally:
        await server.close()


async def _read_answer(reader: asyncio.StreamReader) -> bytes:
    """One HTTP/1.1 answer with a Content-Length, whole (its status line and headers returned)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = next(
        int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
    )
    await asyncio.wait_for(reader.readexactly(length), 10)
    return head


async def test_an_entry_keeps_an_idle_connection_past_client_pools_and_no_longer(regions: Regions) -> None:
    """An entry keeps an idle client connection for `scheduler.keep_alive_s`, the schedulers' own:
    past the 5 s clients' pools reuse one for (a request sent as it closed would break), and not
    for aiohttp's default of an hour."""
    keep_s = CLIENT_POOL_KEEPALIVE_S + 1
    scheduler = dataclasses.replace(regions.config.scheduler, keep_alive_s=keep_s)
    entry = make_entries(dataclasses.replace(regions.config, scheduler=scheduler), regions.topology)[0]
    port = free_port_run(1)
    server = await start_entry(entry, "127.0.0.1", port)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        open_s = await closed_after(reader, 4 * keep_s)  # the answer, then the idle time
        writer.close()
        assert CLIENT_POOL_KEEPALIVE_S < open_s < keep_s + 3, open_s
    finally:
        await server.close()
