"""The scheduler's KV index rebuilt from the nodes after the scheduler crashes, on the live cluster.

A turn leaves its system prompt's blocks in a node's engine (vLLM's own KV events) and in its DRAM
and SSD (the connector's save, the node store's events). The scheduler is killed (SIGKILL) and
`symphony up` starts it again. Within a second of the new scheduler answering /readyz as ready, its
index holds for every node exactly what the node's own WatchBlocks snapshot names (same epoch and
seq, same blocks per tier), and a new session of the same tenant with the same system prompt, sent
at once, goes to the node that holds it: the restarted scheduler has no session history, only the
index, to find it with, and while its own tokenizer loads an engine's /tokenize gives the ids.

The figures (process start, first answer, ready, index synced, tokenizer loaded, routed; all as a
poller of /readyz saw them) are printed. The bound asserted is the claimed one: from ready to the
index in sync and the request routed on it; the tokenizer's load is reported, not bounded (it takes
seconds: transformers)."""

from __future__ import annotations

import os
import re
import signal
import time
import uuid
from typing import Any

import psutil
import pytest

from symphony.tenancy import DEFAULT_TENANT
from tests.e2e.conftest import LiveCluster
from tests.e2e.index_support import (
    Holdings,
    IndexView,
    ReadyzPoller,
    chat,
    node_holdings,
    nodes,
    prompt_keys,
    store_fingerprint,
)
from tests.helpers import wait_until

pytestmark = pytest.mark.e2e
TIMEOUT_S = 60
RESTART_TIMEOUT_S = 180  # the launcher's back-off, then a Python process starting on a loaded host
BOUND_S = 1.0  # the claim: a restarted scheduler routes with the same knowledge within one second
SYSTEM = (
    "You are the travel desk of a company that books trains for its staff. Answer briefly, name "
    "the station and the platform, and never promise a seat that is not booked. "
) * 12  # about 400 tokens: a dozen blocks


def _located(metrics: str, source: str) -> float:
    found = re.search(rf'symphony_kv_located_total{{source="{source}"}} (\S+)', metrics)
    return float(found.group(1)) if found else 0.0


def _from_engine(metrics: str) -> float:
    found = re.search(r'symphony_token_ids_from_engine_total{outcome="ok"} (\S+)', metrics)
    return float(found.group(1)) if found else 0.0


def _matches(shown: dict[str, dict[str, Any]], held: dict[str, Holdings]) -> bool:
    """Per node, the index (as /readyz shows it) is at the snapshot's point with its blocks."""
    views = {name: IndexView.of(shown.get(name, {})) for name in held}
    return all(view is not None and view.matches(held[name]) for name, view in views.items())


def _in_step(url: str, addresses: dict[str, str]) -> dict[str, Holdings] | None:
    """Every node's snapshot, if the scheduler's index matches each of them now."""
    held = {name: node_holdings(address) for name, address in addresses.items()}
    return held if _matches(nodes(url), held) else None


def test_a_restarted_scheduler_rebuilds_its_index_from_the_nodes_within_a_second_and_routes_on_it(
    live_cluster: LiveCluster,
) -> None:
    url, model = live_cluster.url, live_cluster.model
    wait_until(
        lambda: all(n.get("kv_index", {}).get("state") == "synced" for n in nodes(url).values()),
        TIMEOUT_S,
        "both nodes' block streams to be in sync",
    )
    tag = uuid.uuid4().hex[:8]
    system = f"[{tag}] {SYSTEM}"  # this test's own blocks

    def messages(question: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": system}, {"role": "user", "content": question}]

    first = chat(url, model, f"restart-a-{tag}", messages("Which platform for Lyon?"))
    cluster = nodes(url)
    addresses = {name: str(node["address"]) for name, node in cluster.items()}
    holder = cluster[first.node]
    keys = prompt_keys(
        str(holder["engine_url"]),
        model,
        messages("Which platform for Lyon?"),
        store_fingerprint(addresses[first.node]),
        DEFAULT_TENANT,
        live_cluster.engine_headers,
    )
    assert len(keys) >= 10
    wait_until(
        lambda: all(node_holdings(addresses[first.node]).holds(tier, keys) for tier in ("engine", "dram", "ssd")),
        TIMEOUT_S,
        f"{first.node} to hold the prompt's blocks in its engine, DRAM and SSD",
    )
    # Quiet nodes (the turn's saves done) and the running scheduler's index in step with them.
    before: dict[str, Holdings] = {}

    def quiet() -> bool:
        held = _in_step(url, addresses)
        before.update(held or {})
        return held is not None

    wait_until(quiet, TIMEOUT_S, "the nodes to be quiet and the index in step with them")

    old = live_cluster.scheduler_pid()
    with ReadyzPoller(url) as poller:
        os.kill(old, signal.SIGKILL)
        wait_until(
            lambda: not psutil.pid_exists(old) or psutil.Process(old).status() == psutil.STATUS_ZOMBIE,
            10,
            "the killed scheduler to be gone",
        )
        dead = time.time()  # every answer from now on is the new scheduler's
        answered = poller.wait(lambda s: s.nodes is not None, RESTART_TIMEOUT_S, "the new scheduler to answer", dead)
        started = psutil.Process(live_cluster.scheduler_pid()).create_time()
        ready = poller.wait(lambda s: s.status == 200, TIMEOUT_S, "the new scheduler to be ready", dead)
        synced = poller.wait(
            lambda s: s.nodes is not None and _matches(s.nodes, before), TIMEOUT_S, "the index to match the nodes", dead
        )
        # At once: a new session of the same tenant and system prompt, which only the index can place.
        # The tokenizer is most likely still loading: an engine's /tokenize gives the ids meanwhile.
        tokenizer_then = (synced.tokenizers or {}).get(model)
        from_engine = _from_engine(live_cluster.metrics())
        routed_at = time.time()
        second = chat(url, model, f"restart-b-{tag}", messages("And which platform for Turin?"))
        tokenizer = poller.wait(
            lambda s: (s.tokenizers or {}).get(model) == "ready", TIMEOUT_S, "the tokenizer to load", dead
        )

    figures = {
        "process_start_to_first_answer_s": round(answered.received - started, 3),
        "first_answer_to_ready_s": round(ready.received - answered.received, 3),
        "ready_to_index_synced_s": round(synced.received - ready.received, 3),
        "ready_to_tokenizer_s": round(tokenizer.received - ready.received, 3),
        "ready_to_routed_s": round(routed_at - ready.received, 3),
        "process_start_to_index_synced_s": round(synced.received - started, 3),
        "readyz_round_trip_s": round(synced.received - synced.sent, 3),
        "blocks": {name: held.counts() for name, held in before.items()},
    }
    print("scheduler restart:", figures)
    # The nodes held the same all along: the index matched what they hold, not an earlier state.
    assert {name: node_holdings(address) for name, address in addresses.items()} == before
    assert (second.node, second.route) == (first.node, "symphony_local_kv"), figures
    assert second.cached_tokens >= 10 * 32, "the engine's own cache served the shared prompt"
    assert _located(live_cluster.metrics(), "index") >= 1
    assert synced.received - ready.received <= BOUND_S, figures
    assert routed_at - ready.received <= BOUND_S, figures
    if tokenizer_then == "loading":
        assert _from_engine(live_cluster.metrics()) >= from_engine + 1, "the ids came from an engine's /tokenize"
