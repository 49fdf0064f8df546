"""Eviction policies: pure bookkeeping of *which* pages go first; no tensors, files or locks.

Each policy tracks the pages one tier holds and, asked for `count` victims, returns them all or
None (nothing changes on None; the caller's state stays consistent). Pages the caller must not evict
(under I/O) are skipped through `evictable`, so eviction never waits on I/O. The same objects serve
the node manager and the simulator. `DeferredTouches` queues the recency updates of loads and
replays them into a store's policies before it evicts.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from node_manager.kv.pages import Priority, Tier

K = TypeVar("K", bound=Hashable)  # what a tier evicts: a page id, a segment number
Evictable = Callable[[K], bool]


@dataclass(frozen=True, slots=True)
class PageMeta:
    """What ordering needs to know about a page: its layer and the session it was staged for."""

    layer: int
    session: Hashable
    priority: Priority = Priority.NORMAL


class EvictionPolicy(Protocol[K]):
    def insert(self, item: K, meta: PageMeta) -> None: ...
    def insert_many(self, items: Sequence[K], meta: PageMeta) -> None: ...
    def touch(self, item: K) -> None: ...
    def touch_many(self, items: Sequence[K]) -> None: ...
    def remove(self, item: K) -> None: ...
    def victims(self, count: int, evictable: Evictable[K]) -> list[K] | None: ...
    def __len__(self) -> int: ...


def session_yield_key(priority: Priority, size: int) -> tuple[int, int]:
    """Symphony's order between sessions whose staged KV must give memory back (smallest first):
    lower priority tiers before higher ones, then smaller sessions, the cheapest to reload or
    recompute. Shared by the store's top tier and the warmed blocks inside vLLM."""
    return int(priority), size


def _take(candidates: Iterator[K], count: int, evictable: Evictable[K]) -> list[K] | None:
    chosen = list(itertools.islice((c for c in candidates if evictable(c)), count))
    return chosen if len(chosen) == count else None


class LRUPolicy(Generic[K]):
    """Least recently used first (the SSD tier, per segment)."""

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()

    def insert(self, item: K, meta: PageMeta | None = None) -> None:
        self._order[item] = None
        self._order.move_to_end(item)

    def insert_many(self, items: Sequence[K], meta: PageMeta | None = None) -> None:
        for item in items:
            self.insert(item, meta)

    def touch(self, item: K) -> None:
        if item in self._order:
            self._order.move_to_end(item)

    def touch_many(self, items: Sequence[K]) -> None:
        for item in items:
            self.touch(item)

    def remove(self, item: K) -> None:
        self._order.pop(item, None)

    def victims(self, count: int, evictable: Evictable[K]) -> list[K] | None:
        return _take(iter(self._order), count, evictable)

    def oldest_first(self) -> list[K]:
        """A snapshot, least recently used first (for callers that evict by size, not count)."""
        return list(self._order)

    def __len__(self) -> int:
        return len(self._order)


class PriorityLRUPolicy(Generic[K]):
    """LRU weighted by priority tier (the DRAM tier).

    A page's eviction age is its last use minus a per-priority credit: a high-priority page is
    treated as if used `credit[HIGH]` ticks later than it was, so it outlives normal and low pages of
    the same age but does not live forever. One LRU list per priority keeps every operation O(1); a
    victim is the oldest credited head across the three lists.
    """

    def __init__(self, credit: dict[Priority, int] | None = None) -> None:
        self._credit = credit or {Priority.LOW: 0, Priority.NORMAL: 10_000, Priority.HIGH: 40_000}
        self._lists: dict[Priority, OrderedDict[K, int]] = {p: OrderedDict() for p in Priority}
        self._priority_of: dict[K, Priority] = {}
        self._clock = itertools.count()

    def insert(self, item: K, meta: PageMeta) -> None:
        self.remove(item)
        self._priority_of[item] = meta.priority
        self._lists[meta.priority][item] = next(self._clock)

    def insert_many(self, items: Sequence[K], meta: PageMeta) -> None:
        """`insert` for each item in order; a save inserts a layer's ~64 pages, so the lookups are hoisted."""
        priority_of, lists, clock = self._priority_of, self._lists, self._clock
        entries = lists[meta.priority]
        for item in items:
            old = priority_of.get(item)
            if old is not None:
                del lists[old][item]
            priority_of[item] = meta.priority
            entries[item] = next(clock)

    def touch(self, item: K) -> None:
        priority = self._priority_of.get(item)
        if priority is not None:
            entries = self._lists[priority]
            entries[item] = next(self._clock)
            entries.move_to_end(item)

    def touch_many(self, items: Sequence[K]) -> None:
        """`touch` for each item in order; a load touches ~64 pages per layer, so the lookups are hoisted."""
        priority_of, lists, clock = self._priority_of.get, self._lists, self._clock
        for item in items:
            priority = priority_of(item)
            if priority is not None:
                entries = lists[priority]
                entries[item] = next(clock)
                entries.move_to_end(item)

    def remove(self, item: K) -> None:
        priority = self._priority_of.pop(item, None)
        if priority is not None:
            del self._lists[priority][item]

    @staticmethod
    def _credited(entries: OrderedDict[K, int], credit: int) -> Iterator[tuple[int, K]]:
        # A function, not a generator expression in a comprehension: the credit must bind per list now,
        # not when heapq.merge first pulls from the stream (by then the loop variable is the last priority).
        return ((tick + credit, item) for item, tick in entries.items())

    def _oldest_first(self) -> Iterator[K]:
        streams = [self._credited(entries, self._credit[p]) for p, entries in self._lists.items()]
        for _, item in heapq.merge(*streams, key=lambda pair: pair[0]):
            yield item

    def victims(self, count: int, evictable: Evictable[K]) -> list[K] | None:
        return _take(self._oldest_first(), count, evictable)

    def __len__(self) -> int:
        return len(self._priority_of)


class TopTierYieldPolicy(Generic[K]):
    """Symphony's yielding order for staged top-tier KV.

    Lower priority tiers go before higher ones; within a priority, later layers before earlier ones
    (a consumer loading layer by layer needs layer 0 first, so the later layers have the most time to
    come back); within a layer, smaller sessions before larger (they are cheapest to recompute or
    reload). Pages are bucketed by (priority, layer), then by session, so a victim search visits
    buckets, not every page.
    """

    def __init__(self, session_size: Callable[[Hashable], int]) -> None:
        self._session_size = session_size
        self._buckets: dict[tuple[Priority, int], dict[Hashable, dict[K, None]]] = {}
        self._meta: dict[K, PageMeta] = {}

    def insert(self, item: K, meta: PageMeta) -> None:
        self.remove(item)
        self._meta[item] = meta
        bucket = self._buckets.setdefault((meta.priority, meta.layer), {})
        bucket.setdefault(meta.session, {})[item] = None

    def insert_many(self, items: Sequence[K], meta: PageMeta) -> None:
        for item in items:
            self.insert(item, meta)

    def touch(self, item: K) -> None:
        """Recency plays no part in this order."""

    def touch_many(self, items: Sequence[K]) -> None:
        """Recency plays no part in this order."""

    def remove(self, item: K) -> None:
        meta = self._meta.pop(item, None)
        if meta is None:
            return
        key = (meta.priority, meta.layer)
        sessions = self._buckets[key]
        pages = sessions[meta.session]
        del pages[item]
        if not pages:
            del sessions[meta.session]
            if not sessions:
                del self._buckets[key]

    def _in_order(self) -> Iterator[K]:
        for key in sorted(self._buckets, key=lambda k: (k[0], -k[1])):
            sessions = self._buckets.get(key, {})
            priority = key[0]
            for session in sorted(sessions, key=lambda s: session_yield_key(priority, self._session_size(s))):
                yield from list(sessions.get(session, ()))

    def victims(self, count: int, evictable: Evictable[K]) -> list[K] | None:
        return _take(self._in_order(), count, evictable)

    def __len__(self) -> int:
        return len(self._meta)


TouchBatch = tuple[Tier, tuple[Hashable, ...], tuple[int, ...]]  # (tier, keys, layers): pages keys x layers


class DeferredTouches:
    """Recency updates for pages a load used, queued and replayed into the policies in order
    (`apply`) before the next eviction decision: an LRU update per page costs as much as copying the
    page, on the load's path. A batch repeated (the same session resumed again) only moves to the
    back, as only a page's last use orders it. Recency stays exact relative to other touches; a page
    inserted meanwhile may look older than it is by that short window.

    Bounded: at most `max_pages` pages wait; the batch that overflows the bound replays them all,
    which bounds the pause the next eviction pays. No lock of its own: the caller's."""

    def __init__(self, policies: Mapping[Tier, EvictionPolicy], max_pages: int = 65_536) -> None:
        self._policies = policies
        self._max_pages = max_pages
        self._batches: OrderedDict[TouchBatch, None] = OrderedDict()
        self._pages = 0

    def __len__(self) -> int:
        """Batches waiting."""
        return len(self._batches)

    def add(self, tier: Tier, keys: tuple[Hashable, ...], layers: tuple[int, ...]) -> None:
        """Pages (key, layer) of `tier`, every key by every layer, were used."""
        if not keys:
            return
        batch = (tier, keys, layers)
        if batch in self._batches:
            self._batches.move_to_end(batch)
            return
        self._batches[batch] = None
        self._pages += len(keys) * len(layers)
        if self._pages > self._max_pages:
            self.apply()

    def apply(self) -> None:
        """Replay every waiting batch, oldest first."""
        while self._batches:
            (tier, keys, layers), _ = self._batches.popitem(last=False)
            self._policies[tier].touch_many([(key, layer) for layer in layers for key in keys])
        self._pages = 0
