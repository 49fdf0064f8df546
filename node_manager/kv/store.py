"""TieredStore: one node's KV pages across HBM, DRAM and SSD, and the bookkeeping that ties them.

The store is the front, and holds the state every part shares: the lock, the page directory
(which tier holds which copy of every page), the slot allocators and eviction policies of HBM and
DRAM, the session registry and the admission count of I/O jobs. It exposes bookkeeping only, and
never does I/O under its lock: lookups (`residency`, `loadable_prefix_blocks`, `page_checksums`),
pins for readers outside the store (`pin_dram`, `pinned_dram_pages`), and the primitives its parts
use (`StoreFront`: allocate, drop, publish, touch). The parts move bytes:

- `ingest` (`PageIngest`): saves and peer pages, reserve → fill → verify → install into DRAM;
- `write_behind` (`WriteBehind`): an SSD copy of every page saved, written by background threads;
- `loads` (`Loads`): layer-wise loads into caller rows and promotions, planned by `load_plan`.

Invariants: a page with no SSD copy is pinned in DRAM until the write-behind has written it (unless
the SSD tier degrades: counted, logged once), so a copy in a tier above SSD can always be dropped
without loss; a pinned page is never evicted or replaced; a block enters `block_index` once some
tier holds every one of its layers, and leaves it when one of its pages loses its last copy; the
block events (`holdings`) name each full block a tier comes to hold whole or stops holding, under
the lock, with the directory change they describe.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from node_manager.kv.block_events import BlockEventLog
from node_manager.kv.block_index import BlockIndex
from node_manager.kv.directory import NO_COPY, PageDirectory, SessionKey
from node_manager.kv.errors import InvalidRequest, ModelMismatch
from node_manager.kv.eviction import DeferredTouches, EvictionPolicy, PageMeta, PriorityLRUPolicy, TopTierYieldPolicy
from node_manager.kv.holdings import BlockHoldings
from node_manager.kv.ingest import PageIngest
from node_manager.kv.loader import copy_lanes
from node_manager.kv.loads import Loads
from node_manager.kv.metrics import KVMetrics, TierMeters
from node_manager.kv.pages import PageId, PageMac, Tier
from node_manager.kv.sessions import SessionRecord, SessionRegistry, addressed_keys, check_range
from node_manager.kv.slots import DevicePool, DramArena, SlotAllocator
from node_manager.kv.ssd_tier import SsdTier
from node_manager.kv.store_config import StoreConfig
from node_manager.kv.tiers import ArenaTier, SegmentTier, SlotTier
from node_manager.kv.write_behind import WriteBehind
from symphony.kv_addressing import BlockKey, ModelFingerprint
from symphony.kv_geometry import KVGeometry
from symphony.logs import get_logger

log = get_logger(__name__)


@dataclass(slots=True)
class DramPin:
    """Pages pinned in DRAM for a reader outside the store: `slots[i, j]` is the arena slot of block
    i in the j-th layer asked for, -1 where DRAM held no copy. `rows`/`layers` are the directory
    cells that hold a pin, released once by `unpin_dram`."""

    rows: np.ndarray
    layers: np.ndarray
    slots: np.ndarray
    complete: bool  # DRAM held every page asked for
    released: bool = False


class TieredStore:
    """The front (see the module docstring). Its parts: `ingest`, `write_behind`, `loads`; what
    they use of it, and under which lock, is `StoreFront`'s to say."""

    def __init__(
        self,
        geometry: KVGeometry,
        config: StoreConfig,
        metrics: KVMetrics | None = None,
        events: BlockEventLog | None = None,
    ) -> None:
        """`events`: the node's block event log (a private one if None). The pages found on SSD at
        start publish nothing: a subscriber learns of them from its first snapshot."""
        config.validate()
        self.geometry = geometry
        self.config = config
        self.metrics = metrics or KVMetrics()
        self.lock = threading.RLock()
        self.directory = PageDirectory(geometry.num_layers)
        self.events = events if events is not None else BlockEventLog(metrics=self.metrics)
        self.holdings = BlockHoldings(self.directory, self.events)
        self.sessions = SessionRegistry(self.lock, geometry, config, self._reprioritize)
        self.hbm: SlotTier = DevicePool(geometry, config.hbm_bytes, config.device)
        self.dram: ArenaTier = DramArena(
            config.arena_name, geometry, config.dram_bytes, pin_for_cuda=config.device != "cpu"
        )
        self.ssd: SegmentTier = SsdTier(
            config.ssd_dir,
            geometry.page_bytes,
            config.ssd_bytes,
            config.model,
            direct_io=True,  # the arena's pages are page-aligned: the write-behind writes them O_DIRECT
            keep_other_models=config.ssd_keep_other_models,
            headroom_bytes=config.ssd_headroom_bytes,
            mac=PageMac(config.page_secret),
        )
        # Blocks complete in some tier, for the connector to look up without asking (block_index). A
        # complete block has a page per layer, so the tiers' pages bound how many there can be.
        total_pages = (config.hbm_bytes + config.dram_bytes + config.ssd_bytes) // geometry.page_bytes
        self.block_index = BlockIndex(f"{config.arena_name}-blocks", total_pages // geometry.num_layers + 1)
        self._slots = {Tier.HBM: SlotAllocator(self.hbm.num_slots), Tier.DRAM: SlotAllocator(self.dram.num_slots)}
        self._policies: dict[Tier, EvictionPolicy[PageId]] = {
            Tier.HBM: TopTierYieldPolicy(self.sessions.blocks_of),
            Tier.DRAM: PriorityLRUPolicy(),
        }
        self.io = copy_lanes(config.io_threads)  # saves, and the stripes of every load
        self._inflight = 0
        self._closed = False
        self.touches = DeferredTouches(self._policies)
        self.meters = TierMeters(self.metrics, geometry.page_bytes)
        capacities = {Tier.HBM: config.hbm_bytes, Tier.DRAM: config.dram_bytes, Tier.SSD: config.ssd_bytes}
        for tier, capacity in capacities.items():
            self.metrics.tier_capacity.labels(tier.name).set(capacity)
        self.write_behind = WriteBehind(self)
        self.ingest = PageIngest(self, self.write_behind)
        self.loads = Loads(self)
        self._index_ssd()
        self.write_behind.start()

    @property
    def model(self) -> ModelFingerprint:
        return self.config.model

    @property
    def closed(self) -> bool:
        return self._closed

    def check_model(self, fingerprint: bytes, side: Literal["sender", "receiver"]) -> None:
        """Raise ModelMismatch unless `fingerprint` (the requester's, on the sending side; the peer's,
        on the receiving side) is this store's: a node serving another model (another dtype, another
        revision of the weights) must never get or give this store's pages. Counted per side."""
        if fingerprint != self.config.model:
            self.metrics.peer_refused.labels(side).inc()
            who = "the requester" if side == "sender" else "the peer"
            shown = fingerprint.hex()[:12] if fingerprint else "none"
            raise ModelMismatch(
                f"{who} serves model {shown}, this node {self.config.model.hex()[:12]}: "
                "KV never moves between different models"
            )

    # ---- lookups ----------------------------------------------------------------------------------

    def residency(self, tenant: str, session_id: str) -> dict[Tier, list[list[bool]]]:
        """tier -> per layer, per block: whether that tier holds the page."""
        with self.lock:
            record = self.sessions.get(tenant, session_id)
            d = self.directory
            ids = d.rows(record.blocks.block_keys)
            tables = {Tier.HBM: d.hbm, Tier.DRAM: d.dram, Tier.SSD: d.ssd_seq}
            return {tier: d.held_matrix(ids, table).T.tolist() for tier, table in tables.items()}

    def loadable_prefix_blocks(self, tenant: str, session_id: str) -> int:
        """Leading blocks some tier holds in every layer: what a load delivers without recompute."""
        with self.lock:
            record = self.sessions.get(tenant, session_id)
            d = self.directory
            ids = d.rows(record.blocks.block_keys)
            unknown = np.flatnonzero(ids < 0)
            known = ids[: unknown[0]] if len(unknown) else ids  # the prefix ends at the first unknown block
            complete = d.complete_rows(known)
            return int(np.argmin(complete)) if not complete.all() else len(known)

    def loadable_tail_tokens(self, tenant: str, session_id: str) -> int:
        """Tokens of the session's partial last block (a finished turn's tail, `tail_key`) that some
        tier holds in every layer, when every full block before it is loadable too; 0 otherwise."""
        with self.lock:
            record = self.sessions.get(tenant, session_id)
            blocks = record.blocks
            if not blocks.tail_tokens or self.loadable_prefix_blocks(tenant, session_id) < blocks.num_blocks:
                return 0
            key = addressed_keys(record, blocks.num_blocks, 1, None, len(blocks.tail_tokens))[0]
            row = self.directory.row(key)
            held = row is not None and bool(self.directory.complete_rows(np.array([row]))[0])
            return len(blocks.tail_tokens) if held else 0

    def dram_slots(self, tenant: str, session_id: str) -> list[list[int]]:
        """Per layer, per block: the DRAM arena slot holding the page, or -1."""
        with self.lock:
            record = self.sessions.get(tenant, session_id)
            d = self.directory
            return d.lookup(d.dram, d.rows(record.blocks.block_keys)).T.tolist()

    def page_checksums(self, tenant: str, session_id: str, first_block: int, count: int) -> np.ndarray:
        """[count, layers] uint64: the checksum on record for page (first_block + i, layer), 0 where no
        tier holds it. A sender labels the pages it loads with these instead of hashing them again;
        a page replaced in between fails the receiver's check rather than passing with stale bytes."""
        with self.lock:
            record = self.sessions.get(tenant, session_id)
            check_range(self.geometry, record, 0, first_block, count)
            d = self.directory
            ids = d.rows(record.blocks.block_keys[first_block : first_block + count])
            out = np.zeros((count, self.geometry.num_layers), np.uint64)
            known = ids >= 0
            out[known] = d.checksum[ids[known]]
            return out

    def pinned_pages(self) -> int:
        """Pages with I/O in progress (loads, or a write-behind still owed): 0 once the store is idle."""
        with self.lock:
            return self.directory.pinned_pages()

    def demote(self, tenant: str, session_id: str, tier: Tier) -> int:
        """Drop the session's copies in `tier` (HBM or DRAM) that the SSD tier also holds, and return
        how many pages were dropped. Pinned pages (under I/O or held by a load) and pages with no SSD
        copy stay: demoting frees the tier, it never loses KV. An operator frees DRAM for other
        sessions this way; benchmarks use it to leave a history on SSD only."""
        if tier is Tier.SSD:
            raise InvalidRequest("only HBM and DRAM copies can be demoted (SSD is the last tier)")
        dropped = 0
        with self.lock:
            record = self.sessions.get(tenant, session_id)
            d = self.directory
            table = d.slots(tier)
            for key in record.blocks.block_keys:
                row = d.row(key)
                if row is None:
                    continue
                for layer in range(self.geometry.num_layers):
                    if table[row, layer] >= 0 and not d.pins[row, layer] and d.ssd_location(row, layer) is not None:
                        self.drop_copy(key, layer, tier, "demoted")
                        dropped += 1
            self.refresh_gauges()
        return dropped

    # ---- pins for readers outside the store -------------------------------------------------------

    @contextlib.contextmanager
    def pinned_dram_pages(
        self, tenant: str, session_id: str, first_block: int, count: int
    ) -> Iterator[tuple[np.ndarray, np.ndarray] | None]:
        """(slots, checksums), each [count, layers], when DRAM holds every page of blocks
        first_block..first_block + count - 1. The pages stay pinned (neither evicted nor replaced)
        until the block exits, so a sender can write them from the arena without copying them out
        first. None, with nothing pinned, when some page is elsewhere: the caller loads instead.
        A block that exits normally counts as a DRAM read of every page."""
        d = self.directory
        started = time.perf_counter()
        with self.lock:
            record = self.sessions.get(tenant, session_id)
            check_range(self.geometry, record, 0, first_block, count)
            keys = record.blocks.block_keys[first_block : first_block + count]
            ids = d.rows(keys)
            slots = d.dram[ids] if len(ids) and ids.min() >= 0 else None
            if slots is None or slots.min() < 0:
                held = None
            else:
                d.pins[ids] += 1
                held = slots, d.checksum[ids]
                self.touches.add(Tier.DRAM, tuple(keys), tuple(range(self.geometry.num_layers)))
        try:
            yield held
            if held is not None:
                self.meters.observe_io(Tier.DRAM, "read", held[0].size, started)
        finally:
            if held is not None:
                with self.lock:
                    d.pins[ids] -= 1

    def pin_dram(
        self,
        tenant: str,
        session_id: str,
        first_block: int,
        count: int,
        layers: Sequence[int],
        *,
        whole: bool = False,
        record_reads: bool = True,
        last_key: BlockKey | None = None,
        tail_tokens: int = 0,
    ) -> DramPin:
        """Pin the DRAM copies of blocks first_block.. for `layers` so that another process (the vLLM
        worker, which maps the arena) can copy them out; pages DRAM does not hold get slot -1 and
        are not pinned. The pins hold until `unpin_dram`: neither eviction nor a replacing save can
        touch a pinned slot. With `whole`, nothing is pinned unless every page is (`complete`).
        `record_reads`: count the pages as DRAM hits and misses; off where a load into DRAM
        already counted them. `last_key`, `tail_tokens`: see `addressed_keys`."""
        d = self.directory
        with self.lock:
            record = self.sessions.get(tenant, session_id)
            check_range(self.geometry, record, 0, first_block, count, tail_tokens)
            if not all(0 <= layer < self.geometry.num_layers for layer in layers):
                raise InvalidRequest(f"layers must be within 0..{self.geometry.num_layers - 1}")
            keys = addressed_keys(record, first_block, count, last_key, tail_tokens)
            ids = d.rows(keys)
            columns = np.asarray(layers, dtype=np.int64)
            slots = np.full((len(ids), len(columns)), -1, np.int64)
            known = ids >= 0
            slots[known] = d.dram[ids[known]][:, columns]
            held = slots >= 0
            complete = bool(held.all())
            if whole and not complete:
                held[:] = False
            rows, cols = np.nonzero(held)
            np.add.at(d.pins, (ids[rows], columns[cols]), 1)
            if held.any():
                self.touches.add(Tier.DRAM, tuple(keys), tuple(int(layer) for layer in columns))
            if record_reads and (complete or not whole):
                self.meters.count_hits(Tier.DRAM, int(held.sum()))
                self.metrics.misses.inc(int((~held).sum()))
        return DramPin(ids[rows], columns[cols], slots, complete)

    def unpin_dram(self, pin: DramPin) -> None:
        with self.lock:
            if pin.released:
                return
            pin.released = True
            np.subtract.at(self.directory.pins, (pin.rows, pin.layers), 1)

    # ---- I/O jobs (`StoreFront`) ------------------------------------------------------------------

    def admit_jobs(self, count: int) -> bool:
        with self.lock:
            if self._closed or self._inflight + count > self.config.max_inflight_jobs:
                return False
            self._inflight += count
            return True

    def jobs_done(self, count: int) -> None:
        self._inflight -= count

    @property
    def jobs_in_flight(self) -> int:
        return self._inflight

    # ---- slots and copies (`StoreFront`; caller holds the lock) -----------------------------------

    def allocatable(self, tier: Tier, protect: SessionKey | None = None) -> int:
        d = self.directory
        evictable = (d.slots(tier) >= 0) & (d.pins == 0)
        protected = [row for row, owner in enumerate(d.owners) if owner == protect]
        return self._slots[tier].free + int(np.count_nonzero(evictable)) - int(np.count_nonzero(evictable[protected]))

    def allocate(self, tier: Tier, count: int, protect: SessionKey | None = None) -> list[int] | None:
        allocator = self._slots[tier]
        if count == 0:
            return []
        shortfall = count - allocator.free
        if shortfall > 0:
            self.touches.apply()
            d = self.directory

            def evictable(page: PageId) -> bool:
                key, layer = page
                row = d.row(key)
                return row is not None and not d.pins[row, layer] and d.owners[row] != protect

            victims = self._policies[tier].victims(shortfall, evictable)
            if victims is None:
                return None
            self.holdings.removing_keys(tier, [key for key, _ in victims])
            for key, layer in victims:
                self.drop_copy(key, layer, tier, "capacity", announce=False)
        return allocator.allocate(count)

    def release_slots(self, tier: Tier, slots: list[int]) -> None:
        self._slots[tier].release(slots)

    def policy(self, tier: Tier) -> EvictionPolicy:
        return self._policies[tier]

    def drop_copy(self, key: BlockKey, layer: int, tier: Tier, reason: str, *, announce: bool = True) -> None:
        d = self.directory
        row = d.row(key)
        if row is None:
            return
        if tier is Tier.SSD:
            location = d.ssd_location(row, layer)
            if location is None:
                return
            if announce:
                self.holdings.removing(tier, row)
            self.ssd.drop_page(location)
            d.set_ssd(row, layer, None)
        else:
            table = d.slots(tier)
            slot = int(table[row, layer])
            if slot < 0:
                return
            if announce:
                self.holdings.removing(tier, row)
            self._slots[tier].release([slot])
            self._policies[tier].remove((key, layer))
            table[row, layer] = NO_COPY
        self.metrics.evictions.labels(tier.name, reason).inc()
        self.after_copy_dropped(row, layer, reason)

    def after_copy_dropped(self, row: int, layer: int, reason: str) -> None:
        d = self.directory
        if d.held(row, layer):
            return
        self.block_index.discard(d.keys[row])  # type: ignore[arg-type]  # an object array of BlockKey
        if reason != "superseded":
            self.metrics.last_copy_dropped.labels(reason).inc()
        d.release_if_empty(row)

    def publish_complete(self, rows: np.ndarray) -> None:
        # Blocks leave the index in `after_copy_dropped`, when a page loses its last copy.
        keys = self.directory.keys
        self.block_index.add(keys[row] for row in rows[self.directory.complete_rows(rows)].tolist())

    def _reprioritize(self, record: SessionRecord) -> None:
        """The session's priority changed: its pages take it, in the directory and in both
        policies' order. Caller holds the lock."""
        d = self.directory
        for key in record.blocks.block_keys:
            row = d.row(key)
            if row is None:
                continue
            d.priority[row] = record.priority
            for layer in range(self.geometry.num_layers):
                meta = PageMeta(layer, d.owners[row], record.priority)
                for tier in (Tier.HBM, Tier.DRAM):
                    if d.slots(tier)[row, layer] >= 0:
                        self._policies[tier].insert((key, layer), meta)

    def _index_ssd(self) -> None:
        """At start: every page the SSD tier holds enters the directory (the newest copy of a page
        wins), and complete blocks the block index."""
        report = self.ssd.rebuild()
        pages, damaged = report.pages, report.damaged
        other = sum(report.other_models.values())
        self.metrics.count_rebuild(damaged, report.quarantined, other, report.kept_other_models)
        d = self.directory
        for (key, layer), location, checksum, tail in pages:
            row = d.ensure_row(key, tail=tail)
            d.tail[row] |= tail  # the newest segment may be the first to say (version 3 segments do not)
            older = d.ssd_location(row, layer)
            if older is not None:
                self.ssd.drop_page(older)  # an older copy; the newest segment wins
            d.set_ssd(row, layer, location)
            d.checksum[row, layer] = checksum
        self.publish_complete(np.arange(len(d.keys))[[key is not None for key in d.keys]])
        if pages or damaged:
            log.info(
                "KV index rebuilt from SSD",
                pages=d.pages_held(),
                segments=len(self.ssd.segments),
                damaged_segments=damaged,
                directory=str(self.ssd.directory),
            )
        self.refresh_gauges()

    # ---- metrics and life cycle -------------------------------------------------------------------

    def refresh_gauges(self) -> dict[Tier, int]:
        slots = self._slots
        pages = {
            Tier.HBM: slots[Tier.HBM].num_slots - slots[Tier.HBM].free,
            Tier.DRAM: slots[Tier.DRAM].num_slots - slots[Tier.DRAM].free,
            Tier.SSD: sum(len(s.live) for s in self.ssd.segments.values()),
        }
        for tier, count in pages.items():
            self.metrics.tier_pages.labels(tier.name).set(count)
        # SSD bytes are what its files occupy (headers and superseded pages included), not pages x size.
        held_bytes = {
            Tier.HBM: pages[Tier.HBM] * self.geometry.page_bytes,
            Tier.DRAM: pages[Tier.DRAM] * self.geometry.page_bytes,
            Tier.SSD: self.ssd.used_bytes,
        }
        for tier, nbytes in held_bytes.items():
            self.metrics.tier_bytes.labels(tier.name).set(nbytes)
        self.metrics.other_model_segments.set(self.ssd.other_model_segments)
        return pages

    def stats(self) -> dict[str, int]:
        with self.lock:
            pages = self.refresh_gauges()
            return {
                "pages": self.directory.pages_held(),
                "sessions": len(self.sessions),
                "hbm_pages": pages[Tier.HBM],
                "dram_pages": pages[Tier.DRAM],
                "ssd_pages": pages[Tier.SSD],
                "ssd_bytes": self.ssd.used_bytes,
                "write_queue": self.write_behind.queued,
                "write_behind_held": int(self.write_behind.holding_off),
            }

    def close(self, flush_timeout: float = 30.0) -> None:
        """Finish pending writes (so every saved page is on SSD), then free the arena."""
        self.write_behind.flush(flush_timeout)
        with self.lock:
            self._closed = True
        self.write_behind.stop(flush_timeout)
        self.io.shutdown(wait=True)
        self.loads.close()
        self.dram.close()
        self.hbm.close()
        self.block_index.close()
