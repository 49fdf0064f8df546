"""The cluster KV index on the live cluster: a node's engine and tiers report the blocks a turn
computed (vLLM's own events and the store's), the scheduler's index applies them, and a new session
of the same tenant whose prompt starts with the same system prompt is routed by content to the node
that holds it, without any session history there; or, with that node busy, to the idle one, which
pulls the prompt's KV over under the name of the session that computed it."""

from __future__ import annotations

import re
import uuid
from typing import Any

import openai
import pytest

from tests.e2e.conftest import LiveCluster
from tests.e2e.index_support import wait_for_content_routing, wait_indexed
from tests.helpers import wait_until

pytestmark = pytest.mark.e2e
SYSTEM = (
    "You are the support assistant of a company that runs language models for its customers. "
    "Answer briefly and politely, name the relevant product, and never invent prices. "
) * 12  # about 400 tokens: a dozen KV blocks that the second session need not compute again


def _metric(metrics: str, sample: str) -> float:
    found = re.search(rf"^{re.escape(sample)} (\S+)$", metrics, re.M)
    return float(found.group(1)) if found else 0.0


def _located(metrics: str, source: str) -> float:
    found = re.search(rf'symphony_kv_located_total{{source="{source}"}} (\S+)', metrics)
    return float(found.group(1)) if found else 0.0


def _chat(cluster: LiveCluster, session: str, system: str, question: str) -> str:
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    raw = client.chat.completions.with_raw_response.create(
        model=cluster.model,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=4,
        temperature=0.0,
        extra_headers={"X-Session-ID": session},
    )
    assert raw.parse().choices[0].message.content is not None
    return raw.headers["x-symphony-node"]


def test_a_shared_system_prompt_draws_a_new_session_to_the_node_that_holds_it(live_cluster: LiveCluster) -> None:
    before = _located(live_cluster.metrics(), "index")
    wait_for_content_routing(live_cluster.url, live_cluster.model)
    tag = uuid.uuid4().hex[:8]
    system = f"[{tag}] {SYSTEM}"  # this test's own blocks: no earlier run's cache holds them
    first = _chat(live_cluster, f"prefix-a-{tag}", system, "Which product answers chats?")
    asked = [{"role": "system", "content": system}, {"role": "user", "content": "Which product answers chats?"}]
    wait_indexed(live_cluster, first, asked, "engine")
    # A new session: the same system prompt, another question. Both nodes are idle (as the scheduler
    # sees them: a status polled while the first turn ran would make its node look busy, and the
    # other node could then pull the prompt from it), so the prefix the first node's engine holds
    # decides: it costs nothing to load there and a pull to the other.
    wait_until(lambda: _sees_idle(live_cluster.readyz()["nodes"]), 30, "the scheduler to see both nodes idle")
    second = _chat(live_cluster, f"prefix-b-{tag}", system, "And which one summarises documents?")
    assert second == first, [line for line in live_cluster.metrics().splitlines() if "kv_located" in line]
    assert _located(live_cluster.metrics(), "index") - before >= 2


def test_a_new_session_sent_past_a_busy_holder_pulls_the_prompts_kv_from_it(live_cluster: LiveCluster) -> None:
    """A session computes a prompt on node X. With X busy generating, a new session with the very
    same messages is sent to idle Y, which pulls the first session's pages from X (its name is the
    only one under which a node serves pages) before the engine prefills: the engine finds all but
    the prompt's last block loaded, and answers as X did at temperature 0."""
    wait_for_content_routing(live_cluster.url, live_cluster.model)
    client = openai.OpenAI(base_url=live_cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    tag = uuid.uuid4().hex[:8]
    messages = [
        {"role": "system", "content": f"[{tag}] {SYSTEM}"},
        {"role": "user", "content": "Which product summarises documents?"},
    ]

    def ask(session: str) -> tuple[str, str, int]:
        raw = client.chat.completions.with_raw_response.create(
            model=live_cluster.model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=12,
            temperature=0.0,
            extra_headers={"X-Session-ID": session},
        )
        reply = raw.parse()
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        cached = reply.usage.prompt_tokens_details.cached_tokens or 0
        return raw.headers["x-symphony-node"], reply.choices[0].message.content or "", cached

    holder, answer, _ = ask(f"donor-{tag}")
    (other,) = {"node-0", "node-1"} - {holder}
    assert wait_indexed(live_cluster, holder, messages, "dram") >= 12
    # Busy: a turn of another session sharing the system prompt, generating past its first token.
    # With both nodes idle as the scheduler sees them, it goes to the holder too.
    wait_until(lambda: _sees_idle(live_cluster.readyz()["nodes"]), 30, "the scheduler to see both nodes idle")
    held = client.chat.completions.with_raw_response.create(
        model=live_cluster.model,
        messages=[messages[0], {"role": "user", "content": "Tell me about every product, at length."}],
        max_tokens=160,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Session-ID": f"busy-{tag}"},
    )
    chunks = iter(held.parse())
    next(c for c in chunks if c.choices and c.choices[0].delta.content)
    assert held.headers["x-symphony-node"] == holder
    wait_until(
        lambda: _sees_one_busy_node(live_cluster.readyz()["nodes"], holder, other),
        30,
        f"the scheduler to see {holder} busy and {other} ready and idle",
        interval_s=0.1,
    )
    before = _metric(live_cluster.metrics(), 'symphony_route_prefix_pulls_total{outcome="ready"}')
    served, pulled_answer, cached = ask(f"pulled-{tag}")
    assert served == other, [line for line in live_cluster.metrics().splitlines() if "pull" in line]
    assert _metric(live_cluster.metrics(), 'symphony_route_prefix_pulls_total{outcome="ready"}') == before + 1
    assert cached >= 12 * 32, "the pulled pages were loaded, not recomputed"
    assert pulled_answer == answer
    assert sum(1 for _ in chunks) > 0  # the busy turn runs to its end


def _sees_one_busy_node(nodes: dict[str, Any], busy: str, idle: str) -> bool:
    return (
        nodes[busy]["inflight"] == 1
        and nodes[idle]["state"] == "ready"
        and nodes[idle]["running"] == nodes[idle]["waiting"] == nodes[idle]["inflight"] == 0
    )


def _sees_idle(nodes: dict[str, Any]) -> bool:
    return all(n["state"] == "ready" and n["running"] == n["waiting"] == n["inflight"] == 0 for n in nodes.values())
