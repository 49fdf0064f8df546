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
import contextlib
import itertools
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from node_manager.kv.block_index import BlockIndex
from node_manager.kv.directory import NO_COPY, PageDirectory, SessionKey
from node_manager.kv.eviction import EvictionPolicy, PageMeta, PriorityLRUPolicy, TopTierYieldPolicy
from node_manager.kv.loader import (
    LayerPlan,
    LayerResult,
    LayerwiseLoad,
    RowTarget,
    StripedLoad,
    copy_lanes,
)
from node_manager.kv.memory_load import MemoryLoad, PreparedDramLoad
from node_manager.kv.metrics import KVMetrics
from node_manager.kv.pages import PageId, Priority, Tier, run_checksums
from node_manager.kv.segments import SegmentEntry
from node_manager.kv.slots import DevicePool, DramArena, SlotAllocator, consecutive_runs, copy_rows
from node_manager.kv.ssd_load import BadPage, PreparedSsdLoad, SsdLoad
from node_manager.kv.ssd_tier import Segment, SsdFullError, SsdLocation, SsdTier
from node_manager.kv.tiers import ArenaTier, SegmentTier, SlotTier
from symphony.kv_addressing import (
    FINGERPRINT_BYTES,
    BlockKey,
    ModelFingerprint,
    SessionBlocks,
    chain_after,
    tail_key,
    tenant_root,
    token_array,
)
from symphony.kv_geometry import KVGeometry
from symphony.logs import get_logger

log = get_logger("node_manager.kv.store")

# Bounds the deferred recency updates: replaying them costs ~0.3 us per page, paid by the next
# eviction (or the load that overflows the bound), so this caps that pause at ~20 ms.
_MAX_PENDING_TOUCH_PAGES = 65_536
TouchBatch = tuple[Tier, tuple[BlockKey, ...], tuple[int, ...]]  # pages (key, layer) for keys x layers
WritePending = tuple[BlockKey, int, int]  # (block key, layer, directory row) owed an SSD copy


class KVStoreError(Exception):
    """Base of the store's client-facing errors."""


class SessionNotFound(KVStoreError):
    pass


class HistoryChanged(KVStoreError):
    """The session's stored history no longer has the block a caller addressed (another request
    registered a different history under the same session id)."""


class InvalidRequest(KVStoreError):
    pass


class ModelMismatch(KVStoreError):
    """Pages asked for, or offered, under another model's fingerprint than the store's."""


class StoreBusy(KVStoreError):
    """Too much I/O already in flight; the caller should retry later (or recompute)."""


@dataclass(frozen=True)
class StoreConfig:
    hbm_bytes: int
    dram_bytes: int
    ssd_bytes: int
    ssd_dir: Path
    arena_name: str
    model: ModelFingerprint  # whose KV the store holds: keys hang off it, segments carry it
    device: str = "cpu"
    io_threads: int = 2
    max_inflight_jobs: int = 256  # queued + running layer jobs and save copies
    segment_max_bytes: int = 8 * 1024 * 1024
    ssd_writers: int = 2
    max_sessions: int = 100_000
    max_session_tokens: int = 1_048_576
    # How long the write-behind may hold off while a foreground transfer (a peer pull) runs.
    write_behind_max_delay_s: float = 0.5
    ssd_keep_other_models: bool = False  # keep other models' segments on disk, unloaded (`SsdTier`)

    def validate(self) -> None:
        if not 0 <= self.hbm_bytes <= self.dram_bytes <= self.ssd_bytes:
            raise ValueError(
                "KV tier capacities must satisfy 0 <= hbm_bytes <= dram_bytes <= ssd_bytes "
                f"(got {self.hbm_bytes}, {self.dram_bytes}, {self.ssd_bytes})"
            )
        for name in (
            "io_threads",
            "max_inflight_jobs",
            "segment_max_bytes",
            "ssd_writers",
            "max_sessions",
            "max_session_tokens",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"KV store: {name} must be positive")
        if self.write_behind_max_delay_s < 0:
            raise ValueError("KV store: write_behind_max_delay_s must be >= 0")
        if len(self.model) != FINGERPRINT_BYTES:
            raise ValueError(f"KV store: a model fingerprint is {FINGERPRINT_BYTES} bytes, got {len(self.model)}")


@dataclass(slots=True)
class SessionRecord:
    key: SessionKey
    token_ids: np.ndarray  # read-only uint32 (`token_array`)
    blocks: SessionBlocks
    priority: Priority


@dataclass(slots=True)
class PageReservation:
    """DRAM slots set aside for pages of one layer that a caller fills itself (a peer's stream read
    straight into the arena): slot `slots[i]` will hold block `keys[i]`. Invisible to loads and
    eviction until committed; a reservation must end in `commit_pages` or `release_pages`."""

    record: SessionRecord
    layer: int
    keys: list[BlockKey]
    slots: list[int]


@dataclass(slots=True)
class VerifiedPages:
    """A reservation's pages after their checksums were taken: the ones to install, and the slots
    of those that failed the check (to give back)."""

    record: SessionRecord
    layer: int
    keys: list[BlockKey]
    slots: list[int]
    checksums: list[int]
    rejected_slots: list[int]


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
    def __init__(self, geometry: KVGeometry, config: StoreConfig, metrics: KVMetrics | None = None) -> None:
        config.validate()
        self.geometry = geometry
        self.config = config
        self.metrics = metrics or KVMetrics()
        self._lock = threading.RLock()
        self._sessions: OrderedDict[SessionKey, SessionRecord] = OrderedDict()
        self._directory = PageDirectory(geometry.num_layers)
        self.hbm: SlotTier = DevicePool(geometry, config.hbm_bytes, config.device)
        self.dram: ArenaTier = DramArena(
            config.arena_name, geometry, config.dram_bytes, pin_for_cuda=config.device != "cpu"
        )
        # The arena's pages are page-aligned, so the write-behind may use O_DIRECT straight from them.
        self.ssd: SegmentTier = SsdTier(
            config.ssd_dir,
            geometry.page_bytes,
            config.ssd_bytes,
            config.model,
            direct_io=True,
            keep_other_models=config.ssd_keep_other_models,
        )
        # Blocks complete in some tier, for the connector to look up without asking (block_index). A
        # complete block has a page per layer, so the tiers' pages bound how many there can be.
        total_pages = (config.hbm_bytes + config.dram_bytes + config.ssd_bytes) // geometry.page_bytes
        self.block_index = BlockIndex(f"{config.arena_name}-blocks", total_pages // geometry.num_layers + 1)
        self._hbm_slots = SlotAllocator(self.hbm.num_slots)
        self._dram_slots = SlotAllocator(self.dram.num_slots)
        self._hbm_policy: EvictionPolicy = TopTierYieldPolicy(self._session_blocks)
        self._dram_policy: EvictionPolicy = PriorityLRUPolicy()
        self._io = copy_lanes(config.io_threads)  # saves, and the stripes of every load
        self._readahead_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-readahead")
        self._inflight = 0
        self._pending_touches: OrderedDict[TouchBatch, None] = OrderedDict()
        self._pending_touch_pages = 0
        self._write_queue: deque[PageId] = deque()
        self._writer_wake = threading.Condition(self._lock)
        self._writes_in_progress = 0
        self._foreground_transfers = 0
        self._writers_held = 0  # write-behind threads in `_yield_to_foreground` (stats, tests)
        self._flush_waiters = 0
        self._ssd_degraded = False
        self._closed = False
        # Looked up once: a labelled child costs a lock and a dict lookup, on every layer of a load.
        self._hits = {tier: self.metrics.hits.labels(tier.name) for tier in Tier}
        self._io_metrics = {
            (tier, direction): (
                self.metrics.io_bytes.labels(tier.name, direction),
                self.metrics.io_seconds.labels(tier.name, direction),
            )
            for tier in Tier
            for direction in ("read", "write")
        }
        capacities = {Tier.HBM: config.hbm_bytes, Tier.DRAM: config.dram_bytes, Tier.SSD: config.ssd_bytes}
        for tier, capacity in capacities.items():
            self.metrics.tier_capacity.labels(tier.name).set(capacity)
        self._rebuild_index()
        # More than one writer keeps the device busy while another segment waits on its fsync: one
        # writer left it idle between segments and persisted a 47 MB save at about half the speed of
        # one plain write + fsync of the same bytes.
        self._writers = [
            threading.Thread(target=self._write_behind_loop, name=f"kv-write-behind-{i}", daemon=True)
            for i in range(config.ssd_writers)
        ]
        for writer in self._writers:
            writer.start()

    @property
    def model(self) -> ModelFingerprint:
        return self.config.model

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

    # ---- sessions ---------------------------------------------------------------------------------

    def put_session(
        self, tenant: str, session_id: str, token_ids: Sequence[int], priority: Priority | None = None
    ) -> SessionRecord:
        """Register a session's token history (or extend it). A history that does not extend the
        stored one (an edited conversation) replaces it; its keys are recomputed."""
        if not tenant or not session_id:
            raise InvalidRequest("tenant and session_id must be non-empty")
        if len(token_ids) > self.config.max_session_tokens:
            raise InvalidRequest(
                f"{len(token_ids)} tokens exceed kv.max_session_tokens ({self.config.max_session_tokens})"
            )
        key = (tenant, session_id)
        try:
            tokens = token_array(token_ids)
        except (ValueError, OverflowError, TypeError) as exc:
            raise InvalidRequest(f"bad token ids: {exc}") from None
        with self._lock:
            record = self._sessions.get(key)
        blocks = chain_after(
            self.config.model,
            tenant,
            tokens,
            self.geometry.block_size,
            record.token_ids if record else None,
            record.blocks if record else None,
        )
        with self._lock:
            old = self._sessions.get(key)
            new_priority = priority if priority is not None else (old.priority if old else Priority.NORMAL)
            record = SessionRecord(key, tokens, blocks, new_priority)
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

    def addresses(
        self,
        tenant: str,
        session_id: str,
        first_block: int,
        count: int,
        last_key: BlockKey | None,
        tail_tokens: int = 0,
    ) -> bool:
        """Whether the registered history has blocks first_block.. (the last a partial one of
        `tail_tokens` tokens, if given), the last of them keyed `last_key` if given: a load can be
        served. False for an unknown session or another history."""
        with self._lock:
            record = self._sessions.get((tenant, session_id))
        if record is None:
            return False
        try:
            self._check_range(record, 0, first_block, count, tail_tokens)
            addressed_keys(record, first_block, count, last_key, tail_tokens)
        except (InvalidRequest, HistoryChanged):
            return False
        return True

    def set_priority(self, tenant: str, session_id: str, priority: Priority) -> None:
        with self._lock:
            record = self.session(tenant, session_id)
            record.priority = priority
            self._reprioritize(record)

    def _reprioritize(self, record: SessionRecord) -> None:
        d = self._directory
        for key in record.blocks.block_keys:
            row = d.row(key)
            if row is None:
                continue
            d.priority[row] = record.priority
            for layer in range(self.geometry.num_layers):
                meta = PageMeta(layer, d.owners[row], record.priority)
                if d.hbm[row, layer] >= 0:
                    self._hbm_policy.insert((key, layer), meta)
                if d.dram[row, layer] >= 0:
                    self._dram_policy.insert((key, layer), meta)

    def _session_blocks(self, key: object) -> int:
        record = self._sessions.get(key)  # type: ignore[arg-type]
        return record.blocks.num_blocks if record else 0

    def residency(self, tenant: str, session_id: str) -> dict[Tier, list[list[bool]]]:
        """tier -> per layer, per block: whether that tier holds the page."""
        with self._lock:
            record = self.session(tenant, session_id)
            d = self._directory
            ids = d.rows(record.blocks.block_keys)
            tables = {Tier.HBM: d.hbm, Tier.DRAM: d.dram, Tier.SSD: d.ssd_seq}
            return {tier: d.held_matrix(ids, table).T.tolist() for tier, table in tables.items()}

    def loadable_prefix_blocks(self, tenant: str, session_id: str) -> int:
        """Leading blocks some tier holds in every layer: what a load delivers without recompute."""
        with self._lock:
            record = self.session(tenant, session_id)
            d = self._directory
            ids = d.rows(record.blocks.block_keys)
            unknown = np.flatnonzero(ids < 0)
            known = ids[: unknown[0]] if len(unknown) else ids  # the prefix ends at the first unknown block
            complete = d.complete_rows(known)
            return int(np.argmin(complete)) if not complete.all() else len(known)

    def loadable_tail_tokens(self, tenant: str, session_id: str) -> int:
        """Tokens of the session's partial last block (a finished turn's tail, `tail_key`) that some
        tier holds in every layer, when every full block before it is loadable too; 0 otherwise."""
        with self._lock:
            record = self.session(tenant, session_id)
            blocks = record.blocks
            if not blocks.tail_tokens or self.loadable_prefix_blocks(tenant, session_id) < blocks.num_blocks:
                return 0
            key = addressed_keys(record, blocks.num_blocks, 1, None, len(blocks.tail_tokens))[0]
            row = self._directory.row(key)
            held = row is not None and bool(self._directory.complete_rows(np.array([row]))[0])
            return len(blocks.tail_tokens) if held else 0

    def demote(self, tenant: str, session_id: str, tier: Tier) -> int:
        """Drop the session's copies in `tier` (HBM or DRAM) that the SSD tier also holds, and return
        how many pages were dropped. Pinned pages (under I/O or held by a load) and pages with no SSD
        copy stay: demoting frees the tier, it never loses KV. An operator frees DRAM for other
        sessions this way; benchmarks use it to leave a history on SSD only."""
        if tier is Tier.SSD:
            raise InvalidRequest("only HBM and DRAM copies can be demoted (SSD is the last tier)")
        dropped = 0
        with self._lock:
            record = self.session(tenant, session_id)
            d = self._directory
            table = d.slots(tier)
            for key in record.blocks.block_keys:
                row = d.row(key)
                if row is None:
                    continue
                for layer in range(self.geometry.num_layers):
                    if table[row, layer] >= 0 and not d.pins[row, layer] and d.ssd_location(row, layer) is not None:
                        self._drop_copy(key, layer, tier, "demoted")
                        dropped += 1
            self._refresh_gauges()
        return dropped

    def dram_slots(self, tenant: str, session_id: str) -> list[list[int]]:
        """Per layer, per block: the DRAM arena slot holding the page, or -1."""
        with self._lock:
            record = self.session(tenant, session_id)
            d = self._directory
            ids = d.rows(record.blocks.block_keys)
            return d.lookup(d.dram, ids).T.tolist()

    def page_checksums(self, tenant: str, session_id: str, first_block: int, count: int) -> np.ndarray:
        """[count, layers] uint64: the checksum on record for page (first_block + i, layer), 0 where no
        tier holds it. A sender labels the pages it loads with these instead of hashing them again;
        a page replaced in between fails the receiver's check rather than passing with stale bytes."""
        with self._lock:
            record = self.session(tenant, session_id)
            self._check_range(record, 0, first_block, count)
            d = self._directory
            ids = d.rows(record.blocks.block_keys[first_block : first_block + count])
            out = np.zeros((count, self.geometry.num_layers), np.uint64)
            known = ids >= 0
            out[known] = d.checksum[ids[known]]
            return out

    @contextlib.contextmanager
    def pinned_dram_pages(
        self, tenant: str, session_id: str, first_block: int, count: int
    ) -> Iterator[tuple[np.ndarray, np.ndarray] | None]:
        """(slots, checksums), each [count, layers], when DRAM holds every page of blocks
        first_block..first_block + count - 1. The pages stay pinned (neither evicted nor replaced)
        until the block exits, so a sender can write them from the arena without copying them out
        first. None, with nothing pinned, when some page is elsewhere: the caller loads instead.
        A block that exits normally counts as a DRAM read of every page."""
        d = self._directory
        started = time.perf_counter()
        with self._lock:
            record = self.session(tenant, session_id)
            self._check_range(record, 0, first_block, count)
            keys = record.blocks.block_keys[first_block : first_block + count]
            ids = d.rows(keys)
            slots = d.dram[ids] if len(ids) and ids.min() >= 0 else None
            if slots is None or slots.min() < 0:
                held = None
            else:
                d.pins[ids] += 1
                held = slots, d.checksum[ids]
                self._defer_touches(Tier.DRAM, tuple(keys), tuple(range(self.geometry.num_layers)))
        try:
            yield held
            if held is not None:
                self._observe_io(Tier.DRAM, "read", held[0].size, started)
        finally:
            if held is not None:
                with self._lock:
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
        d = self._directory
        with self._lock:
            record = self.session(tenant, session_id)
            self._check_range(record, 0, first_block, count, tail_tokens)
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
                self._defer_touches(Tier.DRAM, tuple(keys), tuple(int(layer) for layer in columns))
            if record_reads and (complete or not whole):
                self._hits[Tier.DRAM].inc(int(held.sum()))
                self.metrics.misses.inc(int((~held).sum()))
        return DramPin(ids[rows], columns[cols], slots, complete)

    def unpin_dram(self, pin: DramPin) -> None:
        with self._lock:
            if pin.released:
                return
            pin.released = True
            np.subtract.at(self._directory.pins, (pin.rows, pin.layers), 1)

    def pinned_pages(self) -> int:
        """Pages with I/O in progress (loads, or a write-behind still owed): 0 once the store is idle."""
        with self._lock:
            return self._directory.pinned_pages()

    # ---- saves ------------------------------------------------------------------------------------

    def save_layer(
        self,
        tenant: str,
        session_id: str,
        layer: int,
        first_block: int,
        pages: torch.Tensor,
        expected_checksums: Sequence[int] | None = None,
        tail_tokens: int = 0,
    ) -> concurrent.futures.Future[int]:
        """Save `pages` ([n, page_words] int64, any device) as blocks first_block.. of `layer`.

        Never blocks: the copy into DRAM runs on an I/O thread and the write to SSD behind it. The
        future gives the number of pages kept; `pages` must stay unchanged until it resolves. When
        the store is saturated the save degrades (counted in symphony_kv_save_degraded_total)
        rather than making the caller wait. With `expected_checksums` (pages from a peer), a page
        whose copy in DRAM does not match is not kept: the check runs on the bytes the store keeps,
        and costs no extra pass because every save checksums its pages anyway. `tail_tokens`: the
        last page is a partial block (`addressed_keys`)."""
        record = self.session(tenant, session_id)
        self._check_range(record, layer, first_block, pages.shape[0] if pages.dim() else -1, tail_tokens)
        if pages.dim() != 2 or pages.shape[1] != self.geometry.page_words or pages.dtype != torch.int64:
            raise InvalidRequest(
                f"pages must be int64 [n, {self.geometry.page_words}], got {pages.dtype} {list(pages.shape)}"
            )
        if expected_checksums is not None and len(expected_checksums) != pages.shape[0]:
            raise InvalidRequest(f"{len(expected_checksums)} checksums for {pages.shape[0]} pages")
        keys = addressed_keys(record, first_block, pages.shape[0], None, tail_tokens)
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        if not self._admit_jobs(1):
            self.metrics.save_degraded.labels("io_backpressure").inc(len(keys))
            future.set_result(0)
            return future
        job = self._io.submit(self._save_pages, record, layer, list(keys), pages, expected_checksums)
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

    def _check_range(
        self, record: SessionRecord, layer: int, first_block: int, count: int, tail_tokens: int = 0
    ) -> None:
        if not 0 <= layer < self.geometry.num_layers:
            raise InvalidRequest(f"layer {layer} outside 0..{self.geometry.num_layers - 1}")
        partial = 1 if tail_tokens else 0  # a partial last block may follow the full ones
        if first_block < 0 or count < 0 or first_block + count > record.blocks.num_blocks + partial:
            raise InvalidRequest(
                f"blocks {first_block}..{first_block + count - 1} outside the session's "
                f"{record.blocks.num_blocks} full blocks"
            )

    def _save_pages(
        self, record: SessionRecord, layer: int, keys: list, pages: torch.Tensor, expected: Sequence[int] | None
    ) -> int:
        reservation = self._reserve(record, layer, keys)
        if reservation is None:
            return 0
        started = time.perf_counter()
        copy_rows(self.dram.pages, reservation.slots, pages.to("cpu"), list(range(len(keys))))
        self._observe_io(Tier.DRAM, "write", len(keys), started)
        return self.commit_pages(reservation, expected)

    def reserve_pages(
        self,
        tenant: str,
        session_id: str,
        layer: int,
        first_block: int,
        count: int,
        last_key: BlockKey | None = None,
        tail_tokens: int = 0,
    ) -> PageReservation | None:
        """DRAM slots for blocks first_block.. of `layer`, to be filled through `reserved_views` and
        then committed; None if DRAM has no room (counted as a degraded save). `last_key`,
        `tail_tokens`: see `addressed_keys`."""
        record = self.session(tenant, session_id)
        self._check_range(record, layer, first_block, count, tail_tokens)
        return self._reserve(record, layer, list(addressed_keys(record, first_block, count, last_key, tail_tokens)))

    def _reserve(self, record: SessionRecord, layer: int, keys: list[BlockKey]) -> PageReservation | None:
        with self._lock:
            slots = self._allocate(Tier.DRAM, len(keys))
        if slots is None:
            self.metrics.save_degraded.labels("dram_full").inc(len(keys))
            return None
        return PageReservation(record, layer, keys, slots)

    def reserved_views(self, reservation: PageReservation) -> list[memoryview]:
        """Writable byte views covering the reserved slots in page order, one per run of consecutive
        slots (usually one: fresh slots come off the free stack in order)."""
        slots = reservation.slots
        return [self.dram.run_view(slots[start], stop - start) for start, stop in consecutive_runs(slots)]

    def reserved_checksums(self, reservation: PageReservation, first: int, data: memoryview) -> list[int]:
        """The checksums of the reservation's pages first, first + 1, ... given their bytes back to
        back: for a receiver that checksums pages the moment they land, still in the CPU cache."""
        page_bytes = self.geometry.page_bytes
        return run_checksums(
            reservation.keys[first : first + len(data) // page_bytes], reservation.layer, data, page_bytes
        )

    def commit_pages(self, reservation: PageReservation, expected: Sequence[int] | None = None) -> int:
        """Checksum the reserved pages as they sit in DRAM and install them; with `expected`, a page
        whose checksum differs is dropped instead (counted). Returns the pages kept."""
        return self.commit_many([(reservation, expected)])

    def commit_many(self, batch: Sequence[tuple[PageReservation, Sequence[int] | None]]) -> int:
        """`commit_pages` for several reservations at once, under one lock: the layers of one block
        range go into the directory together, a few whole-array operations instead of a few per
        layer (a peer stream and the connector's saves commit a session's 30 layers this way).
        Raises before installing anything (every reservation still held) if a list of expected
        checksums has the wrong length: `verify_reserved` checks each before any is installed."""
        return self.install_verified([self.verify_reserved(reservation, expected) for reservation, expected in batch])

    def install_verified(self, verified: Sequence[VerifiedPages]) -> int:
        """Install pages `verify_reserved` checked (and give back the slots of those that failed):
        one lock, and the layers of one block range go into the directory together. Returns the
        pages kept."""
        with self._lock:
            for pages in verified:
                if pages.rejected_slots:
                    self._dram_slots.release(pages.rejected_slots)
            for group in _same_blocks(verified):
                first = group[0]
                self._install_saved(
                    first.keys,
                    [pages.layer for pages in group],
                    np.array([pages.slots for pages in group], np.int64),
                    np.array([pages.checksums for pages in group], np.uint64),
                    first.record,
                )
            self._writer_wake.notify_all()  # the writer, not only a waiting flush
        return sum(len(pages.keys) for pages in verified)

    def verify_reserved(
        self, reservation: PageReservation, expected: Sequence[int] | None, actual: list[int] | None = None
    ) -> VerifiedPages:
        """Checksum a reservation's pages as they sit in DRAM, the first step of a commit (then
        `install_verified`); with `expected`, the pages whose checksum differs are set apart
        (counted). `actual`: the pages' checksums, if the caller took them as the bytes arrived
        (`reserved_checksums`). Takes no lock: the slots are the caller's until installed or released."""
        keys, slots, layer = reservation.keys, reservation.slots, reservation.layer
        if expected is not None and len(expected) != len(keys):
            raise InvalidRequest(f"{len(expected)} checksums for {len(keys)} pages")
        if actual is not None and len(actual) != len(keys):
            raise InvalidRequest(f"{len(actual)} computed checksums for {len(keys)} pages")
        checksums = actual if actual is not None else self._reserved_checksums_in_dram(reservation)
        if expected is None or checksums == list(expected):
            return VerifiedPages(reservation.record, layer, keys, slots, checksums, [])
        bad = {i for i, (got, want) in enumerate(zip(checksums, expected, strict=True)) if got != want}
        self.metrics.save_degraded.labels("checksum_mismatch").inc(len(bad))
        keep = [i for i in range(len(keys)) if i not in bad]
        return VerifiedPages(
            reservation.record,
            layer,
            [keys[i] for i in keep],
            [slots[i] for i in keep],
            [checksums[i] for i in keep],
            [slots[i] for i in sorted(bad)],
        )

    def _reserved_checksums_in_dram(self, reservation: PageReservation) -> list[int]:
        """The reservation's page checksums as its pages sit in DRAM, a run of consecutive slots at a time."""
        checksums: list[int] = []
        for view in self.reserved_views(reservation):
            checksums += self.reserved_checksums(reservation, len(checksums), view)
        return checksums

    def release_pages(self, reservation: PageReservation) -> None:
        """Give back the slots of a reservation that will not be committed."""
        with self._lock:
            self._dram_slots.release(reservation.slots)

    def _install_saved(
        self, keys: list[BlockKey], layers: list[int], slots: np.ndarray, checksums: np.ndarray, record: SessionRecord
    ) -> None:
        """Give saved pages their DRAM copies: slot `slots[j, i]` holds page (keys[i], layers[j]).
        Pages no tier holds yet, a new turn's blocks being the common save, are installed with
        whole-array operations over all the layers; if some tier holds any of them, each layer's
        pages are settled one by one first (`_keep_saved_copy`). Caller holds the lock."""
        d = self._directory
        ids = d.rows(keys)
        known = ids[ids >= 0]
        if len(known) and any(d.held_rows(known, layer).any() for layer in layers):
            for j, layer in enumerate(layers):
                self._install_layer_over_copies(keys, layer, slots[j].tolist(), checksums[j].tolist(), record)
            return
        self._install_new(keys, layers, slots, checksums, record)

    def _install_layer_over_copies(
        self, keys: list[BlockKey], layer: int, slots: list[int], checksums: list[int], record: SessionRecord
    ) -> None:
        d = self._directory
        ids = d.rows(keys)
        known = np.flatnonzero(ids >= 0)
        held = known[d.held_rows(ids[known], layer)].tolist() if len(known) else []
        dropped = {i for i in held if not self._keep_saved_copy(keys[i], layer, slots[i], checksums[i])}
        kept = [i for i in range(len(keys)) if i not in dropped]
        self._install_new(
            [keys[i] for i in kept],
            [layer],
            np.array([[slots[i] for i in kept]], np.int64),
            np.array([[checksums[i] for i in kept]], np.uint64),
            record,
        )

    def _install_new(
        self, keys: list[BlockKey], layers: list[int], slots: np.ndarray, checksums: np.ndarray, record: SessionRecord
    ) -> None:
        """Install pages that no tier holds (see `_install_saved`). Caller holds the lock."""
        d = self._directory
        rows = d.rows(keys)  # looked up now: settling copies may have released a row
        for at in np.flatnonzero(rows < 0).tolist():  # blocks new to the directory
            rows[at] = d.ensure_row(keys[at], record.key, record.priority)
        cells = np.ix_(rows, layers)
        d.checksum[cells] = checksums.T
        d.dram[cells] = slots.T
        d.priority[rows] = record.priority
        owed = (d.ssd_seq[cells] < 0) & ~d.persisting[cells]  # [block, layer]
        d.persisting[cells] |= owed
        d.pins[cells] += owed  # held in DRAM until the write-behind has it on SSD
        owners = d.owners
        for row in rows.tolist():
            owners[row] = record.key
        for j, layer in enumerate(layers):  # layer order: the write-behind persists early layers first
            pages = list(zip(keys, itertools.repeat(layer)))
            self._dram_policy.insert_many(pages, PageMeta(layer, record.key, record.priority))
            self._write_queue.extend(itertools.compress(pages, owed[:, j].tolist()))
        self._publish_complete(rows)

    def _keep_saved_copy(self, key: BlockKey, layer: int, slot: int, checksum: int) -> bool:
        """A saved page that some tier already holds: True if its new DRAM copy should be installed
        (copies with other bytes dropped first), False if the slot went back unused."""
        d = self._directory
        row = d.row(key)
        assert row is not None
        same = int(d.checksum[row, layer]) == checksum
        if same and d.dram[row, layer] >= 0:
            self._dram_slots.release([slot])  # identical bytes already cached
            self._defer_touches(Tier.DRAM, (key,), (layer,))
            return False
        if not same and d.pins[row, layer]:
            # Different bytes for a page under I/O: keep the copy being read or persisted intact.
            self._dram_slots.release([slot])
            self.metrics.save_degraded.labels("page_busy").inc()
            return False
        if not same:
            # New bytes under the same key: engines are deterministic per key, so this is rare (a
            # different model or dtype); the newest copy wins everywhere.
            for tier in Tier:
                self._drop_copy(key, layer, tier, "superseded")
        return True

    # ---- write-behind -----------------------------------------------------------------------------

    def _write_behind_loop(self) -> None:
        max_pages = max(1, self.config.segment_max_bytes // self.geometry.page_bytes)
        d = self._directory
        while True:
            with self._lock:
                while not self._write_queue and not self._closed:
                    self._writer_wake.wait()
                if self._closed and not self._write_queue:
                    return
                self._yield_to_foreground()
                batch: list[WritePending] = []
                while self._write_queue and len(batch) < max_pages:
                    key, layer = self._write_queue.popleft()
                    row = d.row(key)
                    if row is not None and d.persisting[row, layer]:
                        batch.append((key, layer, row))
                self._writes_in_progress += 1
            try:
                if batch:
                    self._persist(batch)
            finally:
                with self._lock:
                    self._writes_in_progress -= 1
                    self._writer_wake.notify_all()

    def _yield_to_foreground(self) -> None:
        """Hold the next segment write while a foreground transfer runs. Persisting competes for CPU
        and memory bandwidth with the transfer a request is waiting on (measured on a 2-core host: a
        peer pull ran at about half speed beside it), and the SSD copy is a backstop, not on any
        request's path. Bounded: never longer than write_behind_max_delay_s, never while a flush
        waits, never once a quarter of DRAM waits to be persisted. Caller holds the lock."""
        deadline = time.monotonic() + self.config.write_behind_max_delay_s
        high_water = max(1, self.dram.num_slots // 4)
        self._writers_held += 1  # a count: each write-behind thread holds off on its own
        try:
            while (
                self._foreground_transfers
                and not self._flush_waiters
                and not self._closed
                and len(self._write_queue) < high_water
            ):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._writer_wake.wait(remaining)
        finally:
            self._writers_held -= 1

    @contextlib.contextmanager
    def foreground_transfer(self) -> Iterator[None]:
        """Mark a latency-critical transfer (a peer pull) in progress: the write-behind yields to it."""
        with self._lock:
            self._foreground_transfers += 1
        try:
            yield
        finally:
            with self._lock:
                self._foreground_transfers -= 1
                self._writer_wake.notify_all()

    def _persist(self, batch: list[WritePending]) -> None:
        # The persisting pin keeps each page's row, checksum and DRAM copy in place until the end.
        # The batch's pages are distinct, so its bookkeeping runs as whole-array operations: the
        # lock is shared with the saves this write trails.
        d = self._directory
        nbytes = self.ssd.segment_bytes(len(batch))
        rows = np.fromiter((row for _, _, row in batch), np.int64, len(batch))
        layers = np.fromiter((layer for _, layer, _ in batch), np.int64, len(batch))
        with self._lock:
            checksums = d.checksum[rows, layers]
            slots = d.dram[rows, layers]
        entries = [
            SegmentEntry(key, layer, checksum)
            for (key, layer, _), checksum in zip(batch, checksums.tolist(), strict=True)
        ]
        # One buffer per run of consecutive slots (a save's slots mostly are): fewer, longer writes.
        views = [self.dram.run_view(int(slots[start]), stop - start) for start, stop in consecutive_runs(slots)]
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
            d.persisting[rows, layers] = False
            d.pins[rows, layers] -= 1
            keys = d.keys
            # A page replaced while it was written (another key on its row, other bytes) keeps no SSD copy.
            current = d.checksum[rows, layers] == checksums
            current &= np.fromiter((keys[row] == key for key, _, row in batch), np.bool_, len(batch))
            written = np.flatnonzero(current)
            d.ssd_seq[rows[written], layers[written]] = seq
            d.ssd_page[rows[written], layers[written]] = written
            for index in np.flatnonzero(~current).tolist():
                self.ssd.drop_page(SsdLocation(seq, index))
            if self._ssd_degraded:
                self._ssd_degraded = False
                log.info("KV saves reach SSD again", segment=segment.path.name)
            self._refresh_gauges()

    def _degrade_persist(self, batch: list[WritePending], reason: str, exc: BaseException) -> None:
        self.metrics.save_degraded.labels(reason).inc(len(batch))
        d = self._directory
        with self._lock:
            for _, layer, row in batch:
                d.persisting[row, layer] = False
                d.pins[row, layer] -= 1
            if not self._ssd_degraded:
                self._ssd_degraded = True  # one line per degraded episode, not one per batch
                log.warning(
                    "KV saves stay in DRAM only: the SSD tier refused a write",
                    reason=reason,
                    error=str(exc),
                    directory=str(self.ssd.directory),
                )

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every page saved so far has been written to SSD (or degraded). True if drained."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._flush_waiters += 1
            self._writer_wake.notify_all()  # a write-behind holding off for a transfer goes now
            try:
                while self._write_queue or self._writes_in_progress or self._inflight:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    self._writer_wake.wait(min(remaining, 0.05))
                return True
            finally:
                self._flush_waiters -= 1

    @property
    def ssd_degraded(self) -> bool:
        return self._ssd_degraded

    # ---- loads ------------------------------------------------------------------------------------

    def load(
        self,
        tenant: str,
        session_id: str,
        first_block: int = 0,
        num_blocks: int | None = None,
        target: RowTarget | Tier = Tier.HBM,
        layers: Sequence[int] | None = None,
        last_key: BlockKey | None = None,
        tail_tokens: int = 0,
    ) -> LayerwiseLoad:
        """Bring blocks [first_block, first_block + num_blocks) of every layer into `target`, layer by
        layer from whichever tier holds each page (fastest first). Returns at once; per-layer futures
        report what arrived. With a tier target this is a promotion (prefetch); pages already there
        count as loaded. `last_key`, `tail_tokens`: see `addressed_keys`."""
        record = self.session(tenant, session_id)
        count = record.blocks.num_blocks - first_block if num_blocks is None else num_blocks
        self._check_range(record, 0, first_block, count, tail_tokens)
        rows, plain_rows = None, False
        if isinstance(target, RowTarget):
            if len(target.rows) != count or len(target.tensors) != self.geometry.num_layers:
                raise InvalidRequest("row target needs one tensor per layer and one row per block")
            rows, plain_rows = self._target_rows(target)
        elif target not in (Tier.HBM, Tier.DRAM):
            raise InvalidRequest(f"cannot load into {target.name}")
        order = list(range(self.geometry.num_layers)) if layers is None else list(layers)
        if layers is not None and (
            len(set(order)) != len(order) or not all(0 <= layer < self.geometry.num_layers for layer in order)
        ):
            raise InvalidRequest(f"layers must be distinct and within 0..{self.geometry.num_layers - 1}")
        keys = addressed_keys(record, first_block, count, last_key, tail_tokens)
        handle = LayerwiseLoad(self.geometry.num_layers, first_block, count)
        if not self._admit_jobs(len(order)):
            raise StoreBusy("too many KV transfers in flight; retry or recompute")
        if len(order) < self.geometry.num_layers:
            for layer in set(range(self.geometry.num_layers)).difference(order):
                handle._finish(layer, LayerResult(layer, 0, ()))
        if not order:
            return handle
        prepared, prepared_ssd = None, None
        if rows is not None:
            with self._lock:
                prepared = self._plan_load_from_dram(keys, order, target, rows, plain_rows)  # type: ignore[arg-type]
                if prepared is None and plain_rows:
                    prepared_ssd = self._plan_load_from_ssd(keys, order, target, rows)  # type: ignore[arg-type]
        if prepared is not None:
            MemoryLoad(
                handle,
                prepared,
                self.dram.pages,
                self._io,
                self.config.io_threads,
                on_copied=lambda copied: self._release_prepared(prepared, copied),
            ).start()
            return handle
        if prepared_ssd is not None:
            SsdLoad(
                handle,
                prepared_ssd,
                self.ssd,
                self._io,
                self.config.io_threads,
                self.geometry.page_bytes,
                after_first=lambda: self._readahead_pool.submit(self._readahead, keys, order[1:]),
                on_read=lambda read, bad: self._release_ssd_load(prepared_ssd, read, bad),
            ).start()
            return handle
        run = StripedLoad(
            handle,
            order,
            self._io,
            self.config.io_threads,
            {Tier.HBM: self.hbm.pages, Tier.DRAM: self.dram.pages},
            self.ssd,
            self.geometry.page_words,
            plan=lambda layer: self._plan_layer(handle, record, layer, keys, target, rows),
            finalize=lambda plan: self._finalize_layer(plan, handle, record, target),
            after_first=lambda plan: self._after_first_layer(plan, keys, order[1:]),
        )
        run.start()
        return handle

    def _target_rows(self, target: RowTarget) -> tuple[np.ndarray, bool]:
        """The destination rows, checked against every destination tensor: loads copy into them by
        address, so a row outside a tensor would write over memory that is not the caller's. Also
        whether every tensor is plain CPU memory laid out row by row (copied into by raw address).
        One pass, reading each attribute once: this runs on every load, ~30 tensors."""
        rows = np.asarray(target.rows, dtype=np.int64)
        words = self.geometry.page_words
        height, plain = None, True
        for tensor in target.tensors:
            shape = tensor.shape
            if tensor.dtype is not torch.int64 or len(shape) != 2 or shape[1] != words:
                raise InvalidRequest(f"row target tensors must be [rows, {words}] int64")
            height = shape[0] if height is None else min(height, shape[0])
            plain = plain and tensor.is_cpu and tensor.stride() == (words, 1)
        if len(rows) and (height is None or int(rows.min()) < 0 or int(rows.max()) >= height):
            raise InvalidRequest(f"row target rows must lie within 0..{(height or 0) - 1}")
        return rows, plain

    def _plan_layer(
        self,
        handle: LayerwiseLoad,
        record: SessionRecord,
        layer: int,
        keys: Sequence[BlockKey],
        target: RowTarget | Tier,
        rows: np.ndarray | None,
    ) -> LayerPlan:
        """Decide where each page of `layer` comes from and pin it (bookkeeping only, under the lock),
        with whole-array operations over the load's blocks: this runs once per layer of every load."""
        tier_target = target if isinstance(target, Tier) else None
        if tier_target is None:
            dest = target.tensors[layer]  # type: ignore[union-attr]
        else:
            dest = self.hbm.pages if tier_target is Tier.HBM else self.dram.pages
        plan = LayerPlan(layer, dest, keys)
        if handle.cancelled:
            plan.failed = list(range(len(keys)))
            plan.skipped = True
            return plan
        with self._lock:
            ids = self._directory.rows(keys)  # looked up per layer: a row unpinned meanwhile may be reused
            try:
                self._plan_general(plan, ids, tier_target, rows, record)
            except BaseException:
                self._unpin(plan)  # a half-built plan must not keep its pins
                raise
        return plan

    def _whole_load_rows(
        self, keys: Sequence[BlockKey], order: list[int]
    ) -> tuple[np.ndarray, slice | np.ndarray] | None:
        """For a load planned as a whole: the directory row of each key and the columns of its
        layers, or None if some key has no row. Every layer in order (the usual load) selects whole
        rows, with no column gather."""
        ids = self._directory.rows(keys)
        if not len(ids) or ids.min() < 0:
            return None
        return ids, slice(None) if order == list(range(self.geometry.num_layers)) else np.asarray(order)

    def _pin_whole_load(self, ids: np.ndarray, order: list[int], delta: int) -> None:
        """Take (+1) or release (-1) the pins of a load planned as a whole: whole rows when every
        layer comes, in any order. Caller holds the lock."""
        if len(order) == self.geometry.num_layers:
            self._directory.pins[ids] += delta
        else:
            self._directory.pins[np.ix_(ids, order)] += delta

    def _plan_load_from_dram(
        self, keys: Sequence[BlockKey], order: list[int], target: RowTarget, rows: np.ndarray, plain_rows: bool
    ) -> PreparedDramLoad | None:
        """The common resume: every page the load wants sits in DRAM and none in HBM. Planned and
        pinned for all layers at once, so the lanes spend their time copying, not in Python holding
        the GIL the other lane needs (per-layer planning and finishing cost more than the copies).
        None, with nothing changed, when some page needs the general path. Caller holds the lock."""
        d = self._directory
        found = self._whole_load_rows(keys, order)
        if found is None:
            return None
        ids, columns = found
        slots = d.dram[ids][:, columns]
        if slots.min() < 0 or d.hbm[ids][:, columns].max() >= 0:
            return None
        self._pin_whole_load(ids, order, 1)
        # Saves take consecutive slots for a layer's blocks, so most layers are one run.
        rows_consecutive = bool((np.diff(rows) == 1).all())
        consecutive = ((np.diff(slots, axis=0) == 1).all(axis=0) & rows_consecutive).tolist()
        self._defer_touches(Tier.DRAM, tuple(keys), tuple(order))
        return PreparedDramLoad(keys, target.tensors, order, ids, slots, rows, consecutive, plain_rows)

    def _release_prepared(self, prepared: PreparedDramLoad, copied_layers: int) -> None:
        """Every layer of a load planned as a whole is copied (or skipped): metrics for the load as
        one I/O batch, then its pins and in-flight slots released."""
        pages = copied_layers * len(prepared.block_rows)
        if pages:
            self._hits[Tier.DRAM].inc(pages)
            self._observe_io(Tier.DRAM, "read", pages, prepared.started)
        with self._lock:
            self._pin_whole_load(prepared.block_rows, prepared.order, -1)
            self._inflight -= len(prepared.order)

    def _plan_load_from_ssd(
        self, keys: Sequence[BlockKey], order: list[int], target: RowTarget, rows: np.ndarray
    ) -> PreparedSsdLoad | None:
        """A cold load: every page the load wants sits on SSD and in no faster tier; only for
        destinations of plain CPU rows (`_target_rows`). Planned and pinned for all layers at once,
        as `_plan_load_from_dram` is; None, with nothing changed, when some page needs the general
        path (a copy in a faster tier, a page missing). Caller holds the lock."""
        d = self._directory
        found = self._whole_load_rows(keys, order)
        if found is None:
            return None
        ids, columns = found
        seqs = d.ssd_seq[ids][:, columns]
        if seqs.min() < 0 or d.dram[ids][:, columns].max() >= 0 or d.hbm[ids][:, columns].max() >= 0:
            return None
        segments: dict[int, Segment] = {}
        for seq in sorted(set(seqs.ravel().tolist())):
            segment = self.ssd.pin(seq)
            if segment is None:  # not on disk any more: let the general path report those pages
                for pinned in segments.values():
                    self.ssd.unpin(pinned)
                return None
            segments[seq] = segment
            self.ssd.touch(seq)
        self._pin_whole_load(ids, order, 1)
        return PreparedSsdLoad(
            keys,
            target.tensors,
            order,
            ids,
            seqs,
            d.ssd_page[ids][:, columns],
            d.checksum[ids][:, columns],
            rows,
            segments,
        )

    def _release_ssd_load(self, prepared: PreparedSsdLoad, pages_read: int, bad: list[BadPage]) -> None:
        """Every layer of a load planned as a whole is read (or skipped): metrics for the load as one
        I/O batch, bad copies dropped (never served again), then its pins released."""
        if pages_read:
            self._hits[Tier.SSD].inc(pages_read)
            self._observe_io(Tier.SSD, "read", pages_read, prepared.started)
        with self._lock:
            self._pin_whole_load(prepared.block_rows, prepared.order, -1)
            for segment in prepared.segments.values():
                self.ssd.unpin(segment)
            for page in bad:  # as `_finalize_layer` does: unpinned first, then dropped
                self._drop_bad_ssd_copy(
                    prepared.keys[page.block],
                    int(prepared.block_rows[page.block]),
                    prepared.order[page.position],
                    int(prepared.seqs[page.block, page.position]),
                    int(prepared.pages[page.block, page.position]),
                    page.reason,
                )
            self._inflight -= len(prepared.order)

    def _drop_bad_ssd_copy(self, key: BlockKey, row: int, layer: int, seq: int, index: int, reason: str) -> None:
        """A page read from segment `seq`, entry `index`, failed ("checksum" or "io_error"): counted, and
        that copy is never served again: dropped (and the page, if it was the last copy), unless the
        page has moved to another copy since. Caller holds the lock, the page unpinned."""
        self.metrics.load_errors.labels(reason).inc()
        if reason == "checksum":
            log.warning("KV page failed its checksum on SSD; dropped", layer=layer, segment=seq)
        d = self._directory
        if d.keys[row] == key and d.ssd_seq[row, layer] == seq and d.ssd_page[row, layer] == index:
            self._drop_copy(key, layer, Tier.SSD, "corrupt")

    def _plan_general(
        self, plan: LayerPlan, ids: np.ndarray, tier_target: Tier | None, rows: np.ndarray | None, record: SessionRecord
    ) -> None:
        """Any mix of sources, a tier target, missing pages. Each page comes from the fastest tier
        holding it (never from the tier it is being promoted into). Caller holds the lock."""
        d, layer, keys = self._directory, plan.layer, plan.keys
        hbm, dram, seq = (d.lookup(table, ids, layer) for table in (d.hbm, d.dram, d.ssd_seq))
        if tier_target is None:
            already = np.zeros(len(ids), np.bool_)
        else:
            already = (hbm if tier_target is Tier.HBM else dram) >= 0
        from_hbm = (hbm >= 0) & ~already
        from_dram = (dram >= 0) & ~already & ~from_hbm
        from_ssd = (seq >= 0) & ~already & ~from_hbm & ~from_dram
        # sorted(set()), not np.unique: that imports numpy.ma (~9 ms) on its first call, in a load
        for segment_seq in sorted(set(seq[from_ssd].tolist())):
            segment = self.ssd.pin(segment_seq)
            if segment is None:  # evicted meanwhile: those pages are not on SSD any more
                from_ssd &= seq != segment_seq
                continue
            plan.segments.append(segment)
            self.ssd.touch(segment_seq)
        index = np.flatnonzero(from_hbm | from_dram | from_ssd)
        block_rows = ids[index]
        d.pins[block_rows, layer] += 1  # rows are distinct: chained keys never repeat in a session
        plan.block_rows = block_rows
        plan.index = index
        plan.source = np.where(from_hbm, Tier.HBM, np.where(from_dram, Tier.DRAM, Tier.SSD))[index]
        plan.where = np.where(from_hbm, hbm, np.where(from_dram, dram, seq))[index]
        plan.ssd_page = d.ssd_page[block_rows, layer]
        plan.checksums = d.checksum[block_rows, layer]
        if len(index) and not from_ssd.any() and (from_hbm.all() or from_dram.all()):
            plan.only = Tier.HBM if from_hbm.any() else Tier.DRAM
        plan.failed = np.flatnonzero(~(already | from_hbm | from_dram | from_ssd)).tolist()
        plan.already = int(np.count_nonzero(already))
        for tier, used in ((tier_target, already), (Tier.HBM, from_hbm), (Tier.DRAM, from_dram)):
            if tier is not None and used.any():
                self._defer_touches(tier, tuple(keys[i] for i in np.flatnonzero(used).tolist()), (layer,))
        if plan.failed:
            self.metrics.misses.inc(len(plan.failed))
        if rows is not None:
            plan.rows = rows[index]
        elif plan.reads:
            self._allocate_promotion(plan, tier_target, record)  # type: ignore[arg-type]

    def _allocate_promotion(self, plan: LayerPlan, target: Tier, record: SessionRecord) -> None:
        """Slots in `target` for the plan's reads. Never evicts this session's own pages to make room
        for more of it: what does not fit (its later layers, as layers run in order) is reported as
        not loaded."""
        slots = self._allocate(target, plan.reads, protect=record.key)
        if slots is None:
            room = self._allocatable(target, protect=record.key)
            slots = self._allocate(target, room, protect=record.key) or []
            kept = len(slots)
            plan.failed.extend(plan.index[kept:].tolist())
            self._directory.pins[plan.block_rows[kept:], plan.layer] -= 1
            plan.keep_reads(kept)
        plan.rows = np.asarray(slots, dtype=np.int64)

    def _defer_touches(self, tier: Tier, keys: tuple[BlockKey, ...], layers: tuple[int, ...]) -> None:
        """Record that a load used pages (key, layer) for every key and layer given; the eviction
        policy learns it before its next decision.

        Updating an LRU costs ~0.3 us per page, as much as copying it: loads only queue the batch and
        `_apply_touches` replays batches in order. A batch repeated (the same session resumed again)
        only moves to the back, as only a page's last use orders it. Recency stays exact relative to
        other touches; a page inserted meanwhile may look older than it is by that short window."""
        if not keys:
            return
        batch = (tier, keys, layers)
        if batch in self._pending_touches:
            self._pending_touches.move_to_end(batch)
            return
        self._pending_touches[batch] = None
        self._pending_touch_pages += len(keys) * len(layers)
        if self._pending_touch_pages > _MAX_PENDING_TOUCH_PAGES:
            self._apply_touches()

    def _apply_touches(self) -> None:
        while self._pending_touches:
            (tier, keys, layers), _ = self._pending_touches.popitem(last=False)
            policy = self._hbm_policy if tier is Tier.HBM else self._dram_policy
            policy.touch_many([(key, layer) for layer in layers for key in keys])
        self._pending_touch_pages = 0

    def _unpin(self, plan: LayerPlan) -> None:
        self._directory.pins[plan.block_rows, plan.layer] -= 1
        for segment in plan.segments:
            self.ssd.unpin(segment)
        plan.segments = []

    def _finalize_layer(
        self, plan: LayerPlan, handle: LayerwiseLoad, record: SessionRecord, target: RowTarget | Tier
    ) -> LayerResult:
        """A layer's copies are done (or failed): unpin, drop bad SSD copies, install promoted pages."""
        delivered = not plan.skipped and plan.error is None
        failed = list(plan.failed)
        with self._lock:
            self._inflight -= 1
            if isinstance(target, Tier):
                self._install_promoted(plan, target, record, delivered)  # before unpinning: rows stay put
            self._unpin(plan)
            for position, reason in plan.bad.items():
                self._drop_bad_ssd_copy(
                    plan.keys[plan.index[position]],
                    int(plan.block_rows[position]),
                    plan.layer,
                    int(plan.where[position]),
                    int(plan.ssd_page[position]),
                    reason,
                )
            if isinstance(target, Tier):
                self._refresh_gauges()
        by_tier: dict[Tier, int] = {}
        if delivered:
            sources = plan.source
            if plan.bad:
                bad = list(plan.bad)
                failed.extend(plan.index[bad].tolist())
                sources = np.delete(sources, bad)
            for tier, pages in enumerate(np.bincount(sources, minlength=len(Tier) + 1).tolist()):
                if pages:
                    by_tier[Tier(tier)] = pages
                    self._hits[Tier(tier)].inc(pages)
                    self._observe_io(Tier(tier), "read", pages, plan.started)
        else:
            failed.extend(plan.index.tolist())
        if plan.already and isinstance(target, Tier):
            by_tier[target] = by_tier.get(target, 0) + plan.already
        first = handle.first_block
        failed_abs = tuple(sorted(first + i for i in failed))
        loaded = failed_abs[0] - first if failed_abs else handle.num_blocks
        return LayerResult(plan.layer, loaded, failed_abs, by_tier)

    def _after_first_layer(self, plan: LayerPlan, keys: Sequence[BlockKey], later: list[int]) -> None:
        if later and (plan.source == Tier.SSD).any():
            # fadvise(WILLNEED) blocks while it queues the reads: on its own thread.
            self._readahead_pool.submit(self._readahead, keys, later)

    def _readahead(self, keys: Sequence[BlockKey], layers: list[int]) -> None:
        """Ask the kernel to start reading every SSD-only page of this load now, in file order.

        Lanes then find their pages arriving or arrived instead of each paying a cold read in turn;
        segments hold a save's pages layer-major, so the disk reads the next layers first."""
        d = self._directory
        with self._lock:
            ids = d.rows(keys)
            ids = ids[ids >= 0]
            seqs, pages = d.ssd_seq[ids][:, layers], d.ssd_page[ids][:, layers]
            ssd_only = (seqs >= 0) & (d.dram[ids][:, layers] < 0) & (d.hbm[ids][:, layers] < 0)
            seqs, pages = seqs[ssd_only], pages[ssd_only]
            ranges = []
            for seq in sorted(set(seqs.tolist())):
                segment = self.ssd.segments.get(seq)
                if segment is not None:
                    in_segment = pages[seqs == seq]
                    ranges.append((segment, int(in_segment.min()), int(in_segment.max())))
        for segment, low, high in sorted(ranges, key=lambda r: r[0].seq):
            self.ssd.advise_willneed(segment, low, high)

    def _install_promoted(self, plan: LayerPlan, target: Tier, record: SessionRecord, delivered: bool) -> None:
        """Give the promoted copies their slots; a slot whose read failed, or whose page changed or
        gained a copy there meanwhile, goes back. Caller holds the lock, plan still pinned."""
        d, layer = self._directory, plan.layer
        policy = self._hbm_policy if target is Tier.HBM else self._dram_policy
        table = d.slots(target)
        unused: list[int] = []
        for position, (index, row, slot, checksum) in enumerate(
            zip(plan.index.tolist(), plan.block_rows.tolist(), plan.rows.tolist(), plan.checksums.tolist(), strict=True)
        ):
            key = plan.keys[index]
            if (
                not delivered
                or position in plan.bad
                or d.keys[row] != key
                or table[row, layer] >= 0
                or int(d.checksum[row, layer]) != checksum
            ):
                unused.append(slot)
                continue
            table[row, layer] = slot
            policy.insert((key, layer), PageMeta(layer, record.key, record.priority))
        (self._hbm_slots if target is Tier.HBM else self._dram_slots).release(unused)

    # ---- capacity ---------------------------------------------------------------------------------

    def _allocatable(self, tier: Tier, protect: SessionKey | None = None) -> int:
        """Slots `tier` could hand out now: free ones plus unpinned pages it could evict."""
        d = self._directory
        allocator = self._hbm_slots if tier is Tier.HBM else self._dram_slots
        evictable = (d.slots(tier) >= 0) & (d.pins == 0)
        protected = [row for row, owner in enumerate(d.owners) if owner == protect]
        return allocator.free + int(np.count_nonzero(evictable)) - int(np.count_nonzero(evictable[protected]))

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
            d = self._directory

            def evictable(page: object) -> bool:
                key, layer = page  # type: ignore[misc]
                row = d.row(key)
                return row is not None and not d.pins[row, layer] and d.owners[row] != protect

            victims = policy.victims(shortfall, evictable)
            if victims is None:
                return None
            for key, layer in victims:  # type: ignore[misc]
                self._drop_copy(key, layer, tier, "capacity")
        return allocator.allocate(count)

    def _drop_copy(self, key: BlockKey, layer: int, tier: Tier, reason: str) -> None:
        """Remove one tier's copy of a page; a page left with no copy leaves the directory (counted)."""
        d = self._directory
        row = d.row(key)
        if row is None:
            return
        if tier is Tier.SSD:
            location = d.ssd_location(row, layer)
            if location is None:
                return
            self.ssd.drop_page(location)
            d.set_ssd(row, layer, None)
        else:
            table = d.slots(tier)
            slot = int(table[row, layer])
            if slot < 0:
                return
            (self._hbm_slots if tier is Tier.HBM else self._dram_slots).release([slot])
            (self._hbm_policy if tier is Tier.HBM else self._dram_policy).remove((key, layer))
            table[row, layer] = NO_COPY
        self.metrics.evictions.labels(tier.name, reason).inc()
        self._after_copy_dropped(row, layer, reason)

    def _after_copy_dropped(self, row: int, layer: int, reason: str) -> None:
        d = self._directory
        if d.held(row, layer):
            return
        self.block_index.discard(d.keys[row])  # type: ignore[arg-type]
        if reason != "superseded":
            self.metrics.last_copy_dropped.labels(reason).inc()
        d.release_if_empty(row)

    def _forget_segments(self, segments: list[Segment]) -> None:
        """Segments the SSD tier evicted: their pages lose their SSD copy."""
        d = self._directory
        for segment in segments:
            for index in list(segment.live):
                entry_meta = segment.header.entries[index]
                row = d.row(entry_meta.block_key)
                layer = entry_meta.layer
                if row is not None and d.ssd_location(row, layer) == SsdLocation(segment.seq, index):
                    d.set_ssd(row, layer, None)
                    self.metrics.evictions.labels(Tier.SSD.name, "capacity").inc()
                    self._after_copy_dropped(row, layer, "capacity")

    def _rebuild_index(self) -> None:
        report = self.ssd.rebuild()
        pages, damaged = report.pages, report.damaged
        self.metrics.segments_damaged.inc(damaged)
        other = sum(report.other_models.values())
        self.metrics.segments_other_model.labels("kept" if report.kept_other_models else "dropped").inc(other)
        d = self._directory
        for (key, layer), location, checksum in pages:
            row = d.ensure_row(key)
            older = d.ssd_location(row, layer)
            if older is not None:
                self.ssd.drop_page(older)  # an older copy; the newest segment wins
            d.set_ssd(row, layer, location)
            d.checksum[row, layer] = checksum
        self._publish_complete(np.arange(len(d.keys))[[key is not None for key in d.keys]])
        if pages or damaged:
            log.info(
                "KV index rebuilt from SSD",
                pages=d.pages_held(),
                segments=len(self.ssd.segments),
                damaged_segments=damaged,
                directory=str(self.ssd.directory),
            )
        self._refresh_gauges()

    def _publish_complete(self, rows: np.ndarray) -> None:
        """Put the blocks of `rows` that some tier now holds in every layer into the block index.
        Caller holds the lock. (Blocks leave it in `_after_copy_dropped`, when a page loses its
        last copy.)"""
        d = self._directory
        keys = d.keys
        self.block_index.add(keys[row] for row in rows[d.complete_rows(rows)].tolist())  # type: ignore[misc]

    # ---- metrics and life cycle -------------------------------------------------------------------

    def _observe_io(self, tier: Tier, direction: str, pages: int, started: float) -> None:
        nbytes, seconds = self._io_metrics[tier, direction]
        nbytes.inc(pages * self.geometry.page_bytes)
        seconds.observe(time.perf_counter() - started)

    def _tier_pages(self) -> dict[Tier, int]:
        return {
            Tier.HBM: self._hbm_slots.num_slots - self._hbm_slots.free,
            Tier.DRAM: self._dram_slots.num_slots - self._dram_slots.free,
            Tier.SSD: sum(len(s.live) for s in self.ssd.segments.values()),
        }

    def _refresh_gauges(self) -> dict[Tier, int]:
        pages = self._tier_pages()
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
        with self._lock:
            pages = self._refresh_gauges()
            return {
                "pages": self._directory.pages_held(),
                "sessions": len(self._sessions),
                "hbm_pages": pages[Tier.HBM],
                "dram_pages": pages[Tier.DRAM],
                "ssd_pages": pages[Tier.SSD],
                "ssd_bytes": self.ssd.used_bytes,
                "write_queue": len(self._write_queue),
                "write_behind_held": int(self._writers_held > 0),
            }

    def close(self, flush_timeout: float = 30.0) -> None:
        """Finish pending writes (so every saved page is on SSD), then free the arena."""
        self.flush(flush_timeout)
        with self._lock:
            self._closed = True
            self._writer_wake.notify_all()
        for writer in self._writers:
            writer.join(timeout=flush_timeout)
        self._io.shutdown(wait=True)
        self._readahead_pool.shutdown(wait=True)
        self.dram.close()
        self.hbm.close()
        self.block_index.close()


def addressed_keys(
    record: SessionRecord, first_block: int, count: int, last_key: BlockKey | None, tail_tokens: int = 0
) -> tuple[BlockKey, ...]:
    """The keys of blocks first_block.. of the session's history. With `last_key`, the caller's key
    for the last of them: keys are chained, so one equal key means every block before it is the
    same content too, and a history re-registered with other tokens in the meantime raises
    HistoryChanged instead of serving or storing another history's pages under this one.

    `tail_tokens` > 0: the last block is a partial one, its first `tail_tokens` tokens only (a
    turn that ended mid-block, `tail_key`). Its key comes from the registered tokens, so a caller
    can address the partial tail of an earlier turn whose history this one continues, never a
    tail of tokens the session does not hold."""
    if tail_tokens:
        block_size = record.blocks.block_size
        last = first_block + count - 1
        start = last * block_size
        if (
            not 0 < tail_tokens < block_size
            or count < 1
            or last > record.blocks.num_blocks
            or start + tail_tokens > len(record.token_ids)
        ):
            raise InvalidRequest(f"no partial block of {tail_tokens} tokens at block {last} of the session")
        parent = record.blocks.block_keys[last - 1] if last else tenant_root(record.blocks.model, record.blocks.tenant)
        keys = (
            *record.blocks.block_keys[first_block:last],
            tail_key(parent, record.token_ids[start : start + tail_tokens]),
        )
    else:
        keys = record.blocks.block_keys[first_block : first_block + count]
    if last_key is not None and keys and keys[-1] != last_key:
        raise HistoryChanged(f"session {record.key[1]!r} holds another history at block {first_block + count - 1}")
    return keys


def _same_blocks(verified: Sequence[VerifiedPages]) -> Iterator[list[VerifiedPages]]:
    """Runs of verified pages for the same blocks of one session in distinct layers: each run is
    installed as one [block, layer] array."""
    group: list[VerifiedPages] = []
    for pages in verified:
        if group and (
            pages.record is not group[0].record
            or pages.keys != group[0].keys
            or any(pages.layer == other.layer for other in group)
        ):
            yield group
            group = []
        group.append(pages)
    if group:
        yield group
