"""Evictions reach the scheduler's KV index within one status-poll period (`scheduler.poll_interval_ms`)
on the live cluster: the node dropping a session's DRAM copies (DemoteSession, which publishes the
REMOVED events any DRAM eviction does) and vLLM dropping its own prefix cache (/reset_prefix_cache:
vLLM's AllBlocksCleared, which it publishes with its next step's events).

Each is timed from when the node published the change (its batch's `published_unix_ms`, replayed
from the node's stream after the change) to the first /readyz answer showing the index past that
batch, an upper bound (the answer's arrival). The engine's is also reported from the answer of the
request whose step carried vLLM's event. Figures are printed; the bound asserted is the claimed one."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import grpc
import httpx
import pytest

from symphony.config import load_config
from symphony.rpc import kv_pb2, kv_pb2_grpc
from symphony.tenancy import DEFAULT_TENANT
from tests.e2e.conftest import LiveCluster, reset_engine_cache
from tests.e2e.index_support import (
    Holdings,
    IndexView,
    ReadyzPoller,
    Sample,
    chat,
    node_holdings,
    nodes,
    prompt_keys,
    store_fingerprint,
)
from tests.helpers import wait_until

pytestmark = pytest.mark.e2e
TIMEOUT_S = 60
SYSTEM = (
    "You are the archivist of a city library. Answer briefly, give the shelf and the call number, "
    "and say when a book is out on loan rather than guessing. "
) * 12  # about 400 tokens: a dozen blocks


@dataclass(frozen=True)
class Change:
    seq: int
    published_s: float


def _changes(address: str, epoch: str, after_seq: int, kind: int, tier: int) -> list[Change]:
    """The node's batches after `after_seq` with an event of `kind` in `tier`, replayed from its ring."""
    found = []
    with grpc.insecure_channel(address) as channel:
        call = kv_pb2_grpc.KVStoreStub(channel).WatchBlocks(
            kv_pb2.WatchBlocksRequest(epoch=epoch, after_seq=after_seq), timeout=30
        )
        try:
            for batch in call:
                assert not batch.snapshot_begin, "the node's ring holds what happened since"
                if not batch.events:  # a heartbeat: the replay is done
                    break
                if any(e.kind == kind and e.tier == tier for e in batch.events):
                    found.append(Change(batch.seq, batch.published_unix_ms / 1000))
        finally:
            call.cancel()
    return found


def _seen_within(poller: ReadyzPoller, node: str, epoch: str, changes: list[Change]) -> float:
    """Seconds from each change's publishing to the first answer showing the index past it: the most."""
    assert changes
    worst = 0.0
    for change in changes:

        def past(sample: Sample, seq: int = change.seq) -> bool:
            view = IndexView.of((sample.nodes or {}).get(node, {}))
            return view is not None and view.epoch == epoch and view.seq >= seq

        seen = poller.wait(past, TIMEOUT_S, f"the index to apply {node}'s batch {change.seq}")
        worst = max(worst, seen.received - change.published_s)
    return worst


def _in_step(url: str, node: str, address: str) -> Holdings | None:
    held = node_holdings(address)
    view = IndexView.of(nodes(url)[node])
    return held if view is not None and view.matches(held) else None


def test_evictions_by_the_node_and_by_the_engine_reach_the_index_within_one_poll_period(
    live_cluster: LiveCluster,
) -> None:
    url, model = live_cluster.url, live_cluster.model
    poll_s = load_config(live_cluster.home / "symphony.toml", env={}).scheduler.poll_interval_ms / 1000
    wait_until(
        lambda: all(n.get("kv_index", {}).get("state") == "synced" for n in nodes(url).values()),
        TIMEOUT_S,
        "both nodes' block streams to be in sync",
    )
    tag = uuid.uuid4().hex[:8]
    session = f"evict-{tag}"
    messages = [{"role": "system", "content": f"[{tag}] {SYSTEM}"}, {"role": "user", "content": "Where is Ulysses?"}]
    turn = chat(url, model, session, messages)
    node = nodes(url)[turn.node]
    address, engine_url = str(node["address"]), str(node["engine_url"])
    keys = prompt_keys(
        engine_url, model, messages, store_fingerprint(address), DEFAULT_TENANT, live_cluster.engine_headers
    )
    assert len(keys) >= 10

    def saved() -> bool:
        held = node_holdings(address)
        return all(held.holds(tier, keys) for tier in ("engine", "dram", "ssd"))

    wait_until(saved, TIMEOUT_S, f"{turn.node} to hold the prompt's blocks in its engine, DRAM and SSD")
    figures: dict[str, float] = {"poll_period_s": poll_s}
    with ReadyzPoller(url) as poller:
        # The node: the session's DRAM copies go (SSD keeps them).
        wait_until(lambda: _in_step(url, turn.node, address) is not None, TIMEOUT_S, "the index in step")
        start = node_holdings(address)
        with grpc.insecure_channel(address) as channel:
            kv_pb2_grpc.KVStoreStub(channel).DemoteSession(
                kv_pb2.DemoteRequest(
                    session=kv_pb2.SessionRef(tenant=DEFAULT_TENANT, session_id=session), tier=kv_pb2.TIER_DRAM
                ),
                timeout=60,
            )
        demoted = _changes(address, start.epoch, start.seq, kv_pb2.BLOCK_EVENT_REMOVED, kv_pb2.TIER_DRAM)
        figures["node_eviction_to_index_s"] = round(_seen_within(poller, turn.node, start.epoch, demoted), 3)
        after = node_holdings(address)
        assert not set(keys) & after.keys.get("dram", frozenset()) and after.holds("ssd", keys)

        # The engine: vLLM drops its prefix cache; its next step (a request under one block, which
        # caches nothing) carries the event.
        wait_until(lambda: _in_step(url, turn.node, address) is not None, TIMEOUT_S, "the index in step")
        start = node_holdings(address)
        assert start.holds("engine", keys)
        reset_engine_cache(engine_url, live_cluster.engine_headers)
        reply = httpx.post(
            engine_url + "/v1/completions",
            json={
                "model": model,
                "prompt": "Hello",
                "max_tokens": 1,
                "cache_salt": live_cluster.cache_salt(DEFAULT_TENANT),
            },
            timeout=120,
            headers=live_cluster.engine_headers,
        )
        answered = time.time()
        assert reply.status_code == 200, reply.text
        wait_until(
            lambda: bool(_changes(address, start.epoch, start.seq, kv_pb2.BLOCK_EVENT_CLEARED, kv_pb2.TIER_ENGINE)),
            TIMEOUT_S,
            "the node to publish vLLM's cleared cache",
        )
        cleared = _changes(address, start.epoch, start.seq, kv_pb2.BLOCK_EVENT_CLEARED, kv_pb2.TIER_ENGINE)
        figures["engine_eviction_to_index_s"] = round(_seen_within(poller, turn.node, start.epoch, cleared), 3)

        def engine_empty(sample: Sample) -> bool:
            view = IndexView.of((sample.nodes or {}).get(turn.node, {}))
            return view is not None and view.blocks["engine"] == 0

        seen = poller.wait(engine_empty, TIMEOUT_S, "the index to hold nothing in the engine")
        figures["engine_answer_to_index_s"] = round(seen.received - answered, 3)
    print("evictions seen by the index:", figures)
    final = node_holdings(address)
    assert not final.keys.get("engine")
    wait_until(lambda: _in_step(url, turn.node, address) is not None, TIMEOUT_S, "the index to match the node")
    assert figures["node_eviction_to_index_s"] <= poll_s, figures
    assert figures["engine_eviction_to_index_s"] <= poll_s, figures
