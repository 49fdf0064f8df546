"""Block events: the full blocks this node holds, per tier, as a numbered stream of batches, for the
scheduler's cluster KV index (`KVStore.WatchBlocks`; proto/symphony/v1/kv.proto says what a receiver
may assume, `block_watch` serves it).

`BlockEventLog` is the node's one log:
- `publish(kind, tier, keys)` may be called from any thread. It appends to the open batch under the
  log's own small lock, does no I/O and never takes the store's lock. The store's tiers publish
  under the store's lock, in the critical section of the directory change they describe
  (`holdings`), so a snapshot taken under the store's lock (`snapshot_point`) falls exactly between
  two batches. The only call out is one `call_soon_threadsafe` per wake-up of the event loop, made
  outside the log's lock, and only while someone subscribes.
- Batches carry consecutive `seq` from 1 within `epoch` (random, one per log, so one per node manager
  start). The open batch is sealed (given its seq) when a subscriber reads or is woken, when a
  snapshot point is taken, or once it holds `batch_entries` entries (a block key or an event is one
  entry each); events of one kind and tier published back to back coalesce into one event.
- The ring keeps the latest sealed batches, at most `ring_batches` of them and `ring_entries`
  entries, for subscribers that resume after a seq.
- Subscribers are asyncio consumers on one event loop, at most `max_subscribers`. Each reads the
  ring from its own cursor: its backlog (batches after its cursor) is its queue, bounded by
  `subscriber_backlog`. One that falls further behind, or off the ring, is dropped
  (`SubscriptionEnded("lagging")`) and resubscribes.
- The engine tier (vLLM's own prefix cache) comes in through `engine_emitter()`. The log keeps the
  engine-held keys it was told about, at most `engine_keys`, so that snapshots include them; keys
  past that bound are neither kept nor published (counted, logged once per episode), so the
  events and the snapshots of the engine tier always agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from node_manager.kv.metrics import KVMetrics
from symphony.kv_addressing import BLOCK_KEY_BYTES, BlockKey
from symphony.logs import get_logger
from symphony.rpc import kv_pb2

log = get_logger(__name__)

TIER_ENGINE: int = kv_pb2.TIER_ENGINE
# Tiers by their symphony.v1.Tier value (the store's `pages.Tier` members equal theirs).
TIER_NAMES = {kv_pb2.TIER_HBM: "HBM", kv_pb2.TIER_DRAM: "DRAM", kv_pb2.TIER_SSD: "SSD", TIER_ENGINE: "ENGINE"}


class BlockEventKind(StrEnum):
    STORED = "stored"  # the blocks are now held in the tier
    REMOVED = "removed"  # the blocks are no longer held in the tier
    CLEARED = "cleared"  # nothing is held in the tier any more (names no key)


@dataclass(frozen=True, slots=True)
class BlockEvent:
    kind: BlockEventKind
    tier: int  # a symphony.v1.Tier value
    keys: tuple[BlockKey, ...]


@dataclass(frozen=True, slots=True)
class EventBatch:
    """A sealed live batch (or, from `block_watch`, one batch of a snapshot)."""

    seq: int
    published_unix_ms: int  # when its first event was published
    events: tuple[BlockEvent, ...]
    snapshot_begin: bool = False
    snapshot_end: bool = False

    @property
    def entries(self) -> int:
        return sum(1 + len(event.keys) for event in self.events)


@dataclass(frozen=True)
class BlockEventSettings:
    ring_batches: int = 4096  # live batches kept for resuming subscribers
    ring_entries: int = 1 << 20  # ... and block keys + events in them, all batches together
    batch_entries: int = 1024  # block keys + events per batch, live or snapshot (>= 2)
    subscriber_backlog: int = 1024  # batches a subscriber may fall behind before it is dropped
    max_subscribers: int = 8
    engine_keys: int = 1 << 20  # engine-held keys remembered for snapshots
    heartbeat_s: float = 1.0  # an idle stream sends a heartbeat this often

    def validate(self) -> None:
        for name in ("ring_batches", "ring_entries", "subscriber_backlog", "max_subscribers", "engine_keys"):
            if getattr(self, name) <= 0:
                raise ValueError(f"block events: {name} must be positive")
        if self.batch_entries < 2:
            raise ValueError("block events: batch_entries must be at least 2 (an event and a key)")
        if self.heartbeat_s <= 0:
            raise ValueError("block events: heartbeat_s must be positive")
        if self.subscriber_backlog > self.ring_batches:
            raise ValueError("block events: subscriber_backlog cannot exceed ring_batches")
        if self.batch_entries > self.ring_entries:
            raise ValueError("block events: batch_entries cannot exceed ring_entries")


class SubscriptionEnded(Exception):
    """A subscription is over: `reason` is "closed" (the node stops) or "lagging" (it fell behind
    further than the backlog or the ring allows; resubscribe)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class TooManySubscribers(Exception):
    pass


@dataclass(eq=False, slots=True)
class Subscription:
    """One consumer's place in the log. `cursor`: the last seq it has been handed (None until
    `resume` or `snapshot_point` positions it). Touched by the log under its lock."""

    wake: asyncio.Event
    cursor: int | None = None
    ended: str = ""  # SubscriptionEnded's reason once over


def check_keys(keys: Sequence[BlockKey]) -> None:
    """Raise ValueError unless every key is a 32-byte block key."""
    for key in keys:
        if not isinstance(key, bytes) or len(key) != BLOCK_KEY_BYTES:
            raise ValueError(f"a block key is {BLOCK_KEY_BYTES} bytes, got {key!r:.80}")


class BlockEventLog:
    def __init__(
        self, settings: BlockEventSettings | None = None, metrics: KVMetrics | None = None, epoch: str | None = None
    ) -> None:
        self.settings = settings or BlockEventSettings()
        self.settings.validate()
        self.epoch = epoch or uuid.uuid4().hex
        self._lock = threading.Lock()  # guards everything below; held for list appends, never for I/O
        self._seq = 0  # the last sealed batch
        self._open: list[tuple[BlockEventKind, int, list[BlockKey]]] = []
        self._open_entries = 0
        self._open_ms = 0
        self._ring: dict[int, EventBatch] = {}  # seq -> batch, consecutive, the newest is `_seq`
        self._ring_entries = 0
        self._engine: set[BlockKey] = set()
        self._engine_overflowing = False
        self._subscribers: set[Subscription] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake_pending = False
        self._closed = False
        m = metrics or KVMetrics()
        self._metrics = m
        self._published = {
            (kind, tier): m.block_events.labels(kind.value, name)
            for kind in BlockEventKind
            for tier, name in TIER_NAMES.items()
        }

    # ---- publishing (any thread) ------------------------------------------------------------------

    @property
    def seq(self) -> int:
        """The last sealed batch's seq."""
        return self._seq

    def publish(self, kind: BlockEventKind, tier: int, keys: Sequence[BlockKey]) -> None:
        """Append an event to the open batch. Store tiers publish under the store's lock; the engine
        tier (`TIER_ENGINE`) goes through the engine's bookkeeping (`engine_emitter`)."""
        if tier == TIER_ENGINE:
            self._emit_engine(kind, keys)
            return
        if not keys and kind is not BlockEventKind.CLEARED:
            return
        counter = self._published[kind, tier]  # KeyError for a tier that is none, before anything changes
        with self._lock:
            self._append(kind, tier, keys)
            loop = self._wake_loop()
        counter.inc(len(keys) or 1)
        if loop is not None:
            self._call_wake(loop)

    def engine_emitter(self) -> Callable[[str, Sequence[BlockKey]], None]:
        """`emit(kind, keys)` for the engine tier: kind "stored", "removed" or "cleared" (keys then
        ignored), keys 32-byte block keys; raises ValueError for anything else. Callable from any
        thread. Only changes are published: keys already held are not stored again, keys not held
        are not removed."""
        return self._emit_engine

    def _emit_engine(self, kind: str, keys: Sequence[BlockKey]) -> None:
        kind = BlockEventKind(kind)
        if kind is not BlockEventKind.CLEARED:
            check_keys(keys)
        overflow = 0
        starts_overflow = False
        with self._lock:
            held = self._engine
            named: list[BlockKey] = []
            if kind is BlockEventKind.CLEARED:
                held.clear()
            elif kind is BlockEventKind.STORED:
                named = [key for key in dict.fromkeys(keys) if key not in held]
                room = self.settings.engine_keys - len(held)
                if len(named) > room:
                    overflow = len(named) - room
                    del named[room:]
                held.update(named)
            else:
                named = [key for key in dict.fromkeys(keys) if key in held]
                held.difference_update(named)
            if overflow:
                starts_overflow = not self._engine_overflowing
                self._engine_overflowing = True
            elif len(held) < self.settings.engine_keys:
                self._engine_overflowing = False
            loop = None
            if named or kind is BlockEventKind.CLEARED:
                self._append(kind, TIER_ENGINE, named)
                loop = self._wake_loop()
        if named or kind is BlockEventKind.CLEARED:
            self._published[kind, TIER_ENGINE].inc(len(named) or 1)
        if overflow:
            self._metrics.block_event_engine_overflow.inc(overflow)
            if starts_overflow:
                log.warning(
                    "engine-held block keys past kv.block_events_engine_keys are not tracked",
                    limit=self.settings.engine_keys,
                    dropped=overflow,
                )
        if loop is not None:
            self._call_wake(loop)

    def _append(self, kind: BlockEventKind, tier: int, keys: Sequence[BlockKey]) -> None:
        """Add an event to the open batch, sealing it whenever it fills. Caller holds the lock."""
        limit = self.settings.batch_entries
        pos, count = 0, len(keys)
        while True:
            last = self._open[-1] if self._open else None
            merge = last is not None and last[0] is kind and last[1] == tier and kind is not BlockEventKind.CLEARED
            room = limit - self._open_entries - (0 if merge else 1)
            if room < (1 if count > pos else 0):
                self._seal()
                continue
            take = min(room, count - pos)
            if not self._open:
                self._open_ms = time.time_ns() // 1_000_000
            if merge:
                assert last is not None
                last[2].extend(keys[pos : pos + take])
            else:
                self._open.append((kind, tier, list(keys[pos : pos + take])))
                self._open_entries += 1
            self._open_entries += take
            pos += take
            if pos >= count:
                break
        if self._open_entries >= limit:
            self._seal()

    def _seal(self) -> None:
        """Give the open batch the next seq and put it in the ring. Caller holds the lock."""
        if not self._open:
            return
        self._seq += 1
        batch = EventBatch(self._seq, self._open_ms, tuple(BlockEvent(k, t, tuple(keys)) for k, t, keys in self._open))
        self._ring[self._seq] = batch
        self._ring_entries += self._open_entries
        self._open = []
        self._open_entries = 0
        settings, ring = self.settings, self._ring
        oldest = self._seq - len(ring) + 1
        while len(ring) > settings.ring_batches or (self._ring_entries > settings.ring_entries and len(ring) > 1):
            self._ring_entries -= ring.pop(oldest).entries
            oldest += 1
        self._metrics.block_event_batches.inc()

    def _holds_after(self, seq: int) -> bool:
        """Whether every batch after `seq` is in the ring. Caller holds the lock."""
        return 0 <= seq <= self._seq and (seq == self._seq or seq + 1 in self._ring)

    def _wake_loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop to wake for new events, once per wake-up. Caller holds the lock."""
        if self._subscribers and not self._wake_pending and self._loop is not None:
            self._wake_pending = True
            return self._loop
        return None

    def _call_wake(self, loop: asyncio.AbstractEventLoop) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody left to wake
            loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        """On the loop: seal what was published since the last wake-up (one batch), drop the
        subscribers it leaves too far behind and wake the others."""
        with self._lock:
            self._wake_pending = False
            self._seal()
            woken = list(self._subscribers)
            lagging = [sub for sub in woken if self._lagging(sub)]
            for sub in lagging:
                self._end(sub, "lagging")
        self._dropped(lagging)
        for sub in woken:
            sub.wake.set()

    # ---- subscribers (the event loop) -------------------------------------------------------------

    def subscribe(self) -> Subscription:
        """A new subscription, not yet positioned (`resume` or `snapshot_point` does that). Raises
        TooManySubscribers past max_subscribers, SubscriptionEnded once the log is closed."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._closed:
                raise SubscriptionEnded("closed")
            if len(self._subscribers) >= self.settings.max_subscribers:
                self._metrics.block_event_subscriptions.labels("refused").inc()
                raise TooManySubscribers(
                    f"{len(self._subscribers)} block event subscribers already (kv.block_events_max_subscribers)"
                )
            self._loop = loop
            sub = Subscription(asyncio.Event())
            self._subscribers.add(sub)
            self._metrics.block_event_subscribers.set(len(self._subscribers))
        return sub

    def resume(self, sub: Subscription, epoch: str, after_seq: int) -> bool:
        """Position `sub` right after batch `after_seq` of `epoch` if the ring still holds every
        batch after it; False (nothing changed) otherwise: the subscriber needs a snapshot."""
        with self._lock:
            self._seal()
            if epoch != self.epoch or not self._holds_after(after_seq):
                return False
            sub.cursor = after_seq
        self._metrics.block_event_subscriptions.labels("replay").inc()
        return True

    def snapshot_point(self, sub: Subscription | None) -> tuple[int, list[BlockKey]]:
        """(seq, engine-held keys): the state a snapshot describes is every batch up to seq. The
        caller holds the store's lock and reads the store tiers' holdings under it, so no store
        event can fall between; `sub` (if given) continues after seq."""
        with self._lock:
            self._seal()
            if sub is not None:
                sub.cursor = self._seq
            seq, engine = self._seq, list(self._engine)
        if sub is not None:
            self._metrics.block_event_subscriptions.labels("snapshot").inc()
        return seq, engine

    def read(self, sub: Subscription, limit: int) -> list[EventBatch]:
        """Up to `limit` batches after the subscription's cursor, which moves past them. Raises
        SubscriptionEnded when the log closed or the subscriber fell behind (then it is dropped)."""
        lagging = False
        with self._lock:
            if not sub.ended and self._closed:
                sub.ended = "closed"
            if not sub.ended:
                self._seal()
                lagging = self._lagging(sub)
                if lagging:
                    self._end(sub, "lagging")
            if sub.ended:
                reason = sub.ended
            else:
                assert sub.cursor is not None, "read before resume or snapshot_point"
                stop = min(self._seq, sub.cursor + limit)
                batches = [self._ring[seq] for seq in range(sub.cursor + 1, stop + 1)]
                sub.cursor = stop
                return batches
        if lagging:
            self._dropped([sub])
        raise SubscriptionEnded(reason)

    async def wait(self, sub: Subscription, timeout_s: float) -> None:
        """Until a wake-up (new batches, the log closing, the subscriber dropped) or `timeout_s`."""
        if not sub.wake.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await sub.wake.wait()
        sub.wake.clear()

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subscribers.discard(sub)
            self._metrics.block_event_subscribers.set(len(self._subscribers))

    def close(self) -> None:
        """End every subscription ("closed"): their streams finish cleanly. Publishing goes on
        working (the store may still change while it closes); nobody can subscribe any more."""
        with self._lock:
            self._closed = True
            self._seal()
            subs = list(self._subscribers)
            for sub in subs:
                self._end(sub, "closed")
            loop = self._loop
        if not subs or loop is None:
            return
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            for sub in subs:
                sub.wake.set()
        else:
            with contextlib.suppress(RuntimeError):
                for sub in subs:
                    loop.call_soon_threadsafe(sub.wake.set)

    def _lagging(self, sub: Subscription) -> bool:
        cursor = sub.cursor
        if cursor is None:
            return False
        return self._seq - cursor > self.settings.subscriber_backlog or not self._holds_after(cursor)

    def _end(self, sub: Subscription, reason: str) -> None:
        """Caller holds the lock."""
        sub.ended = reason
        self._subscribers.discard(sub)
        self._metrics.block_event_subscribers.set(len(self._subscribers))

    def _dropped(self, subs: list[Subscription]) -> None:
        if subs:
            self._metrics.block_event_dropped.inc(len(subs))
            log.info("dropped block event subscribers that fell behind", count=len(subs), seq=self._seq)

    # ---- without a subscription (tests, tools) ----------------------------------------------------

    def replay(self, after_seq: int) -> list[EventBatch] | None:
        """Every batch after `after_seq` (the open one sealed first), or None if the ring no longer
        holds them all."""
        with self._lock:
            self._seal()
            if not self._holds_after(after_seq):
                return None
            return [self._ring[seq] for seq in range(after_seq + 1, self._seq + 1)]

    def engine_keys(self) -> set[BlockKey]:
        with self._lock:
            return set(self._engine)

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)
