"""vLLM's own KV events from the cluster's real engine, as Symphony block keys: a completion under a
tenant's cache_salt is reported as the block_key chain of its prompt's full blocks (token ids from
the engine's own /tokenize) for that tenant and the node's model fingerprint, and
/reset_prefix_cache as "cleared" (with the engine's next step). The test subscribes beside the node
manager (ZMQ PUB serves both) and reads the node's own counts of the same events."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import grpc
import httpx
import pytest

from node_manager.engine_event_keys import CLEARED, STORED, TenantSalts
from node_manager.engine_events import EngineEventSubscriber
from symphony.config import load_config
from symphony.kv_addressing import BlockKey, ModelFingerprint, chain_block_keys
from symphony.rpc import node_pb2, node_pb2_grpc
from tests.e2e.conftest import LiveCluster, reset_engine_cache
from tests.e2e.kv_support import BLOCK
from tests.helpers import EmitRecorder, wait_until

pytestmark = pytest.mark.e2e
NODE = 0
TIMEOUT_S = 60


def node_fingerprint(cluster: LiveCluster) -> ModelFingerprint:
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_ports[NODE]}") as channel:
        status = node_pb2_grpc.NodeManagerStub(channel).Status(node_pb2.StatusRequest(), timeout=5)
    return ModelFingerprint(status.model_fingerprint)


@pytest.fixture
def tenant() -> str:
    return f"events-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def recorder() -> EmitRecorder:
    return EmitRecorder()


@pytest.fixture
def subscriber(live_cluster: LiveCluster, tenant: str, recorder: EmitRecorder) -> Iterator[EngineEventSubscriber]:
    config = load_config(live_cluster.home / "symphony.toml", env={})
    sub = EngineEventSubscriber(
        config.engine_events_endpoint(NODE),
        node_fingerprint(live_cluster),
        BLOCK,
        # This test's tenant only (no other traffic is translated), its salts as the cluster's.
        TenantSalts(always=[tenant], key=live_cluster.secret),
        recorder,
        max_blocks=4096,
    )
    sub.start()
    yield sub
    sub.stop()


def complete(engine_url: str, cluster: LiveCluster, prompt: str, tenant: str, salt: str) -> dict[str, object]:
    """One token of completion, as the scheduler relays a tenant's request: its cache_salt and the
    connector's kv_transfer_params (the node registers the session, so it learns the tenant)."""
    response = httpx.post(
        engine_url + "/v1/completions",
        json={
            "model": cluster.model,
            "prompt": prompt,
            "max_tokens": 1,  # the prompt's blocks only: a generated token never gets KV here
            "temperature": 0,
            "cache_salt": salt,
            "kv_transfer_params": cluster.kv_params(tenant, f"s-{uuid.uuid4().hex[:6]}"),
            "return_token_ids": True,
        },
        timeout=120,
        headers=cluster.engine_headers,
    )
    response.raise_for_status()
    return response.json()["choices"][0]  # type: ignore[no-any-return]


def test_the_engines_prefix_cache_is_reported_as_the_tenants_block_keys(
    live_cluster: LiveCluster, subscriber: EngineEventSubscriber, tenant: str, recorder: EmitRecorder
) -> None:
    engine_url = f"http://127.0.0.1:{live_cluster.engine_ports[NODE]}"

    fingerprint = node_fingerprint(live_cluster)

    def prompt_keys(prompt: str) -> tuple[list[int], list[BlockKey]]:
        """The prompt's token ids, from the engine's own tokenizer, and its full blocks' keys."""
        response = httpx.post(
            engine_url + "/tokenize",
            json={"model": live_cluster.model, "prompt": prompt},
            timeout=30,
            headers=live_cluster.engine_headers,
        )
        token_ids = response.json()["tokens"]
        return token_ids, list(chain_block_keys(fingerprint, tenant, token_ids, BLOCK).block_keys)

    # A subscriber connecting to a bound PUB socket misses what is published before the connection
    # is up: requests of new blocks until some are seen (the first batch seen is also a gap), then
    # one more whose blocks, once in, say nothing earlier is still on its way (ZMQ keeps the order).
    def some_block_seen() -> bool:
        complete(engine_url, live_cluster, f"warm {uuid.uuid4().hex} " * 12, tenant, live_cluster.cache_salt(tenant))
        return bool(recorder.keys(STORED))

    wait_until(some_block_seen, TIMEOUT_S, "the test's subscriber to receive the engine's events", interval_s=0.2)
    marker = f"marker {uuid.uuid4().hex} " * 12
    _, marker_keys = prompt_keys(marker)
    complete(engine_url, live_cluster, marker, tenant, live_cluster.cache_salt(tenant))
    wait_until(lambda: recorder.keys(STORED)[-len(marker_keys) :] == marker_keys, TIMEOUT_S, "the marker's blocks")
    recorder.clear()

    def node_count(name: str, **labels: str) -> float:
        return live_cluster.node_metric(NODE, name, **labels)

    node_stored = node_count("symphony_engine_block_event_keys_total", kind="stored")
    node_unknown = node_count("symphony_engine_kv_blocks_dropped_total", reason="unknown_salt")
    node_cleared = node_count("symphony_engine_block_events_total", kind="cleared")

    prompt = f"Tell the story of ticket {uuid.uuid4().hex}. " + "The lighthouse keeper counted the waves. " * 20
    token_ids, expected = prompt_keys(prompt)
    assert len(expected) >= 4, "the prompt must span blocks for the chain to mean anything"
    choice = complete(engine_url, live_cluster, prompt, tenant, live_cluster.cache_salt(tenant))
    assert choice["prompt_token_ids"] == token_ids  # the engine computed the tokens /tokenize named

    wait_until(lambda: len(recorder.keys(STORED)) >= len(expected), TIMEOUT_S, "the prompt's blocks")
    assert recorder.keys(STORED) == expected
    assert (CLEARED, []) not in recorder.calls
    # The node manager's own subscriber saw the same blocks, attributed to the tenant it learnt from
    # the session the connector registered.
    wait_until(
        lambda: node_count("symphony_engine_block_event_keys_total", kind="stored") - node_stored >= len(expected),
        TIMEOUT_S,
        "the node's count of stored keys",
    )
    assert node_count("symphony_engine_block_event_keys_total", kind="stored") - node_stored == len(expected)
    assert node_count("symphony_engine_kv_blocks_dropped_total", reason="unknown_salt") == node_unknown

    # vLLM queues AllBlocksCleared with the events of its next engine step: an idle engine publishes
    # it with the next request's blocks, before them.
    recorder.clear()
    reset_engine_cache(engine_url, live_cluster.engine_headers)
    after = f"After the reset {uuid.uuid4().hex}: " + "the keeper wrote the log. " * 12
    _, after_keys = prompt_keys(after)
    complete(engine_url, live_cluster, after, tenant, live_cluster.cache_salt(tenant))
    wait_until(lambda: len(recorder.keys(STORED)) >= len(after_keys), TIMEOUT_S, "the next request's blocks")
    assert recorder.calls[0] == (CLEARED, [])
    assert recorder.keys(STORED) == after_keys
    wait_until(
        lambda: node_count("symphony_engine_block_events_total", kind="cleared") > node_cleared,
        TIMEOUT_S,
        "the node's cleared",
    )
