"""The KV watcher (scheduler.kv_watch) against a scripted node over real gRPC: the index ends equal
to what the node holds, and every resubscription names the expected (epoch, after_seq)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from scheduler.kv_index import ClusterKVIndex, IndexTier, NodePrefix
from scheduler.kv_watch import KVWatch
from scheduler.metrics import SchedulerMetrics
from scheduler.node_monitor import NodeMonitor
from symphony.kv_addressing import BlockKey, chain_block_keys
from symphony.rpc import kv_pb2, kv_pb2_grpc, node_pb2
from tests.helpers import OTHER_MODEL, TEST_MODEL, async_wait_until
from tests.unit.block_node import TIERS, BlockNode

STORED, REMOVED, CLEARED = kv_pb2.BLOCK_EVENT_STORED, kv_pb2.BLOCK_EVENT_REMOVED, kv_pb2.BLOCK_EVENT_CLEARED
ENGINE, HBM, DRAM, SSD = kv_pb2.TIER_ENGINE, kv_pb2.TIER_HBM, kv_pb2.TIER_DRAM, kv_pb2.TIER_SSD
INDEX_TIER = {ENGINE: IndexTier.ENGINE, HBM: IndexTier.HBM, DRAM: IndexTier.DRAM, SSD: IndexTier.SSD}
WAIT_S = 10.0


def chain(blocks: int, seed: int) -> list[BlockKey]:
    tokens = [(seed * 7919 + i) % 50_000 for i in range(blocks * 4)]
    return list(chain_block_keys(TEST_MODEL, "acme", tokens, 4).block_keys)


@dataclass
class Watched:
    node: BlockNode
    monitor: NodeMonitor
    index: ClusterKVIndex
    metrics: SchedulerMetrics
    watch: KVWatch

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    def matches(self) -> bool:
        """The index holds exactly the node's contents, each block under its fastest tier."""
        want_counts = {INDEX_TIER[t].name.lower(): len(self.node.contents[t]) for t in TIERS}
        if self.index.tier_blocks("node-0") != want_counts:
            return False
        for key in set().union(*self.node.contents.values()):
            best = min(INDEX_TIER[t] for t in TIERS if key in self.node.contents[t])
            tiers = dict.fromkeys(("engine", "hbm", "dram", "ssd"), 0)
            tiers[best.name.lower()] = 1
            if self.index.prefix([key]) != {"node-0": NodePrefix(1, **tiers)}:
                return False
        return True

    async def in_sync(self, what: str) -> None:
        await async_wait_until(lambda: self.watch.synced("node-0") and self.matches(), WAIT_S, what)


@contextlib.asynccontextmanager
async def watching(node: BlockNode, timeout_s: float = 5.0) -> AsyncIterator[Watched]:
    await node.start()
    monitor = NodeMonitor([node.address], poll_interval_s=0.02, down_after_s=1.0)
    index = ClusterKVIndex(10_000, 1)
    metrics = SchedulerMetrics()
    watch = KVWatch(monitor, index, metrics, timeout_s=timeout_s, backoff_max_s=0.05)
    channel = grpc.aio.insecure_channel(node.address)
    view = monitor.nodes[0]
    view.kv = kv_pb2_grpc.KVStoreStub(channel)  # as NodeMonitor.start() does; no Status polling here
    await watch.start()
    # The node reports its name and model after the watch started: it waits for them, then renames.
    monitor.apply_status(view, node_pb2.NodeStatus(node_id="node-0", model_fingerprint=TEST_MODEL))
    try:
        yield Watched(node, monitor, index, metrics, watch)
    finally:
        await watch.stop()
        await channel.close()
        await node.stop()


@pytest.fixture
async def watched() -> AsyncIterator[Watched]:
    async with watching(BlockNode()) as w:
        yield w


async def test_snapshot_live_batches_gap_and_dropped_stream(watched: Watched) -> None:
    w, node = watched, watched.node
    a, b = chain(10, seed=1), chain(6, seed=2)
    await w.in_sync("the first snapshot (empty)")
    assert node.requests == [("", 0)], "a scheduler that knows nothing asks for a snapshot"

    node.publish((STORED, DRAM, a), (STORED, SSD, a[:4]))
    node.publish((STORED, ENGINE, a[:2]), (STORED, HBM, b))
    node.publish((REMOVED, DRAM, a[8:]), (CLEARED, HBM, []))
    await w.in_sync("live batches")
    assert w.watch.prefix(a) == {"node-0": NodePrefix(8, engine=2, dram=6)}
    assert w.sample("symphony_kv_index_events_total", kind="cleared", tier="hbm") == 1
    assert w.sample("symphony_kv_index_event_blocks_total", kind="stored", tier="dram") == 10
    assert w.sample("symphony_kv_index_lag_seconds_count") >= 4

    node.publish((STORED, SSD, b), lose=True)  # seq 4 never arrives
    node.publish((REMOVED, SSD, a[:1]))  # seq 5: a gap
    await async_wait_until(lambda: len(node.requests) == 2, WAIT_S, "a resubscription after the gap")
    assert node.requests[1] == ("", 0), "a gap is repaired by a snapshot"
    await w.in_sync("the snapshot after the gap")
    assert w.sample("symphony_kv_index_resyncs_total", reason="gap") == 1

    node.end_streams()  # the stream ends; the node goes on publishing
    node.publish((STORED, ENGINE, b[:3]))
    await async_wait_until(lambda: len(node.requests) == 3, WAIT_S, "a resubscription after the stream ended")
    assert node.requests[2] == ("boot-1", 5), "a synced node resumes after the last batch it applied"
    await w.in_sync("the replayed batch")
    assert w.sample("symphony_kv_watch_reconnects_total", reason="ended") == 1
    assert w.index.node("node-0").resyncs == 1, "a resumed stream is no resync"


async def test_a_heartbeat_ahead_forces_a_snapshot(watched: Watched) -> None:
    w, node = watched, watched.node
    await w.in_sync("the first snapshot")
    node.publish((STORED, DRAM, chain(3, seed=3)))
    await w.in_sync("a live batch")
    node.publish((STORED, SSD, chain(2, seed=4)), lose=True)
    node.heartbeat()  # seq 2: one past the last batch the scheduler saw
    await async_wait_until(lambda: len(node.requests) == 2, WAIT_S, "a resubscription")
    assert node.requests[1] == ("", 0)
    await w.in_sync("the snapshot after the heartbeat")
    assert w.sample("symphony_kv_index_resyncs_total", reason="heartbeat_ahead") == 1


async def test_a_silent_stream_is_reconnected_and_the_node_falls_back_meanwhile() -> None:
    async with watching(BlockNode(), timeout_s=0.3) as w:
        node = w.node
        await w.in_sync("the first snapshot")
        node.publish((STORED, DRAM, chain(2, seed=5)))
        await w.in_sync("a live batch")
        await async_wait_until(lambda: not w.watch.synced("node-0"), WAIT_S, "fallback once the node is silent")
        assert w.watch.prefix(chain(2, seed=5)) == {}, "a node in fallback is left out"
        w.watch.export_gauges()
        assert w.sample("symphony_kv_index_fallback", node="node-0") == 1
        await async_wait_until(lambda: len(node.requests) >= 2, WAIT_S, "a reconnection after the timeout")
        assert node.requests[1] == ("boot-1", 1)
        assert w.sample("symphony_kv_watch_reconnects_total", reason="timeout") >= 1
        node.heartbeat()
        await w.in_sync("in step again after a heartbeat")
        w.watch.export_gauges()
        assert w.sample("symphony_kv_index_fallback", node="node-0") == 0


async def test_a_restarted_node_is_read_again_from_its_snapshot(watched: Watched) -> None:
    w, node = watched, watched.node
    old, new = chain(5, seed=6), chain(4, seed=7)
    node.publish((STORED, DRAM, old))
    node.publish((STORED, SSD, old))
    await w.in_sync("before the restart")
    node.restart("boot-2")
    node.contents = {tier: set() for tier in TIERS}
    node.contents[SSD].update(old[:2])  # what survived on its disk
    node.contents[DRAM].update(new)
    await async_wait_until(lambda: len(node.requests) == 2, WAIT_S, "a resubscription")
    assert node.requests[1] == ("boot-1", 2), "the scheduler asks to resume; the node answers with a snapshot"
    await w.in_sync("the restarted node's snapshot")
    assert w.index.node("node-0").restarts == 1
    assert w.sample("symphony_kv_index_resyncs_total", reason="restart") == 1
    assert w.sample("symphony_kv_watch_reconnects_total", reason="unavailable") == 1


async def test_batches_of_another_model_are_refused() -> None:
    async with watching(BlockNode(model=OTHER_MODEL)) as w:
        node = w.node
        node.contents[DRAM].update(chain(3, seed=8))
        await async_wait_until(
            lambda: w.sample("symphony_kv_index_resyncs_total", reason="fingerprint") >= 2, WAIT_S, "refusals"
        )
        assert not w.watch.synced("node-0") and w.index.tier_blocks("node-0")["dram"] == 0
        assert set(node.requests) == {("", 0)}
        node.model = TEST_MODEL  # as its Status says
        await w.in_sync("the node's own model")


async def test_a_node_without_block_events_stays_in_fallback() -> None:
    server = grpc.aio.server()
    kv_pb2_grpc.add_KVStoreServicer_to_server(kv_pb2_grpc.KVStoreServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    monitor = NodeMonitor([f"127.0.0.1:{port}"], poll_interval_s=0.02, down_after_s=1.0)
    metrics = SchedulerMetrics()
    watch = KVWatch(monitor, ClusterKVIndex(100, 1), metrics, timeout_s=1.0, backoff_max_s=0.05)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    monitor.nodes[0].kv = kv_pb2_grpc.KVStoreStub(channel)
    monitor.apply_status(monitor.nodes[0], node_pb2.NodeStatus(node_id="node-0", model_fingerprint=TEST_MODEL))
    await watch.start()
    try:

        def reconnects() -> float:
            labels = {"reason": "unimplemented"}
            return metrics.registry.get_sample_value("symphony_kv_watch_reconnects_total", labels) or 0.0

        await async_wait_until(lambda: reconnects() >= 2, WAIT_S, "retries of an unimplemented WatchBlocks")
        assert not watch.synced("node-0")
        assert watch.describe()["node-0"]["fallback"] is True
    finally:
        await watch.stop()
        await channel.close()
        await server.stop(grace=None)


async def test_stop_ends_the_streams(watched: Watched) -> None:
    await watched.in_sync("the first snapshot")
    assert watched.node.streams == 1
    await watched.watch.stop()
    await async_wait_until(lambda: watched.node.streams == 0, WAIT_S, "the node to see the stream cancelled")
    assert not watched.watch.synced("node-0")
