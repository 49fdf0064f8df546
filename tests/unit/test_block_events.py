"""node_manager.kv.block_events: the block event log (seq, epochs, ring, subscribers, engine tier)
and the stream pieces of block_watch that need no store (heartbeats, snapshot chunking)."""

from __future__ import annotations

import asyncio
import hashlib
import sys
import threading

import pytest

from node_manager.kv.block_events import (
    TIER_ENGINE,
    BlockEventKind,
    BlockEventLog,
    BlockEventSettings,
    EventBatch,
    SubscriptionEnded,
    TooManySubscribers,
)
from node_manager.kv.block_watch import StreamHeader, _live, chunk_snapshot
from node_manager.kv.metrics import KVMetrics
from node_manager.kv.pages import Tier
from node_manager.kv_runtime import block_event_settings
from symphony.config import load_config
from symphony.kv_addressing import BlockKey
from symphony.rpc import kv_pb2

STORED, REMOVED, CLEARED = BlockEventKind.STORED, BlockEventKind.REMOVED, BlockEventKind.CLEARED
HEADER = StreamHeader("node-0", b"\x01" * 32, 16, "epoch")
TIMEOUT = 10.0


def key(n: int) -> BlockKey:
    return BlockKey(hashlib.sha256(n.to_bytes(8, "little")).digest())


def keys(*ns: int) -> list[BlockKey]:
    return [key(n) for n in ns]


def make_log(metrics: KVMetrics | None = None, **settings: object) -> BlockEventLog:
    return BlockEventLog(BlockEventSettings(**settings), metrics)  # type: ignore[arg-type]


def flat(batches: list[EventBatch]) -> list[tuple[BlockEventKind, int, tuple[BlockKey, ...]]]:
    return [(event.kind, event.tier, event.keys) for batch in batches for event in batch.events]


def sample(metrics: KVMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


# ---- seq, epoch, batches --------------------------------------------------------------------------


def test_each_log_has_its_own_epoch_and_seqs_count_from_one() -> None:
    first, second = make_log(), make_log()
    assert first.epoch != second.epoch and len(first.epoch) >= 16
    assert first.seq == 0 and first.replay(0) == []
    first.publish(STORED, Tier.DRAM, keys(1))
    first.replay(0)  # seals
    first.publish(REMOVED, Tier.DRAM, keys(1))
    batches = first.replay(0)
    assert batches is not None and [b.seq for b in batches] == [1, 2]
    assert flat(batches) == [(STORED, Tier.DRAM, (key(1),)), (REMOVED, Tier.DRAM, (key(1),))]
    assert all(b.published_unix_ms > 0 and not (b.snapshot_begin or b.snapshot_end) for b in batches)


def test_events_coalesce_into_one_batch_in_order_until_it_is_sealed() -> None:
    log = make_log()
    log.publish(STORED, Tier.DRAM, keys(1, 2))
    log.publish(STORED, Tier.DRAM, keys(3))  # same kind and tier: the same event
    log.publish(STORED, Tier.SSD, keys(1))
    log.publish(REMOVED, Tier.DRAM, keys(2))
    log.publish(STORED, Tier.DRAM, [])  # nothing to say: no event
    batches = log.replay(0)
    assert batches is not None and len(batches) == 1 and batches[0].seq == 1
    assert flat(batches) == [
        (STORED, Tier.DRAM, (key(1), key(2), key(3))),
        (STORED, Tier.SSD, (key(1),)),
        (REMOVED, Tier.DRAM, (key(2),)),
    ]


def test_a_batch_never_holds_more_than_batch_entries_and_keys_keep_their_order() -> None:
    log = make_log(batch_entries=5)
    log.publish(STORED, Tier.DRAM, keys(*range(11)))
    log.publish(REMOVED, Tier.SSD, keys(*range(3)))
    batches = log.replay(0)
    assert batches is not None
    assert [b.seq for b in batches] == list(range(1, len(batches) + 1))
    assert all(b.entries <= 5 for b in batches)
    stored = [k for kind, _, ks in flat(batches) if kind is STORED for k in ks]
    removed = [k for kind, _, ks in flat(batches) if kind is REMOVED for k in ks]
    assert stored == keys(*range(11)) and removed == keys(*range(3))


def test_an_unknown_tier_is_refused_before_anything_changes() -> None:
    log = make_log()
    with pytest.raises(KeyError):
        log.publish(STORED, 9, keys(1))
    assert log.replay(0) == []


# ---- the ring: replay after a seq, or a snapshot when it no longer holds it ----------------------


def test_replay_after_a_seq_the_ring_holds_gives_exactly_the_batches_after_it() -> None:
    log = make_log(batch_entries=2)  # one key per batch
    for n in range(6):
        log.publish(STORED, Tier.DRAM, keys(n))
    batches = log.replay(3)
    assert batches is not None and [b.seq for b in batches] == [4, 5, 6]
    assert [ks for _, _, ks in flat(batches)] == [(key(3),), (key(4),), (key(5),)]
    assert log.replay(6) == [] and log.replay(7) is None


def test_ring_overflow_forgets_the_oldest_batches_by_count_and_by_entries() -> None:
    by_count = make_log(batch_entries=2, ring_batches=4, subscriber_backlog=4)
    for n in range(10):
        by_count.publish(STORED, Tier.DRAM, keys(n))
    assert by_count.replay(5) is None, "batch 6 left the ring: a snapshot is needed"
    held = by_count.replay(6)
    assert held is not None and [b.seq for b in held] == [7, 8, 9, 10]

    by_entries = make_log(batch_entries=4, ring_entries=8)
    for n in range(5):
        by_entries.publish(STORED, Tier.DRAM, keys(3 * n, 3 * n + 1, 3 * n + 2))  # 4 entries each
    assert by_entries.replay(2) is None, "8 entries hold two batches of 4"
    kept = by_entries.replay(3)
    assert kept is not None and [b.seq for b in kept] == [4, 5]


async def test_resume_needs_the_same_epoch_and_a_seq_the_ring_holds() -> None:
    log = make_log(batch_entries=2, ring_batches=3, subscriber_backlog=3)
    for n in range(5):
        log.publish(STORED, Tier.DRAM, keys(n))
    sub = log.subscribe()
    assert not log.resume(sub, "another-epoch", 4)
    assert not log.resume(sub, log.epoch, 1), "batch 2 is gone from the ring"
    assert not log.resume(sub, log.epoch, 6), "a seq the node never reached"
    assert sub.cursor is None
    assert log.resume(sub, log.epoch, 3)
    assert [b.seq for b in log.read(sub, 10)] == [4, 5]
    assert log.read(sub, 10) == []


# ---- subscribers -----------------------------------------------------------------------------------


async def test_a_waiting_subscriber_is_woken_by_a_publish_from_another_thread() -> None:
    log = make_log()
    sub = log.subscribe()
    assert log.resume(sub, log.epoch, 0)
    publisher = threading.Thread(target=log.publish, args=(STORED, Tier.SSD, keys(7)))
    waiting = asyncio.create_task(log.wait(sub, 60.0))
    await asyncio.sleep(0)  # the wait is parked before the publish starts
    publisher.start()
    await asyncio.wait_for(waiting, TIMEOUT)  # woken, long before its own timeout
    publisher.join(TIMEOUT)
    assert flat(log.read(sub, 10)) == [(STORED, Tier.SSD, (key(7),))]


async def test_a_subscriber_that_falls_behind_its_backlog_is_dropped() -> None:
    metrics = KVMetrics()
    log = make_log(metrics, batch_entries=2, subscriber_backlog=3)
    slow, fast = log.subscribe(), log.subscribe()
    assert log.resume(slow, log.epoch, 0) and log.resume(fast, log.epoch, 0)
    for n in range(3):
        log.publish(STORED, Tier.DRAM, keys(n))
    assert len(log.read(fast, 10)) == 3
    log.publish(STORED, Tier.DRAM, keys(3))  # slow is now 4 batches behind
    with pytest.raises(SubscriptionEnded) as ended:
        log.read(slow, 10)
    assert ended.value.reason == "lagging"
    assert [b.seq for b in log.read(fast, 10)] == [4], "the other subscriber is unaffected"
    assert log.subscribers == 1
    assert sample(metrics, "symphony_kv_block_event_subscribers_dropped_total") == 1
    assert sample(metrics, "symphony_kv_block_event_subscribers") == 1


async def test_a_lagging_subscriber_is_dropped_at_the_wake_up_and_woken_to_learn_it() -> None:
    log = make_log(batch_entries=2, subscriber_backlog=2)
    sub = log.subscribe()
    assert log.resume(sub, log.epoch, 0)
    waiting = asyncio.create_task(log.wait(sub, 60.0))
    await asyncio.sleep(0)
    for n in range(4):  # seals 4 batches before the loop runs the wake-up
        log.publish(STORED, Tier.DRAM, keys(n))
    await asyncio.wait_for(waiting, TIMEOUT)
    assert sub.ended == "lagging"
    with pytest.raises(SubscriptionEnded):
        log.read(sub, 10)


async def test_subscribers_past_the_maximum_are_refused_until_one_leaves() -> None:
    metrics = KVMetrics()
    log = make_log(metrics, max_subscribers=2)
    first, _ = log.subscribe(), log.subscribe()
    with pytest.raises(TooManySubscribers):
        log.subscribe()
    assert sample(metrics, "symphony_kv_block_event_subscriptions_total", start="refused") == 1
    log.unsubscribe(first)
    log.subscribe()
    assert log.subscribers == 2


async def test_closing_ends_every_subscription_and_refuses_new_ones() -> None:
    log = make_log()
    sub = log.subscribe()
    assert log.resume(sub, log.epoch, 0)
    waiting = asyncio.create_task(log.wait(sub, 60.0))
    await asyncio.sleep(0)
    log.close()
    await asyncio.wait_for(waiting, TIMEOUT)
    with pytest.raises(SubscriptionEnded) as ended:
        log.read(sub, 10)
    assert ended.value.reason == "closed"
    with pytest.raises(SubscriptionEnded):
        log.subscribe()
    log.publish(STORED, Tier.DRAM, keys(1))  # the store may still change while it closes
    assert log.seq == 0 and [b.seq for b in log.replay(0) or []] == [1]


def test_publishing_from_many_threads_loses_nothing_and_numbers_every_batch_once() -> None:
    log = make_log(batch_entries=7, ring_batches=100_000, ring_entries=1 << 22, subscriber_backlog=10)
    threads, per_thread = 4, 2000
    start = threading.Barrier(threads)

    def publish(t: int) -> None:
        start.wait(TIMEOUT)
        for n in range(per_thread):
            log.publish(STORED if n % 3 else REMOVED, Tier.DRAM if t % 2 else Tier.SSD, keys(t * per_thread + n))

    workers = [threading.Thread(target=publish, args=(t,)) for t in range(threads)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads trade the GIL often: publishes interleave mid-call
    try:
        for worker in workers:
            worker.start()
        seen: list[EventBatch] = []
        while any(worker.is_alive() for worker in workers):  # a reader sealing batches meanwhile
            seen += log.replay(seen[-1].seq if seen else 0) or []
        for worker in workers:
            worker.join(TIMEOUT)
    finally:
        sys.setswitchinterval(switch)
    seen += log.replay(seen[-1].seq if seen else 0) or []
    assert [b.seq for b in seen] == list(range(1, len(seen) + 1))
    assert all(b.entries <= 7 for b in seen)
    named = [k for _, _, ks in flat(seen) for k in ks]
    assert sorted(named) == sorted(keys(*range(threads * per_thread)))
    for t in range(threads):  # each thread's events in the order it published them
        published = keys(*range(t * per_thread, (t + 1) * per_thread))
        theirs = set(published)
        assert [k for k in named if k in theirs] == published


# ---- the engine tier -------------------------------------------------------------------------------


def test_the_engine_emitter_publishes_only_changes_and_remembers_what_the_engine_holds() -> None:
    metrics = KVMetrics()
    log = make_log(metrics)
    emit = log.engine_emitter()
    emit("stored", keys(1, 2, 2))
    emit("stored", keys(2, 3))  # 2 is held already
    emit("removed", keys(1, 9))  # 9 was never held
    assert log.engine_keys() == set(keys(2, 3))
    emit("cleared", [])
    emit("stored", keys(4))
    assert log.engine_keys() == {key(4)}
    assert flat(log.replay(0) or []) == [
        (STORED, TIER_ENGINE, (key(1), key(2), key(3))),
        (REMOVED, TIER_ENGINE, (key(1),)),
        (CLEARED, TIER_ENGINE, ()),
        (STORED, TIER_ENGINE, (key(4),)),
    ]
    assert sample(metrics, "symphony_kv_block_events_total", kind="stored", tier="ENGINE") == 4
    assert sample(metrics, "symphony_kv_block_events_total", kind="cleared", tier="ENGINE") == 1


def test_engine_keys_past_the_bound_are_neither_remembered_nor_published() -> None:
    metrics = KVMetrics()
    log = make_log(metrics, engine_keys=3)
    emit = log.engine_emitter()
    emit("stored", keys(1, 2, 3, 4, 5))
    assert log.engine_keys() == set(keys(1, 2, 3))
    emit("removed", keys(4))  # never held: nothing to say
    emit("removed", keys(1))
    emit("stored", keys(6))  # room again
    assert flat(log.replay(0) or []) == [
        (STORED, TIER_ENGINE, (key(1), key(2), key(3))),
        (REMOVED, TIER_ENGINE, (key(1),)),
        (STORED, TIER_ENGINE, (key(6),)),
    ]
    assert sample(metrics, "symphony_kv_block_event_engine_overflow_total") == 2


@pytest.mark.parametrize(("kind", "bad"), [("evicted", keys(1)), ("stored", [b"short"]), ("removed", ["text"])])
def test_the_engine_emitter_refuses_unknown_kinds_and_malformed_keys(kind: str, bad: list) -> None:
    log = make_log()
    with pytest.raises(ValueError):
        log.engine_emitter()(kind, bad)
    assert log.replay(0) == [] and log.engine_keys() == set()


async def test_a_snapshot_point_seals_what_was_published_and_names_the_engine_keys() -> None:
    log = make_log()
    log.engine_emitter()("stored", keys(1, 2))
    log.publish(STORED, Tier.DRAM, keys(5))
    sub = log.subscribe()
    seq, engine = log.snapshot_point(sub)
    assert (seq, sorted(engine)) == (1, sorted(keys(1, 2)))
    assert sub.cursor == 1 and log.read(sub, 10) == []
    log.publish(REMOVED, Tier.DRAM, keys(5))
    assert [b.seq for b in log.read(sub, 10)] == [2]


# ---- stream pieces without a store -----------------------------------------------------------------


async def test_an_idle_stream_sends_heartbeats_carrying_the_last_seq() -> None:
    log = make_log(heartbeat_s=0.05)
    log.publish(STORED, Tier.DRAM, keys(1))
    sub = log.subscribe()
    assert log.resume(sub, log.epoch, 0)
    stream = _live(log, sub, HEADER)
    first = await asyncio.wait_for(anext(stream), TIMEOUT)
    assert first.seq == 1 and len(first.events) == 1
    beat = await asyncio.wait_for(anext(stream), TIMEOUT)
    assert (beat.seq, len(beat.events), beat.snapshot_begin, beat.snapshot_end) == (1, 0, False, False)
    assert (beat.node_id, beat.epoch, beat.block_size) == ("node-0", "epoch", 16)
    log.publish(REMOVED, Tier.DRAM, keys(1))
    live = await asyncio.wait_for(anext(stream), TIMEOUT)
    assert live.seq == 2 and live.events[0].kind == kv_pb2.BLOCK_EVENT_REMOVED
    log.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(stream), TIMEOUT)


@pytest.mark.parametrize("sizes", [[], [0, 0, 0, 0], [1], [3, 0, 5, 2], [40, 1, 0, 17]])
def test_a_snapshot_is_chunked_into_bounded_batches_of_one_seq(sizes: list[int]) -> None:
    held = [
        (tier, keys(*range(100 * tier, 100 * tier + size))) for tier, size in zip((1, 2, 3, 4), sizes, strict=False)
    ]
    batches = chunk_snapshot(42, held, batch_entries=6)
    assert all(b.seq == 42 and b.entries <= 6 for b in batches)
    assert [b.snapshot_begin for b in batches] == [True] + [False] * (len(batches) - 1)
    assert [b.snapshot_end for b in batches] == [False] * (len(batches) - 1) + [True]
    assert all(kind is STORED for kind, _, _ in flat(batches))
    got = {(tier, k) for _, tier, ks in flat(batches) for k in ks}
    assert got == {(tier, k) for tier, ks in held for k in ks}
    assert len(got) == sum(len(ks) for _, ks in held), "every key once"


# ---- settings --------------------------------------------------------------------------------------


def test_the_node_config_defaults_are_the_logs_defaults() -> None:
    assert block_event_settings(load_config(env={})) == BlockEventSettings()


@pytest.mark.parametrize(
    "bad",
    [
        {"batch_entries": 1},
        {"ring_batches": 0},
        {"heartbeat_s": 0.0},
        {"ring_batches": 4, "subscriber_backlog": 5},
        {"ring_entries": 10, "batch_entries": 11},
    ],
)
def test_settings_a_log_cannot_honour_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="block events"):
        BlockEventLog(BlockEventSettings(**bad))  # type: ignore[arg-type]
