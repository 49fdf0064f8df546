"""Serving through the scheduler with the official openai client: conversations, advisories, errors."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from client_sdk import AsyncSymphonyClient, SymphonyClient
from tests.e2e.conftest import LiveCluster
from tests.helpers import wait_until

pytestmark = pytest.mark.e2e
README = Path(__file__).resolve().parents[2] / "README.md"
QUESTIONS = ["What is the capital of France?", "And what is its most famous tower?", "How tall is it?"]


def _client(cluster: LiveCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_served_model(live_cluster: LiveCluster) -> None:
    models = _client(live_cluster).models.list()
    assert [m.id for m in models.data] == [live_cluster.model]


def _ask(
    client: openai.OpenAI, model: str, session: str, messages: list[dict[str, str]], stream: bool
) -> tuple[str, Any, dict[str, str]]:
    """One turn; returns (answer, usage, response headers)."""
    common: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": 40,
        "temperature": 0.0,
        "extra_headers": {"X-Session-ID": session},
    }
    if not stream:
        raw = client.chat.completions.with_raw_response.create(**common)
        completion = raw.parse()
        return completion.choices[0].message.content or "", completion.usage, dict(raw.headers)
    raw = client.chat.completions.with_raw_response.create(
        **common, stream=True, stream_options={"include_usage": True}
    )
    parts, usage = [], None
    for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    return "".join(parts), usage, dict(raw.headers)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
def test_three_turn_conversation(live_cluster: LiveCluster, stream: bool) -> None:
    client = _client(live_cluster)
    session = f"e2e-conversation-{'stream' if stream else 'plain'}"
    messages: list[dict[str, str]] = []
    prompt_tokens = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        answer, usage, headers = _ask(client, live_cluster.model, session, messages, stream)
        assert answer.strip(), f"empty answer to {question!r}"
        assert usage is not None and usage.completion_tokens >= 1
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert headers["x-symphony-node"] in ("node-0", "node-1")
        prompt_tokens.append(usage.prompt_tokens)
        messages.append({"role": "assistant", "content": answer})
    # Each turn carries the whole history, so the prompt grows turn after turn.
    assert prompt_tokens == sorted(prompt_tokens) and len(set(prompt_tokens)) == 3
    first_answer = messages[1]["content"]
    assert "paris" in first_answer.lower(), first_answer


def test_advisory_sends_turn_three_to_the_advised_node(live_cluster: LiveCluster) -> None:
    client = _client(live_cluster)
    sdk = SymphonyClient(live_cluster.url, model=live_cluster.model)
    before = _metric(live_cluster.metrics(), 'symphony_advisory_followups_total{outcome="honored"}')
    advised_nodes = set()
    for n in range(4):  # several sessions, so both nodes get advised at least once
        session = f"e2e-advised-{n}"
        messages: list[dict[str, str]] = []
        for turn, question in enumerate(QUESTIONS):
            if turn == 2:
                advisory = sdk.typing_started(session)
                assert advisory.session_id == session and advisory.kind == "typing"
                advised_nodes.add(advisory.node)
            messages.append({"role": "user", "content": question})
            answer, _, headers = _ask(client, live_cluster.model, session, messages, stream=n % 2 == 1)
            messages.append({"role": "assistant", "content": answer})
            if turn == 2:
                assert headers["x-symphony-node"] == advisory.node
                assert headers["x-symphony-route"] == "advisory"
    assert advised_nodes == {"node-0", "node-1"}
    after = _metric(live_cluster.metrics(), 'symphony_advisory_followups_total{outcome="honored"}')
    assert after - before == 4


def _metric(text: str, sample: str) -> float:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


BAD_INPUTS = [
    ("malformed-json", "/v1/chat/completions", b'{"messages": [', {}, 400, None),
    ("missing-messages", "/v1/chat/completions", {"max_tokens": 5}, {}, 400, "messages"),
    ("missing-prompt", "/v1/completions", {"max_tokens": 5}, {}, 400, "prompt"),
    (
        "unknown-model",
        "/v1/chat/completions",
        {"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]},
        {},
        404,
        "model",
    ),
    (
        "negative-max-tokens",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5},
        {},
        400,
        "max_tokens",
    ),
    ("absurd-max-tokens", "/v1/completions", {"prompt": "hi", "max_tokens": 10**12}, {}, 400, "max_tokens"),
    (
        "long-session-id",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}]},
        {"X-Session-ID": "s" * 500},
        400,
        "session_id",
    ),
    (
        "non-printable-session-id",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "session_id": "bad\x07id"},
        {},
        400,
        "session_id",
    ),
    ("unknown-advisory-kind", "/v1/advisories", {"session_id": "s", "kind": "dancing"}, {}, 400, "kind"),
    ("advisory-without-session", "/v1/advisories", {"kind": "typing"}, {}, 400, "session_id"),
    (
        "negative-arrival",
        "/v1/advisories",
        {"session_id": "s", "kind": "predecessor", "expected_arrival_ms": -1},
        {},
        400,
        "expected_arrival_ms",
    ),
]


@pytest.mark.parametrize(
    ("name", "path", "body", "headers", "status", "param"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_input_gets_a_4xx_openai_error(
    live_cluster: LiveCluster, name: str, path: str, body: Any, headers: dict[str, str], status: int, param: str | None
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = httpx.post(
        live_cluster.url + path, content=content, headers={"content-type": "application/json", **headers}, timeout=30
    )
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param
    # The scheduler stays healthy and keeps serving after every bad request.
    assert httpx.get(live_cluster.url + "/healthz", timeout=5).status_code == 200


def test_scheduler_serves_after_bad_inputs(live_cluster: LiveCluster) -> None:
    with pytest.raises(openai.NotFoundError):
        _client(live_cluster).chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(openai.BadRequestError):
        _client(live_cluster).chat.completions.create(model=live_cluster.model, messages=[], max_tokens=5)
    reply = _client(live_cluster).chat.completions.create(
        model=live_cluster.model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8
    )
    assert reply.choices[0].message.content


def test_metrics_count_requests_ttft_and_routing(live_cluster: LiveCluster) -> None:
    # The test's own traffic, counted as differences: the metrics owe nothing to the tests before.
    before = live_cluster.metrics()
    client = _client(live_cluster)
    question = [
        {"role": "system", "content": f"Metrics test {uuid.uuid4().hex}."},
        {"role": "user", "content": "Say hi."},
    ]
    # A streamed turn held generating on one node: a turn sent meanwhile goes to the other. The two
    # prompts share no block (each opens with its own system message), so no node holds any of the
    # second one's KV and the load decides, not the prefix cost.
    raw = client.chat.completions.with_raw_response.create(
        model=live_cluster.model,
        messages=question,
        max_tokens=64,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Session-ID": "e2e-metrics-held"},
    )
    chunks = iter(raw.parse())
    next(c for c in chunks if c.choices and c.choices[0].delta.content)  # its first token: a TTFT
    held = raw.headers["x-symphony-node"]
    (other,) = {"node-0", "node-1"} - {held}
    # Least load needs the scheduler to see the held turn, and the other node ready and idle: on a
    # loaded 2-core host a late status poll can leave that node briefly unroutable.
    wait_until(
        lambda: _sees_one_busy_node(live_cluster.readyz()["nodes"], held, other),
        30,
        f"the scheduler to see {held} busy and {other} ready and idle",
        interval_s=0.1,
    )
    beside = [{"role": "system", "content": f"Metrics test {uuid.uuid4().hex}."}, question[-1]]
    _, _, headers = _ask(client, live_cluster.model, "e2e-metrics-beside", beside, stream=False)
    assert headers["x-symphony-node"] == other, (headers.get("x-symphony-route"), live_cluster.readyz())
    assert sum(1 for _ in chunks) > 0  # the held turn runs to its end
    bad = httpx.post(live_cluster.url + "/v1/chat/completions", json={"max_tokens": 5}, timeout=30)
    unknown = httpx.post(
        live_cluster.url + "/v1/chat/completions", json={"model": "gpt-17", "messages": question}, timeout=30
    )
    assert (bad.status_code, unknown.status_code) == (400, 404)
    advised = SymphonyClient(live_cluster.url, model=live_cluster.model).typing_started("e2e-metrics-advised")
    _, _, headers = _ask(client, live_cluster.model, "e2e-metrics-advised", question, stream=False)
    assert headers["x-symphony-node"] == advised.node

    after = live_cluster.metrics()

    def grew(sample: str) -> float:
        return _metric(after, sample) - _metric(before, sample)

    assert grew('symphony_requests_total{endpoint="chat",status="200"}') >= 2
    assert grew('symphony_requests_total{endpoint="chat",status="400"}') >= 1
    assert grew('symphony_requests_total{endpoint="chat",status="404"}') >= 1
    assert grew('symphony_ttft_seconds_count{endpoint="chat",priority="normal"}') >= 1
    assert grew('symphony_e2e_seconds_count{endpoint="chat",stream="false"}') >= 2
    for node in ("node-0", "node-1"):
        assert _routed(after, node) - _routed(before, node) >= 1, node
    assert _metric(after, 'symphony_node_up{node="node-0"}') == 1.0
    assert _metric(after, 'symphony_node_up{node="node-1"}') == 1.0
    assert grew('symphony_advisories_total{kind="typing",outcome="routed"}') >= 1


def _sees_one_busy_node(nodes: dict[str, Any], busy: str, idle: str) -> bool:
    return (
        nodes[busy]["inflight"] == 1
        and nodes[idle]["state"] == "ready"
        and nodes[idle]["running"] == nodes[idle]["waiting"] == nodes[idle]["inflight"] == 0
    )


def _routed(text: str, node: str) -> float:
    """Requests routed to `node`, whatever the reason."""
    return sum(float(v) for v in re.findall(rf'symphony_routed_total{{node="{node}",[^}}]*}} (\S+)', text))


def test_readme_sdk_examples_run(live_cluster: LiveCluster) -> None:
    examples = re.findall(r"<!-- sdk-example -->\s*```python\n(.*?)```", README.read_text(), re.S)
    assert len(examples) >= 2, "README's SDK example blocks (chat frontend, agent)"
    env = {**os.environ, "SYMPHONY_URL": live_cluster.url}
    for code in examples:
        assert len([line for line in code.splitlines() if line.strip()]) <= 5
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip()


def test_async_sdk_streams_a_turn(live_cluster: LiveCluster) -> None:
    async def run() -> str:
        async with AsyncSymphonyClient(live_cluster.url) as client:
            advisory = await client.typing_started("e2e-async")
            assert advisory.node in ("node-0", "node-1")
            stream = await client.chat(
                "e2e-async", [{"role": "user", "content": "Count to three."}], stream=True, max_tokens=16
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    assert asyncio.run(run()).strip()


def test_status_cli_shows_both_nodes(live_cluster: LiveCluster) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "symphony.cli", "status", "--url", live_cluster.url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"node-0\s+ready", done.stdout) and re.search(r"node-1\s+ready", done.stdout)
    # Each engine's KV capacity, read from vLLM's cache config (the cluster's 512-block override):
    # what the `symphony` policy takes the KV usage gauge as a fraction of.
    assert len(re.findall(r"of 16384 tokens", done.stdout)) == 2, done.stdout
    assert {n["kv_cache_tokens"] for n in live_cluster.readyz()["nodes"].values()} == {512 * 32}


def test_client_leaving_mid_stream_aborts_the_generation(live_cluster: LiveCluster) -> None:
    client = _client(live_cluster)
    raw = client.chat.completions.with_raw_response.create(
        model=live_cluster.model,
        messages=[{"role": "user", "content": "Write a very long story."}],
        max_tokens=4000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    node = raw.headers["x-symphony-node"]
    stream = raw.parse()
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    wait_until(lambda: live_cluster.node_state(node)["running"] >= 1, 10, "the engine to report the request")
    stream.close()
    # 4,000 forced tokens would keep the engine busy for minutes; an aborted request frees it at once.
    wait_until(
        lambda: live_cluster.node_state(node)["running"] == 0 and live_cluster.node_state(node)["inflight"] == 0,
        15,
        "the engine to drop the abandoned request",
    )


def test_proxy_bench_writes_its_keys(live_cluster: LiveCluster, tmp_path: Path) -> None:
    # A smoke run of the benchmark's code path against the session cluster (figures come from the
    # full run, which starts a private 1-node cluster).
    out, plot = tmp_path / "proxy.json", tmp_path / "proxy.png"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "symphony.cli",
            "bench",
            "proxy",
            "--out",
            str(out),
            "--plot",
            str(plot),
            "--scheduler-url",
            live_cluster.url,
            "--engine-url",
            f"http://127.0.0.1:{live_cluster.engine_ports[0]}",
            "--concurrency",
            "2",
            "--rounds",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        # The cluster's home: the secret its engines' key and the signed params come from.
        env={**os.environ, "SYMPHONY_HOME": str(live_cluster.home)},
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    for key in (
        "direct_ttft_ms_p50",
        "direct_ttft_ms_p99",
        "via_scheduler_ttft_ms_p50",
        "via_scheduler_ttft_ms_p99",
        "overhead_ms_p50",
    ):
        assert isinstance(result[key], float), key
    assert result["samples_per_path"] == 4
    assert 0 < result["direct_ttft_ms_p50"] < 60_000
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
