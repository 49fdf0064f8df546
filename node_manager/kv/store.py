"""TieredStore: one node's KV pages across HBM, DRAM and SSD, with a layer-wise async load/save API.

Bookkeeping (sessions, the page directory, slot allocation, eviction choices) happens here, under
one lock, and never does I/O. Moving bytes is `loader.py`'s job: loads run layer by layer on the
copy lanes with the pages involved pinned, so eviction skips them instead of waiting. Saves land in
the DRAM arena and are written behind to SSD, so a persistent copy of every saved page exists unless
the SSD tier degrades (counted, logged once). A copy in a tier above SSD can always be dropped
without loss.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from node_manager.kv.eviction import EvictionPolicy, PageMeta, PriorityLRUPolicy, TopTierYieldPolicy
from node_manager.kv.loader import (
    LayerPlan,
    LayerResult,
    LayerwiseLoad,
    PlannedRead,
    RowTarget,
    StripedLoad,
    copy_lanes,
)
from node_manager.kv.metrics import KVMetrics
from node_manager.kv.pages import PageId, Priority, Tier, page_checksum
from node_manager.kv.segments import SegmentEntry
from node_manager.kv.slots import DevicePool, DramArena, SlotAllocator, copy_rows
from node_manager.kv.ssd_tier import Segment, SsdFullError, SsdLocation, SsdTier
from symphony.kv_addressing import SessionBlocks, chain_block_keys
from symphony.kv_geometry import KVGeometry
from symphony.logs import get_logger

log = get_logger("node_manager.kv.store")

SessionKey = tuple[str, str]  # (tenant, session id)
_MAX_PENDING_TOUCH_BATCHES = 4096  # ~64 pages each: bounds the deferred-recency queue


class KVStoreError(Exception):
    """Base of the store's client-facing errors."""


class SessionNotFound(KVStoreError):
    pass


class InvalidRequest(KVStoreError):
    pass


class StoreBusy(KVStoreError):
    """Too much I/O already in flight; the caller should retry later (or recompute)."""


@dataclass(frozen=True)
class StoreConfig:
    hbm_bytes: int
    dram_bytes: int
    ssd_bytes: int
    ssd_dir: Path
    arena_name: str
    device: str = "cpu"
    io_threads: int = 2
    max_inflight_jobs: int = 256  # queued + running layer jobs and save copies
    segment_max_bytes: int = 8 * 1024 * 1024
    max_sessions: int = 100_000
    max_session_tokens: int = 1_048_576

    def validate(self) -> None:
        if not 0 <= self.hbm_bytes <= self.dram_bytes <= self.ssd_bytes:
            raise ValueError("KV tier capacities must satisfy 0 <= hbm_bytes <= dram_bytes <= ssd_bytes "
                             f"(got {self.hbm_bytes}, {self.dram_bytes}, {self.ssd_bytes})")
        for name in ("io_threads", "max_inflight_jobs", "segment_max_bytes", "max_sessions", "max_session_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KV store: {name} must be positive")


@dataclass(slots=True)
class SessionRecord:
    key: SessionKey
    token_ids: list[int]
    blocks: SessionBlocks
    priority: Priority


@dataclass(slots=True)
class PageEntry:
    checksum: int
    owner: SessionKey
    priority: Priority
    hbm: int | None = None
    dram: int | None = None
    ssd: SsdLocation | None = None
    pins: int = 0  # I/O in progress on some copy of this page
    persisting: bool = False  # queued for, or being written by, the write-behind

    def tiers(self) -> list[Tier]:
        held = []
        if self.hbm is not None:
            held.append(Tier.HBM)
        if self.dram is not None:
            held.append(Tier.DRAM)
        if self.ssd is not None:
            held.append(Tier.SSD)
        return held


class TieredStore:
    def __init__(self, geometry: KVGeometry, config: StoreConfig, metrics: KVMetrics | None = None) -> None:
        config.validate()
        self.geometry = geometry
        self.config = config
        self.metrics = metrics or KVMetrics()
        self._lock = threading.RLock()
        self._sessions: OrderedDict[SessionKey, SessionRecord] = OrderedDict()
        self._pages: dict[PageId, PageEntry] = {}
        self.hbm = DevicePool(geometry, config.hbm_bytes, config.device)
        self.dram = DramArena(config.arena_name, geometry, config.dram_bytes, pin_for_cuda=config.device != "cpu")
        self.ssd = SsdTier(config.ssd_dir, geometry.page_bytes, config.ssd_bytes)
        self._hbm_slots = SlotAllocator(self.hbm.num_slots)
        self._dram_slots = SlotAllocator(self.dram.num_slots)
        self._hbm_policy: EvictionPolicy = TopTierYieldPolicy(self._session_blocks)
        self._dram_policy: EvictionPolicy = PriorityLRUPolicy()
        self._io = copy_lanes(config.io_threads)  # saves, and the stripes of every load
        self._readahead_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-readahead")
        self._inflight = 0
        self._pending_touches: deque[tuple[Tier, list[PageId]]] = deque()
        self._write_queue: deque[PageId] = deque()
        self._writer_wake = threading.Condition(self._lock)
        self._writes_in_progress = 0
        self._ssd_degraded = False
        self._closed = False
        capacities = {Tier.HBM: config.hbm_bytes, Tier.DRAM: config.dram_bytes, Tier.SSD: config.ssd_bytes}
        for tier, capacity in capacities.items():
            self.metrics.tier_capacity.labels(tier.name).set(capacity)
        self._rebuild_index()
        self._writer = threading.Thread(target=self._write_behind_loop, name="kv-write-behind", daemon=True)
        self._writer.start()

    # ---- sessions ---------------------------------------------------------------------------------

    def put_session(self, tenant: str, session_id: str, token_ids: Sequence[int],
                    priority: Priority | None = None) -> SessionRecord:
        """Register a session's token history (or extend it). A history that does not extend the
        stored one (an edited conversation) replaces it; its keys are recomputed."""
        if not tenant or not session_id:
            raise InvalidRequest("tenant and session_id must be non-empty")
        if len(token_ids) > self.config.max_session_tokens:
            raise InvalidRequest(f"{len(token_ids)} tokens exceed kv.max_session_tokens "
                                 f"({self.config.max_session_tokens})")
        key = (tenant, session_id)
        with self._lock:
            record = self._sessions.get(key)
        start = None
        if record is not None and record.token_ids == list(token_ids[:len(record.token_ids)]):
            start = record.blocks
        try:
            blocks = chain_block_keys(tenant, token_ids, self.geometry.block_size, start)
        except (ValueError, OverflowError) as exc:
            raise InvalidRequest(str(exc)) from None
        with self._lock:
            old = self._sessions.get(key)
            new_priority = priority if priority is not None else (old.priority if old else Priority.NORMAL)
            record = SessionRecord(key, list(token_ids), blocks, new_priority)
            self._sessions[key] = record
            self._sessions.move_to_end(key)
            while len(self._sessions) > self.config.max_sessions:
                # Forgetting a session keeps its pages (other sessions may share them); they age out.
                self._sessions.popitem(last=False)
            if old is not None and old.priority != new_priority:
                self._reprioritize(record)
        return record

    def session(self, tenant: str, session_id: str) -> SessionRecord:
        with self._lock:
            record = self._sessions.get((tenant, session_id))
            if record is None:
                raise SessionNotFound(f"no session {session_id!r} for this tenant")
            self._sessions.move_to_end(record.key)
            return record

    def set_priority(self, tenant: str, session_id: str, priority: Priority) -> None:
        with self._lock:
            record = self.session(tenant, session_id)
            record.priority = priority
            self._reprioritize(record)

    def _reprioritize(self, record: SessionRecord) -> None:
        for layer in range(self.geometry.num_layers):
            for key in record.blocks.block_keys:
                entry = self._pages.get((key, layer))
                if entry is None:
                    continue
                entry.priority = record.priority
                meta = PageMeta(layer, entry.owner, entry.priority)
                if entry.hbm is not None:
                    self._hbm_policy.insert((key, layer), meta)
                if entry.dram is not None:
                    self._dram_policy.insert((key, layer), meta)

    def _session_blocks(self, key: object) -> int:
        record = self._sessions.get(key)  # type: ignore[arg-type]
        return record.blocks.num_blocks if record else 0

    def residency(self, tenant: str, session_id: str) -> dict[Tier, list[list[bool]]]:
        """tier -> per layer, per block: whether that tier holds the page."""
        with self._lock:
            record = self.session(tenant, session_id)
            out: dict[Tier, list[list[bool]]] = {tier: [] for tier in Tier}
            for layer in range(self.geometry.num_layers):
                held = [self._pages.get((key, layer)) for key in record.blocks.block_keys]
                out[Tier.HBM].append([e is not None and e.hbm is not None for e in held])
                out[Tier.DRAM].append([e is not None and e.dram is not None for e in held])
                out[Tier.SSD].append([e is not None and e.ssd is not None for e in held])
            return out

    def loadable_prefix_blocks(self, tenant: str, session_id: str) -> int:
        """Leading blocks some tier holds in every layer: what a load delivers without recompute."""
        with self._lock:
            record = self.session(tenant, session_id)
            for index, key in enumerate(record.blocks.block_keys):
                if any((key, layer) not in self._pages for layer in range(self.geometry.num_layers)):
                    return index
            return record.blocks.num_blocks

    def dram_slots(self, tenant: str, session_id: str) -> list[list[int]]:
        """Per layer, per block: the DRAM arena slot holding the page, or -1."""
        with self._lock:
            record = self.session(tenant, session_id)
            slots = []
            for layer in range(self.geometry.num_layers):
                row = []
                for key in record.blocks.block_keys:
                    entry = self._pages.get((key, layer))
                    row.append(entry.dram if entry is not None and entry.dram is not None else -1)
                slots.append(row)
            return slots

    # ---- saves ------------------------------------------------------------------------------------

    def save_layer(self, tenant: str, session_id: str, layer: int, first_block: int,
                   pages: torch.Tensor) -> concurrent.futures.Future[int]:
        """Save `pages` ([n, page_words] int64, any device) as blocks first_block.. of `layer`.

        Never blocks: the copy into DRAM runs on an I/O thread and the write to SSD behind it. The
        future gives the number of pages kept; `pages` must stay unchanged until it resolves. When
        the store is saturated the save degrades (counted in symphony_kv_save_degraded_total)
        rather than making the caller wait."""
        record = self.session(tenant, session_id)
        self._check_range(record, layer, first_block, pages.shape[0] if pages.dim() else -1)
        if pages.dim() != 2 or pages.shape[1] != self.geometry.page_words or pages.dtype != torch.int64:
            raise InvalidRequest(f"pages must be int64 [n, {self.geometry.page_words}], got "
                                 f"{pages.dtype} {list(pages.shape)}")
        keys = record.blocks.block_keys[first_block:first_block + pages.shape[0]]
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        if not self._admit_jobs(1):
            self.metrics.save_degraded.labels("io_backpressure").inc(len(keys))
            future.set_result(0)
            return future
        job = self._io.submit(self._save_pages, record, layer, list(keys), pages)
        job.add_done_callback(lambda done: self._chain(done, future))
        return future

    def _chain(self, done: concurrent.futures.Future[int], future: concurrent.futures.Future[int]) -> None:
        with self._lock:
            self._inflight -= 1
        if done.exception() is not None:
            future.set_exception(done.exception())  # type: ignore[arg-type]
        else:
            future.set_result(done.result())

    def _admit_jobs(self, count: int) -> bool:
        """Reserve room for `count` I/O jobs under kv.max_inflight_jobs; False (nothing taken) if full."""
        with self._lock:
            if self._closed or self._inflight + count > self.config.max_inflight_jobs:
                return False
            self._inflight += count
            return True

    def _check_range(self, record: SessionRecord, layer: int, first_block: int, count: int) -> None:
        if not 0 <= layer < self.geometry.num_layers:
            raise InvalidRequest(f"layer {layer} outside 0..{self.geometry.num_layers - 1}")
        if first_block < 0 or count < 0 or first_block + count > record.blocks.num_blocks:
            raise InvalidRequest(f"blocks {first_block}..{first_block + count - 1} outside the session's "
                                 f"{record.blocks.num_blocks} full blocks")

    def _save_pages(self, record: SessionRecord, layer: int, keys: list, pages: torch.Tensor) -> int:
        with self._lock:
            slots = self._allocate(Tier.DRAM, len(keys))
        if slots is None:
            self.metrics.save_degraded.labels("dram_full").inc(len(keys))
            return 0
        started = time.perf_counter()
        copy_rows(self.dram.pages, slots, pages.to("cpu"), list(range(len(slots))))
        checksums = [page_checksum(key, layer, self.dram.page_view(slot))
                     for key, slot in zip(keys, slots, strict=True)]
        self._observe_io(Tier.DRAM, "write", len(keys), started)
        with self._lock:
            for key, slot, checksum in zip(keys, slots, checksums, strict=True):
                self._install_saved((key, layer), slot, checksum, record)
            self._writer_wake.notify()
        return len(keys)

    def _install_saved(self, page: PageId, slot: int, checksum: int, record: SessionRecord) -> None:
        entry = self._pages.get(page)
        if entry is not None and entry.checksum == checksum and entry.dram is not None:
            self._dram_slots.release([slot])  # identical bytes already cached
            self._defer_touches(Tier.DRAM, [page])
            return
        if entry is not None and entry.pins and entry.checksum != checksum:
            # Different bytes for a page under I/O: keep the copy being read or persisted intact.
            self._dram_slots.release([slot])
            self.metrics.save_degraded.labels("page_busy").inc()
            return
        if entry is not None and entry.checksum != checksum:
            # New bytes under the same key: engines are deterministic per key, so this is rare (a
            # different model or dtype); the newest copy wins everywhere.
            self._drop_copy(page, entry, Tier.HBM, "superseded")
            self._drop_copy(page, entry, Tier.SSD, "superseded")
            entry.checksum = checksum
        if entry is None:
            entry = PageEntry(checksum, record.key, record.priority)
            self._pages[page] = entry
        if entry.dram is not None:
            self._drop_copy(page, entry, Tier.DRAM, "superseded")
        entry.dram = slot
        entry.owner, entry.priority = record.key, record.priority
        self._dram_policy.insert(page, PageMeta(page[1], record.key, record.priority))
        if entry.ssd is None and not entry.persisting:
            entry.persisting = True
            entry.pins += 1  # held in DRAM until the write-behind has it on SSD
            self._write_queue.append(page)

    # ---- write-behind -----------------------------------------------------------------------------

    def _write_behind_loop(self) -> None:
        max_pages = max(1, self.config.segment_max_bytes // self.geometry.page_bytes)
        while True:
            with self._lock:
                while not self._write_queue and not self._closed:
                    self._writer_wake.wait()
                if self._closed and not self._write_queue:
                    return
                batch: list[tuple[PageId, PageEntry]] = []
                while self._write_queue and len(batch) < max_pages:
                    page = self._write_queue.popleft()
                    entry = self._pages.get(page)
                    if entry is not None and entry.persisting:
                        batch.append((page, entry))
                self._writes_in_progress += 1
            try:
                if batch:
                    self._persist(batch)
            finally:
                with self._lock:
                    self._writes_in_progress -= 1
                    self._writer_wake.notify_all()

    def _persist(self, batch: list[tuple[PageId, PageEntry]]) -> None:
        nbytes = self.ssd.segment_bytes(len(batch))
        entries = [SegmentEntry(page[0], page[1], entry.checksum) for page, entry in batch]
        views = [self.dram.page_view(entry.dram) for _, entry in batch]  # type: ignore[arg-type]
        try:
            with self._lock:
                seq, evicted = self.ssd.reserve(nbytes)
                self._forget_segments(evicted)
        except SsdFullError as exc:
            self._degrade_persist(batch, "ssd_full", exc)
            return
        started = time.perf_counter()
        try:
            self.ssd.write(seq, entries, views)
        except OSError as exc:
            with self._lock:
                self.ssd.release_reservation(nbytes)
            self._degrade_persist(batch, "ssd_full" if exc.errno == 28 else "ssd_error", exc)
            return
        self._observe_io(Tier.SSD, "write", len(batch), started)
        with self._lock:
            segment = self.ssd.commit(seq, entries)
            for index, (page, entry) in enumerate(batch):
                entry.persisting = False
                entry.pins -= 1
                if self._pages.get(page) is entry and entry.checksum == entries[index].checksum:
                    entry.ssd = SsdLocation(seq, index)
                else:
                    self.ssd.drop_page(SsdLocation(seq, index))
            if self._ssd_degraded:
                self._ssd_degraded = False
                log.info("KV saves reach SSD again", segment=segment.path.name)
            self._refresh_gauges()

    def _degrade_persist(self, batch: list[tuple[PageId, PageEntry]], reason: str, exc: BaseException) -> None:
        self.metrics.save_degraded.labels(reason).inc(len(batch))
        with self._lock:
            for _, entry in batch:
                entry.persisting = False
                entry.pins -= 1
            if not self._ssd_degraded:
                self._ssd_degraded = True  # one line per degraded episode, not one per batch
                log.warning("KV saves stay in DRAM only: the SSD tier refused a write", reason=reason,
                            error=str(exc), directory=str(self.ssd.directory))

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every page saved so far has been written to SSD (or degraded). True if drained."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._write_queue or self._writes_in_progress or self._inflight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._writer_wake.wait(min(remaining, 0.05))
            return True

    @property
    def ssd_degraded(self) -> bool:
        return self._ssd_degraded

    # ---- loads ------------------------------------------------------------------------------------

    def load(self, tenant: str, session_id: str, first_block: int = 0, num_blocks: int | None = None,
             target: RowTarget | Tier = Tier.HBM, layers: Sequence[int] | None = None) -> LayerwiseLoad:
        """Bring blocks [first_block, first_block + num_blocks) of every layer into `target`, layer by
        layer from whichever tier holds each page (fastest first). Returns at once; per-layer futures
        report what arrived. With a tier target this is a promotion (prefetch); pages already there
        count as loaded."""
        record = self.session(tenant, session_id)
        count = record.blocks.num_blocks - first_block if num_blocks is None else num_blocks
        self._check_range(record, 0, first_block, count)
        if isinstance(target, RowTarget):
            if len(target.rows) != count or len(target.tensors) != self.geometry.num_layers:
                raise InvalidRequest("row target needs one tensor per layer and one row per block")
        elif target not in (Tier.HBM, Tier.DRAM):
            raise InvalidRequest(f"cannot load into {target.name}")
        order = list(range(self.geometry.num_layers)) if layers is None else list(layers)
        handle = LayerwiseLoad(self.geometry.num_layers, first_block, count)
        keys = record.blocks.block_keys[first_block:first_block + count]
        if not self._admit_jobs(len(order)):
            raise StoreBusy("too many KV transfers in flight; retry or recompute")
        for layer in range(self.geometry.num_layers):
            if layer not in order:
                handle._finish(layer, LayerResult(layer, 0, ()))
        if not order:
            return handle
        run = StripedLoad(
            handle, order, self._io, self.config.io_threads, {Tier.HBM: self.hbm.pages, Tier.DRAM: self.dram.pages},
            self.ssd, self.geometry.page_words,
            plan=lambda layer: self._plan_layer(handle, record, layer, keys, target),
            finalize=lambda plan: self._finalize_layer(plan, handle, record, target),
            after_first=lambda plan: self._after_first_layer(plan, keys, order[1:]))
        run.start()
        return handle

    def _plan_layer(self, handle: LayerwiseLoad, record: SessionRecord, layer: int, keys: Sequence,
                    target: RowTarget | Tier) -> LayerPlan:
        """Decide where each page of `layer` comes from and pin it (bookkeeping only, under the lock).
        This loop is the load path's Python cost, paid for every page: the common DRAM hit does the
        least work and recency is updated in one batch per tier."""
        tier_target = target if isinstance(target, Tier) else None
        if tier_target is None:
            dest = target.tensors[layer]  # type: ignore[union-attr]
        else:
            dest = self.hbm.pages if tier_target is Tier.HBM else self.dram.pages
        plan = LayerPlan(layer, dest)
        if handle.cancelled:
            plan.failed = list(range(len(keys)))
            plan.skipped = True
            return plan
        pages = [(key, layer) for key in keys]
        with self._lock:
            try:
                entries = list(map(self._pages.get, pages))
                if tier_target is None and self._plan_from_dram(plan, pages, entries, target.rows):  # type: ignore[union-attr]
                    return plan
                reads, failed = plan.reads, plan.failed
                touched: dict[Tier, list[PageId]] = {Tier.HBM: [], Tier.DRAM: []}
                ssd_pin, ssd_touch = self.ssd.pin, self.ssd.touch
                for index, entry in enumerate(entries):
                    if entry is None:
                        failed.append(index)
                        continue
                    hbm, dram = entry.hbm, entry.dram
                    if tier_target is not None and (hbm if tier_target is Tier.HBM else dram) is not None:
                        plan.already += 1
                        touched[tier_target].append(pages[index])
                        continue
                    if hbm is not None and tier_target is not Tier.HBM:
                        reads.append((index, pages[index], entry, Tier.HBM, hbm))
                        touched[Tier.HBM].append(pages[index])
                    elif dram is not None:
                        reads.append((index, pages[index], entry, Tier.DRAM, dram))
                        touched[Tier.DRAM].append(pages[index])
                    elif entry.ssd is not None and ssd_pin(entry.ssd.seq) is not None:
                        ssd_touch(entry.ssd.seq)
                        reads.append((index, pages[index], entry, Tier.SSD, entry.ssd))
                    else:
                        failed.append(index)
                        continue
                    entry.pins += 1
                self._defer_touches(Tier.HBM, touched[Tier.HBM])
                self._defer_touches(Tier.DRAM, touched[Tier.DRAM])
                if failed:
                    self.metrics.misses.inc(len(failed))
                if tier_target is None:
                    rows = target.rows  # type: ignore[union-attr]
                    plan.rows = [rows[read[0]] for read in reads]
                elif reads:
                    # Never evict this session's own pages to make room for more of it: what does not
                    # fit (its later layers, as layers run in order) is reported as not loaded.
                    slots = self._allocate(tier_target, len(reads), protect=record.key)
                    if slots is None:
                        room = self._allocatable(tier_target, protect=record.key)
                        slots = self._allocate(tier_target, room, protect=record.key) or []
                        failed.extend(read[0] for read in reads[len(slots):])
                        self._unpin(reads[len(slots):])
                        del reads[len(slots):]
                    plan.rows = slots
            except BaseException:
                self._unpin(plan.reads)  # a half-built plan must not keep its pins
                raise
        return plan

    def _plan_from_dram(self, plan: LayerPlan, pages: list[PageId], entries: list, rows: Sequence[int]) -> bool:
        """The common resume: every page of the layer sits in DRAM and none in HBM. Planned with
        whole-list operations instead of the per-page branches (a third of the cost); False, with
        nothing changed, when the layer needs the general path. Caller holds the lock."""
        if None in entries:
            return False
        slots = [entry.dram for entry in entries]
        if None in slots or any(entry.hbm is not None for entry in entries):
            return False
        for entry in entries:
            entry.pins += 1
        dram = Tier.DRAM
        plan.reads = [(index, page, entry, dram, slot)
                      for index, (page, entry, slot) in enumerate(zip(pages, entries, slots, strict=True))]
        plan.rows = list(rows)
        self._defer_touches(dram, pages)
        return True

    def _defer_touches(self, tier: Tier, pages: list[PageId]) -> None:
        """Record that a load used `pages`; the eviction policy learns it before its next decision.

        Updating an LRU costs ~0.3 us per page, as much as copying it: loads only queue the batch and
        `_apply_touches` replays batches in order. Recency stays exact relative to other touches; a
        page inserted meanwhile may look older than it is by that short window. Bounded."""
        if not pages:
            return
        self._pending_touches.append((tier, pages))
        if len(self._pending_touches) > _MAX_PENDING_TOUCH_BATCHES:
            self._apply_touches()

    def _apply_touches(self) -> None:
        while self._pending_touches:
            tier, pages = self._pending_touches.popleft()
            (self._hbm_policy if tier is Tier.HBM else self._dram_policy).touch_many(pages)

    def _unpin(self, reads: Sequence[PlannedRead]) -> None:
        for _, _, entry, source, where in reads:
            entry.pins -= 1
            if source is Tier.SSD:
                segment = self.ssd.segments.get(where.seq)
                if segment is not None:
                    self.ssd.unpin(segment)

    def _finalize_layer(self, plan: LayerPlan, handle: LayerwiseLoad, record: SessionRecord,
                        target: RowTarget | Tier) -> LayerResult:
        """A layer's copies are done (or failed): unpin, drop bad SSD copies, install promoted pages."""
        reads = plan.reads
        delivered = not plan.skipped and plan.error is None
        failed = list(plan.failed)
        by_tier: dict[Tier, int] = {}
        with self._lock:
            self._inflight -= 1
            self._unpin(reads)
            for position, reason in plan.bad.items():
                _, page, entry, _, location = reads[position]
                self.metrics.load_errors.labels(reason).inc()
                if reason == "checksum":
                    log.warning("KV page failed its checksum on SSD; dropped", layer=plan.layer, segment=location.seq)
                if entry.ssd == location:
                    # A bad copy is never served again: drop it (and the page if it was the last copy).
                    self._drop_copy(page, entry, Tier.SSD, "corrupt")
            if isinstance(target, Tier):
                self._install_promoted(plan, target, record, delivered)
                self._refresh_gauges()
        if delivered:
            for position, (index, _, _, source, _) in enumerate(reads):
                if position in plan.bad:
                    failed.append(index)
                else:
                    by_tier[source] = by_tier.get(source, 0) + 1
            for tier, pages in by_tier.items():
                self.metrics.hits.labels(tier.name).inc(pages)
                self._observe_io(tier, "read", pages, plan.started)
        else:
            failed.extend(read[0] for read in reads)
        if plan.already and isinstance(target, Tier):
            by_tier[target] = by_tier.get(target, 0) + plan.already
        first = handle.first_block
        failed_abs = tuple(sorted(first + i for i in failed))
        loaded = failed_abs[0] - first if failed_abs else handle.num_blocks
        return LayerResult(plan.layer, loaded, failed_abs, by_tier)

    def _after_first_layer(self, plan: LayerPlan, keys: Sequence, later: list[int]) -> None:
        if later and any(read[3] is Tier.SSD for read in plan.reads):
            # fadvise(WILLNEED) blocks while it queues the reads: on its own thread.
            self._readahead_pool.submit(self._readahead, keys, later)

    def _readahead(self, keys: Sequence, layers: list[int]) -> None:
        """Ask the kernel to start reading every SSD-only page of this load now, in file order.

        Lanes then find their pages arriving or arrived instead of each paying a cold read in turn;
        segments hold a save's pages layer-major, so the disk reads the next layers first."""
        with self._lock:
            spans: dict[int, tuple[int, int]] = {}
            get = self._pages.get
            for layer in layers:
                for key in keys:
                    entry = get((key, layer))
                    if entry is None or entry.ssd is None or entry.dram is not None or entry.hbm is not None:
                        continue
                    seq, index = entry.ssd.seq, entry.ssd.index
                    low, high = spans.get(seq, (index, index))
                    spans[seq] = (min(low, index), max(high, index))
            ranges = [(self.ssd.segments[seq], low, high) for seq, (low, high) in spans.items()
                      if seq in self.ssd.segments]
        for segment, low, high in sorted(ranges, key=lambda r: r[0].seq):
            self.ssd.advise_willneed(segment, low, high)

    def _install_promoted(self, plan: LayerPlan, target: Tier, record: SessionRecord, delivered: bool) -> None:
        policy = self._hbm_policy if target is Tier.HBM else self._dram_policy
        unused: list[int] = []
        for position, ((_, page, read_entry, _, _), slot) in enumerate(zip(plan.reads, plan.rows, strict=True)):
            entry = self._pages.get(page)
            held = entry is not None and (entry.hbm if target is Tier.HBM else entry.dram) is not None
            if not delivered or position in plan.bad or entry is not read_entry or held:
                unused.append(slot)
                continue
            if target is Tier.HBM:
                entry.hbm = slot
            else:
                entry.dram = slot
            policy.insert(page, PageMeta(plan.layer, record.key, record.priority))
        (self._hbm_slots if target is Tier.HBM else self._dram_slots).release(unused)

    # ---- capacity ---------------------------------------------------------------------------------

    def _allocatable(self, tier: Tier, protect: SessionKey | None = None) -> int:
        """Slots `tier` could hand out now: free ones plus unpinned pages it could evict."""
        allocator = self._hbm_slots if tier is Tier.HBM else self._dram_slots
        held = (e for e in self._pages.values() if (e.hbm if tier is Tier.HBM else e.dram) is not None)
        return allocator.free + sum(1 for e in held if not e.pins and e.owner != protect)

    def _allocate(self, tier: Tier, count: int, protect: SessionKey | None = None) -> list[int] | None:
        """`count` free slots in `tier`, evicting by its policy if needed; None (nothing changed) if the
        tier cannot make that much room without touching pinned pages."""
        allocator = self._hbm_slots if tier is Tier.HBM else self._dram_slots
        if count == 0:
            return []
        shortfall = count - allocator.free
        if shortfall > 0:
            self._apply_touches()
            policy = self._hbm_policy if tier is Tier.HBM else self._dram_policy
            def evictable(page: object) -> bool:
                entry = self._pages[page]  # type: ignore[index]
                return not entry.pins and entry.owner != protect

            victims = policy.victims(shortfall, evictable)
            if victims is None:
                return None
            for page in victims:
                self._drop_copy(page, self._pages[page], tier, "capacity")  # type: ignore[index]
        return allocator.allocate(count)

    def _drop_copy(self, page: PageId, entry: PageEntry, tier: Tier, reason: str) -> None:
        """Remove one tier's copy of a page; a page left with no copy leaves the directory (counted)."""
        if tier is Tier.HBM and entry.hbm is not None:
            self._hbm_slots.release([entry.hbm])
            self._hbm_policy.remove(page)
            entry.hbm = None
        elif tier is Tier.DRAM and entry.dram is not None:
            self._dram_slots.release([entry.dram])
            self._dram_policy.remove(page)
            entry.dram = None
        elif tier is Tier.SSD and entry.ssd is not None:
            self.ssd.drop_page(entry.ssd)
            entry.ssd = None
        else:
            return
        self.metrics.evictions.labels(tier.name, reason).inc()
        if not entry.tiers() and self._pages.get(page) is entry:
            del self._pages[page]
            if reason != "superseded":
                self.metrics.last_copy_dropped.labels(reason).inc()

    def _forget_segments(self, segments: list[Segment]) -> None:
        """Segments the SSD tier evicted: their pages lose their SSD copy."""
        for segment in segments:
            for index in list(segment.live):
                entry_meta = segment.header.entries[index]
                page = (entry_meta.block_key, entry_meta.layer)
                entry = self._pages.get(page)
                if entry is not None and entry.ssd == SsdLocation(segment.seq, index):
                    entry.ssd = None
                    self.metrics.evictions.labels(Tier.SSD.name, "capacity").inc()
                    if not entry.tiers():
                        del self._pages[page]
                        self.metrics.last_copy_dropped.labels("capacity").inc()

    def _rebuild_index(self) -> None:
        pages, damaged = self.ssd.rebuild()
        self.metrics.segments_damaged.inc(damaged)
        for page, location, checksum in pages:
            entry = self._pages.get(page)
            if entry is not None and entry.ssd is not None:
                self.ssd.drop_page(entry.ssd)  # an older copy; the newest segment wins
            self._pages[page] = PageEntry(checksum, ("", ""), Priority.NORMAL, ssd=location)
        if pages or damaged:
            log.info("KV index rebuilt from SSD", pages=len(self._pages), segments=len(self.ssd.segments),
                     damaged_segments=damaged, directory=str(self.ssd.directory))
        self._refresh_gauges()

    # ---- metrics and life cycle -------------------------------------------------------------------

    def _observe_io(self, tier: Tier, direction: str, pages: int, started: float) -> None:
        self.metrics.io_bytes.labels(tier.name, direction).inc(pages * self.geometry.page_bytes)
        self.metrics.io_seconds.labels(tier.name, direction).observe(time.perf_counter() - started)

    def _tier_pages(self) -> dict[Tier, int]:
        return {Tier.HBM: self._hbm_slots.num_slots - self._hbm_slots.free,
                Tier.DRAM: self._dram_slots.num_slots - self._dram_slots.free,
                Tier.SSD: sum(len(s.live) for s in self.ssd.segments.values())}

    def _refresh_gauges(self) -> dict[Tier, int]:
        pages = self._tier_pages()
        for tier, count in pages.items():
            self.metrics.tier_pages.labels(tier.name).set(count)
        # SSD bytes are what its files occupy (headers and superseded pages included), not pages x size.
        held_bytes = {Tier.HBM: pages[Tier.HBM] * self.geometry.page_bytes,
                      Tier.DRAM: pages[Tier.DRAM] * self.geometry.page_bytes, Tier.SSD: self.ssd.used_bytes}
        for tier, nbytes in held_bytes.items():
            self.metrics.tier_bytes.labels(tier.name).set(nbytes)
        return pages

    def stats(self) -> dict[str, int]:
        with self._lock:
            pages = self._refresh_gauges()
            return {
                "pages": len(self._pages),
                "sessions": len(self._sessions),
                "hbm_pages": pages[Tier.HBM],
                "dram_pages": pages[Tier.DRAM],
                "ssd_pages": pages[Tier.SSD],
                "ssd_bytes": self.ssd.used_bytes,
                "write_queue": len(self._write_queue),
            }

    def close(self, flush_timeout: float = 30.0) -> None:
        """Finish pending writes (so every saved page is on SSD), then free the arena."""
        self.flush(flush_timeout)
        with self._lock:
            self._closed = True
            self._writer_wake.notify_all()
        self._writer.join(timeout=flush_timeout)
        self._io.shutdown(wait=True)
        self._readahead_pool.shutdown(wait=True)
        self.dram.close()
        self.hbm.close()

