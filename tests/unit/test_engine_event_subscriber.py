"""node_manager.engine_events: vLLM's publisher configuration, and the subscriber thread fed by vLLM's
own ZmqEventPublisher over a real ipc socket."""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed import kv_events as vllm_events

from node_manager.engine_event_keys import CLEARED, REMOVED, STORED, Emit, TenantSalts
from node_manager.engine_events import (
    EngineEventMetrics,
    EngineEventSubscriber,
    configured_tenants,
    counting_emit,
    engine_block_events,
    engine_kv_blocks,
    kv_events_config,
)
from symphony.config import load_config
from symphony.kv_addressing import BlockKey, chain_block_keys
from symphony.kv_geometry import smollm2_geometry
from symphony.tenancy import engine_cache_salt
from tests.helpers import TEST_MODEL, EmitRecorder, wait_until

BS = 32
TIMEOUT_S = 10
_ids = itertools.count()


class NoSessions:
    def tenant_generation(self) -> int:
        return 0

    def tenants(self) -> list[str]:
        return []


def block(tenant: str, base: int) -> tuple[vllm_events.BlockStored, BlockKey]:
    """A one-block prompt's BlockStored, as vLLM's block pool builds it, and its Symphony key."""
    token_ids = list(range(base, base + BS))
    event = vllm_events.BlockStored(
        block_hashes=[hashlib.sha256(b"%d" % next(_ids)).digest()],
        parent_block_hash=None,
        token_ids=token_ids,
        block_size=BS,
        lora_id=None,
        medium=vllm_events.MEDIUM_GPU,
        lora_name=None,
        extra_keys=[(engine_cache_salt(tenant),)],
        group_idx=0,
    )
    return event, chain_block_keys(TEST_MODEL, tenant, token_ids, BS).block_keys[0]


def publisher(endpoint: str) -> vllm_events.EventPublisher:
    """What the engine core runs: vLLM's own publisher, from the configuration Symphony gives it."""
    return vllm_events.EventPublisherFactory.create(KVEventsConfig(**kv_events_config(endpoint)), 0)


def publish(pub: vllm_events.EventPublisher, *events: vllm_events.KVCacheEvent) -> None:
    pub.publish(vllm_events.KVEventBatch(ts=0.0, events=list(events)))


def publish_until(pub: vllm_events.EventPublisher, event: vllm_events.KVCacheEvent, done: Callable[[], bool]) -> None:
    """Publish `event` until `done`: ZMQ's PUB drops what it sends before the subscriber's
    connection is up (it reconnects every 100 ms while no engine listens)."""

    def sent_and_done() -> bool:
        publish(pub, event)
        return done()

    wait_until(sent_and_done, TIMEOUT_S, "the subscriber to receive the publisher's batches", interval_s=0.02)


def handshake(pub: vllm_events.EventPublisher, recorder: EmitRecorder) -> None:
    """Publish until the subscriber receives, then a marker, and forget what it emitted once the
    marker is in (ZMQ keeps one connection's order: nothing sent before it comes later)."""
    recorder.clear()
    publish_until(pub, vllm_events.AllBlocksCleared(), lambda: (CLEARED, []) in recorder.calls)
    marker, key = block("default", 1_000_000)
    publish(pub, marker, vllm_events.BlockRemoved(block_hashes=marker.block_hashes, medium="GPU"))
    wait_until(lambda: (REMOVED, [key]) in recorder.calls, TIMEOUT_S, "the handshake's marker")
    recorder.clear()


@pytest.fixture
def endpoint(tmp_path: Path) -> str:
    return f"ipc://{tmp_path / 'events'}"


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def recorder() -> EmitRecorder:
    return EmitRecorder()


StartSubscriber = Callable[[Emit], EngineEventSubscriber]


@pytest.fixture
def start_subscriber(endpoint: str, registry: CollectorRegistry) -> Iterator[StartSubscriber]:
    started: list[EngineEventSubscriber] = []

    def start(emit: Emit) -> EngineEventSubscriber:
        metrics = EngineEventMetrics(registry)
        sub = EngineEventSubscriber(
            endpoint, TEST_MODEL, BS, TenantSalts(NoSessions()), emit, max_blocks=64, metrics=metrics, poll_s=0.02
        )
        sub.start()
        started.append(sub)
        return sub

    yield start
    for sub in started:
        sub.stop()


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    sample = registry.get_sample_value(name, labels)
    return 0.0 if sample is None else sample


def test_vllm_accepts_the_ipc_endpoint_and_binds_it_unchanged(endpoint: str) -> None:
    config = KVEventsConfig(**kv_events_config(endpoint))
    assert config.enable_kv_cache_events and config.publisher == "zmq" and config.buffer_steps == 1
    pub = publisher(endpoint)
    try:
        resolved = pub.get_publisher_config()
        assert resolved is not None and resolved.endpoint == endpoint  # not rewritten at rank 0
        assert Path(endpoint.removeprefix("ipc://")).is_socket()  # bound, not connected
    finally:
        pub.shutdown()


def test_blocks_published_by_vllm_reach_emit_as_block_keys(
    endpoint: str, start_subscriber: StartSubscriber, recorder: EmitRecorder, registry: CollectorRegistry
) -> None:
    start_subscriber(recorder)
    pub = publisher(endpoint)
    try:
        handshake(pub, recorder)
        (a, key_a), (b, key_b) = block("default", 100), block("default", 900)
        publish(pub, a)
        publish(pub, b, vllm_events.BlockRemoved(block_hashes=a.block_hashes, medium="GPU"))
        wait_until(lambda: len(recorder.calls) == 3, TIMEOUT_S, "three events")
        assert recorder.calls == [(STORED, [key_a]), (STORED, [key_b]), (REMOVED, [key_a])]
        wait_until(lambda: value(registry, "symphony_engine_kv_blocks_live") == 1, TIMEOUT_S, "the live gauge")
        assert value(registry, "symphony_engine_kv_view_lost_total", reason="all_blocks_cleared") >= 1
    finally:
        pub.shutdown()


def test_an_engine_lost_clears_and_its_successor_is_followed_from_its_first_batches(
    endpoint: str, start_subscriber: StartSubscriber, recorder: EmitRecorder, registry: CollectorRegistry
) -> None:
    subscriber = start_subscriber(recorder)
    first = publisher(endpoint)
    handshake(first, recorder)
    blocks = [block("default", 100 * i) for i in range(30)]  # the old engine's numbers reach 30+
    for event, _ in blocks:
        publish(first, event)
    wait_until(lambda: len(recorder.calls) == len(blocks), TIMEOUT_S, "the old engine's blocks")
    first.shutdown()
    subscriber.engine_lost("engine_restarting")
    wait_until(lambda: recorder.calls[-1:] == [(CLEARED, [])], TIMEOUT_S, "cleared")
    assert value(registry, "symphony_engine_kv_view_lost_total", reason="engine_restarting") == 1

    second = publisher(endpoint)  # the restarted engine binds the same socket, numbers from 0 again
    try:
        handshake(second, recorder)
        event, key = block("default", 50_000)
        publish(second, event)
        wait_until(lambda: recorder.calls == [(STORED, [key])], TIMEOUT_S, "the new engine's block")
        # Its small numbers were expected: not taken for yet another restart.
        assert value(registry, "symphony_engine_kv_view_lost_total", reason="restart") == 0
    finally:
        second.shutdown()


def test_an_emit_that_raises_resynchronises_the_view_and_the_thread_goes_on(
    endpoint: str, start_subscriber: StartSubscriber, recorder: EmitRecorder, registry: CollectorRegistry
) -> None:
    failures = iter([True])
    armed = threading.Event()

    def emit(kind: str, keys: Sequence[BlockKey]) -> None:
        if kind == STORED and armed.is_set() and next(failures, False):
            raise RuntimeError("the event log is full")
        recorder(kind, keys)

    start_subscriber(emit)
    pub = publisher(endpoint)
    try:
        handshake(pub, recorder)
        armed.set()
        (a, _), (b, key_b) = block("default", 100), block("default", 700)
        publish(pub, a)  # its "stored" raises
        publish(pub, b)
        wait_until(lambda: len(recorder.calls) == 2, TIMEOUT_S, "the resync and the next block")
        assert recorder.calls == [(CLEARED, []), (STORED, [key_b])]
        assert value(registry, "symphony_engine_kv_view_lost_total", reason="emit_error") == 1
    finally:
        pub.shutdown()


def test_stop_acts_on_a_pending_loss_and_ends_the_thread(
    start_subscriber: StartSubscriber, recorder: EmitRecorder
) -> None:
    subscriber = start_subscriber(recorder)
    assert subscriber.connected.wait(TIMEOUT_S)
    subscriber.engine_lost("engine_stopped")
    subscriber.stop(timeout_s=TIMEOUT_S)
    assert not subscriber.running
    assert recorder.calls == [(CLEARED, [])]


def test_counting_emit_counts_events_and_keys(registry: CollectorRegistry) -> None:
    emit = counting_emit(EngineEventMetrics(registry))
    _, key = block("default", 1)
    emit(STORED, [key, key])
    emit(CLEARED, [])
    assert value(registry, "symphony_engine_block_events_total", kind="stored") == 1
    assert value(registry, "symphony_engine_block_event_keys_total", kind="stored") == 2
    assert value(registry, "symphony_engine_block_events_total", kind="cleared") == 1
    assert value(registry, "symphony_engine_block_event_keys_total", kind="cleared") == 0


def test_the_engines_blocks_come_from_its_overrides_or_its_kv_space() -> None:
    geometry = smollm2_geometry(32)
    assert engine_kv_blocks(["--num-gpu-blocks-override", "512"], 1, geometry) == 512
    assert engine_kv_blocks(["--seed", "1", "--num-gpu-blocks-override=77"], 1, geometry) == 77
    assert engine_kv_blocks([], 2, geometry) == 2 * 1024**3 // geometry.block_bytes


def test_the_nodes_subscriber_follows_the_config() -> None:
    geometry = smollm2_geometry(64)
    config = load_config(
        env={}, overrides={"scheduler": {"api_keys": ["acme:k1", "globex:k2", "acme:k3"]}, "engine": {"block_size": 64}}
    )
    sub = engine_block_events(config, 1, TEST_MODEL, geometry, NoSessions(), EmitRecorder())
    assert sub is not None and sub.endpoint == config.engine_events_endpoint(1)
    assert configured_tenants(config) == ["default", "acme", "globex"]
    for off in ({"kv_events": False}, {"enabled": False}):
        config = load_config(env={}, overrides={"engine": off})
        assert engine_block_events(config, 0, TEST_MODEL, geometry, NoSessions(), EmitRecorder()) is None
