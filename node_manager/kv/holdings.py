"""Which full blocks each store tier holds whole, and the block events that say when that changes.

A tier holds a block when it holds every layer of it (a load from that tier alone would be whole);
it stops holding it when any layer leaves. Partial tail blocks (`PageDirectory.tail`) are never
named. Every write to a tier's directory table that can change this goes through `BlockHoldings`
in the same critical section, under the store's lock:
- a write that adds copies takes `complete(tier, rows)` before it (unless each row lacked a copy
  there) and calls `stored(tier, rows, before)` after it: rows newly whole there publish STORED;
- a copy about to be cleared calls `removing(tier, row)` first (`removing_keys` for many blocks,
  each about to lose a copy there): a block the tier holds whole publishes REMOVED.
So the events published so far for a tier always add up to `snapshot()[tier]`, which is what
`block_watch` relies on. Pure bookkeeping: no I/O, no lock of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from node_manager.kv.block_events import BlockEventKind, BlockEventLog
from node_manager.kv.directory import PageDirectory
from node_manager.kv.pages import Tier
from symphony.kv_addressing import BlockKey


class BlockHoldings:
    def __init__(self, directory: PageDirectory, events: BlockEventLog) -> None:
        self._directory = directory
        self.events = events

    def complete(self, tier: Tier, rows: np.ndarray) -> np.ndarray:
        """For known rows: whether `tier` holds every layer of the block and it is a full block."""
        d = self._directory
        return (d.table(tier)[rows] >= 0).all(axis=1) & ~d.tail[rows]

    def stored(self, tier: Tier, rows: np.ndarray, before: np.ndarray | None) -> None:
        """Copies were added to `tier` in `rows` (distinct; `before`: `complete` just before, None
        when each row lacked a copy there before, so none was whole): STORED for the blocks it now
        holds whole and did not."""
        now = self.complete(tier, rows)
        if before is not None:
            now &= ~before
        if now.any():
            self.events.publish(BlockEventKind.STORED, tier, self._keys(rows[now]))

    def removing(self, tier: Tier, row: int) -> None:
        """A copy that `tier` holds in `row` is about to be cleared: REMOVED if the tier held the
        block whole."""
        d = self._directory
        if not d.tail[row] and bool((d.table(tier)[row] >= 0).all()):
            self.events.publish(BlockEventKind.REMOVED, tier, self._keys(np.array([row])))

    def removing_keys(self, tier: Tier, keys: Sequence[BlockKey]) -> None:
        """`removing` for many copies at once: blocks `keys` (known, repeats allowed) are each about
        to lose at least one copy that `tier` holds."""
        rows = self._directory.rows(list(dict.fromkeys(keys)))
        whole = self.complete(tier, rows)
        if whole.any():
            self.events.publish(BlockEventKind.REMOVED, tier, self._keys(rows[whole]))

    def snapshot(self) -> dict[Tier, list[BlockKey]]:
        """Every full block each tier holds whole, now. Caller holds the store's lock."""
        d = self._directory
        full = ~d.tail
        return {tier: self._keys(np.flatnonzero((d.table(tier) >= 0).all(axis=1) & full)) for tier in Tier}

    def _keys(self, rows: np.ndarray) -> list[BlockKey]:
        """The keys of rows in use (a row holding a copy always is)."""
        keys = self._directory.keys
        return [key for row in rows.tolist() if (key := keys[row]) is not None]
