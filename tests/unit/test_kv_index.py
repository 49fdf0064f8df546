"""The cluster KV index (scheduler.kv_index): the block event protocol per node, and prefix()
against a naive model of what each node holds."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.kv_index import (
    BlockBatch,
    BlockEvent,
    ClusterKVIndex,
    EventKind,
    IndexTier,
    NodePrefix,
    Outcome,
    SyncState,
)
from symphony.config import KV_INDEX_MAX_NODES
from symphony.kv_addressing import BlockKey, chain_block_keys
from tests.helpers import OTHER_MODEL, TEST_MODEL

STORED, REMOVED, CLEARED = EventKind.STORED, EventKind.REMOVED, EventKind.CLEARED
ENGINE, HBM, DRAM, SSD = IndexTier.ENGINE, IndexTier.HBM, IndexTier.DRAM, IndexTier.SSD


def chain(blocks: int, tenant: str = "acme", seed: int = 0, model: bytes = TEST_MODEL) -> list[BlockKey]:
    tokens = [(seed * 7919 + i) % 50_000 for i in range(blocks * 4)]
    return list(chain_block_keys(model, tenant, tokens, 4).block_keys)  # type: ignore[arg-type]


def ev(kind: EventKind, tier: IndexTier, keys: Sequence[BlockKey] = ()) -> BlockEvent:
    return BlockEvent(kind, tier, b"".join(keys))


def snapshot(epoch: str, seq: int, *events: BlockEvent) -> BlockBatch:
    return BlockBatch(epoch, seq, events, snapshot_begin=True, snapshot_end=True)


def live(epoch: str, seq: int, *events: BlockEvent) -> BlockBatch:
    return BlockBatch(epoch, seq, events)


class Node:
    """Applies batches to one node of an index with an advancing fake clock."""

    def __init__(self, index: ClusterKVIndex, node_id: str) -> None:
        self.index, self.node_id = index, node_id
        index.add_node(node_id)
        self.now = 0.0

    def apply(self, batch: BlockBatch) -> Outcome:
        self.now += 1
        return self.index.apply(self.node_id, batch, now_s=self.now, now_unix_ms=int(self.now * 1000)).outcome


@pytest.fixture
def index() -> ClusterKVIndex:
    return ClusterKVIndex(10_000, 4)


def test_stored_blocks_are_found_per_node_with_their_fastest_tier(index: ClusterKVIndex) -> None:
    a, b = Node(index, "a"), Node(index, "b")
    keys = chain(10)
    assert a.apply(snapshot("ea", 1, ev(STORED, DRAM, keys), ev(STORED, SSD, keys))) is Outcome.APPLIED
    assert b.apply(snapshot("eb", 7, ev(STORED, SSD, keys[:6]), ev(STORED, ENGINE, keys[:2]))) is Outcome.APPLIED
    assert index.prefix(keys) == {
        "a": NodePrefix(10, dram=10),
        "b": NodePrefix(6, engine=2, ssd=4),
    }
    assert a.apply(live("ea", 2, ev(STORED, HBM, keys[:3]))) is Outcome.APPLIED
    assert index.prefix(keys)["a"] == NodePrefix(10, hbm=3, dram=7)
    assert index.prefix(keys[3:])["b"] == NodePrefix(3, ssd=3)  # any chain segment, from its first key
    assert index.tier_blocks("a") == {"engine": 0, "hbm": 3, "dram": 10, "ssd": 10}


def test_a_block_no_node_holds_ends_every_prefix(index: ClusterKVIndex) -> None:
    a = Node(index, "a")
    keys = chain(8)
    a.apply(snapshot("e", 1, ev(STORED, DRAM, keys)))
    assert a.apply(live("e", 2, ev(REMOVED, DRAM, keys[3:4]))) is Outcome.APPLIED
    assert index.prefix(keys) == {"a": NodePrefix(3, dram=3)}
    assert index.blocks == 7, "a block no node holds leaves the index"
    assert index.prefix(chain(8, tenant="other")) == {}, "another tenant's chain names other blocks"
    assert index.prefix(chain(8, model=OTHER_MODEL)) == {}, "another model's chain names other blocks"
    assert index.prefix([]) == {}


def test_removed_from_one_tier_falls_back_to_the_next(index: ClusterKVIndex) -> None:
    a = Node(index, "a")
    keys = chain(4)
    a.apply(snapshot("e", 1, ev(STORED, ENGINE, keys), ev(STORED, DRAM, keys)))
    a.apply(live("e", 2, ev(REMOVED, ENGINE, keys[:2])))
    assert index.prefix(keys) == {"a": NodePrefix(4, engine=2, dram=2)}
    a.apply(live("e", 3, ev(REMOVED, SSD, keys)))  # a tier that never held them: nothing changes
    assert index.prefix(keys) == {"a": NodePrefix(4, engine=2, dram=2)}


def test_cleared_empties_one_tier_of_one_node(index: ClusterKVIndex) -> None:
    a, b = Node(index, "a"), Node(index, "b")
    keys = chain(5)
    a.apply(snapshot("e", 1, ev(STORED, ENGINE, keys), ev(STORED, SSD, keys[:3])))
    b.apply(snapshot("f", 1, ev(STORED, ENGINE, keys)))
    assert a.apply(live("e", 2, ev(CLEARED, ENGINE))) is Outcome.APPLIED
    assert index.prefix(keys) == {"a": NodePrefix(3, ssd=3), "b": NodePrefix(5, engine=5)}
    assert index.tier_blocks("a")["engine"] == 0
    a.apply(live("e", 3, ev(STORED, ENGINE, keys[:1])))  # stored again after the clear: held again
    assert index.prefix(keys)["a"] == NodePrefix(3, engine=1, ssd=2)


def test_live_batches_in_order_and_heartbeats_in_step_keep_a_node_synced(index: ClusterKVIndex) -> None:
    a = Node(index, "a")
    assert index.node("a").state is SyncState.NO_EVENTS
    assert index.resume_point("a") == ("", 0)
    a.apply(snapshot("e", 10))
    assert index.synced("a") and index.resume_point("a") == ("e", 10)
    assert a.apply(live("e", 10)) is Outcome.APPLIED  # heartbeat: seq = the last live batch's
    assert a.apply(live("e", 11, ev(STORED, DRAM, chain(1)))) is Outcome.APPLIED
    assert a.apply(live("e", 11)) is Outcome.APPLIED
    assert index.resume_point("a") == ("e", 11)
    node = index.node("a")
    assert (node.batches_applied, node.events_applied, node.resyncs) == (4, 1, 0)
    assert node.last_event_s == a.now


@pytest.mark.parametrize(
    ("batch", "reason"),
    [
        (live("e", 13, ev(STORED, DRAM, chain(1, seed=9))), "gap"),
        (live("e", 12), "heartbeat_ahead"),
        (live("e", 11, ev(STORED, DRAM, chain(1, seed=9))), "out_of_order"),
        (live("e", 10), "out_of_order"),
        (live("other", 12, ev(STORED, DRAM, chain(1, seed=9))), "epoch"),
        (BlockBatch("e", 12, (ev(STORED, DRAM, chain(1, seed=9)),), snapshot_end=True), "snapshot_end"),
        (live("e", 12, BlockEvent(STORED, DRAM, b"short")), "malformed"),
    ],
)
def test_a_gap_marks_the_node_out_of_sync_and_asks_for_a_snapshot(
    index: ClusterKVIndex, batch: BlockBatch, reason: str
) -> None:
    a = Node(index, "a")
    keys = chain(3)
    a.apply(snapshot("e", 11, ev(STORED, DRAM, keys)))  # in sync, at 11
    resyncs = index.node("a").resyncs

    result = index.apply("a", batch, now_s=99.0, now_unix_ms=0)

    assert (result.outcome, result.reason) == (Outcome.RESYNC, reason)
    assert not index.synced("a") and index.resume_point("a") == ("", 0)
    assert index.node("a").resyncs == resyncs + 1
    assert index.prefix(keys) == {"a": NodePrefix(3, dram=3)}, "entries stay until the snapshot replaces them"
    assert index.prefix(chain(1, seed=9)) == {}, "nothing of the refused batch is applied"
    assert a.apply(live("e", 12)) is Outcome.RESYNC, "only a snapshot brings it back"
    assert a.apply(snapshot("e", 20, ev(STORED, SSD, keys[:1]))) is Outcome.APPLIED
    assert index.synced("a") and index.prefix(keys) == {"a": NodePrefix(1, ssd=1)}


def test_a_snapshot_replaces_the_nodes_entries_and_no_others(index: ClusterKVIndex) -> None:
    a, b = Node(index, "a"), Node(index, "b")
    old, new = chain(6, seed=1), chain(4, seed=2)
    a.apply(snapshot("e", 1, ev(STORED, DRAM, old), ev(STORED, ENGINE, old[:2])))
    b.apply(snapshot("f", 1, ev(STORED, SSD, old)))
    a.apply(snapshot("e", 5, ev(STORED, HBM, new)))
    assert index.prefix(old) == {"b": NodePrefix(6, ssd=6)}
    assert index.prefix(new) == {"a": NodePrefix(4, hbm=4)}
    assert index.tier_blocks("a") == {"engine": 0, "hbm": 4, "dram": 0, "ssd": 0}
    assert index.node("a").resyncs == 1 and index.node("a").reasons == {"expired": 1}
    assert index.node("a").restarts == 0, "same epoch: the node no longer held our seq, it did not restart"


def test_a_snapshot_in_several_batches_resyncs_until_its_end(index: ClusterKVIndex) -> None:
    a = Node(index, "a")
    keys = chain(9)
    assert a.apply(BlockBatch("e", 40, (ev(STORED, DRAM, keys[:3]),), snapshot_begin=True)) is Outcome.APPLIED
    assert index.node("a").state is SyncState.RESYNCING and index.resume_point("a") == ("", 0)
    assert a.apply(BlockBatch("e", 40, (ev(STORED, DRAM, keys[3:6]),))) is Outcome.APPLIED
    assert a.apply(BlockBatch("e", 40, (ev(STORED, DRAM, keys[6:]),), snapshot_end=True)) is Outcome.APPLIED
    assert index.synced("a") and index.resume_point("a") == ("e", 40)
    assert index.prefix(keys) == {"a": NodePrefix(9, dram=9)}
    assert a.apply(live("e", 41, ev(REMOVED, DRAM, keys[8:]))) is Outcome.APPLIED, "live batches continue at seq + 1"


def test_a_stream_lost_mid_snapshot_needs_a_new_one(index: ClusterKVIndex) -> None:
    a = Node(index, "a")
    a.apply(snapshot("e", 3))
    assert index.stream_lost("a") == "" and index.resume_point("a") == ("e", 3), "a synced node resumes"
    a.apply(BlockBatch("e", 4, (ev(STORED, DRAM, chain(2)),), snapshot_begin=True))
    assert index.stream_lost("a") == "snapshot_cut"
    assert index.resume_point("a") == ("", 0)
    assert a.apply(BlockBatch("e", 4, snapshot_end=True)) is Outcome.RESYNC, "the end of a cut snapshot is refused"


def test_a_snapshot_of_two_epochs_is_one_resync(index: ClusterKVIndex) -> None:
    a = Node(index, "a")
    a.apply(BlockBatch("e", 4, (ev(STORED, DRAM, chain(2)),), snapshot_begin=True))
    assert a.apply(BlockBatch("f", 4, snapshot_end=True)) is Outcome.RESYNC
    assert index.stream_lost("a") == "", "the resync was counted once, when the other epoch came"
    assert index.node("a").reasons == {"epoch": 1}


def test_a_new_epoch_means_the_node_restarted(index: ClusterKVIndex) -> None:
    a = Node(index, "a")
    before = chain(5, seed=3)
    a.apply(snapshot("boot-1", 100, ev(STORED, DRAM, before)))
    result = index.apply("a", snapshot("boot-2", 0, ev(STORED, SSD, before[:2])), now_s=1.0, now_unix_ms=0)
    assert result.resynced == "restart"
    assert index.node("a").restarts == 1
    assert index.resume_point("a") == ("boot-2", 0)
    assert index.prefix(before) == {"a": NodePrefix(2, ssd=2)}
    assert a.apply(live("boot-2", 1, ev(STORED, DRAM, before[2:3]))) is Outcome.APPLIED


def test_dropping_a_node_clears_it_and_requires_a_snapshot(index: ClusterKVIndex) -> None:
    a, b = Node(index, "a"), Node(index, "b")
    keys = chain(3)
    a.apply(snapshot("e", 1, ev(STORED, DRAM, keys)))
    b.apply(snapshot("f", 1, ev(STORED, DRAM, keys)))
    index.drop_node("a", "fingerprint")
    assert index.prefix(keys) == {"b": NodePrefix(3, dram=3)}
    assert not index.synced("a") and index.node("a").last_resync_reason == "fingerprint"


def test_renamed_nodes_keep_their_entries(index: ClusterKVIndex) -> None:
    a = Node(index, "127.0.0.1:50051")
    keys = chain(2)
    a.apply(snapshot("e", 1, ev(STORED, DRAM, keys)))
    index.rename_node("127.0.0.1:50051", "node-0")
    assert index.prefix(keys) == {"node-0": NodePrefix(2, dram=2)}
    assert index.synced("node-0") and index.node_ids == ["node-0"]
    index.add_node("node-1")
    with pytest.raises(ValueError):
        index.rename_node("node-0", "node-1")


def test_node_slots_are_bounded() -> None:
    index = ClusterKVIndex(100, 2)
    index.add_node("a")
    index.add_node("b")
    assert index.add_node("a").slot == 0, "adding a known node again changes nothing"
    with pytest.raises(ValueError):
        index.add_node("c")
    with pytest.raises(ValueError):
        ClusterKVIndex(100, KV_INDEX_MAX_NODES + 1)
    ClusterKVIndex(100, KV_INDEX_MAX_NODES)  # the configuration's bound is the index's


def test_describe_reports_the_node_for_status(index: ClusterKVIndex) -> None:
    index.add_node("a")
    index.apply("a", BlockBatch("e", 2, (ev(STORED, HBM, chain(2)),), True, True, 1_000), now_s=5.0, now_unix_ms=1_004)
    detail = index.describe("a", now_s=6.5)
    assert detail["state"] == "synced" and (detail["epoch"], detail["seq"]) == ("e", 2)
    assert (detail["last_event_age_s"], detail["lag_ms"], detail["events_applied"]) == (1.5, 4.0, 1)
    assert detail["blocks"] == {"engine": 0, "hbm": 2, "dram": 0, "ssd": 0}


# -- prefix() against a naive model ---------------------------------------------------------------
NODES = ("n0", "n1", "n2")
CHAINS = [chain(12, seed=s) for s in range(3)]
ALL_KEYS = [key for keys in CHAINS for key in keys]


Held = dict[str, dict[IndexTier, set[BlockKey]]]


def reference_prefix(held: Held, keys: Sequence[BlockKey]) -> dict[str, NodePrefix]:
    """Walk the keys per node, the slow obvious way."""
    out = {}
    for node, tiers in held.items():
        counts = dict.fromkeys(IndexTier, 0)
        blocks = 0
        for key in keys:
            best = next((tier for tier in IndexTier if key in tiers[tier]), None)
            if best is None:
                break
            counts[best] += 1
            blocks += 1
        if blocks:
            out[node] = NodePrefix(blocks, counts[ENGINE], counts[HBM], counts[DRAM], counts[SSD])
    return out


key_sets = st.lists(st.sampled_from(range(len(ALL_KEYS))), max_size=10).map(lambda ix: [ALL_KEYS[i] for i in ix])
events = st.tuples(st.sampled_from(EventKind), st.sampled_from(IndexTier), key_sets)
steps = st.tuples(st.sampled_from(NODES), st.booleans(), st.lists(events, max_size=4))


@settings(max_examples=150, deadline=None)
@given(st.lists(steps, min_size=1, max_size=25), st.integers(0, len(ALL_KEYS) - 1), st.sampled_from([0, 7, 400]))
def test_prefix_matches_a_naive_model(script: list[tuple[str, bool, list]], probe: int, sweep: int) -> None:
    index = ClusterKVIndex(1_000, len(NODES))
    held: Held = {node: {tier: set() for tier in IndexTier} for node in NODES}
    seqs = dict.fromkeys(NODES, 0)
    for node in NODES:
        index.add_node(node)
    for node, is_snapshot, node_events in script:
        batch_events = tuple(ev(kind, tier, () if kind is CLEARED else keys) for kind, tier, keys in node_events)
        if is_snapshot:
            held[node] = {tier: set() for tier in IndexTier}
            batch = BlockBatch("e", seqs[node], batch_events, snapshot_begin=True, snapshot_end=True)
        elif index.node(node).state is not SyncState.SYNCED:
            continue  # a live batch before any snapshot is refused; the model skips it too
        else:
            seqs[node] += 1 if batch_events else 0  # an empty one is a heartbeat: the last seq
            batch = BlockBatch("e", seqs[node], batch_events)
        assert index.apply(node, batch, now_s=0.0, now_unix_ms=0).outcome is Outcome.APPLIED
        for kind, tier, keys in node_events:
            if kind is STORED:
                held[node][tier].update(keys)
            elif kind is REMOVED:
                held[node][tier].difference_update(keys)
            else:
                held[node][tier].clear()
        index.table.sweep_step(sweep)  # besides apply's own: clears reach slots through lookups and sweeps
    synced = {node: tiers for node, tiers in held.items() if index.synced(node)}
    for keys in [*CHAINS, CHAINS[probe // 12][probe % 12 :]]:
        assert index.prefix(keys) == reference_prefix(synced, keys)
    for node in synced:
        assert index.tier_blocks(node) == {tier.name.lower(): len(held[node][tier]) for tier in IndexTier}
    assert index.blocks >= len(set().union(*(t for tiers in synced.values() for t in tiers.values())))


def test_snapshot_apply_time_is_measured() -> None:
    """A restarted scheduler rebuilds its index from every node's snapshot: time one of 200k blocks
    (in batches of 4096 keys, as a node might send them) and keep it well under a second per 100k."""
    blocks, per_batch = 200_000, 4096
    rng = np.random.default_rng(5)
    raw = rng.bytes(32 * blocks)
    index = ClusterKVIndex(1_000_000, 64)
    index.add_node("a")
    batches = [
        BlockBatch("e", 9, (BlockEvent(STORED, DRAM, raw[32 * i : 32 * (i + per_batch)]),), snapshot_begin=(i == 0))
        for i in range(0, blocks, per_batch)
    ]
    batches.append(BlockBatch("e", 9, snapshot_end=True))
    started = time.perf_counter()
    for batch in batches:
        assert index.apply("a", batch, now_s=0.0, now_unix_ms=0).outcome is Outcome.APPLIED
    seconds = time.perf_counter() - started
    print(f"snapshot of {blocks} blocks applied in {seconds:.3f} s ({seconds / blocks * 1e6:.2f} us/block)")
    assert index.synced("a") and index.tier_blocks("a")["dram"] == blocks
    assert seconds < 4.0, f"{seconds:.2f} s for {blocks} blocks"


def test_a_removed_nodes_slot_is_reused_and_holds_nothing_of_it() -> None:
    index = ClusterKVIndex(1_000, 2)
    keys = chain(3)
    for node in ("a", "b"):
        index.add_node(node)
        index.table.store(
            np.array([int.from_bytes(k[:8], "little") for k in keys], np.uint64), index.node(node).slot, 2
        )
    assert set(index.prefix(keys)) == {"a", "b"}
    with pytest.raises(ValueError, match="room for 2"):
        index.add_node("c")
    index.remove_node("a")
    index.remove_node("a")  # gone already: nothing to do
    assert index.node_ids == ["b"] and set(index.prefix(keys)) == {"b"}
    assert index.tier_blocks("b")["dram"] == 3
    assert index.add_node("c").slot == 0  # a's slot, with none of a's blocks
    assert set(index.prefix(keys)) == {"b"} and index.tier_blocks("c")["dram"] == 0
    assert index.node_ids == ["c", "b"]
