"""An advisory for a session whose last prompt its node's engine still caches (as the scheduler's KV
index, fed by the engine's own events, says) moves nothing: a move would bring the engine nothing
and cost it a warm-up forward pass. The turn that follows counts as advised with its KV ready. Once
the engine's cache is emptied, the KV is in the node's DRAM only; on this host's costs loading it at
the next turn's arrival is cheaper than a warm-up pass, so that advisory moves nothing either, and
the turn still finds its history cached."""

from __future__ import annotations

import re
import uuid

import httpx
import pytest

from tests.e2e.conftest import LiveCluster, reset_engine_cache
from tests.e2e.index_support import chat, node_holdings, nodes, wait_for_content_routing, wait_indexed
from tests.helpers import wait_until

pytestmark = pytest.mark.e2e
SYSTEM = "You answer questions about the history of computing, briefly and precisely. " * 12  # ~170 tokens


def _metric(cluster: LiveCluster, sample: str) -> float:
    found = re.search(rf"^{re.escape(sample)} (\S+)$", cluster.metrics(), re.M)
    return float(found.group(1)) if found else 0.0


def _advise(cluster: LiveCluster, session: str) -> str:
    reply = httpx.post(cluster.url + "/v1/advisories", json={"session_id": session, "kind": "typing"}, timeout=10)
    assert reply.status_code == 202, reply.text
    return str(reply.json()["node"])


def test_an_advisory_moves_nothing_into_an_engine_that_caches_the_session(live_cluster: LiveCluster) -> None:
    wait_for_content_routing(live_cluster.url, live_cluster.model)
    session = f"in-engine-{uuid.uuid4().hex[:8]}"
    messages = [
        {"role": "system", "content": f"[{session}] {SYSTEM}"},
        {"role": "user", "content": "Who built the first stored-program computer?"},
    ]
    node = chat(live_cluster.url, live_cluster.model, session, messages).node
    blocks = wait_indexed(live_cluster, node, messages, "engine")
    # As the scheduler sees them, both nodes idle: the advisory goes where the session's KV is.
    wait_until(lambda: live_cluster.settled(), 30, "the scheduler to see every node idle")

    in_engine = 'symphony_prefetches_total{outcome="in_engine"}'
    done = 'symphony_prefetches_total{outcome="done"}'
    on_arrival = 'symphony_prefetches_total{outcome="loads_on_arrival"}'
    ready = 'symphony_advised_requests_total{kind="typing",kv_ready="yes"}'
    before = {sample: _metric(live_cluster, sample) for sample in (in_engine, on_arrival, done, ready)}
    assert _advise(live_cluster, session) == node
    assert _metric(live_cluster, in_engine) == before[in_engine] + 1
    messages += [{"role": "assistant", "content": "The Manchester Baby."}, {"role": "user", "content": "When?"}]
    turn = chat(live_cluster.url, live_cluster.model, session, messages)
    assert (turn.node, turn.route) == (node, "advisory")
    assert turn.cached_tokens >= blocks * 32, "the engine's own cache served the history"
    assert _metric(live_cluster, ready) == before[ready] + 1
    assert _metric(live_cluster, done) == before[done], "no move was asked for"

    # The engine forgets everything; the index hears of it from the engine's events, which vLLM
    # sends with its next step's: a one-token request straight to the engine makes one.
    engine_url = str(nodes(live_cluster.url)[node]["engine_url"])
    reset_engine_cache(engine_url, live_cluster.engine_headers)
    step = httpx.post(
        engine_url + "/v1/completions",
        json={"model": live_cluster.model, "prompt": "Hi", "max_tokens": 1},
        timeout=60,
        headers=live_cluster.engine_headers,
    )
    assert step.status_code == 200, step.text
    address = str(nodes(live_cluster.url)[node]["address"])
    wait_until(lambda: not node_holdings(address).keys.get("engine"), 30, f"{node}'s engine cache to be empty")
    wait_until(
        lambda: nodes(live_cluster.url)[node]["kv_index"]["blocks"]["engine"] == 0,
        30,
        "the index to see the engine cache emptied",
    )
    # Its KV is in the node's DRAM now: on this host's costs (the default profile, a 2-core CPU),
    # loading it at the turn's arrival costs far less than the warm-up pass a move would end in.
    wait_until(lambda: live_cluster.settled(), 30, "the scheduler to see every node idle")
    assert _advise(live_cluster, session) == node
    assert _metric(live_cluster, in_engine) == before[in_engine] + 1
    assert _metric(live_cluster, on_arrival) == before[on_arrival] + 1
    messages += [{"role": "assistant", "content": "In 1948."}, {"role": "user", "content": "Where?"}]
    turn = chat(live_cluster.url, live_cluster.model, session, messages)
    assert (turn.node, turn.route) == (node, "advisory")
    assert turn.cached_tokens >= blocks * 32, "the node's tiers served the history"
    assert _metric(live_cluster, done) == before[done], "no move was asked for"
