"""The cluster KV index on the live cluster: a node's engine and tiers report the blocks a turn
computed (vLLM's own events and the store's), the scheduler's index applies them, and a new session
of the same tenant whose prompt starts with the same system prompt is routed by content to the node
that holds it, without any session history there."""

from __future__ import annotations

import re
import uuid

import openai
import pytest

from tests.e2e.conftest import LiveCluster
from tests.helpers import wait_until

pytestmark = pytest.mark.e2e
TIMEOUT_S = 60
SYSTEM = (
    "You are the support assistant of a company that runs language models for its customers. "
    "Answer briefly and politely, name the relevant product, and never invent prices. "
) * 12  # about 400 tokens: a dozen KV blocks that the second session need not compute again


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
    # Both nodes' indexes must be current, and the scheduler's tokenizer loaded (it loads in the
    # background at start): routing prices nodes by content only then, by session hints before.
    wait_until(
        lambda: all(n.get("kv_index", {}).get("state") == "synced" for n in live_cluster.readyz()["nodes"].values()),
        TIMEOUT_S,
        "both nodes' block streams to be in sync",
    )
    wait_until(
        lambda: live_cluster.readyz()["tokenizers"].get(live_cluster.model) == "ready",
        TIMEOUT_S,
        "the scheduler's tokenizer to load",
    )
    tag = uuid.uuid4().hex[:8]
    system = f"[{tag}] {SYSTEM}"  # this test's own blocks: no earlier run's cache holds them
    first = _chat(live_cluster, f"prefix-a-{tag}", system, "Which product answers chats?")

    def engine_blocks() -> int:
        return int(live_cluster.node_state(first)["kv_index"]["blocks"]["engine"])

    wait_until(lambda: engine_blocks() >= 10, TIMEOUT_S, f"the index to see {first}'s engine cache hold the prompt")
    # A new session: the same system prompt, another question. Both nodes are idle, so the prefix
    # the first node's engine holds decides.
    second = _chat(live_cluster, f"prefix-b-{tag}", system, "And which one summarises documents?")
    assert second == first, [line for line in live_cluster.metrics().splitlines() if "kv_located" in line]
    assert _located(live_cluster.metrics(), "index") - before >= 2
