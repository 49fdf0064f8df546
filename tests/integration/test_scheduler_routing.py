"""Issue 5's scheduler behaviour over real HTTP and gRPC, with fake nodes: advisories that move KV,
tenants from API keys, baselines behind the same interface, selective pushing, the admin API."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
import openai
import pytest

from client_sdk import AsyncAdminClient, AsyncSymphonyClient
from eval.bench_cluster import advisory_p99_bound_ms
from eval.loadgen import LoadGenerator, LoadSettings
from eval.workloads import SHAREGPT_SAMPLE, HumanTiming, load_sharegpt
from scheduler import prefetcher, pull_costs
from symphony.cli import main
from symphony.kv_transfer import AUTH_PARAM, params_key, params_refusal
from symphony.rpc import kv_pb2
from symphony.tenancy import internal_headers
from tests.helpers import async_wait_until
from tests.integration.conftest import CHAT, WARM_UPS_PAY, MakeNode, StartScheduler, ready
from tests.integration.fakes import FakeEngine, FakeNodeManager

KEYS = ["acme:key-acme", "rival:key-rival"]
ACME = {"Authorization": "Bearer key-acme"}
RIVAL = {"Authorization": "Bearer key-rival"}


def _metric(text: str, sample: str) -> float:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_an_advisory_moves_the_sessions_kv_to_the_node_it_picks(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    node_a, node_b = await make_node(engine.url, "node-a"), await make_node(engine.url, "node-b")
    url, state = await start_scheduler([node_a, node_b], typing_lead_ms=7000)
    state.dispatcher.profile = WARM_UPS_PAY
    async with httpx.AsyncClient(base_url=url) as client:
        holder, other = await _first_turn_then_busy(client, node_a, node_b)  # the KV must move
        advice = await client.post("/v1/advisories", json={"session_id": "s", "kind": "typing"})
        assert advice.status_code == 202 and advice.json()["node"] == other.status.node_id
        await async_wait_until(lambda: bool(other.kv.prefetches), 10, "the prefetch request")
        prefetch = other.kv.prefetches[0]
        assert (prefetch.session.tenant, prefetch.session.session_id) == ("default", "s")
        assert prefetch.target_tier == kv_pb2.TIER_HBM and prefetch.deadline_ms == 7000
        assert prefetch.source_peer == holder.address  # pulled from the node that holds it
        # The warm-up in the engine's cache goes under the salt the session's requests carry.
        assert prefetch.engine_cache_salt == engine.requests[-1]["cache_salt"]
        assert not holder.kv.prefetches

        async def moved() -> bool:
            return 'symphony_prefetches_total{outcome="done"} 1.0' in (await client.get("/metrics")).text

        await async_wait_until(moved, 10, "the prefetch to finish")
        # The user still typing: the same history already sits in that node's top tier, so a repeated
        # advisory routes there but asks the node for nothing (a move would cost an engine warm-up).
        again = await client.post("/v1/advisories", json={"session_id": "s", "kind": "typing"})
        assert again.status_code == 202 and again.json()["node"] == other.status.node_id
        assert len(other.kv.prefetches) == 1
        assert _metric((await client.get("/metrics")).text, 'symphony_prefetches_total{outcome="unchanged"}') == 1
        monkeypatch.setattr(prefetcher, "MOVE_FRESH_S", 0.0)  # ... but only for a while: then it moves again
        await client.post("/v1/advisories", json={"session_id": "s", "kind": "typing"})
        await async_wait_until(lambda: len(other.kv.prefetches) == 2, 10, "the second prefetch request")
        await async_wait_until(
            lambda: all(p.state == "done" for p in state.dispatcher.prefetches.values()),
            10,
            "the second prefetch to finish",
        )
        reply = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s"})
        assert reply.headers["x-symphony-node"] == other.status.node_id
        assert reply.headers["x-symphony-route"] == "advisory"
        metrics = (await client.get("/metrics")).text
        assert _metric(metrics, 'symphony_advised_requests_total{kind="typing",kv_ready="yes"}') == 1
        assert _metric(metrics, 'symphony_advisories_total{kind="typing",outcome="routed"}') == 3


async def test_a_request_routed_away_from_its_kv_without_an_advisory_pulls_it_over_first(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pull_costs, "MIN_PULL_TOKENS", 1)  # this session's history is a few tokens
    node_a, node_b = await make_node(engine.url, "node-a"), await make_node(engine.url, "node-b")
    url, state = await start_scheduler([node_a, node_b], route_pull_min_tokens=1, route_pull_wait_ms=20_000)
    async with httpx.AsyncClient(base_url=url) as client:
        holder, other = await _first_turn_then_busy(client, node_a, node_b)
        other.kv.release.clear()  # the pull is under way until the test lets it end
        other.kv.final_pages = (60, 30)  # it fetches half of the history's pages; its DRAM had the rest
        sent = len(engine.requests)
        second = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s"}))
        await async_wait_until(lambda: bool(other.kv.prefetches), 10, "the pull request")
        pull = other.kv.prefetches[0]
        # Only to the node's DRAM (the request's own prefill loads it), from the node holding it.
        assert pull.target_tier == kv_pb2.TIER_DRAM and pull.source_peer == holder.address
        assert not pull.engine_cache_salt  # a node refuses a salt for any target but its engine's cache
        assert len(engine.requests) == sent and not second.done()  # the request waits for its KV
        other.kv.release.set()
        reply = await second
        assert reply.status_code == 200 and reply.headers["x-symphony-node"] == other.status.node_id
        assert _metric((await client.get("/metrics")).text, 'symphony_route_pulls_total{outcome="ready"}') == 1
        # The pull's time is kept for that link, over the tokens it fetched: moves over it are priced
        # by what they take.
        links = state.dispatcher.links
        rate, samples = links.observed(holder.status.node_id, other.status.node_id)
        assert samples == 1 and rate > 0
        pulled = other.kv.prefetches[0]
        assert pulled.source_peer == holder.address
        assert state.dispatcher.links.observed(other.status.node_id, holder.status.node_id) == (0.0, 0)
        # Shown where an operator looks: /readyz (so `symphony status`) and the metrics.
        shown = (await client.get("/readyz")).json()["observed_links"]
        assert [(x["source"], x["target"], x["pulls"], x["priced"]) for x in shown] == [
            (holder.status.node_id, other.status.node_id, 1, False)
        ]
        pair = f'source="{holder.status.node_id}",target="{other.status.node_id}"'
        series = f"symphony_link_observed_ms_per_token{{{pair}}}"
        assert _metric((await client.get("/metrics")).text, series) == pytest.approx(rate)


async def test_a_request_arriving_while_its_advisorys_move_is_under_way_waits_for_the_kv(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    """An advisory moments before its request: the move to the advised node is still pulling the
    history when the request comes. The request waits for the KV (a pull the node joins to the
    move's) instead of reaching the engine without it and recomputing the whole history."""
    node_a, node_b = await make_node(engine.url, "node-a"), await make_node(engine.url, "node-b")
    url, _ = await start_scheduler([node_a, node_b], route_pull_min_tokens=1, route_pull_wait_ms=20_000)
    async with httpx.AsyncClient(base_url=url) as client:
        holder, other = await _first_turn_then_busy(client, node_a, node_b)
        other.kv.release.clear()  # the advisory's move is under way until the test lets it end
        advice = await client.post("/v1/advisories", json={"session_id": "s", "kind": "typing"})
        assert advice.status_code == 202 and advice.json()["node"] == other.status.node_id
        await async_wait_until(lambda: bool(other.kv.prefetches), 10, "the advisory's move")
        sent = len(engine.requests)
        second = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s"}))
        await async_wait_until(lambda: len(other.kv.prefetches) == 2, 10, "the request's pull")
        pull = other.kv.prefetches[1]
        assert pull.target_tier == kv_pb2.TIER_DRAM and pull.source_peer == holder.address
        assert not pull.engine_cache_salt
        assert len(engine.requests) == sent and not second.done()  # the request waits for its KV
        other.kv.release.set()
        reply = await second
        assert reply.status_code == 200 and reply.headers["x-symphony-node"] == other.status.node_id
        assert reply.headers["x-symphony-route"] == "advisory"
        assert _metric((await client.get("/metrics")).text, 'symphony_route_pulls_total{outcome="ready"}') == 1


async def test_a_pull_that_runs_late_delays_the_request_only_by_the_bounded_wait(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    node_a, node_b = await make_node(engine.url, "node-a"), await make_node(engine.url, "node-b")
    url, _ = await start_scheduler([node_a, node_b], route_pull_min_tokens=1, route_pull_wait_ms=300)
    async with httpx.AsyncClient(base_url=url) as client:
        _, other = await _first_turn_then_busy(client, node_a, node_b)
        other.kv.release.clear()  # a pull that never finishes
        reply = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s"})
        assert reply.status_code == 200 and reply.headers["x-symphony-node"] == other.status.node_id
        assert len(other.kv.prefetches) == 1
        assert _metric((await client.get("/metrics")).text, 'symphony_route_pulls_total{outcome="late"}') == 1
        other.kv.release.set()


async def _first_turn_then_busy(
    client: httpx.AsyncClient, node_a: FakeNodeManager, node_b: FakeNodeManager
) -> tuple[FakeNodeManager, FakeNodeManager]:
    """Session "s" takes a turn on one node, which then gets busy: (that node, the other)."""
    await ready(client, 2)
    turn = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s"})
    holder, other = (node_a, node_b) if turn.headers["x-symphony-node"] == "node-a" else (node_b, node_a)
    holder.status.num_requests_running = 6
    await async_wait_until(lambda: _busy(client, holder.status.node_id), 10, "the load to be polled")
    return holder, other


async def _busy(client: httpx.AsyncClient, node_id: str) -> bool:
    return (await client.get("/readyz")).json()["nodes"][node_id]["running"] > 0


async def test_where_a_warm_up_costs_more_than_a_load_an_advisory_only_pulls_to_dram(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    """On the default (2-core CPU) costs a warm-up pass costs the engine ~72 ms, loading a short
    history at the request's arrival a fraction of a millisecond: an advisory to the node that holds
    the session's KV asks it for nothing, and one to another node only pulls the KV into its DRAM
    (no warm-up, no salt), which the request then loads."""
    node_a, node_b = await make_node(engine.url, "node-a"), await make_node(engine.url, "node-b")
    url, state = await start_scheduler([node_a, node_b])
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client, 2)
        turn = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s"})
        holder = node_a if turn.headers["x-symphony-node"] == "node-a" else node_b
        advice = await client.post("/v1/advisories", json={"session_id": "s", "kind": "typing"})
        assert advice.json()["node"] == holder.status.node_id
        metrics = (await client.get("/metrics")).text
        assert _metric(metrics, 'symphony_prefetches_total{outcome="loads_on_arrival"}') == 1
        assert holder.kv.prefetches == [] and not state.dispatcher.prefetches
        holder, other = await _first_turn_then_busy(client, node_a, node_b)  # now the KV must move
        advice = await client.post("/v1/advisories", json={"session_id": "s", "kind": "typing"})
        assert advice.json()["node"] == other.status.node_id
        await async_wait_until(lambda: bool(other.kv.prefetches), 10, "the pull request")
        pull = other.kv.prefetches[0]
        assert pull.target_tier == kv_pb2.TIER_DRAM and pull.source_peer == holder.address
        assert pull.engine_cache_salt == ""


async def test_a_first_turns_advisory_pre_assigns_a_node_and_moves_nothing(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    node = await make_node(engine.url)
    url, state = await start_scheduler([node])
    state.dispatcher.profile = WARM_UPS_PAY
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        advice = await client.post(
            "/v1/advisories", json={"session_id": "new", "kind": "predecessor", "expected_arrival_ms": 1800}
        )
        assert advice.status_code == 202 and advice.json()["node"] == "node-0"
        reply = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "new"})
        assert reply.headers["x-symphony-route"] == "advisory"
        assert node.kv.prefetches == []


async def test_a_predecessor_hint_prefetches_by_its_expected_arrival_and_late_kv_counts_as_not_ready(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    node = await make_node(engine.url)
    node.kv.release.clear()  # the move does not finish before the request
    url, state = await start_scheduler([node])
    state.dispatcher.profile = WARM_UPS_PAY
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        await client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "agent"})
        await client.post(
            "/v1/advisories", json={"session_id": "agent", "kind": "predecessor", "expected_arrival_ms": 1800}
        )
        await async_wait_until(lambda: bool(node.kv.prefetches), 10, "the prefetch request")
        assert node.kv.prefetches[0].deadline_ms == 1800 and node.kv.prefetches[0].source_peer == ""
        await client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "agent"})
        node.kv.release.set()
        metrics = (await client.get("/metrics")).text
        assert _metric(metrics, 'symphony_advised_requests_total{kind="predecessor",kv_ready="no"}') == 1


async def test_tenants_come_from_api_keys_and_key_the_kv_the_engine_gets(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    url, state = await start_scheduler(
        [await make_node(engine.url)], api_keys=KEYS, cluster={"secret": "the cluster's secret, signing"}
    )
    key = params_key(state.config.cluster.secret.encode())
    assert state.config.cluster.secret  # a real key: the empty secret's would be anyone's

    def params() -> dict[str, object]:
        """The last request's kv_transfer_params, once the connector's check of them has passed."""
        sent = engine.requests[-1]["kv_transfer_params"]
        assert params_refusal(sent, engine.requests[-1]["model"], key, time.time()) is None
        return {name: value for name, value in sent.items() if name != AUTH_PARAM}

    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "key-acme"}):
            refused = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert refused.status_code == 401
            assert refused.json()["error"]["type"] == "authentication_error"
            assert (
                await client.post("/v1/advisories", json={"session_id": "s", "kind": "typing"}, headers=headers)
            ).status_code == 401
        assert engine.requests == []
        # A client naming another tenant's KV gets its own anyway.
        forged = {**CHAT, "kv_transfer_params": {"tenant": "rival", "session_id": "theirs"}}
        reply = await client.post("/v1/chat/completions", json=forged, headers={**ACME, "X-Session-ID": "mine"})
        assert reply.status_code == 200
        assert params() == {"tenant": "acme", "session_id": "mine"}
        acme_salt = engine.requests[-1]["cache_salt"]
        await client.post("/v1/chat/completions", json=CHAT, headers={**RIVAL, "X-Session-ID": "mine"})
        assert params() == {"tenant": "rival", "session_id": "mine"}
        # The engine's own prefix cache is split by tenant too: a client cannot pick another's salt.
        assert engine.requests[-1]["cache_salt"] != acme_salt
        await client.post(
            "/v1/chat/completions", json={**CHAT, "cache_salt": acme_salt}, headers={**RIVAL, "X-Session-ID": "mine"}
        )
        assert engine.requests[-1]["cache_salt"] not in (acme_salt, engine.requests[-2]["cache_salt"])


async def test_operational_detail_needs_the_admin_or_the_internal_token_once_keys_are_set(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    """/metrics, /readyz's details and /summary span every tenant: a tenant's key does not read them,
    nor does nothing; the admin token and the cluster's internal token do. /readyz's status and
    /healthz stay open for probes."""
    secret = "the cluster's secret, shared"
    url, _ = await start_scheduler(
        [await make_node(engine.url)], api_keys=KEYS, admin_token="s3cret", cluster={"secret": secret}
    )
    readers = {"admin": {"Authorization": "Bearer s3cret"}, "internal": internal_headers(secret)}
    refused = {
        "nobody": ({}, 401),
        "a tenant": (ACME, 403),
        "another cluster": (internal_headers("another cluster's secret"), 403),
        "the secret itself": ({"Authorization": f"Bearer {secret}"}, 403),
    }
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        for path in ("/metrics", "/summary"):
            for who, (headers, status) in refused.items():
                answer = await client.get(path, headers=headers)
                assert answer.status_code == status, (path, who)
                kind = "authentication_error" if status == 401 else "permission_error"
                assert answer.json()["error"]["type"] == kind, (path, who)
            for who, headers in readers.items():
                assert (await client.get(path, headers=headers)).status_code == 200, (path, who)
        for who, (headers, _) in refused.items():
            bare = await client.get("/readyz", headers=headers)
            assert bare.status_code == 200 and bare.json() == {"status": "ready", "ready_nodes": 1}, who
        for headers in readers.values():
            assert "node-0" in (await client.get("/readyz", headers=headers)).json()["nodes"]
        assert (await client.get("/healthz")).status_code == 200


async def test_status_says_the_details_need_the_admin_token(
    make_node: MakeNode,
    engine: FakeEngine,
    start_scheduler: StartScheduler,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`symphony status --url` sends no cluster token elsewhere: it says what it needs, not an empty
    cluster; with the admin token in the environment it shows the nodes."""
    url, _ = await start_scheduler([await make_node(engine.url)], api_keys=KEYS, admin_token="s3cret")
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
    monkeypatch.delenv("SYMPHONY_ADMIN_TOKEN", raising=False)
    assert await asyncio.to_thread(main, ["status", "--url", url]) == 2
    assert "SYMPHONY_ADMIN_TOKEN" in capsys.readouterr().err
    monkeypatch.setenv("SYMPHONY_ADMIN_TOKEN", "s3cret")
    assert await asyncio.to_thread(main, ["status", "--url", url]) == 0
    assert "node-0" in capsys.readouterr().out


async def test_a_tenant_cannot_advise_or_move_another_tenants_session(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    node_a, node_b = await make_node(engine.url, "node-a"), await make_node(engine.url, "node-b")
    url, state = await start_scheduler([node_a, node_b], api_keys=KEYS)
    state.dispatcher.profile = WARM_UPS_PAY
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client, 2)
        await client.post("/v1/chat/completions", json=CHAT, headers={**ACME, "X-Session-ID": "s"})
        # The same session id from another tenant is another session: nothing of acme's moves (an
        # advisory starts its prefetch before it answers, so none was started).
        assert (
            await client.post("/v1/advisories", json={"session_id": "s", "kind": "typing"}, headers=RIVAL)
        ).status_code == 202
        assert state.dispatcher.prefetcher.inflight == 0 and not state.dispatcher.prefetches
        assert [p for node in (node_a, node_b) for p in node.kv.prefetches] == []
        # Acme's own advisory does move it.
        await client.post("/v1/advisories", json={"session_id": "s", "kind": "typing"}, headers=ACME)
        assert list(state.dispatcher.prefetches) == [("acme", "s")]


async def test_recompute_baseline_keeps_requests_off_the_tiers_and_ignores_advisories(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    node = await make_node(engine.url)
    url, _ = await start_scheduler([node], policy="recompute")
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        await client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s"})
        sent = engine.requests[-1]["kv_transfer_params"]
        assert {name: value for name, value in sent.items() if name != AUTH_PARAM} == {
            "tenant": "default",
            "session_id": "s",
            "symphony_tiers": False,
        }
        advice = await client.post("/v1/advisories", json={"session_id": "s", "kind": "typing"})
        assert advice.status_code == 202 and advice.json()["node"] is None
        reply = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s"})
        assert reply.headers["x-symphony-route"] == "recompute"
        assert node.kv.prefetches == []
        assert 'symphony_advisories_total{kind="typing",outcome="ignored"} 1.0' in (await client.get("/metrics")).text


async def test_selective_pushing_holds_requests_until_a_node_has_room(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    node_a = await make_node(engine.url, "node-a", running=4, waiting=2)
    node_b = await make_node(engine.url, "node-b", running=4, waiting=1)
    url, state = await start_scheduler([node_a, node_b], queue_timeout_s=30)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        await ready(client, 2)
        held = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
        await async_wait_until(lambda: len(state.dispatcher.queue) == 1, 10, "the request to wait")
        assert engine.requests == []
        node_b.status.num_requests_waiting = 0  # node-b's queue drains
        reply = await held
        assert reply.status_code == 200 and reply.headers["x-symphony-node"] == "node-b"
        assert len(state.dispatcher.queue) == 0


async def test_a_held_request_that_finds_no_room_in_time_gets_503(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    url, _ = await start_scheduler([await make_node(engine.url, waiting=3)], queue_timeout_s=0.3)
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        reply = await client.post("/v1/chat/completions", json=CHAT)
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "queue_timeout"
        assert engine.requests == []


async def test_past_capacity_a_newcomer_is_refused_at_once_with_retry_after(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    """Requests that ended set the rate slots free up at (at most a few a second over 5 s here);
    with every node's engine full, a request that would wait past `max_queue_wait_s` for one is
    answered 503 `overloaded` at once, not after `queue_timeout_s`."""
    node = await make_node(engine.url)
    url, state = await start_scheduler([node], queue_timeout_s=30, max_queue_wait_s=0.01)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        await ready(client)
        for _ in range(3):
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        node.status.num_requests_waiting = 2  # the engine is full
        await async_wait_until(lambda: state.cluster.nodes[0].waiting == 2, 10, "the scheduler to see it")
        started = time.monotonic()
        reply = await client.post("/v1/chat/completions", json=CHAT)
        assert time.monotonic() - started < 5.0
        assert reply.status_code == 503, reply.text
        error = reply.json()["error"]
        assert error["code"] == "overloaded" and "max_queue_wait_s" in error["message"]
        assert int(reply.headers["retry-after"]) >= 1
        assert len(engine.requests) == 3
        assert 'symphony_overloaded_total{priority="normal"} 1.0' in (await client.get("/metrics")).text


async def test_admin_sets_priority_tiers_and_a_high_session_is_promoted(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    node = await make_node(engine.url)
    url, state = await start_scheduler([node], admin_token="s3cret", api_keys=KEYS)
    state.dispatcher.profile = WARM_UPS_PAY
    admin = {"Authorization": "Bearer s3cret"}
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        body = {"tenant": "acme", "session_id": "vip", "priority": "high"}
        assert (await client.put("/admin/v1/priorities", json=body)).status_code == 401
        wrong = await client.put("/admin/v1/priorities", json=body, headers=ACME)  # a tenant key is no admin token
        assert wrong.status_code == 403 and wrong.json()["error"]["type"] == "permission_error"
        bad = await client.put("/admin/v1/priorities", json={**body, "priority": "urgent"}, headers=admin)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
        await client.post("/v1/chat/completions", json=CHAT, headers={**ACME, "X-Session-ID": "vip"})
        reply = await client.put("/admin/v1/priorities", json=body, headers=admin)
        assert reply.status_code == 200 and reply.json()["promoted"] == 1
        await async_wait_until(lambda: bool(node.kv.prefetches), 10, "the promotion's prefetch")
        assert node.kv.prefetches[0].priority == kv_pb2.PRIORITY_HIGH
        # A whole tenant set to high: each of its sessions the scheduler knows moves up.
        for session in ("t1", "t2"):
            await client.post("/v1/chat/completions", json=CHAT, headers={**ACME, "X-Session-ID": session})
        tenant_wide = await client.put(
            "/admin/v1/priorities", json={"tenant": "acme", "priority": "high"}, headers=admin
        )
        assert tenant_wide.json()["promoted"] >= 2  # t1, t2 (and vip, unless its move is still pending)
        await async_wait_until(
            lambda: {p.session.session_id for p in node.kv.prefetches} >= {"vip", "t1", "t2"},
            10,
            "the tenant's prefetches",
        )
        await client.put("/admin/v1/priorities", json={"tenant": "acme", "priority": "normal"}, headers=admin)
        assert (
            await client.put("/admin/v1/priorities", json={"tenant": "rival", "priority": "low"}, headers=admin)
        ).status_code == 200
        listing = (await client.get("/admin/v1/priorities", headers=admin)).json()
        assert listing["tenants"] == {"rival": "low"}
        assert listing["sessions"] == [{"tenant": "acme", "session_id": "vip", "priority": "high"}]
        await client.post("/v1/chat/completions", json=CHAT, headers={**ACME, "X-Session-ID": "vip"})
        metrics = (await client.get("/metrics", headers=admin)).text
        assert _metric(metrics, 'symphony_priority_requests_total{priority="high"}') == 1


async def test_the_admin_api_is_off_without_a_token(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    url, _ = await start_scheduler([await make_node(engine.url)])
    async with httpx.AsyncClient(base_url=url) as client:
        reply = await client.get("/admin/v1/priorities", headers={"Authorization": "Bearer anything"})
        assert reply.status_code == 403 and reply.json()["error"]["code"] == "admin_disabled"


async def test_the_sdk_debounces_typing_sends_agent_hints_and_sets_priorities(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    url, state = await start_scheduler([await make_node(engine.url)], admin_token="s3cret", api_keys=KEYS)
    client = AsyncSymphonyClient(url, api_key="key-acme", model="m", max_retries=0)
    try:
        async with httpx.AsyncClient(base_url=url) as probe:
            await ready(probe)
        first = await client.typing("chat-1")
        assert first is not None and first.node == "node-0"
        assert await client.typing("chat-1") is None  # keystrokes within the window send nothing
        await client.chat("chat-1", [{"role": "user", "content": "hi"}], max_tokens=4)
        assert await client.typing("chat-1") is not None  # the next turn's typing is a new advisory

        @client.predecessor("reviewer", expected_arrival_ms=1800)
        async def architect_step() -> str:
            return "design"

        assert await architect_step() == "design"
        hint = state.advisories.take(("acme", "reviewer"))
        assert hint is not None and (hint.kind, hint.expected_arrival_ms) == ("predecessor", 1800)
    finally:
        await client.close()
    # An advisory the scheduler refused was not sent: the next keystroke tries again, not None.
    stranger = AsyncSymphonyClient(url, api_key="wrong", model="m", max_retries=0)
    try:
        for _ in range(2):
            with pytest.raises(openai.AuthenticationError):
                await stranger.typing("chat-2")
    finally:
        await stranger.close()
    admin = AsyncAdminClient(url, token="s3cret")
    try:
        reply = await admin.set_priority("acme", "low")
        assert reply["priority"] == "low" and (await admin.priorities())["tenants"] == {"acme": "low"}
    finally:
        await admin.close()
    intruder = AsyncAdminClient(url, token="key-acme")
    try:
        with pytest.raises(openai.PermissionDeniedError):
            await intruder.set_priority("acme", "high")
    finally:
        await intruder.close()


async def test_the_cli_sets_and_lists_priorities(
    make_node: MakeNode,
    engine: FakeEngine,
    start_scheduler: StartScheduler,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    url, state = await start_scheduler([await make_node(engine.url)], admin_token="s3cret")
    token_file = tmp_path / "admin-token"
    token_file.write_text("s3cret\n")
    base = ["--url", url, "--token", "s3cret"]
    from_file = ["--url", url, "--token-file", str(token_file)]  # out of sight of `ps`
    assert await asyncio.to_thread(main, ["admin", "priority", "set", "low", "--tenant", "acme", *from_file]) == 0
    assert "tenant 'acme': priority low" in capsys.readouterr().out
    assert state.priorities.of("acme", "any") == "low"
    assert await asyncio.to_thread(main, ["admin", "priority", "list", *base]) == 0
    assert '"acme": "low"' in capsys.readouterr().out
    wrong = ["--url", url, "--token", "nope"]
    assert await asyncio.to_thread(main, ["admin", "priority", "set", "high", "--tenant", "acme", *wrong]) == 2
    assert "refused: 403 wrong admin token" in capsys.readouterr().err


async def test_the_load_generator_replays_users_through_the_scheduler(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    url, _ = await start_scheduler([await make_node(engine.url, "node-a"), await make_node(engine.url, "node-b")])
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client, 2)
    conversations = load_sharegpt(SHAREGPT_SAMPLE, limit=3)
    generator = LoadGenerator(
        url,
        "m",
        conversations,
        HumanTiming(time_scale=0.001),
        LoadSettings(users=2, duration_s=3.0, max_answer_tokens=8),
    )
    records = await generator.run()
    assert records and all(r.ok and r.node in ("node-a", "node-b") for r in records)
    # Each user's conversations, one after another (how many fit in 3 s depends on the host's speed).
    assert all(re.fullmatch(r"load-u[01]-c\d+", r.session) for r in records), {r.session for r in records}
    first = next(r for r in records if r.turn == 0)
    assert (first.prompt_tokens, first.cached_tokens, first.output_tokens) == (7, 4, 3)
    assert any(r.turn > 0 for r in records) and all(r.advised and r.advisory_ms > 0 for r in records)
    # Each turn carried the conversation so far: the user's messages and the answers ("onetwothree").
    turns = [body for body in engine.requests if body["messages"][-1]["role"] == "user"]
    assert any(
        len(body["messages"]) >= 3 and body["messages"][1] == {"role": "assistant", "content": "onetwothree"}
        for body in turns
    )
    async with httpx.AsyncClient(base_url=url) as client:
        metrics = (await client.get("/metrics")).text
    assert _metric(metrics, 'symphony_advisories_total{kind="typing",outcome="routed"}') == len(records)
    assert _metric(metrics, "symphony_advisory_seconds_count") == len(records)
    assert advisory_p99_bound_ms(metrics) > 0
