"""The cluster KV index's storage: a bounded LRU hash table from block keys to which node slots hold
each block in which tier. Pure: numpy arrays, no I/O, no clocks, no locks (one caller, the
scheduler's event loop). `scheduler.kv_index` gives it node names and the block event protocol.

Keys. A block is stored under the first 8 bytes of its 32-byte key (little-endian; 0, which marks
an empty slot, reads as 1), like the node's shared-memory block index. The keys are sha256 outputs,
so with n blocks indexed a key that is not there matches one that is with odds n/2**64 (5e-13 at
10M blocks), and some two indexed keys share a prefix with odds ~n**2/2**65 (3e-6 at 10M). Either
only misleads a routing estimate (a node is said to hold a block it lacks); no KV is loaded on the
index's word, the node looks its blocks up under their whole keys.

Layout. `nbuckets` buckets of `WAYS` slots, each slot a key (8 bytes), one holder mask per tier
(`NUM_TIERS` masks of `max_nodes` bits: bit s of tier t's mask = node slot s holds the block in
tier t) and an LRU tick (4 bytes): 44 bytes per slot at 64 nodes (uint64 masks), 20 at 8 nodes
(uint8). Sized so that `max_blocks` fill at most `LOAD` of the slots: ~49 bytes per block at 64
nodes. A key lives in one of two buckets (from its low and high 32 bits), the emptier one when it
is inserted: a lookup reads both in one vectorised gather, whatever the table's size, and deleting
is clearing a slot. When both buckets are full (~1% of inserts at full load) one of their keys
whose other bucket has room moves there; only when none can does the least recently used of their
slots go ("conflict" evictions: none in 600k inserts at full load in the tests).

LRU. Every operation takes the next tick (a counter, not a clock); a store or a lookup stamps the
blocks it touches. When an insert would pass `max_blocks`, the oldest blocks go, about
`max_blocks * EVICT_FRACTION` at once (the oldest of all, found through a sampled tick threshold,
so an eviction round costs one pass over the ticks rather than a sort): the table holds at most
`max_blocks` blocks after every call. The ticks are uint32; when they run out the table renumbers
them in order (`_rebase`), a full pass once per ~4e9 operations.

Clearing a node's tier (a node restarted, resynchronises, or its engine dropped its cache) is lazy,
O(1) per clear: the clear is logged with its tick, and a block whose tick is older than a logged
clear has that clear applied when it is next read or written ("normalised"). An incremental sweep
(`sweep_step`, a bounded slice of slots per call) normalises every slot over time; a full pass ends
the clears logged before it began. Invariant: a slot's masks, with the logged clears newer than its
tick applied, are the truth; `tier_counts` counts those true bits per (tier, node slot).
"""

from __future__ import annotations

import math

import numpy as np

WAYS = 16  # slots per bucket
LOAD = 0.9  # at most this fraction of slots hold blocks
NUM_TIERS = 4  # mask columns, fastest first (scheduler.kv_index.IndexTier)
EVICT_FRACTION = 1 / 64  # of max_blocks, evicted in one round when the table is full
# Slots normalised per sweep_step (the index takes one per batch applied while clears are pending):
# ~0.2-0.4 ms; a pass over a 10M-block table takes ~1400 batches.
SWEEP_SLOTS = 1 << 13
# Logged clears beyond which the whole table is normalised at once (~1 s per 10M blocks, blocking).
MAX_CLEARS = 4096
TICK_LIMIT = 2**32 - 2  # the last usable tick; EMPTY_TICK marks empty slots
EMPTY_TICK = 2**32 - 1
_SAMPLE = 1 << 16  # ticks sampled to find an eviction threshold
_EXACT_BELOW = 1 << 17  # slots under which the eviction threshold is found exactly
_COUNT_CHUNK = 1 << 15  # rows per unpackbits call when counting bits
_ONE = np.uint64(1)
# Keys per lookup in prefix_counts, chunk after chunk up to the first key absent: a chain of up to
# 256 blocks (8k tokens at 32 a block) in one. At 10M blocks a lookup of 256 keys costs ~2x one of
# 32 (~19 against ~10 us), so a chain that misses early pays ~9 us more than with chunks of 32,
# and one of 160 blocks that hits ~27 us less.
_PREFIX_CHUNK = 256
# Buckets in a sample of where blocks sit (`fastest_sample`): at most 16x as many blocks, and
# under 2x as many buckets are taken, so that one bit count covers them (_COUNT_CHUNK).
SAMPLE_BUCKETS = 256


def _fastest(masks: np.ndarray) -> np.ndarray:
    """(n, NUM_TIERS) masks keeping, per node bit, only the fastest tier holding the block there."""
    faster = np.zeros_like(masks)
    faster[:, 1:] = np.bitwise_or.accumulate(masks[:, :-1], axis=1)
    return masks & ~faster


def mask_dtype(max_nodes: int) -> np.dtype:
    """The narrowest little-endian unsigned type with a bit per node slot (1..64 nodes)."""
    if not 1 <= max_nodes <= 64:
        raise ValueError(f"the index holds 1..64 node slots, got {max_nodes}")
    return np.dtype(f"<u{max(1, 1 << math.ceil(math.log2(math.ceil(max_nodes / 8))))}")


def index_keys(blob: bytes) -> np.ndarray:
    """Table keys of block keys given back to back (32 bytes each): their first 8 bytes as uint64,
    0 read as 1. Raises ValueError when the length is not a multiple of 32."""
    if len(blob) % 32:
        raise ValueError(f"block keys are 32 bytes each; got {len(blob)} bytes")
    return np.maximum(np.frombuffer(blob, dtype="<u8")[::4], _ONE)  # a contiguous copy


class BlockTable:
    """Block keys (uint64, `index_keys`) -> holder masks per tier, bounded, least recently used out."""

    def __init__(
        self, max_blocks: int, max_nodes: int, *, evict_fraction: float = EVICT_FRACTION, tick_limit: int = TICK_LIMIT
    ) -> None:
        if max_blocks <= 0:
            raise ValueError("max_blocks must be positive")
        self.max_blocks = max_blocks
        self.max_nodes = max_nodes
        self.dtype = mask_dtype(max_nodes)
        self.nbuckets = max(2, math.ceil(max_blocks / LOAD / WAYS))
        slots = self.nbuckets * WAYS
        self._keys = np.zeros(slots, np.uint64)
        self._keys2d = self._keys.reshape(self.nbuckets, WAYS)
        self._masks = np.zeros((slots, NUM_TIERS), self.dtype)
        self._ticks = np.full(slots, EMPTY_TICK, np.uint32)
        self._fill = np.zeros(self.nbuckets, np.uint8)  # occupied slots per bucket
        self._evict_batch = int(max_blocks * evict_fraction)
        self._tick_limit = tick_limit
        self._tick = 0
        self._rng = np.random.default_rng(0)  # eviction sampling; seeded: the table stays deterministic
        self.count = 0  # occupied slots (blocks whose holders were all cleared lazily count until swept)
        self.evictions = 0  # blocks evicted for room: max_blocks reached
        self.conflict_evictions = 0  # blocks evicted because both of a new key's buckets were full
        self.tier_counts = np.zeros((NUM_TIERS, max_nodes), np.int64)  # true bits per (tier, node slot)
        # The clear log: ticks (ascending), masks of the bits each clears, and their suffix ORs
        # (row i: everything logged at or after clear i; last row: nothing).
        self._clear_at = np.zeros(0, np.int64)
        self._clear_masks = np.zeros((0, NUM_TIERS), self.dtype)
        self._clear_suffix = np.zeros((1, NUM_TIERS), self.dtype)
        self._sweep_cursor = 0
        self._sweep_pass_start = 0  # clears logged at or before it end when the current pass ends

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def slots(self) -> int:
        return self.nbuckets * WAYS

    def approx_bytes(self) -> int:
        """Bytes of the table's arrays (allocated in full at construction, whatever the fill)."""
        arrays = (self._keys, self._masks, self._ticks, self._fill, self.tier_counts, self._clear_masks)
        return sum(a.nbytes for a in arrays) + self._clear_at.nbytes + self._clear_suffix.nbytes

    @property
    def pending_clears(self) -> int:
        return len(self._clear_at)

    def bit(self, node_slot: int) -> np.unsignedinteger:
        """The mask bit of a node slot, in the masks' type."""
        return np.left_shift(self.dtype.type(1), self.dtype.type(node_slot))

    # -- lookups ----------------------------------------------------------------------------------
    def _buckets(self, keys: np.ndarray) -> np.ndarray:
        """(n, 2) candidate buckets of each key: its low and high 32 bits modulo the bucket count."""
        return (keys.view(np.uint32).reshape(len(keys), 2) % np.uint32(self.nbuckets)).astype(np.intp)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """The slot of each key, -1 where absent. Touches nothing."""
        n = len(keys)
        if not n:
            return np.zeros(0, np.intp)
        buckets = self._buckets(keys)
        # np.take and flat indices rather than fancy indexing: a third of the time on small batches.
        hit = (np.take(self._keys2d, buckets, axis=0).reshape(n, 2 * WAYS) == keys[:, None]).ravel()
        rows = np.arange(n)
        pos = hit.reshape(n, 2 * WAYS).argmax(axis=1)
        slots = np.take(buckets.ravel(), 2 * rows + pos // WAYS) * WAYS + pos % WAYS
        return np.where(np.take(hit, 2 * WAYS * rows + pos), slots, -1)

    def holders(self, slots: np.ndarray) -> np.ndarray:
        """(n, NUM_TIERS) true masks of occupied slots (normalised first; touches no tick)."""
        self._normalise(slots)
        return self._masks[slots]

    def prefix_counts(self, keys: np.ndarray) -> np.ndarray | None:
        """For the chain `keys`, (NUM_TIERS, max_nodes) counts: [t, s] = how many of the leading
        blocks node slot s holds (contiguous from the first key) have tier t as their fastest tier
        on s. None when no node holds the first block. Stamps the leading blocks some node holds."""
        parts = []
        for start in range(0, len(keys), _PREFIX_CHUNK):
            chunk = keys[start : start + _PREFIX_CHUNK]
            parts.append(self._leading(chunk))
            if len(parts[-1]) < len(chunk):
                break
        slots = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, np.intp)
        if not len(slots):
            return None
        self._normalise(slots)
        masks = np.take(self._masks, slots, axis=0)
        held = np.bitwise_and.accumulate(np.bitwise_or.reduce(masks, axis=1))  # nodes holding 0..i
        cut = int(np.count_nonzero(held))  # held only shrinks: its zeros are a suffix
        if not cut:
            return None
        self._ticks[slots[:cut]] = self._advance()
        best = _fastest(masks[:cut]) & held[:cut, None]
        counts = self._bit_counts(best[:_COUNT_CHUNK])
        for start in range(_COUNT_CHUNK, cut, _COUNT_CHUNK):
            counts += self._bit_counts(best[start : start + _COUNT_CHUNK])
        return counts

    def fastest_sample(self, buckets: int = SAMPLE_BUCKETS, offset: int = 0) -> np.ndarray:
        """(NUM_TIERS, max_nodes) counts over a sample of the blocks held: [t, s] = how many of them
        have tier t as their fastest on node slot s. The sample is every block of every `step`-th
        occupied bucket, `step` such that about `buckets` are taken (`offset` shifts which, so that
        successive samples differ, and `step` successive ones cover the table once): each block is
        in it with the same odds, whatever its bucket's fill. Costs
        one pass over the bucket fills (~0.2 ms at 1M blocks) plus the sample. Touches no tick."""
        occupied = np.flatnonzero(self._fill)
        if not len(occupied) or buckets <= 0:
            return np.zeros((NUM_TIERS, self.max_nodes), np.int64)
        step = max(1, len(occupied) // min(buckets, _COUNT_CHUNK // WAYS // 2))
        chosen = occupied[offset % step :: step]  # fewer than twice `buckets`; offsets 0..step-1 cover all
        slots = (chosen[:, None] * WAYS + np.arange(WAYS)).ravel()
        slots = slots[self._ticks[slots] != EMPTY_TICK]
        self._normalise(slots)
        return self._bit_counts(_fastest(self._masks[slots]))

    def _leading(self, keys: np.ndarray) -> np.ndarray:
        """The slots of `keys` up to the first one absent."""
        slots = self.lookup(keys)
        missing = np.flatnonzero(slots < 0)
        return slots[: missing[0]] if len(missing) else slots

    # -- changes ----------------------------------------------------------------------------------
    def store(self, keys: np.ndarray, node_slot: int, tier: int) -> int:
        """Node slot `node_slot` holds `keys` in `tier` now; stamps them. Returns blocks evicted."""
        evicted = 0
        for start in range(0, len(keys), self.max_blocks):  # each chunk fits after evicting older ones
            evicted += self._store_chunk(np.unique(keys[start : start + self.max_blocks]), node_slot, tier)
        return evicted

    def _store_chunk(self, keys: np.ndarray, node_slot: int, tier: int) -> int:
        tick = self._advance()
        bit = self.bit(node_slot)
        slots = self.lookup(keys)
        found = slots[slots >= 0]
        self._normalise(found)
        column = self._masks[found, tier]
        added = int(np.count_nonzero((column & bit) == 0))
        self._masks[found, tier] = column | bit
        self._ticks[found] = tick
        missing = keys[slots < 0]
        evicted = 0
        if len(missing):
            evicted = self._make_room(len(missing), tick)
            placed, conflicts = self._insert(missing, tick)
            self._masks[placed, tier] = bit
            added += len(placed)
            evicted += conflicts
        self.tier_counts[tier, node_slot] += added
        return evicted

    def remove(self, keys: np.ndarray, node_slot: int, tier: int) -> None:
        """Node slot `node_slot` no longer holds `keys` in `tier`. Touches no tick; a block no node
        holds anywhere leaves the table."""
        slots = self.lookup(np.unique(keys))
        found = slots[slots >= 0]
        self._normalise(found)
        bit = self.bit(node_slot)
        column = self._masks[found, tier]
        self.tier_counts[tier, node_slot] -= int(np.count_nonzero(column & bit))
        self._masks[found, tier] = column & ~bit
        self._delete(found[~self._masks[found].any(axis=1)])

    def clear(self, node_slot: int, tiers: list[int]) -> None:
        """Node slot `node_slot` holds nothing in `tiers`: logged now, applied lazily (see the module
        docstring). O(1) but for a full normalisation once MAX_CLEARS are pending."""
        row = np.zeros((1, NUM_TIERS), self.dtype)
        row[0, tiers] = self.bit(node_slot)
        self.tier_counts[tiers, node_slot] = 0
        tick = self._advance()
        if not len(self._clear_at):
            self._sweep_cursor, self._sweep_pass_start = 0, tick
        self._clear_at = np.append(self._clear_at, tick)
        self._clear_masks = np.concatenate((self._clear_masks, row))
        self._refresh_suffix()
        if len(self._clear_at) > MAX_CLEARS:
            self.normalise_all()

    def sweep_step(self, max_slots: int = SWEEP_SLOTS) -> None:
        """Normalise the next `max_slots` slots while clears are pending (see the module docstring)."""
        if not len(self._clear_at):
            return
        start = self._sweep_cursor
        stop = min(start + max_slots, self.slots)
        span = np.arange(start, stop)
        occupied = span[self._ticks[start:stop] != EMPTY_TICK]
        self._normalise(occupied)
        self._delete(occupied[~self._masks[occupied].any(axis=1)])
        self._sweep_cursor = stop
        if stop == self.slots:  # a full pass: the clears logged before it began are applied everywhere
            keep = self._clear_at > self._sweep_pass_start
            self._clear_at, self._clear_masks = self._clear_at[keep], self._clear_masks[keep]
            self._refresh_suffix()
            self._sweep_cursor, self._sweep_pass_start = 0, self._tick

    def normalise_all(self) -> None:
        """Apply every logged clear to every slot and empty the log: O(slots)."""
        if not len(self._clear_at):
            return
        self._sweep_cursor, self._sweep_pass_start = 0, self._tick
        while len(self._clear_at):
            self.sweep_step(max(SWEEP_SLOTS, self.slots))

    # -- internals --------------------------------------------------------------------------------
    def _advance(self) -> int:
        if self._tick >= self._tick_limit:
            self._rebase()
        self._tick += 1
        return self._tick

    def _rebase(self) -> None:
        """Renumber the ticks 1..k in their order (the LRU order is kept); clears applied first."""
        self.normalise_all()
        occupied = self._ticks != EMPTY_TICK
        if occupied.any():
            ranks = np.unique(self._ticks[occupied], return_inverse=True)[1]
            self._ticks[occupied] = ranks.astype(np.uint32) + 1
            self._tick = int(ranks.max()) + 1
        else:
            self._tick = 0
        self._sweep_pass_start = self._tick

    def _refresh_suffix(self) -> None:
        suffix = np.zeros((len(self._clear_at) + 1, NUM_TIERS), self.dtype)
        if len(self._clear_at):
            suffix[:-1] = np.bitwise_or.accumulate(self._clear_masks[::-1], axis=0)[::-1]
        self._clear_suffix = suffix

    def _normalise(self, slots: np.ndarray) -> None:
        """Apply to `slots` (occupied) the logged clears newer than their ticks."""
        if not len(self._clear_at) or not len(slots):
            return
        first = np.searchsorted(self._clear_at, self._ticks[slots].astype(np.int64), side="right")
        pending = first < len(self._clear_at)
        if pending.any():
            stale = slots[pending]
            self._masks[stale] &= ~self._clear_suffix[first[pending]]

    def _delete(self, slots: np.ndarray) -> None:
        """Empty occupied `slots` (their true masks must be zero, or counted off by the caller)."""
        if not len(slots):
            return
        self._keys[slots] = 0
        self._masks[slots] = 0
        self._ticks[slots] = EMPTY_TICK
        np.subtract.at(self._fill, slots // WAYS, 1)
        self.count -= len(slots)

    def _evict(self, slots: np.ndarray) -> None:
        self._normalise(slots)
        for start in range(0, len(slots), _COUNT_CHUNK):
            self.tier_counts -= self._bit_counts(self._masks[slots[start : start + _COUNT_CHUNK]])
        self._delete(slots)

    def _bit_counts(self, masks: np.ndarray) -> np.ndarray:
        """(NUM_TIERS, max_nodes): set bits per column and bit of (n, NUM_TIERS) masks."""
        width = 8 * self.dtype.itemsize
        raw = np.ascontiguousarray(masks).view(np.uint8).reshape(len(masks), NUM_TIERS * self.dtype.itemsize)
        bits = np.unpackbits(raw, axis=1, bitorder="little")
        # uint16 sums: twice as fast as int64 ones here; callers pass at most _COUNT_CHUNK rows.
        counts = np.add.reduce(bits, axis=0, dtype=np.uint16).astype(np.int64)
        return counts.reshape(NUM_TIERS, width)[:, : self.max_nodes]

    def _make_room(self, incoming: int, tick: int) -> int:
        """Evict the oldest blocks (never those stamped `tick`) so that `incoming` more fit."""
        need = self.count + incoming - self.max_blocks
        if need <= 0:
            return 0
        target = min(self.count, need + self._evict_batch)
        victims = self._oldest(target, tick)
        if len(victims) < need:  # pragma: no cover - store() chunks keep a call within max_blocks
            raise RuntimeError(f"{need} blocks must go but only {len(victims)} are older than this call")
        self._evict(victims)
        self.evictions += len(victims)
        return len(victims)

    def _oldest(self, target: int, tick: int) -> np.ndarray:
        """About `target` (at least, when that many exist) occupied slots of the oldest ticks < `tick`."""
        ticks = self._ticks
        if self.slots <= _EXACT_BELOW:
            order = np.argpartition(ticks, target - 1)[:target]
            return order[ticks[order] < tick]
        # Sampled: the tick below which ~target slots lie, then one pass over the ticks.
        sample = ticks[self._rng.integers(0, self.slots, _SAMPLE)]
        rank = min(_SAMPLE - 1, math.ceil(target / self.slots * _SAMPLE))
        threshold = min(int(np.partition(sample, rank)[rank]), tick)
        victims = np.flatnonzero(ticks < threshold)
        if len(victims) < target:  # short of the target: take from the threshold's own tick, then all
            if threshold < tick:
                victims = np.concatenate((victims, np.flatnonzero(ticks == threshold)[: target - len(victims)]))
            if len(victims) < target:
                order = np.argpartition(ticks, target - 1)[:target]
                victims = order[ticks[order] < tick]
        elif len(victims) > 2 * target:  # a sample far off: keep the oldest `target`
            victims = victims[np.argpartition(ticks[victims], target - 1)[:target]]
        return victims

    def _insert(self, keys: np.ndarray, tick: int) -> tuple[np.ndarray, int]:
        """Place absent, distinct `keys` (room made), stamped `tick`, masks empty. Returns their
        slots and the number of conflict evictions."""
        buckets = self._buckets(keys)
        placed = np.full(len(keys), -1, np.intp)
        pending = np.arange(len(keys))
        while len(pending):
            first, second = buckets[pending, 0], buckets[pending, 1]
            chosen = np.where(self._fill[first] <= self._fill[second], first, second)
            order = np.argsort(chosen, kind="stable")
            pending, chosen = pending[order], chosen[order]
            bucket, start, count = np.unique(chosen, return_index=True, return_counts=True)
            rank = np.arange(len(chosen)) - np.repeat(start, count)
            free = WAYS - self._fill[bucket].astype(np.intp)
            fits = rank < np.repeat(free, count)
            if not fits.any():
                break
            group = np.repeat(np.arange(len(bucket)), count)[fits]
            empty_before = np.cumsum(self._keys2d[bucket] == 0, axis=1)  # (buckets, WAYS)
            way = (empty_before[group] <= rank[fits, None]).sum(axis=1)  # the rank-th empty way
            slots = chosen[fits] * WAYS + way
            self._keys[slots] = keys[pending[fits]]
            self._ticks[slots] = tick
            self._fill[bucket] += np.minimum(count, free).astype(np.uint8)
            self.count += len(slots)
            placed[pending[fits]] = slots
            pending = pending[~fits]
        conflicts = 0
        for i in pending.tolist():  # both buckets full (rare): move a resident out, or evict
            slot, moved_to = self._make_slot(buckets[i])
            # A key placed by this call may be the one moved (it follows) or evicted (before its masks
            # were set: it is not counted as placed).
            placed[placed == slot] = moved_to
            if moved_to < 0:
                conflicts += 1
                self.conflict_evictions += 1
            self._keys[slot], self._ticks[slot] = keys[i], tick
            self._fill[slot // WAYS] += 1
            self.count += 1
            placed[i] = slot
        return placed[placed >= 0], conflicts

    def _make_slot(self, buckets: np.ndarray) -> tuple[int, int]:
        """Empty a slot of the two full `buckets` (a key's candidates): move one of their keys whose
        other bucket has room there (cuckoo, one step), else evict the least recently used of them.
        Returns the slot and where its key moved (-1: it was evicted)."""
        candidates = (buckets[:, None] * WAYS + np.arange(WAYS)).ravel()
        own = np.repeat(buckets, WAYS)
        theirs = self._buckets(self._keys[candidates])
        other = np.where(theirs[:, 0] == own, theirs[:, 1], theirs[:, 0])
        movable = np.flatnonzero(self._fill[other] < WAYS)
        if len(movable):
            source, target_bucket = candidates[movable[0]], other[movable[0]]
            target = target_bucket * WAYS + int(np.argmax(self._keys2d[target_bucket] == 0))
            # Its masks true before they move: a clear pending for it must not be lost to the sweep
            # (the target may lie behind its cursor), or a reused node slot would show its bits.
            self._normalise(np.array([source]))
            self._keys[target], self._masks[target], self._ticks[target] = (
                self._keys[source],
                self._masks[source],
                self._ticks[source],
            )
            self._fill[target_bucket] += 1
            self._delete_moved(source)
            return int(source), int(target)
        victim = int(candidates[int(np.argmin(self._ticks[candidates]))])
        self._evict(np.array([victim]))
        return victim, -1

    def _delete_moved(self, slot: int) -> None:
        self._keys[slot], self._ticks[slot] = 0, EMPTY_TICK
        self._masks[slot] = 0
        self._fill[slot // WAYS] -= 1
