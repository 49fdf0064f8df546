"""The page directory: for every (block, layer) page, which tiers hold a copy and where.

One row per block key, one column per layer, in numpy tables. A load asks about ~64 blocks x 30
layers at once; answering with whole-array operations costs microseconds per layer, far less than
per-page objects (docs/design-notes.md#page-directory). Pure bookkeeping: no locks, no I/O;
the store calls it under its lock.

Bounded: a row lives only while some layer of its block has a copy in a tier (or is pinned), so
rows never outnumber the pages the tiers can hold; the tables grow by doubling up to that.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from node_manager.kv.pages import Priority, Tier
from node_manager.kv.ssd_tier import SsdLocation
from symphony.kv_addressing import BlockKey

NO_COPY = -1  # in the slot and segment tables: this tier holds no copy of the page
SessionKey = tuple[str, str]  # (tenant, session id)
_NO_OWNER: SessionKey = ("", "")


class PageDirectory:
    """Tables indexed [row, layer]. `hbm` and `dram` hold slot numbers, `ssd_seq`/`ssd_page` the
    segment and page index of the SSD copy, `checksum` the page's checksum (valid while any copy
    exists), `pins` the I/O in progress on the page (eviction skips pinned pages) and `persisting`
    whether the write-behind still owes it an SSD copy. Per row: the block key, the session that
    last saved it (`owners`), that session's priority, and whether the key is a partial tail
    block's (`tail`, `kv_addressing.tail_key`: never named by block events)."""

    def __init__(self, num_layers: int, rows: int = 256) -> None:
        self.num_layers = num_layers
        self._row_of: dict[BlockKey, int] = {}
        self.keys: list[BlockKey | None] = []
        self.owners: list[SessionKey] = []
        self._free: list[int] = []
        self.priority = np.empty(0, np.int8)
        self.tail = np.empty(0, np.bool_)
        self.hbm = self.dram = self.ssd_seq = self.ssd_page = np.empty((0, num_layers), np.int64)
        self.checksum = np.empty((0, num_layers), np.uint64)
        self.pins = np.empty((0, num_layers), np.int32)
        self.persisting = np.empty((0, num_layers), np.bool_)
        self._grow(max(1, rows))

    def __len__(self) -> int:
        return len(self._row_of)

    def _grow(self, rows: int) -> None:
        old = len(self.keys)
        added = rows - old

        def extend(table: np.ndarray, fill: object) -> np.ndarray:
            tail = np.full((added, *table.shape[1:]), fill, table.dtype)
            return np.concatenate((table, tail))

        self.hbm, self.dram = extend(self.hbm, NO_COPY), extend(self.dram, NO_COPY)
        self.ssd_seq, self.ssd_page = extend(self.ssd_seq, NO_COPY), extend(self.ssd_page, 0)
        self.checksum, self.pins = extend(self.checksum, 0), extend(self.pins, 0)
        self.persisting = extend(self.persisting, False)
        self.priority = extend(self.priority, Priority.NORMAL)
        self.tail = extend(self.tail, False)
        self.keys.extend([None] * added)
        self.owners.extend([_NO_OWNER] * added)
        self._free.extend(range(rows - 1, old - 1, -1))  # lowest rows first: they stay dense

    # ---- rows -------------------------------------------------------------------------------------

    def row(self, key: BlockKey) -> int | None:
        return self._row_of.get(key)

    def rows(self, keys: Sequence[BlockKey]) -> np.ndarray:
        """The row of each key, NO_COPY for keys the directory does not know."""
        get = self._row_of.get
        return np.fromiter((get(key, NO_COPY) for key in keys), np.int64, len(keys))

    def ensure_row(
        self, key: BlockKey, owner: SessionKey = _NO_OWNER, priority: Priority = Priority.NORMAL, tail: bool = False
    ) -> int:
        """The key's row, made for it if it has none (`tail`: the key is a partial tail block's; a
        known row keeps what it was made with)."""
        row = self._row_of.get(key)
        if row is not None:
            return row
        if not self._free:
            self._grow(2 * len(self.keys))
        row = self._free.pop()
        self._row_of[key] = row
        self.keys[row] = key
        self.owners[row] = owner
        self.priority[row] = priority
        self.tail[row] = tail
        return row

    def release_if_empty(self, row: int) -> bool:
        """Forget a row whose block has no copy left in any layer and no I/O pending."""
        if (self.hbm[row] >= 0).any() or (self.dram[row] >= 0).any() or (self.ssd_seq[row] >= 0).any():
            return False
        if self.pins[row].any() or self.persisting[row].any():
            return False
        del self._row_of[self.keys[row]]  # type: ignore[arg-type]  # an object array of BlockKey
        self.keys[row] = None
        self.owners[row] = _NO_OWNER
        self.checksum[row] = 0
        self.tail[row] = False
        self._free.append(row)
        return True

    # ---- pages ------------------------------------------------------------------------------------

    def held(self, row: int, layer: int) -> bool:
        """Whether some tier holds a copy of this page."""
        return bool(self.hbm[row, layer] >= 0 or self.dram[row, layer] >= 0 or self.ssd_seq[row, layer] >= 0)

    def held_rows(self, rows: np.ndarray, layer: int) -> np.ndarray:
        """`held` for many known rows at once: a bool per row."""
        return (self.hbm[rows, layer] >= 0) | (self.dram[rows, layer] >= 0) | (self.ssd_seq[rows, layer] >= 0)

    def complete_rows(self, rows: np.ndarray) -> np.ndarray:
        """For known rows: whether some tier holds every layer of the block (what a load can serve
        without recomputing any of it)."""
        return ((self.hbm[rows] >= 0) | (self.dram[rows] >= 0) | (self.ssd_seq[rows] >= 0)).all(axis=1)

    def slots(self, tier: Tier) -> np.ndarray:
        """The slot table of a slot-backed tier (HBM or DRAM)."""
        return self.hbm if tier is Tier.HBM else self.dram

    def table(self, tier: Tier) -> np.ndarray:
        """The table of any tier whose entries are >= 0 where it holds a copy: slots, or SSD segments."""
        return self.ssd_seq if tier is Tier.SSD else self.slots(tier)

    def ssd_location(self, row: int, layer: int) -> SsdLocation | None:
        seq = int(self.ssd_seq[row, layer])
        return None if seq < 0 else SsdLocation(seq, int(self.ssd_page[row, layer]))

    def set_ssd(self, row: int, layer: int, location: SsdLocation | None) -> None:
        self.ssd_seq[row, layer] = NO_COPY if location is None else location.seq
        self.ssd_page[row, layer] = 0 if location is None else location.index

    def lookup(self, table: np.ndarray, ids: np.ndarray, layer: int | None = None) -> np.ndarray:
        """`table` (a slot or segment table) at rows `ids`, all layers or one: [len(ids), layers] or
        [len(ids)], NO_COPY for unknown rows (NO_COPY ids)."""
        known = ids >= 0
        safe = np.where(known, ids, 0)
        if layer is None:
            return np.where(known[:, None], table[safe], NO_COPY)
        return np.where(known, table[safe, layer], NO_COPY)

    def held_matrix(self, ids: np.ndarray, table: np.ndarray) -> np.ndarray:
        """[len(ids), layers] bool: whether `table` has a copy, False for unknown rows."""
        return self.lookup(table, ids) >= 0

    def pages_held(self) -> int:
        return int(np.count_nonzero((self.hbm >= 0) | (self.dram >= 0) | (self.ssd_seq >= 0)))

    def pinned_pages(self) -> int:
        return int(np.count_nonzero(self.pins))

    def ssd_copies(self) -> Iterator[tuple[BlockKey, int, SsdLocation, int]]:
        """(block key, layer, SSD location, checksum) of every page with an SSD copy."""
        for row, layer in zip(*np.nonzero(self.ssd_seq >= 0), strict=True):
            key = self.keys[row]
            assert key is not None
            yield (
                key,
                int(layer),
                SsdLocation(int(self.ssd_seq[row, layer]), int(self.ssd_page[row, layer])),
                int(self.checksum[row, layer]),
            )
