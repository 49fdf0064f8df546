"""What each storage tier promises the store: one Protocol per kind of tier.

`TieredStore` holds its tiers through these types (`hbm: SlotTier`, `dram: ArenaTier`,
`ssd: SegmentTier`); `DevicePool`, `DramArena` (`slots`) and `SsdTier` (`ssd_tier`) conform. A tier
stores bytes only: which page a slot or segment entry holds, and which copies exist, is the page
directory's (`directory`), kept by the store under its lock.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from node_manager.kv.pages import PageMac
from node_manager.kv.segments import SegmentEntry
from node_manager.kv.ssd_tier import RebuildReport, Segment, SsdLocation


class SlotTier(Protocol):
    """A tier of fixed-size page slots in one tensor: HBM (`DevicePool`) and DRAM (`DramArena`).

    Stores: page bytes only, slot `s` being row `pages[s]` (`[num_slots, page_words]` int64, at least
    one row even when `num_slots` is 0). Which slots are free is the store's `SlotAllocator`.
    Lock: none. The store's lock guards who owns a slot; a slot's bytes are read or written, with no
    lock held, only by its owner: a load holding a pin on the page, or the holder of a reservation.
    Raises: only the constructor, when the memory cannot be had (OSError for the arena).
    `close` releases the memory; the caller makes sure no I/O can touch it any more."""

    num_slots: int
    pages: torch.Tensor

    def close(self) -> None: ...


class ArenaTier(SlotTier, Protocol):
    """The DRAM tier: a `SlotTier` in named shared memory (`/dev/shm/<name>`), which other processes
    (the vLLM worker) map to read pinned slots and fill reserved ones.

    `run_view` gives the bytes of consecutive slots, page-aligned, for stream reads straight into
    reserved slots and for O_DIRECT writes of pages to SSD. Same lock rule as `SlotTier`."""

    name: str
    path: Path

    def run_view(self, first_slot: int, count: int) -> memoryview: ...


class SegmentTier(Protocol):
    """The SSD tier: pages in immutable segment files (`segments`), evicted whole, least recently
    used first.

    Stores: each segment's header (block key, layer, checksum per entry) and page bytes; `live` holds
    the entries the page directory still points at. `used_bytes` counts committed segments plus
    reservations; `other_model_segments` segments of another model (or MAC key) kept on disk, never loaded.
    Lock: the bookkeeping methods (`rebuild` to `unpin`) are called with the store's lock held and do
    no I/O beyond unlinking files; `write`, `read_into`, `advise_willneed` and `drop_cache` do file
    I/O and are called without it, on segments reserved (`write`) or pinned (the reads).
    Raises: `reserve` SsdFullError when no room can be made; `write` and `read_into` OSError."""

    directory: Path
    page_bytes: int
    mac: PageMac  # of every page it writes and reads
    used_bytes: int
    other_model_segments: int
    segments: dict[int, Segment]

    def rebuild(self) -> RebuildReport:
        """Index the segments on disk (at start, before any other call)."""
        ...

    def segment_bytes(self, pages: int) -> int: ...

    def reserve(self, nbytes: int) -> tuple[int, list[Segment]]:
        """Room for a segment: (its seq, the segments evicted to make room, whose pages are gone)."""
        ...

    def release_reservation(self, nbytes: int) -> None: ...

    def evict_for(self, nbytes: int) -> list[Segment]:
        """Least recently used unpinned segments of at least `nbytes` removed, whatever the capacity:
        a write found the disk full all the same."""
        ...

    def commit(self, seq: int, entries: list[SegmentEntry]) -> Segment:
        """A reserved segment, written, joins the index with every entry live."""
        ...

    def drop_page(self, location: SsdLocation) -> None:
        """An entry is no longer live; a segment with none live and no pin is deleted."""
        ...

    def touch(self, seq: int) -> None: ...

    def pin(self, seq: int) -> Segment | None:
        """Keep a segment on disk while it is read; None if it is gone."""
        ...

    def unpin(self, segment: Segment) -> None: ...

    def write(self, seq: int, entries: list[SegmentEntry], pages: list[memoryview]) -> None:
        """Write a reserved segment durably (it exists under its name whole, or not at all)."""
        ...

    def read_into(self, segment: Segment, reads: list[tuple[int, memoryview]]) -> None:
        """Read entries (index, destination) of a pinned segment; OSError on a short read."""
        ...

    def advise_willneed(self, segment: Segment, first: int, last: int) -> None: ...

    def drop_cache(self) -> None: ...
