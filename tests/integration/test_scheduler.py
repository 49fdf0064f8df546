"""The scheduler as a real HTTP server polling real gRPC servers, with fault-injecting fakes behind it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from eval.loadgen import server_timing_ms
from scheduler.cost_profile import DEFAULT_PROFILE, to_json
from scheduler.kv_index import NodePrefix
from symphony.cli_status import _kv_index_text
from symphony.kv_addressing import ModelFingerprint, chain_block_keys
from symphony.models import DEFAULT_MODEL_NAME
from symphony.rpc import kv_pb2, node_pb2
from symphony.tenancy import secret_check
from tests.helpers import async_wait_until, free_port
from tests.integration.conftest import CHAT, MakeNode, StartScheduler, ready
from tests.integration.fakes import FakeEngine, FakeNodeManager


async def test_readiness_follows_node_status(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    node = await make_node(engine.url)
    url, _ = await start_scheduler([node])
    async with httpx.AsyncClient(base_url=url) as client:
        assert (await client.get("/readyz")).status_code in (200, 503)
        await ready(client)
        body = (await client.get("/v1/models")).json()
        assert [m["id"] for m in body["data"]] == ["m"]

        node.status.engine_state = node_pb2.ENGINE_STATE_RESTARTING
        await _wait_status(client, 503)
        assert (await client.get("/readyz")).json()["nodes"]["node-0"]["state"] == "restarting"

        node.status.engine_state = node_pb2.ENGINE_STATE_READY
        await _wait_status(client, 200)
        await node.stop()  # the node manager itself disappears
        started = time.monotonic()
        await _wait_status(client, 503)
        assert (await client.get("/readyz")).json()["nodes"]["node-0"]["state"] == "unreachable"
        assert time.monotonic() - started < 5, "a dead node manager is noticed within its down threshold"
        assert (await client.get("/healthz")).status_code == 200


async def test_readiness_shows_the_cost_profile_in_use(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler, tmp_path: Path
) -> None:
    """A measured profile for this host and model is used; a broken one leaves the defaults, and
    says why, without keeping the scheduler from serving."""
    node = await make_node(engine.url)
    good = tmp_path / "good.json"
    measured = dataclasses.replace(
        DEFAULT_PROFILE, measured_at_unix_s=time.time(), host=socket.gethostname(), model=DEFAULT_MODEL_NAME
    )
    good.write_text(to_json(measured))
    bad = tmp_path / "bad.json"
    bad.write_text(to_json(dataclasses.replace(measured, step_ms=float("nan"))))
    for path, status, problem in ((good, "loaded", ""), (bad, "invalid", "step_ms: nan")):
        url, state = await start_scheduler([node], cost_profile=str(path))
        async with httpx.AsyncClient(base_url=url) as client:
            await ready(client)
            shown = (await client.get("/readyz")).json()["cost_profile"]
            assert (shown["path"], shown["status"]) == (str(path), status) and problem in shown["problem"]
            reply = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s-1"})
            assert reply.status_code == 200
        assert state.dispatcher.policy.profile == (measured if status == "loaded" else DEFAULT_PROFILE)  # type: ignore[attr-defined]


async def _wait_status(client: httpx.AsyncClient, code: int) -> None:
    async def check() -> bool:
        return (await client.get("/readyz")).status_code == code

    await async_wait_until(check, 10, f"/readyz to answer {code}")


async def test_chat_is_relayed_with_node_headers_and_session(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    url, _ = await start_scheduler([await make_node(engine.url)])
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        reply = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s-1"})
        assert reply.status_code == 200
        assert reply.headers["x-symphony-node"] == "node-0"
        assert server_timing_ms(reply.headers["server-timing"], "route") > 0  # its time before going out
        assert reply.json()["choices"][0]["message"]["content"] == "hello"
        assert engine.headers[-1]["x-session-id"] == "s-1"

        async with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as stream:
            assert stream.status_code == 200
            assert stream.headers["content-type"].startswith("text/event-stream")
            text = "".join([chunk async for chunk in stream.aiter_text()])
        words = [
            json.loads(line[6:])["choices"][0]["delta"]["content"]
            for line in text.splitlines()
            if line.startswith("data: {")
        ]
        assert words == ["one", "two", "three"]
        assert text.rstrip().endswith("data: [DONE]")


async def test_missing_model_is_filled_in_for_the_engine(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    url, _ = await start_scheduler([await make_node(engine.url)])
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        reply = await client.post("/v1/chat/completions", json={"messages": CHAT["messages"]})
        assert reply.status_code == 200
        assert engine.requests[-1]["model"] == "m"


async def test_engine_4xx_passes_through(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    url, _ = await start_scheduler([await make_node(engine.url)])
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        reply = await client.post(
            "/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "bad"}]}
        )
        assert reply.status_code == 400
        assert reply.json()["error"]["param"] == "temperature"


@pytest.mark.parametrize(
    "fields",
    [
        {"messages": [{"role": {}, "content": "hi"}]},
        {"messages": [{"role": ["user"], "content": "hi"}]},
        {"temperature": "hot"},
        {"stop": 5},
        {"max_tokens": "16"},
        {"session_id": {}},
    ],
    ids=["role-object", "role-list", "temperature", "stop", "max_tokens", "session_id"],
)
async def test_a_field_of_the_wrong_type_is_an_openai_style_400_and_reaches_no_engine(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler, fields: dict[str, object]
) -> None:
    url, _ = await start_scheduler([await make_node(engine.url)])
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        reply = await client.post("/v1/chat/completions", json={**CHAT, **fields})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", next(iter(fields)))
    assert not engine.requests


async def test_unreachable_engine_gives_503_quickly(make_node: MakeNode, start_scheduler: StartScheduler) -> None:
    dead_engine = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    url, state = await start_scheduler([await make_node(dead_engine)])
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        await ready(client)
        started = time.monotonic()
        reply = await client.post("/v1/chat/completions", json=CHAT)
        assert reply.status_code == 503
        error = reply.json()["error"]
        assert error["code"] == "engine_unreachable"
        assert "node-0" in error["message"]
        assert time.monotonic() - started < 10, "an unreachable engine must not hang the request"
        assert (await client.get("/healthz")).status_code == 200
        assert state.dispatcher.inflight_total == 0


async def test_no_available_node_gives_503(start_scheduler: StartScheduler) -> None:
    node = FakeNodeManager(node_pb2.NodeStatus(node_id="node-0", engine_state=node_pb2.ENGINE_STATE_STARTING))
    await node.start()
    url, _ = await start_scheduler([node])
    async with httpx.AsyncClient(base_url=url) as client:
        reply = await client.post("/v1/chat/completions", json=CHAT)
        assert reply.status_code == 503
        assert reply.json()["error"]["type"] == "server_error"
        await node.stop()


async def test_unreachable_engine_is_retried_once_elsewhere(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    dead = await make_node(f"http://127.0.0.1:{free_port()}", "node-a")
    alive = await make_node(engine.url, "node-b", running=5)  # busier, so least-load tries node-a first
    url, state = await start_scheduler([dead, alive])
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client, 2)
        reply = await client.post("/v1/chat/completions", json=CHAT)
        assert reply.status_code == 200
        assert reply.headers["x-symphony-node"] == "node-b"
        metrics = (await client.get("/metrics")).text
        assert 'symphony_dispatch_retries_total{node="node-a"} 1.0' in metrics
        # node-a stays out of rotation for a moment: the next request goes straight to node-b.
        assert (await client.post("/v1/chat/completions", json=CHAT)).headers["x-symphony-node"] == "node-b"
        assert state.dispatcher.inflight_total == 0


async def test_broken_stream_ends_with_an_error_event(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    url, state = await start_scheduler([await make_node(engine.url)])
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        body = {**CHAT, "stream": True, "messages": [{"role": "user", "content": "break"}]}
        async with client.stream("POST", "/v1/chat/completions", json=body) as stream:
            text = "".join([chunk async for chunk in stream.aiter_text()])
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == "engine_stream_broken"
        assert text.rstrip().endswith("data: [DONE]")
        assert state.dispatcher.inflight_total == 0


async def test_client_leaving_mid_stream_aborts_the_engine_request(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    url, state = await start_scheduler([await make_node(engine.url)])
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        body = {**CHAT, "stream": True, "messages": [{"role": "user", "content": "stall"}]}
        async with client.stream("POST", "/v1/chat/completions", json=body) as stream:
            async for chunk in stream.aiter_text():
                if "first" in chunk:
                    break  # leave after the first token
        await asyncio.wait_for(engine.disconnected.wait(), 10)
        await async_wait_until(lambda: state.dispatcher.inflight_total == 0, 10, "in-flight count back to 0")
        metrics = (await client.get("/metrics")).text
        assert 'symphony_requests_total{endpoint="chat",status="499"} 1.0' in metrics


async def test_a_client_leaving_after_the_last_event_of_a_stream_is_served_not_gone(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    """GuideLLM closes a stream once it has read `data: [DONE]`, which can be before the engine's end
    of stream reaches the scheduler: the client had its whole answer, a 200, not a 499."""
    url, state = await start_scheduler([await make_node(engine.url)])
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        body = {**CHAT, "stream": True, "messages": [{"role": "user", "content": "linger"}]}
        text = ""
        async with client.stream("POST", "/v1/chat/completions", json=body) as stream:
            async for chunk in stream.aiter_text():
                text += chunk
                if text.endswith("data: [DONE]\n\n"):
                    break
        await asyncio.wait_for(engine.disconnected.wait(), 10)
        await async_wait_until(lambda: state.dispatcher.inflight_total == 0, 10, "in-flight count back to 0")
        metrics = (await client.get("/metrics")).text
        assert 'symphony_requests_total{endpoint="chat",status="200"} 1.0' in metrics
        assert 'status="499"' not in metrics
        assert 'symphony_e2e_seconds_count{endpoint="chat",stream="true"} 1.0' in metrics


async def test_inflight_limit_answers_429(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    url, _ = await start_scheduler([await make_node(engine.url)], max_inflight_requests=1)
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        body = {**CHAT, "stream": True, "messages": [{"role": "user", "content": "stall"}]}
        async with client.stream("POST", "/v1/chat/completions", json=body) as stream:
            assert stream.status_code == 200
            second = await client.post("/v1/chat/completions", json=CHAT)
            assert second.status_code == 429
            assert second.json()["error"]["type"] == "rate_limit_error"


async def test_oversized_body_and_unknown_routes_get_openai_errors(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    url, _ = await start_scheduler([await make_node(engine.url)], max_body_bytes=1024)
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 4096}]}
        reply = await client.post("/v1/chat/completions", json=big)
        assert reply.status_code == 413
        assert "limit" in reply.json()["error"]["message"]
        missing = await client.get("/v1/nope")
        assert missing.status_code == 404 and missing.json()["error"]["message"] == "no such endpoint"
        wrong_method = await client.get("/v1/chat/completions")
        assert wrong_method.status_code == 405 and "error" in wrong_method.json()


async def test_advisory_pins_the_next_request_and_spreads_sessions(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    url, _ = await start_scheduler([await make_node(engine.url, "node-a"), await make_node(engine.url, "node-b")])
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client, 2)
        advised = {}
        for session in ("s1", "s2", "s3", "s4"):
            reply = await client.post("/v1/advisories", json={"session_id": session, "kind": "typing"})
            assert reply.status_code == 202
            advised[session] = reply.json()["node"]
        # Pending advisories count as load about to land, so four sessions split two and two.
        assert sorted(advised.values()) == ["node-a", "node-a", "node-b", "node-b"]
        for session, node in advised.items():
            reply = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": session})
            assert reply.headers["x-symphony-node"] == node
            assert reply.headers["x-symphony-route"] == "advisory"
        # The advisory is used up: the session's next request is routed by load again.
        reply = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s1"})
        assert reply.headers["x-symphony-route"].startswith("symphony")
        metrics = (await client.get("/metrics")).text
        assert 'symphony_advisory_followups_total{outcome="honored"} 4.0' in metrics
        assert 'symphony_advisories_total{kind="typing",outcome="routed"} 4.0' in metrics


async def test_advisory_for_a_node_that_went_down_is_rerouted(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    node_a, node_b = await make_node(engine.url, "node-a"), await make_node(engine.url, "node-b")
    url, _ = await start_scheduler([node_a, node_b])
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client, 2)
        advised = (await client.post("/v1/advisories", json={"session_id": "s", "kind": "typing"})).json()["node"]
        down, other = (node_a, "node-b") if advised == "node-a" else (node_b, "node-a")
        down.status.engine_state = node_pb2.ENGINE_STATE_RESTARTING
        await ready(client, 1)
        reply = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s"})
        assert reply.status_code == 200
        assert reply.headers["x-symphony-node"] == other
        assert reply.headers["x-symphony-route"] == "symphony_after_advisory"


async def test_an_advised_request_leaves_its_node_while_a_prefill_runs_there(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    """The advisory's node is honoured unless a request is still in its prefill there (a stream
    whose first token has not come back): the new request's prefill would start behind it."""
    node_a, node_b = await make_node(engine.url, "node-a"), await make_node(engine.url, "node-b")
    url, _ = await start_scheduler([node_a, node_b])
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        await ready(client, 2)
        nodes = {"node-a": node_a, "node-b": node_b}
        advised = {}
        for session in ("s", "p"):
            reply = await client.post("/v1/advisories", json={"session_id": session, "kind": "typing"})
            advised[session] = reply.json()["node"]
        # Two announced sessions split over the two nodes; move p's advisory onto s's node by
        # advising it again while the other node looks busy.
        other = "node-b" if advised["s"] == "node-a" else "node-a"
        nodes[other].status.num_requests_running = 9

        async def other_looks_busy() -> bool:
            return (await client.get("/readyz")).json()["nodes"][other]["running"] == 9

        await async_wait_until(other_looks_busy, 5, f"{other} to report 9 running")
        reply = await client.post("/v1/advisories", json={"session_id": "p", "kind": "typing"})
        assert reply.json()["node"] == advised["s"]
        held = {**CHAT, "stream": True, "messages": [{"role": "user", "content": "prefill"}]}

        async def stream_p() -> httpx.Response:
            async with client.stream("POST", "/v1/chat/completions", json=held, headers={"X-Session-ID": "p"}) as reply:
                await reply.aread()
                return reply

        prefill = asyncio.create_task(stream_p())

        async def prefilling_on_advised_node() -> bool:
            return (await client.get("/readyz")).json()["nodes"][advised["s"]]["prefilling"] == 1

        await async_wait_until(prefilling_on_advised_node, 5, "p's stream to be in its prefill")
        nodes[other].status.num_requests_running = 0

        async def other_looks_idle() -> bool:
            return (await client.get("/readyz")).json()["nodes"][other]["running"] == 0

        await async_wait_until(other_looks_idle, 5, f"{other} to report 0 running")
        reply = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s"})
        assert reply.status_code == 200
        assert reply.headers["x-symphony-node"] == other
        assert reply.headers["x-symphony-route"] == "symphony_after_advisory"
        engine.prefill_done.set()
        streamed = await prefill
        assert streamed.headers["x-symphony-node"] == advised["s"]
        assert streamed.headers["x-symphony-route"] == "advisory"

        async def no_prefill_left() -> bool:
            return all(n["prefilling"] == 0 for n in (await client.get("/readyz")).json()["nodes"].values())

        await async_wait_until(no_prefill_left, 5, "the stream's first token to end its prefill count")


async def test_model_whose_nodes_are_all_down_is_unavailable_not_unknown(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    node = await make_node(engine.url)
    url, _ = await start_scheduler([node])
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        node.status.engine_state = node_pb2.ENGINE_STATE_RESTARTING
        await _wait_status(client, 503)
        reply = await client.post("/v1/chat/completions", json=CHAT)
        assert reply.status_code == 503
        assert reply.json()["error"]["code"] == "no_engine_available"
        unknown = await client.post("/v1/chat/completions", json={**CHAT, "model": "other"})
        assert unknown.status_code == 404


SLOW = {**CHAT, "messages": [{"role": "user", "content": "slow"}]}


async def test_engine_that_never_answers_gives_504(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    url, state = await start_scheduler([await make_node(engine.url)], request_timeout_s=0.5)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        await ready(client)
        reply = await client.post("/v1/chat/completions", json=SLOW)
        assert reply.status_code == 504
        assert reply.json()["error"]["code"] == "engine_timeout"
        assert len(engine.requests) == 1, "a request the engine may be working on is not sent elsewhere"
        assert state.dispatcher.inflight_total == 0


async def test_client_leaving_a_plain_request_aborts_it_at_the_engine(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    url, state = await start_scheduler([await make_node(engine.url)])
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        pending = asyncio.create_task(client.post("/v1/chat/completions", json=SLOW))
        await async_wait_until(lambda: len(engine.requests) == 1, 10, "the engine to receive the request")
        pending.cancel()  # the client hangs up before the answer
        with pytest.raises(asyncio.CancelledError):
            await pending
    await asyncio.wait_for(engine.disconnected.wait(), 10)
    await async_wait_until(lambda: state.dispatcher.inflight_total == 0, 10, "in-flight count back to 0")


async def test_a_plain_request_counts_as_prefilling_until_its_engines_gauges_do(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    """A plain answer tells nothing of its first token: the request counts as prefilling on its
    node (what the next request's prefill would wait behind) until a status brings engine gauges
    read after it was sent, not for its whole generation and not never (a burst sent between two
    polls would otherwise all land on one node)."""
    node = await make_node(engine.url)
    node.status.metrics_age_ms = 250  # gauges read before anything is sent (still fresh: < 300 ms)
    url, state = await start_scheduler([node])
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        pending = asyncio.create_task(client.post("/v1/chat/completions", json=SLOW))
        await async_wait_until(lambda: len(engine.requests) == 1, 10, "the engine to receive the request")
        view = state.dispatcher.cluster.nodes[0]
        polled = view.last_status_at
        await async_wait_until(lambda: view.last_status_at > polled + 0.1, 5, "statuses with old gauges")
        assert (view.inflight, view.prefilling) == (1, 1), "old gauges do not count the request"
        node.status.metrics_age_ms = 0
        await async_wait_until(lambda: view.prefilling == 0, 5, "gauges read after the send to count it")
        assert view.inflight == 1 and view.prefilling_work.tokens == 0
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        await async_wait_until(lambda: view.inflight == 0, 10, "the request to end")
        # One that ends before any gauges count it leaves the count with it.
        node.status.metrics_age_ms = 250
        pending = asyncio.create_task(client.post("/v1/chat/completions", json=SLOW))
        await async_wait_until(lambda: view.prefilling == 1, 10, "the second request to be sent")
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        await async_wait_until(lambda: view.inflight == 0, 10, "the second request to end")
        node.status.metrics_age_ms = 0
        polled = view.last_status_at
        await async_wait_until(lambda: view.last_status_at > polled, 5, "a status with new gauges")
        assert view.prefilling == 0 and view.ungauged == 0


async def test_two_nodes_claiming_one_name_both_get_traffic(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    first, second = await make_node(engine.url, "node-0"), await make_node(engine.url, "node-0")
    url, _ = await start_scheduler([first, second])
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client, 2)
        names = set((await client.get("/readyz")).json()["nodes"])
        assert len(names) == 2 and "node-0" in names
        served = {(await client.post("/v1/chat/completions", json=CHAT)).headers["x-symphony-node"] for _ in range(4)}
        assert served == names


async def test_expired_advisories_stop_counting_as_load(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    url, state = await start_scheduler(
        [await make_node(engine.url, "node-a"), await make_node(engine.url, "node-b")], advisory_ttl_s=0.2
    )
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client, 2)
        for i in range(6):
            await client.post("/v1/advisories", json={"session_id": f"gone-{i}", "kind": "typing"})
        assert sum(state.advisories.pending_by_node.values()) == 6

        async def drained() -> bool:
            metrics = (await client.get("/metrics")).text
            return "symphony_advisories_pending 0.0" in metrics

        await async_wait_until(drained, 10, "expired advisories to be dropped")
        assert 'symphony_advisories_dropped_total{reason="expired"} 6.0' in (await client.get("/metrics")).text


async def test_the_kv_index_follows_each_nodes_block_stream(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    streaming = await make_node(engine.url, "node-0")
    silent = await make_node(engine.url, "node-1")  # a node manager without block events
    model = ModelFingerprint(streaming.status.model_fingerprint)
    keys = list(chain_block_keys(model, "default", list(range(96)), 32).block_keys)
    streaming.kv.blocks = keys
    url, state = await start_scheduler([streaming, silent])
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client, 2)
        await async_wait_until(lambda: state.kv_synced("node-0"), 10, "node-0's snapshot in the index")
        assert streaming.kv.watch_requests[0] == ("", 0), "a scheduler starts from each node's snapshot"
        assert state.kv_prefix(keys) == {"node-0": NodePrefix(3, dram=3)}
        assert not state.kv_synced("node-1")
        body = (await client.get("/readyz")).json()
        assert body["nodes"]["node-0"]["kv_index"]["state"] == "synced"
        assert body["nodes"]["node-0"]["kv_index"]["fallback"] is False
        assert body["nodes"]["node-1"]["kv_index"]["fallback"] is True
        assert body["kv_index"]["blocks"] == 3 and body["kv_index"]["max_blocks"] == 1_000_000
        assert _kv_index_text(body["nodes"]["node-0"]).startswith(" index=synced lag=")
        assert _kv_index_text(body["nodes"]["node-1"]).startswith(" index=fallback(no_events) ")
        metrics = (await client.get("/metrics")).text
        assert 'symphony_kv_index_fallback{node="node-0"} 0.0' in metrics
        assert 'symphony_kv_index_fallback{node="node-1"} 1.0' in metrics
        assert "symphony_kv_index_blocks 3.0" in metrics
        assert 'symphony_kv_watch_reconnects_total{reason="unimplemented"}' in metrics


async def test_a_regions_summary_prices_what_it_holds_by_the_tiers_its_index_saw(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    """/summary tells the global layer what loading (and reading out for a pull) the region's KV
    costs: node-0's 3 blocks on SSD and node-1's 1 in DRAM price a token at (3 SSD + 1 DRAM) / 4."""
    on_disk, in_memory = await make_node(engine.url, "node-0"), await make_node(engine.url, "node-1")
    model = ModelFingerprint(on_disk.status.model_fingerprint)
    on_disk.kv.blocks = list(chain_block_keys(model, "default", list(range(96)), 32).block_keys)
    on_disk.kv.blocks_tier = kv_pb2.TIER_SSD
    in_memory.kv.blocks = list(chain_block_keys(model, "other", list(range(32)), 32).block_keys)
    url, state = await start_scheduler([on_disk, in_memory])
    tiers = DEFAULT_PROFILE.tier_load_ms_per_token
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client, 2)
        await async_wait_until(
            lambda: state.kv_synced("node-0") and state.kv_synced("node-1"), 10, "both nodes' snapshots in the index"
        )
        summary = (await client.get("/summary")).json()
    expected = (3 * tiers.ssd + tiers.dram) / 4
    assert summary["held_load_ms_per_token"] == pytest.approx(expected)
    assert summary["held_read_ms_per_token"] == pytest.approx(expected)
    assert summary["pulled_load_ms_per_token"] == pytest.approx(tiers.dram)


async def test_the_kv_index_can_be_turned_off(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    node = await make_node(engine.url)
    node.kv.blocks = []
    url, state = await start_scheduler([node], kv_index_enabled=False)
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        body = (await client.get("/readyz")).json()
    assert "kv_index" not in body and "kv_index" not in body["nodes"]["node-0"]
    assert state.kv_prefix([]) == {} and not state.kv_synced("node-0")
    assert node.kv.watch_requests == []


async def test_a_node_under_another_cluster_secret_is_reported_and_sent_nothing(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    """Its engine would refuse this scheduler's engine key: a client gets a 503, not a 401."""
    secret = "this cluster's secret, 32 chars"
    node = await make_node(engine.url, secret_check=secret_check(secret.encode()))
    url, state = await start_scheduler([node], cluster={"secret": secret})
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        assert (await client.get("/readyz")).json()["nodes"]["node-0"]["same_secret"] is True
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        node.status.secret_check = secret_check(b"another cluster's secret")
        await async_wait_until(
            lambda: state.cluster.nodes[0].secret_check == node.status.secret_check, 10, "the node's next status"
        )
        shown = (await client.get("/readyz")).json()
        assert shown["nodes"]["node-0"]["same_secret"] is False
        assert shown["nodes"]["node-0"]["state"] == "foreign_secret"
        refused = await client.post("/v1/chat/completions", json=CHAT)
        assert refused.status_code == 503, refused.text
        assert len(engine.requests) == 1  # the first, before the change
    assert secret_check(b"") == b"" and len(secret_check(b"k")) == 8
    assert secret_check(b"k") == secret_check(b"k") != secret_check(b"j")
