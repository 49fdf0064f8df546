"""The prefetcher reports each finished pull from a peer once, over the tokens it fetched, timed
from the first request for the node's job (scheduler.prefetcher -> scheduler.pull_costs)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from scheduler.decisions import Pull
from scheduler.metrics import SchedulerMetrics
from scheduler.prefetcher import MoveState, Prefetch, Prefetcher
from symphony.priority import Priority
from symphony.rpc import kv_pb2_grpc
from tests.helpers import async_wait_until
from tests.integration.fakes import FakeNodeManager, ready_status

SESSION = ("default", "s")


@pytest.fixture
async def node() -> AsyncIterator[FakeNodeManager]:
    manager = FakeNodeManager(ready_status("node-b", "http://127.0.0.1:1"))
    await manager.start()
    yield manager
    await manager.stop()


async def test_a_joined_pull_is_one_sample_timed_from_its_first_request(node: FakeNodeManager) -> None:
    channel = grpc.aio.insecure_channel(node.address)
    stub = kv_pb2_grpc.KVStoreStub(channel)
    pulled: list[tuple[str, str, int, float]] = []
    addresses = {"node-a": "peer:1"}  # node-b pulls from node-a, whose manager listens there
    prefetcher = Prefetcher(
        lambda _node: stub, addresses.get, SchedulerMetrics(), 8, lambda *_: None, lambda *a: pulled.append(a)
    )
    node.kv.joins, node.kv.final_pages = True, (40, 10)  # a quarter of the pages came from the peer
    node.kv.release.clear()
    try:
        first = prefetcher.start(SESSION, "node-b", "node-a", 5_000, Priority.NORMAL, 2_000, "dram")
        await async_wait_until(lambda: len(node.kv.prefetches) == 1, 10, "the first request")
        joined = asyncio.create_task(prefetcher.pull(SESSION, "node-b", Pull("node-a", 2_000, 5_000), Priority.NORMAL))
        await async_wait_until(lambda: len(node.kv.prefetches) == 2, 10, "the second request, joining the job")
        node.kv.release.set()
        assert await joined == "ready"
        assert first is not None and first.task is not None
        await first.task
        assert len(pulled) == 1  # one job, one sample
        source, target, tokens, ms = pulled[0]
        assert (source, target, tokens) == ("node-a", "node-b", 500)
        assert [r.source_peer for r in node.kv.prefetches] == ["peer:1", "peer:1"]
        assert first.finished_at is not None and ms >= (first.finished_at - first.started_at) * 1000 - 1
        # A move from the node's own tiers, or one that fetched nothing from the peer, is no sample.
        node.kv.joins, node.kv.final_pages = False, (40, 0)
        assert await prefetcher.pull(SESSION, "node-b", Pull("node-a", 2_000, 5_000), Priority.NORMAL) == "ready"
        own = prefetcher.start(SESSION, "node-b", "", 5_000, Priority.NORMAL, 2_000, "dram")
        assert own is not None and own.task is not None
        await own.task
        assert len(pulled) == 1
        # A source that left the cluster: nothing is asked of the node.
        asked = len(node.kv.prefetches)
        gone = await prefetcher.pull(SESSION, "node-b", Pull("node-c", 2_000, 5_000), Priority.NORMAL)
        assert gone == "not_started" and len(node.kv.prefetches) == asked
    finally:
        await prefetcher.stop()
        await channel.close()


async def test_a_move_past_a_near_nodes_blocks_names_both_peers_and_is_no_sample(node: FakeNodeManager) -> None:
    """A far source with a near node: the node is asked to pull the near node's blocks first. Its
    timing spans two links, so it calibrates neither; a near node without an address is left out."""
    channel = grpc.aio.insecure_channel(node.address)
    stub = kv_pb2_grpc.KVStoreStub(channel)
    pulled: list[tuple[str, str, int, float]] = []
    addresses = {"node-far": "far:1", "node-near": "near:1"}
    prefetcher = Prefetcher(
        lambda _node: stub, addresses.get, SchedulerMetrics(), 8, lambda *_: None, lambda *a: pulled.append(a)
    )
    node.kv.final_pages = (40, 40)
    try:
        move = prefetcher.start(
            SESSION, "node-b", "node-far", 5_000, Priority.NORMAL, 2_000, "dram", 0, ("node-near", 46)
        )
        assert move is not None and move.task is not None
        await move.task
        asked = node.kv.prefetches[-1]
        assert (asked.source_peer, asked.near_peer, asked.near_blocks) == ("far:1", "near:1", 46)
        assert move.state == "done" and move.near == "node-near" and pulled == []
        gone = prefetcher.start(SESSION, "node-b", "node-far", 5_000, Priority.NORMAL, 2_000, "dram", 0, ("node-x", 9))
        assert gone is not None and gone.task is not None
        await gone.task
        asked = node.kv.prefetches[-1]
        assert (asked.source_peer, asked.near_peer, asked.near_blocks) == ("far:1", "", 0)
        assert len(pulled) == 1 and pulled[0][0] == "node-far"  # one link timed: a sample
    finally:
        await prefetcher.stop()
        await channel.close()


async def test_a_pull_that_joins_a_two_link_move_is_no_sample_either() -> None:
    """An advisory's move (far source, near node) is under way when its request's own pull, from
    the near node alone, joins the node's job (which keeps the move's peers). If the pull's follower
    ends first, the job it reports timed two links: no sample. Driven in that order directly (over
    the network either follower may end first). A job the near-only pull started is its sample."""
    pulled: list[tuple[str, str, int, float]] = []
    prefetcher = Prefetcher(
        lambda _node: None, {}.get, SchedulerMetrics(), 8, lambda *_: None, lambda *a: pulled.append(a)
    )

    def pull_ends(job: str) -> None:
        pull = Prefetch(SESSION, "node-b", 2_000, 1.0, prefetch_id=job, source="node-near", target="dram")
        pull.pages_in_target = pull.pages_from_peer = 40
        prefetcher._finish(pull, MoveState.DONE)

    prefetcher._job_started["1"] = (1.0, "node-far", "node-near")  # the move started job 1
    pull_ends("1")
    assert pulled == []
    prefetcher._job_started["2"] = (1.0, "node-near", "")  # the pull started job 2
    pull_ends("2")
    assert [sample[:3] for sample in pulled] == [("node-near", "node-b", 2_000)]
