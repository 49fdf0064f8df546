"""`StoreFront`: the bookkeeping of `TieredStore` as its parts see it (`write_behind`, `ingest`,
`load_plan`, `loads`). They take the store through this Protocol, so they never import `store`.

Lock: `lock` (reentrant) guards the page directory, the slot allocators, the eviction policies,
the session registry and the SSD tier's bookkeeping. Members documented "caller holds the lock"
must be called with it held; the others take it themselves or need none. Never held across I/O.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Protocol

import numpy as np

from node_manager.kv.directory import PageDirectory, SessionKey
from node_manager.kv.eviction import DeferredTouches, EvictionPolicy
from node_manager.kv.holdings import BlockHoldings
from node_manager.kv.metrics import KVMetrics, TierMeters
from node_manager.kv.pages import Tier
from node_manager.kv.sessions import SessionRegistry
from node_manager.kv.store_config import StoreConfig
from node_manager.kv.tiers import ArenaTier, SegmentTier, SlotTier
from symphony.kv_addressing import BlockKey
from symphony.kv_geometry import KVGeometry


class StoreFront(Protocol):
    geometry: KVGeometry
    config: StoreConfig
    metrics: KVMetrics
    lock: threading.RLock
    directory: PageDirectory
    sessions: SessionRegistry
    hbm: SlotTier
    dram: ArenaTier
    ssd: SegmentTier
    io: concurrent.futures.ThreadPoolExecutor  # the copy lanes: saves, and the stripes of every load
    touches: DeferredTouches  # recency of pages loads used, for the policies (caller holds the lock)
    meters: TierMeters  # per-tier hit and I/O series (no lock)
    # Block events: every write to a tier's directory table reports through it (caller holds the lock).
    holdings: BlockHoldings

    # ---- I/O jobs (kv.max_inflight_jobs) ----------------------------------------------------------

    def admit_jobs(self, count: int) -> bool:
        """Room for `count` I/O jobs (a save's copy, a load's layer); False, nothing taken, if the
        store is full or closed. Takes the lock."""
        ...

    def jobs_done(self, count: int) -> None:
        """`count` admitted jobs are over. Caller holds the lock."""
        ...

    @property
    def jobs_in_flight(self) -> int:
        """Admitted jobs not yet over. Caller holds the lock."""
        ...

    # ---- slots and copies (caller holds the lock) -------------------------------------------------

    def allocate(self, tier: Tier, count: int, protect: SessionKey | None = None) -> list[int] | None:
        """`count` free slots in `tier` (HBM or DRAM), evicting unpinned pages by its policy, never
        those of session `protect`; None, nothing changed, if that cannot make enough room."""
        ...

    def allocatable(self, tier: Tier, protect: SessionKey | None = None) -> int:
        """Slots `allocate` could hand out now."""
        ...

    def release_slots(self, tier: Tier, slots: list[int]) -> None:
        """Give back slots that hold no page (the directory does not point at them)."""
        ...

    def policy(self, tier: Tier) -> EvictionPolicy:
        """The eviction order of `tier`'s pages (HBM or DRAM), to insert a page given a slot."""
        ...

    def drop_copy(self, key: BlockKey, layer: int, tier: Tier, reason: str, *, announce: bool = True) -> None:
        """Remove one tier's copy of a page (counted); a page left with no copy leaves the directory.
        `announce=False`: the caller already reported the copy's removal (`holdings.removing_keys`)."""
        ...

    def after_copy_dropped(self, row: int, layer: int, reason: str) -> None:
        """A copy of page (row, layer) is gone from the directory: if it was the last, the block
        leaves the block index and its row may be released."""
        ...

    def publish_complete(self, rows: np.ndarray) -> None:
        """Put the blocks of `rows` that some tier holds in every layer into the block index."""
        ...

    def refresh_gauges(self) -> dict[Tier, int]:
        """Set the per-tier page and byte gauges; returns the pages per tier."""
        ...
