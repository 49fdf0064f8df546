"""KVStore.WatchBlocks over a real gRPC server running a node's KV runtime (`start_kv`, no engine):
a snapshot, live events for pages written with WritePages, heartbeats, a resume that gets only what
it missed, the subscriber limit, streams ending cleanly when the node stops, and the stream applied
to the scheduler's index and located per tenant and model."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch

from node_manager.kv.pages import PageMac, Tier
from node_manager.kv.transfer import page_batch
from node_manager.kv_runtime import GRPC_OPTIONS, KVRuntime, start_kv
from scheduler.kv_index import ClusterKVIndex, NodePrefix, Outcome
from scheduler.kv_locator import KVLocator
from scheduler.kv_watch import to_batch
from scheduler.routing import HeldPrefix
from symphony.config import load_config
from symphony.kv_addressing import BlockKey, ModelFingerprint, chain_block_keys, token_array
from symphony.kv_geometry import KVGeometry
from symphony.rpc import kv_pb2, kv_pb2_grpc
from tests.helpers import OTHER_MODEL, TEST_MODEL, async_wait_until, free_port

GEOMETRY = KVGeometry(num_layers=3, kv_heads=1, head_size=8, block_size=16)
TENANT = "acme"
READ_TIMEOUT_S = 10.0
SECRET = "a cluster secret for the block watch tests"
STORED, REMOVED = kv_pb2.BLOCK_EVENT_STORED, kv_pb2.BLOCK_EVENT_REMOVED


@dataclass
class Node:
    runtime: KVRuntime
    server: grpc.aio.Server
    stub: kv_pb2_grpc.KVStoreStub
    channel: grpc.aio.Channel


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    config = load_config(
        env={},
        overrides={
            "cluster": {"secret": SECRET},
            "node": {"grpc_port_base": free_port()},
            "kv": {
                "hbm_bytes": 64 * GEOMETRY.page_bytes,
                "dram_bytes": 256 * GEOMETRY.page_bytes,
                "ssd_bytes": 8 << 20,
                "ssd_dir": str(tmp_path / "ssd"),
                "metrics_port_base": 0,
                "block_events_heartbeat_s": 0.2,
                "block_events_max_subscribers": 2,
                "block_events_batch_entries": 4,  # a session's keys span batches
            },
        },
    )
    server = grpc.aio.server(options=GRPC_OPTIONS)
    runtime = await start_kv(config, 0, GEOMETRY, TEST_MODEL, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Node(runtime, server, kv_pb2_grpc.KVStoreStub(channel), channel)
    finally:
        await channel.close()
        runtime.end_streams()
        await server.stop(grace=1.0)
        await runtime.close()


@dataclass
class Receiver:
    """A cluster index's view of one node, built from its stream: checks the stream's promises
    (seq order, heartbeats, one epoch) as it goes."""

    epoch: str = ""
    seq: int = -1
    held: dict[int, set[bytes]] = field(default_factory=dict)
    snapshots: int = 0
    heartbeats: int = 0
    live: list[kv_pb2.BlockEventBatch] = field(default_factory=list)
    _snapshot: dict[int, set[bytes]] | None = None

    def apply(self, batch: kv_pb2.BlockEventBatch) -> None:
        assert batch.node_id == "node-0" and batch.model_fingerprint == TEST_MODEL
        assert batch.block_size == GEOMETRY.block_size
        if batch.snapshot_begin:
            self._snapshot, self.epoch = {}, batch.epoch
        if self._snapshot is not None:
            assert batch.epoch == self.epoch
            for event in batch.events:
                assert event.kind == STORED, "a snapshot only stores"
                self._snapshot.setdefault(event.tier, set()).update(event.block_keys)
            if batch.snapshot_end:
                self.held, self.seq, self._snapshot = self._snapshot, batch.seq, None
                self.snapshots += 1
            return
        assert batch.epoch == self.epoch, "one epoch per node start"
        if not batch.events:
            assert batch.seq == self.seq, "a heartbeat carries the last live seq"
            self.heartbeats += 1
            return
        assert batch.seq == self.seq + 1, "live batches are consecutive"
        self.seq = batch.seq
        self.live.append(batch)
        for event in batch.events:
            held = self.held.setdefault(event.tier, set())
            if event.kind == STORED:
                held.update(event.block_keys)
            elif event.kind == REMOVED:
                held.difference_update(event.block_keys)
            else:
                held.clear()

    def named(self) -> set[bytes]:
        return {key for batch in self.live for event in batch.events for key in event.block_keys}


async def read_until(call: grpc.aio.UnaryStreamCall, receiver: Receiver, done: Callable[[Receiver], bool]) -> None:
    """Apply batches until `done(receiver)` holds; every read has a deadline."""
    while not done(receiver):
        batch = await _read(call)
        assert batch is not grpc.aio.EOF, "the stream ended early"
        receiver.apply(batch)


async def _read(call: grpc.aio.UnaryStreamCall) -> kv_pb2.BlockEventBatch:
    return await asyncio.wait_for(call.read(), READ_TIMEOUT_S)


async def upload(stub: kv_pb2_grpc.KVStoreStub, session: str, blocks: int, seed: int) -> list[BlockKey]:
    """Register a session of `blocks` full blocks and write every page of it; its block keys."""
    ref = kv_pb2.SessionRef(tenant=TENANT, session_id=session)
    token_ids = [seed * 1000 + i for i in range(blocks * GEOMETRY.block_size)]
    await stub.PutSession(kv_pb2.PutSessionRequest(session=ref, token_ids=token_ids), timeout=10)
    keys = list(chain_block_keys(TEST_MODEL, TENANT, token_ids, GEOMETRY.block_size).block_keys)
    gen = torch.Generator().manual_seed(seed)
    pages = [torch.randint(0, 2**62, (blocks, GEOMETRY.page_words), generator=gen) for _ in range(GEOMETRY.num_layers)]
    mac = PageMac(SECRET.encode())
    batches = [
        page_batch(mac, ref, keys, layer, 0, pages[layer].numpy().tobytes()) for layer in range(GEOMETRY.num_layers)
    ]
    reply = await stub.WritePages(iter(batches), timeout=10)
    assert (reply.pages_stored, reply.pages_rejected) == (blocks * GEOMETRY.num_layers, 0)
    return keys


def holds(tier: int, keys: list[BlockKey]) -> Callable[[Receiver], bool]:
    return lambda receiver: set(keys) <= receiver.held.get(tier, set())


async def test_a_watcher_gets_a_snapshot_then_live_events_then_resumes_with_only_what_it_missed(node: Node) -> None:
    stub, runtime = node.stub, node.runtime
    before = await upload(stub, "before", 2, seed=1)
    await asyncio.to_thread(runtime.store.write_behind.flush, READ_TIMEOUT_S)

    receiver = Receiver()
    call = stub.WatchBlocks(kv_pb2.WatchBlocksRequest(), timeout=60)
    await read_until(call, receiver, lambda r: r.snapshots == 1)
    assert receiver.epoch == runtime.events.epoch
    assert receiver.held == {kv_pb2.TIER_DRAM: set(before), kv_pb2.TIER_SSD: set(before)}

    live = await upload(stub, "live", 5, seed=2)  # 5 keys: more than one batch of 4 entries
    await read_until(call, receiver, holds(kv_pb2.TIER_SSD, live))
    assert receiver.held[kv_pb2.TIER_DRAM] == set(before) | set(live)
    assert receiver.held[kv_pb2.TIER_SSD] == set(before) | set(live)
    assert all(len(event.block_keys) + 1 <= 4 for batch in receiver.live for event in batch.events)

    engine_key = BlockKey(b"\x05" * 32)
    runtime.events.engine_emitter()("stored", [engine_key])
    await read_until(call, receiver, holds(kv_pb2.TIER_ENGINE, [engine_key]))
    await read_until(call, receiver, lambda r: r.heartbeats >= 1)  # idle now: a heartbeat within ~0.2 s
    call.cancel()
    await async_wait_until(
        lambda: runtime.events.subscribers == 0, READ_TIMEOUT_S, "the cancelled stream to unsubscribe"
    )
    left_at = receiver.seq

    missed = await upload(stub, "missed", 2, seed=3)
    await asyncio.to_thread(runtime.store.write_behind.flush, READ_TIMEOUT_S)
    receiver.live.clear()
    resumed = stub.WatchBlocks(kv_pb2.WatchBlocksRequest(epoch=receiver.epoch, after_seq=left_at), timeout=60)
    first = await _read(resumed)
    assert not first.snapshot_begin and first.seq == left_at + 1, "a replay, not a snapshot"
    receiver.apply(first)
    await read_until(resumed, receiver, holds(kv_pb2.TIER_SSD, missed))
    assert receiver.snapshots == 1 and receiver.named() == set(missed), "only what it missed"
    resumed.cancel()
    await async_wait_until(
        lambda: runtime.events.subscribers == 0, READ_TIMEOUT_S, "the cancelled stream to unsubscribe"
    )

    fresh = Receiver()
    again = stub.WatchBlocks(kv_pb2.WatchBlocksRequest(epoch="another-epoch", after_seq=left_at), timeout=60)
    await read_until(again, fresh, lambda r: r.snapshots == 1)
    assert fresh.held == receiver.held, "a snapshot equals what the events added up to"
    again.cancel()

    metrics = runtime.store.metrics.registry
    assert metrics.get_sample_value("symphony_kv_block_event_subscriptions_total", {"start": "snapshot"}) == 2
    assert metrics.get_sample_value("symphony_kv_block_event_subscriptions_total", {"start": "replay"}) == 1


async def test_subscribers_past_the_limit_are_refused_and_streams_end_cleanly_when_the_node_stops(node: Node) -> None:
    stub = node.stub
    calls = [stub.WatchBlocks(kv_pb2.WatchBlocksRequest(), timeout=60) for _ in range(2)]
    for call in calls:
        assert (await _read(call)).snapshot_end  # subscribed
    refused = stub.WatchBlocks(kv_pb2.WatchBlocksRequest(), timeout=60)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await _read(refused)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    node.runtime.end_streams()
    for call in calls:
        while (batch := await _read(call)) is not grpc.aio.EOF:
            assert not batch.events  # heartbeats at most
        assert await call.code() == grpc.StatusCode.OK


async def follow(node: Node, index: ClusterKVIndex, until: Callable[[], bool]) -> None:
    """Subscribe as the scheduler does (from the index's resume point) and apply the node's batches
    to `index` until it is in sync and `until()` holds; then leave."""
    stub, runtime = node.stub, node.runtime
    epoch, after_seq = index.resume_point("node-0")
    call = stub.WatchBlocks(kv_pb2.WatchBlocksRequest(epoch=epoch, after_seq=after_seq), timeout=60)
    try:
        while not (index.synced("node-0") and until()):
            message = await _read(call)
            assert message is not grpc.aio.EOF
            applied = index.apply("node-0", to_batch(message), now_s=0.0, now_unix_ms=0)
            assert applied.outcome is Outcome.APPLIED, applied
    finally:
        call.cancel()
        await async_wait_until(lambda: runtime.events.subscribers == 0, READ_TIMEOUT_S, "the stream to unsubscribe")
    assert index.stream_lost("node-0") == ""


async def test_the_schedulers_index_stays_in_sync_with_the_nodes_stream(node: Node) -> None:
    """The node's stream applied to the scheduler's own cluster index (`scheduler.kv_index`): the
    snapshot and every live batch apply in order, a resume continues it, and the index knows which
    tier holds each of a session's blocks."""
    index = ClusterKVIndex(max_blocks=1024)
    index.add_node("node-0")
    stub, runtime = node.stub, node.runtime

    first = await upload(stub, "first", 3, seed=7)
    await follow(node, index, lambda: index.prefix(first).get("node-0") == NodePrefix(3, dram=3))
    await asyncio.to_thread(runtime.store.write_behind.flush, READ_TIMEOUT_S)
    second = await upload(stub, "second", 2, seed=8)
    await asyncio.to_thread(runtime.store.write_behind.flush, READ_TIMEOUT_S)
    await asyncio.to_thread(runtime.store.demote, TENANT, "first", Tier.DRAM)
    await follow(node, index, lambda: index.prefix(first).get("node-0") == NodePrefix(3, ssd=3))  # resumed
    assert index.node("node-0").restarts == 0 and index.node("node-0").resyncs == 0
    assert index.prefix(second)["node-0"] == NodePrefix(2, dram=2)


async def test_a_prefix_is_found_only_under_its_own_tenant_and_model(node: Node) -> None:
    """A real node's blocks, in the scheduler's index from its stream, located as the scheduler
    locates a request (`KVLocator`): a new session of the tenant whose prompt starts with them finds
    them; the same tokens under another tenant or another model's fingerprint find nothing, since
    their block keys are other chains (the scheduler keys a request under the fingerprint its
    nodes report; a second model is not run live in the end-to-end suite)."""
    index = ClusterKVIndex(max_blocks=1024)
    index.add_node("node-0")
    blocks, size = 4, GEOMETRY.block_size
    keys = await upload(node.stub, "system-prompt", blocks, seed=9)
    await follow(node, index, lambda: index.prefix(keys).get("node-0") == NodePrefix(blocks, dram=blocks))
    # The same leading tokens (upload's), then a question of the new session's own.
    prompt = token_array([*(9 * 1000 + i for i in range(blocks * size)), *range(1, size + 5)])
    locator = KVLocator(index.prefix, index.synced, max_sessions=16)

    def held(tenant: str, model: ModelFingerprint) -> Mapping[str, HeldPrefix] | None:
        return locator.locate(tenant, f"new-{tenant}", prompt, model, size, ["node-0"], {}).held

    assert held(TENANT, TEST_MODEL) == {"node-0": HeldPrefix(dram=blocks * size)}
    assert held("globex", TEST_MODEL) == {}
    assert held(TENANT, OTHER_MODEL) == {}
