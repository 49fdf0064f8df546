"""WatchBlocks: one subscriber's stream of block event batches (proto/symphony/v1/kv.proto).

A stream starts with a replay from the log's ring when the request names this log's epoch and a
seq the ring still holds everything after; otherwise with a snapshot: STORED events for every full
block each store tier holds whole and every engine-held key, as of one seq, in batches of at most
`batch_entries` entries, the first marked snapshot_begin and the last snapshot_end. Live batches
follow from the next seq, and a heartbeat (no events, the last seq sent) after `heartbeat_s` with
nothing else to send.

The snapshot is exact: it is read under the store's lock, where every store tier publishes, with
the log's snapshot point taken in the same critical section, so each change is either in it or in
a batch after it, never both and never neither.

Ends: `TooManySubscribers` before anything is sent; `SubscriptionEnded("lagging")` when the reader
fell further behind than the log keeps for it; the generator returns once the log closes (the node
stops). Cancelling it (the client went away) unsubscribes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from node_manager.kv.block_events import (
    TIER_ENGINE,
    BlockEvent,
    BlockEventKind,
    BlockEventLog,
    EventBatch,
    Subscription,
    SubscriptionEnded,
)
from node_manager.kv.store import TieredStore
from symphony.kv_addressing import BlockKey
from symphony.rpc import kv_pb2

READ_BATCHES = 64  # batches taken from the ring per read: the loop yields between reads
_KINDS = {
    BlockEventKind.STORED: kv_pb2.BLOCK_EVENT_STORED,
    BlockEventKind.REMOVED: kv_pb2.BLOCK_EVENT_REMOVED,
    BlockEventKind.CLEARED: kv_pb2.BLOCK_EVENT_CLEARED,
}
_TIERS = {int(tier): tier for tier in (kv_pb2.TIER_HBM, kv_pb2.TIER_DRAM, kv_pb2.TIER_SSD, kv_pb2.TIER_ENGINE)}


@dataclass(frozen=True, slots=True)
class StreamHeader:
    """What every batch of a node's stream repeats."""

    node_id: str
    model_fingerprint: bytes
    block_size: int
    epoch: str


def to_proto(batch: EventBatch, header: StreamHeader) -> kv_pb2.BlockEventBatch:
    return kv_pb2.BlockEventBatch(
        node_id=header.node_id,
        model_fingerprint=header.model_fingerprint,
        block_size=header.block_size,
        epoch=header.epoch,
        seq=batch.seq,
        snapshot_begin=batch.snapshot_begin,
        snapshot_end=batch.snapshot_end,
        events=[kv_pb2.BlockEvent(kind=_KINDS[e.kind], tier=_TIERS[e.tier], block_keys=e.keys) for e in batch.events],
        published_unix_ms=batch.published_unix_ms,
    )


def snapshot(store: TieredStore, sub: Subscription | None = None) -> list[EventBatch]:
    """Everything the node holds as STORED batches, all with the seq they describe; `sub` (if given)
    continues after that seq. Takes the store's lock for the read: run it off the event loop."""
    log = store.events
    with store.lock:
        seq, engine = log.snapshot_point(sub)
        held: list[tuple[int, list[BlockKey]]] = [(int(tier), keys) for tier, keys in store.holdings.snapshot().items()]
    held.append((TIER_ENGINE, engine))
    return chunk_snapshot(seq, held, log.settings.batch_entries)


def chunk_snapshot(seq: int, held: list[tuple[int, list[BlockKey]]], batch_entries: int) -> list[EventBatch]:
    """STORED events for `held` (tier, keys), in batches of at most `batch_entries` entries (an
    event or a key each), marked as one snapshot at `seq`."""
    now_ms = time.time_ns() // 1_000_000
    groups: list[list[BlockEvent]] = [[]]
    room = batch_entries
    for tier, keys in held:
        at = 0
        while at < len(keys):
            if room < 2:
                groups.append([])
                room = batch_entries
            take = min(room - 1, len(keys) - at)
            groups[-1].append(BlockEvent(BlockEventKind.STORED, tier, tuple(keys[at : at + take])))
            room -= 1 + take
            at += take
    last = len(groups) - 1
    return [
        EventBatch(seq, now_ms, tuple(events), snapshot_begin=i == 0, snapshot_end=i == last)
        for i, events in enumerate(groups)
    ]


async def watch_blocks(
    store: TieredStore, header: StreamHeader, epoch: str, after_seq: int
) -> AsyncIterator[kv_pb2.BlockEventBatch]:
    """The stream for a request resuming after (`epoch`, `after_seq`); see the module docstring."""
    log = store.events
    sub = log.subscribe()
    try:
        if not (epoch and log.resume(sub, epoch, after_seq)):
            for batch in await asyncio.to_thread(snapshot, store, sub):
                yield to_proto(batch, header)
        async for message in _live(log, sub, header):
            yield message
    finally:
        log.unsubscribe(sub)


async def _live(log: BlockEventLog, sub: Subscription, header: StreamHeader) -> AsyncIterator[kv_pb2.BlockEventBatch]:
    heartbeat_s = log.settings.heartbeat_s
    last_sent = time.monotonic()
    while True:
        try:
            batches = log.read(sub, READ_BATCHES)
        except SubscriptionEnded as ended:
            if ended.reason == "closed":
                return
            raise
        if batches:
            for batch in batches:
                yield to_proto(batch, header)
            last_sent = time.monotonic()
            continue
        idle = time.monotonic() - last_sent
        if idle >= heartbeat_s:
            assert sub.cursor is not None
            yield to_proto(EventBatch(sub.cursor, time.time_ns() // 1_000_000, ()), header)
            last_sent = time.monotonic()
            continue
        await log.wait(sub, heartbeat_s - idle)
