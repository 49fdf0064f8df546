"""TieredStore: one node's KV pages across HBM, DRAM and SSD, with a layer-wise async load/save API.

Bookkeeping (sessions, the page directory, slot allocation, eviction choices) happens under one
lock and never does I/O; copies and file I/O run on a bounded pool of I/O threads with the pages
involved pinned, so eviction skips them instead of waiting. Saves land in the DRAM arena and are
written behind to SSD, so a persistent copy of every saved page exists unless the SSD tier degrades
(counted, logged once). A copy in a tier above SSD can always be dropped without loss.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from node_manager.kv.eviction import EvictionPolicy, PageMeta, PriorityLRUPolicy, TopTierYieldPolicy
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


@dataclass(frozen=True, slots=True)
class LayerResult:
    layer: int
    loaded: int  # blocks now in the destination, counted from the load's first block
    failed: tuple[int, ...]  # block indexes (session-relative) that could not be loaded
    by_tier: dict[Tier, int] = field(default_factory=dict)


class LayerwiseLoad:
    """Per-layer readiness of one load. Layer l's future resolves only after layers < l, so a consumer
    may run layer 0 while later layers are still arriving."""

    def __init__(self, num_layers: int, first_block: int, num_blocks: int) -> None:
        self.first_block = first_block
        self.num_blocks = num_blocks
        self.layers: list[concurrent.futures.Future[LayerResult]] = [concurrent.futures.Future()
                                                                     for _ in range(num_layers)]
        self._finished: dict[int, LayerResult | BaseException] = {}
        self._next = 0
        self._delivering = False
        self._lock = threading.Lock()
        self.cancelled = False

    def layer_ready(self, layer: int) -> concurrent.futures.Future[LayerResult]:
        return self.layers[layer]

    async def wait_layer(self, layer: int) -> LayerResult:
        return await asyncio.wrap_future(self.layers[layer])

    def wait_all(self, timeout: float | None = None) -> list[LayerResult]:
        return [f.result(timeout) for f in self.layers]

    def cancel(self) -> None:
        """Layers not started yet are skipped (reported as failed)."""
        self.cancelled = True

    def _finish(self, layer: int, outcome: LayerResult | BaseException) -> None:
        # One thread delivers at a time, in layer order: a thread that finds another delivering only
        # queues its result, so layer l+1 can never resolve before layer l (futures run callbacks).
        with self._lock:
            self._finished[layer] = outcome
            if self._delivering:
                return
            self._delivering = True
        while True:
            with self._lock:
                if self._next not in self._finished:
                    self._delivering = False
                    return
                future, result = self.layers[self._next], self._finished.pop(self._next)
                self._next += 1
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)


@dataclass(frozen=True, slots=True)
class RowTarget:
    """Load into caller-owned tensors: `tensors[layer]` is `[rows, page_words]` int64 (a view of the
    engine's paged KV, for instance) and block `first_block + i` lands in row `rows[i]`."""

    tensors: Sequence[torch.Tensor]
    rows: Sequence[int]


@dataclass(slots=True)
class _Read:
    index: int  # position in the load's block range
    page: PageId
    entry: PageEntry
    source: Tier
    slot: int | None = None
    location: SsdLocation | None = None


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
        self._io = concurrent.futures.ThreadPoolExecutor(config.io_threads, thread_name_prefix="kv-io")
        self._readahead_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-readahead")
        self._inflight = 0
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
            self._dram_policy.touch(page)
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
        if order:
            # The first layer runs alone; only then are the others started (and, from SSD, read
            # ahead), so the disk serves the layer a consumer waits on first instead of queueing it
            # behind the rest of the session.
            self._submit_layer(handle, record, order[0], keys, target, order[1:])
        return handle

    def _submit_layer(self, handle: LayerwiseLoad, record: SessionRecord, layer: int, keys: Sequence,
                      target: RowTarget | Tier, then: list[int] | None = None) -> None:
        job = self._io.submit(self._load_layer, handle, record, layer, keys, target)
        job.add_done_callback(lambda done: self._layer_done(handle, layer, done, (record, keys, target, then)))

    def _readahead(self, keys: Sequence, layers: list[int]) -> None:
        """Ask the kernel to start reading every SSD-only page of this load now, in file order.

        Layer jobs then find their pages arriving or arrived instead of each paying a cold read in
        turn; segments hold a save's pages layer-major, so the disk reads layer 0 first."""
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

    def _layer_done(self, handle: LayerwiseLoad, layer: int, done: concurrent.futures.Future[LayerResult],
                    rest: tuple[SessionRecord, Sequence, RowTarget | Tier, list[int] | None]) -> None:
        with self._lock:
            self._inflight -= 1
        exc = done.exception()
        record, keys, target, then = rest
        # Deliver first: the consumer waiting on this layer should not wait for the others to start.
        handle._finish(layer, exc if exc is not None else done.result())
        if then:  # the first layer is done (or failed): start the others, whatever happened to it
            if exc is None and done.result().by_tier.get(Tier.SSD):
                # fadvise(WILLNEED) blocks while it queues the reads: on its own thread.
                self._readahead_pool.submit(self._readahead, keys, then)
            for later in then:
                self._submit_layer(handle, record, later, keys, target)

    def _load_layer(self, handle: LayerwiseLoad, record: SessionRecord, layer: int, keys: Sequence,
                    target: RowTarget | Tier) -> LayerResult:
        first = handle.first_block
        if handle.cancelled:
            return LayerResult(layer, 0, tuple(range(first, first + len(keys))))
        reads, failed, dest_slots, already = self._plan_layer(record, layer, keys, target)
        by_tier: dict[Tier, int] = {}
        try:
            bad = self._copy_layer(layer, reads, target, dest_slots)
        finally:
            with self._lock:
                self._release_reads(reads)
        for read in reads:
            by_tier[read.source] = by_tier.get(read.source, 0) + 1
        with self._lock:
            if isinstance(target, Tier):
                self._install_promoted(layer, reads, bad, target, dest_slots, record)
            failed.extend(read.index for read in reads if read.index in bad)
            if isinstance(target, Tier):
                self._refresh_gauges()
        if already and isinstance(target, Tier):
            by_tier[target] = by_tier.get(target, 0) + already
        failed_abs = tuple(sorted(first + i for i in failed))
        loaded = next((i for i in range(len(keys)) if first + i in failed_abs), len(keys))
        return LayerResult(layer, loaded, failed_abs, by_tier)

    def _plan_layer(self, record: SessionRecord, layer: int, keys: Sequence, target: RowTarget | Tier
                    ) -> tuple[list[_Read], list[int], list[int], int]:
        reads: list[_Read] = []
        failed: list[int] = []
        already = 0
        # The per-page loop is the load path's Python cost (~2,000 pages for a 2,048-token session):
        # lookups are hoisted out of it and the common DRAM hit does the least work.
        get = self._pages.get
        to_hbm, to_dram = target is Tier.HBM, target is Tier.DRAM
        touch_hbm, touch_dram = self._hbm_policy.touch, self._dram_policy.touch
        with self._lock:
            for index, key in enumerate(keys):
                page = (key, layer)
                entry = get(page)
                if entry is None:
                    failed.append(index)
                    continue
                if (to_hbm and entry.hbm is not None) or (to_dram and entry.dram is not None):
                    already += 1
                    (touch_hbm if to_hbm else touch_dram)(page)
                    continue
                if entry.hbm is not None and not to_hbm:
                    touch_hbm(page)
                    read = _Read(index, page, entry, Tier.HBM, slot=entry.hbm)
                elif entry.dram is not None:
                    touch_dram(page)
                    read = _Read(index, page, entry, Tier.DRAM, slot=entry.dram)
                elif entry.ssd is not None and self.ssd.pin(entry.ssd.seq) is not None:
                    self.ssd.touch(entry.ssd.seq)
                    read = _Read(index, page, entry, Tier.SSD, location=entry.ssd)
                else:
                    failed.append(index)
                    continue
                entry.pins += 1
                reads.append(read)
            if failed:
                self.metrics.misses.inc(len(failed))
            dest_slots: list[int] = []
            if isinstance(target, Tier) and reads:
                # Never evict this session's own pages to make room for more of it: what does not
                # fit (its later layers, as layers run in order) is reported as not loaded.
                slots = self._allocate(target, len(reads), protect=record.key)
                if slots is None:
                    room = self._allocatable(target, protect=record.key)
                    slots = self._allocate(target, room, protect=record.key) or []
                    for read in reads[len(slots):]:
                        failed.append(read.index)
                    self._release_reads(reads[len(slots):])
                    del reads[len(slots):]
                dest_slots = slots
        return reads, failed, dest_slots, already

    def _release_reads(self, reads: list[_Read]) -> None:
        for read in reads:
            read.entry.pins -= 1
            if read.location is not None:
                segment = self.ssd.segments.get(read.location.seq)
                if segment is not None:
                    self.ssd.unpin(segment)
            read.location = None

    def _copy_layer(self, layer: int, reads: list[_Read], target: RowTarget | Tier, dest_slots: list[int]) -> set[int]:
        """Do the copies for one layer (no lock held). Returns the indexes whose data failed its check."""
        if isinstance(target, RowTarget):
            dest = target.tensors[layer]
            rows = [target.rows[r.index] for r in reads]
        else:
            dest = self.hbm.pages if target is Tier.HBM else self.dram.pages
            rows = dest_slots
        bad: set[int] = set()
        for source in (Tier.HBM, Tier.DRAM):
            picked = [(i, r) for i, r in enumerate(reads) if r.source is source]
            if not picked:
                continue
            started = time.perf_counter()
            pool = self.hbm.pages if source is Tier.HBM else self.dram.pages
            copy_rows(dest, [rows[i] for i, _ in picked], pool, [r.slot for _, r in picked])  # type: ignore[misc]
            self._observe_io(source, "read", len(picked), started)
            self.metrics.hits.labels(source.name).inc(len(picked))
        ssd_reads = [(i, r) for i, r in enumerate(reads) if r.source is Tier.SSD]
        if ssd_reads:
            bad = self._read_ssd(layer, ssd_reads, dest, rows)
        if dest.device.type == "cuda":
            torch.cuda.current_stream(dest.device).synchronize()
        return bad

    def _read_ssd(self, layer: int, ssd_reads: list[tuple[int, _Read]], dest: torch.Tensor,
                  rows: list[int]) -> set[int]:
        started = time.perf_counter()
        direct = dest.device.type == "cpu" and dest.is_contiguous()
        staging = dest if direct else torch.empty(len(ssd_reads), self.geometry.page_words, dtype=torch.int64,
                                                  pin_memory=dest.device.type == "cuda")
        staging_rows = [rows[i] for i, _ in ssd_reads] if direct else list(range(len(ssd_reads)))
        by_segment: dict[int, list[tuple[int, memoryview]]] = {}
        views: list[memoryview] = []
        for (_, read), row in zip(ssd_reads, staging_rows, strict=True):
            view = memoryview(staging[row].numpy()).cast("B")
            views.append(view)
            assert read.location is not None
            by_segment.setdefault(read.location.seq, []).append((read.location.index, view))
        bad: set[int] = set()
        failed_segments: set[int] = set()
        for seq, segment_reads in by_segment.items():
            segment = self.ssd.segments.get(seq)
            try:
                if segment is None:
                    raise FileNotFoundError(f"segment {seq:x} vanished")
                self.ssd.read_into(segment, segment_reads)
            except OSError as exc:
                log.warning("KV segment read failed", segment=seq, error=str(exc))
                failed_segments.add(seq)
        for (_, read), view in zip(ssd_reads, views, strict=True):
            assert read.location is not None
            if read.location.seq in failed_segments:
                bad.add(read.index)
                self.metrics.load_errors.labels("io_error").inc()
            elif page_checksum(read.page[0], layer, view) != read.entry.checksum:
                bad.add(read.index)
                self.metrics.load_errors.labels("checksum").inc()
                log.warning("KV page failed its checksum on SSD; dropped", layer=layer, segment=read.location.seq)
            else:
                self.metrics.hits.labels(Tier.SSD.name).inc()
        if direct:
            # The read went straight into the caller's rows; a failed row must not keep unverified bytes.
            for k, (_, read) in enumerate(ssd_reads):
                if read.index in bad:
                    staging[staging_rows[k]].zero_()
        else:
            good = [k for k, (_, read) in enumerate(ssd_reads) if read.index not in bad]
            if good:
                copy_rows(dest, [rows[ssd_reads[k][0]] for k in good], staging, good)
        self._observe_io(Tier.SSD, "read", len(ssd_reads), started)
        if bad:
            with self._lock:
                for _, read in ssd_reads:
                    if read.index in bad and read.entry.ssd == read.location:
                        # A bad copy is never served again: drop it (and the page if it was the last copy).
                        self._drop_copy(read.page, read.entry, Tier.SSD, "corrupt")
        return bad

    def _install_promoted(self, layer: int, reads: list[_Read], bad: set[int], target: Tier, slots: list[int],
                          record: SessionRecord) -> None:
        policy = self._hbm_policy if target is Tier.HBM else self._dram_policy
        unused: list[int] = []
        for read, slot in zip(reads, slots, strict=True):
            entry = self._pages.get(read.page)
            held = entry is not None and (entry.hbm if target is Tier.HBM else entry.dram) is not None
            if read.index in bad or entry is not read.entry or held:
                unused.append(slot)
                continue
            if target is Tier.HBM:
                entry.hbm = slot
            else:
                entry.dram = slot
            policy.insert(read.page, PageMeta(layer, record.key, record.priority))
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

