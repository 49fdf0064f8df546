"""Layer-wise loads: the data-movement half of the general load path (`loads`, `load_plan`).

The store decides under its lock what each layer needs (a `LayerPlan`: which pages come from which
tier into which rows, all pinned); this module moves the bytes and delivers layers in order. Every
layer is cut into stripes, one per copy lane, and each lane walks the layers in order doing its
stripe, so a layer is ready as soon as every lane has passed it and both cores copy at once.

Why lanes and not one thread per layer: on CPU, `torch` copies fan out over OpenMP, and a second
thread starting OpenMP regions gives the process two thread teams on two cores; each region then
pays a futex wake-up (docs/design-notes.md#copy-lanes). Lanes run torch single-threaded
(`single_threaded_torch`) and supply the parallelism themselves, which keeps layer copies at memcpy
speed whatever the engine's own threads do.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from node_manager.kv.pages import Tier
from node_manager.kv.slots import copy_rows
from node_manager.kv.ssd_tier import Segment
from node_manager.kv.tiers import SegmentTier
from symphony.kv_addressing import BlockKey
from symphony.logs import get_logger

log = get_logger(__name__)


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
        self.layers: list[concurrent.futures.Future[LayerResult]] = [
            concurrent.futures.Future() for _ in range(num_layers)
        ]
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
        # Layers resolve in order, so the last one resolving means all have: one wake-up, not one per
        # layer (on two cores each wake-up of a waiter takes a core from the copying lanes).
        if self.layers[-1] not in concurrent.futures.wait(self.layers[-1:], timeout).done:
            raise TimeoutError(f"layers not all loaded within {timeout} s")
        return [f.result() for f in self.layers]

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
            try:
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)
            except concurrent.futures.InvalidStateError:
                pass  # the consumer cancelled its wait (a client went away): nothing to tell it


@dataclass(frozen=True, slots=True)
class RowTarget:
    """Load into caller-owned tensors: `tensors[layer]` is `[rows, page_words]` int64 (a view of the
    engine's paged KV, for instance) and block `first_block + i` lands in row `rows[i]`."""

    tensors: Sequence[torch.Tensor]
    rows: Sequence[int]


def _no_reads() -> np.ndarray:
    return np.empty(0, np.int64)


@dataclass(slots=True)
class LayerPlan:
    """One layer of a load, decided under the store lock, as parallel arrays with one entry per read
    (a page to copy): read j is block `index[j]` of the load, comes from tier `source[j]` (slot
    `where[j]` for HBM/DRAM, segment `where[j]` page `ssd_page[j]` for SSD) and lands in
    `dest[rows[j]]`. `block_rows[j]` is its directory row, which holds the page's pin. Arrays, not
    per-page objects: a plan covers ~64 pages and is built under the store lock, where every
    microsecond is paid by every other caller."""

    layer: int
    dest: torch.Tensor
    keys: Sequence[BlockKey] = ()  # the load's block keys, indexed by `index`
    index: np.ndarray = field(default_factory=_no_reads)
    source: np.ndarray = field(default_factory=_no_reads)
    where: np.ndarray = field(default_factory=_no_reads)
    ssd_page: np.ndarray = field(default_factory=_no_reads)
    rows: np.ndarray = field(default_factory=_no_reads)
    block_rows: np.ndarray = field(default_factory=_no_reads)
    checksums: np.ndarray = field(default_factory=_no_reads)
    segments: list[Any] = field(default_factory=list)  # SSD segments pinned for this layer's reads
    only: Tier | None = None  # set when every read comes from this one slot tier (HBM or DRAM)
    failed: list[int] = field(default_factory=list)  # blocks no tier holds (or no room in a tier target)
    already: int = 0  # blocks a tier target held before the load
    started: float = 0.0
    bad: dict[int, str] = field(default_factory=dict)  # read position -> "checksum" | "io_error"
    skipped: bool = False  # cancelled before a lane copied its stripe
    error: BaseException | None = None

    @property
    def reads(self) -> int:
        return len(self.index)

    def keep_reads(self, count: int) -> None:
        """Drop every read after the first `count` (a tier target had no room for them)."""
        for name in ("index", "source", "where", "ssd_page", "rows", "block_rows", "checksums"):
            setattr(self, name, getattr(self, name)[:count])


def row_views(tensor: torch.Tensor, rows: Sequence[int], row_bytes: int) -> list[memoryview]:
    """Byte views of rows of a contiguous CPU tensor, as slices of one view of the whole tensor: a
    view per row through `tensor[row].numpy()` costs ~5 us, a third of a page's read from a warm disk."""
    flat = tensor.numpy().data.cast("B")
    return [flat[row * row_bytes : (row + 1) * row_bytes] for row in rows]


def read_verified_pages(
    ssd: SegmentTier,
    segments: Mapping[int, Segment],
    layer: int,
    keys: Sequence[BlockKey],
    seqs: Sequence[int],
    pages: Sequence[int],
    checksums: Sequence[int],
    views: Sequence[memoryview],
) -> dict[int, str]:
    """Read page i of `layer` (entry `pages[i]` of segment `seqs[i]`) into `views[i]` and check it
    against `checksums[i]` (keyed by `keys[i]`). Returns {i: "io_error" | "checksum"} for the pages
    that failed; their views hold unverified bytes, which the caller must not deliver. A segment's
    adjacent entries are read with one scattered `preadv`."""
    by_segment: dict[int, list[tuple[int, memoryview]]] = {}
    members: dict[int, list[int]] = {}
    for i, (seq, page, view) in enumerate(zip(seqs, pages, views, strict=True)):
        by_segment.setdefault(seq, []).append((page, view))
        members.setdefault(seq, []).append(i)
    bad: dict[int, str] = {}
    tag = ssd.mac.tag
    for seq, reads in by_segment.items():
        segment = segments.get(seq)
        try:
            if segment is None:
                raise FileNotFoundError(f"segment {seq:x} vanished")
            ssd.read_into(segment, reads)
        except OSError as exc:
            log.warning("KV segment read failed", segment=seq, error=str(exc))
            bad.update(dict.fromkeys(members[seq], "io_error"))
    for i, (key, view, expected) in enumerate(zip(keys, views, checksums, strict=True)):
        if i not in bad and tag(key, layer, view) != expected:
            bad[i] = "checksum"
    return bad


def single_threaded_torch() -> None:
    """Thread initializer: torch ops on this thread run without OpenMP (see the module docstring).

    Sets OpenMP's per-thread thread count, not `torch.set_num_threads`, which would also change the
    default for every thread torch initializes later (the engine's included)."""
    torch.get_num_threads()  # let torch initialize this thread's OpenMP state first
    for library in _openmp_libraries():
        library.omp_set_num_threads(1)


@functools.cache
def _openmp_libraries() -> list[ctypes.CDLL]:
    """The OpenMP runtimes this process has loaded (torch ships its own libgomp)."""
    found: list[ctypes.CDLL] = []
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    except OSError:
        return found
    for path in sorted(paths):
        try:
            found.append(ctypes.CDLL(path))
        except OSError:
            continue
    return found


def copy_lanes(count: int) -> concurrent.futures.ThreadPoolExecutor:
    """`count` lane threads, all started now: a pool that spawns its threads on first use would add
    thread start-up (milliseconds) to the first layer of the first loads."""
    lanes = concurrent.futures.ThreadPoolExecutor(
        count, thread_name_prefix="kv-lane", initializer=single_threaded_torch
    )
    started = threading.Barrier(count + 1)
    for _ in range(count):  # each task blocks until all are running, so each gets its own thread
        lanes.submit(started.wait, 30)
    started.wait(30)
    return lanes


class StripedLoad:
    """Runs one load over `stripes` lanes and delivers each layer once every lane has passed it.

    The first layer runs alone: only once it is delivered do the lanes start on the others (and
    SSD read-ahead begins), so the disk serves the layer a consumer waits on first instead of
    queueing it behind the rest of the session. Lanes never wait on each other, so a busy pool
    cannot deadlock. (A load whose every page sits in DRAM takes `memory_load.MemoryLoad` instead.)
    The first lane to reach a layer plans it (`plan(layer)`: the store's bookkeeping, pins taken),
    so planning layer l+1 overlaps the other lane's copy of layer l. `finalize(plan)` is the store's
    bookkeeping for a finished layer (unpin, install, metrics) and returns its result;
    `after_first(plan)` runs once the load's first layer is delivered."""

    def __init__(
        self,
        handle: LayerwiseLoad,
        order: list[int],
        lanes: concurrent.futures.Executor,
        stripes: int,
        pools: dict[Tier, torch.Tensor],
        ssd: SegmentTier,
        page_words: int,
        plan: Callable[[int], LayerPlan],
        finalize: Callable[[LayerPlan], LayerResult],
        after_first: Callable[[LayerPlan], None],
    ) -> None:
        self.handle = handle
        self._lanes = lanes
        self.order = order
        self.stripes = stripes
        self._pools = pools
        self._ssd = ssd
        self._page_words = page_words
        self._plan = plan
        self._finalize = finalize
        self._after_first = after_first
        self._plans: list[LayerPlan | None] = [None] * len(order)
        # A first layer run alone is one stripe: it then waits on one lane's wake-up and one read,
        # not on the slower of two (thread wake-ups here take up to milliseconds).
        self._stripes = [1 if position == 0 else stripes for position in range(len(order))]
        self._remaining = list(self._stripes)
        self._lock = threading.Lock()

    def start(self) -> None:
        self._submit(0, 1)

    def _submit(self, start: int, stop: int) -> None:
        for lane in range(self._stripes[start]):
            try:
                self._lanes.submit(self._run_lane, lane, start, stop)
            except RuntimeError:
                # The store is closing: run this lane's share here as skipped, so every layer is
                # still finalized (pins released) and resolved (as not loaded).
                self._run_lane(lane, start, stop, skip=True)

    def _run_lane(self, lane: int, start: int, stop: int, skip: bool = False) -> None:
        for position in range(start, stop):
            try:
                self._lane_layer(lane, position, skip)
            except Exception:  # never abandon the remaining layers: their pins would leak
                log.exception("KV load lane failed on a layer", layer=self.order[position])

    def _lane_layer(self, lane: int, position: int, skip: bool) -> None:
        layer = self.order[position]
        bad: dict[int, str] = {}
        error: BaseException | None = None
        with self._lock:
            plan = self._plans[position]
            if plan is None:
                try:
                    plan = self._plan(layer)
                except Exception as exc:  # deliver the failure; later layers still run
                    plan = LayerPlan(layer, torch.empty(0), error=exc)
                plan.started = time.perf_counter()
                self._plans[position] = plan
        count = plan.reads
        stripes = self._stripes[position]
        low, high = count * lane // stripes, count * (lane + 1) // stripes
        skipped = skip or self.handle.cancelled
        if not skipped and high > low:
            try:
                bad = self._copy_stripe(plan, low, high)
            except Exception as exc:  # a lane must finish every layer, or the load never completes
                error = exc
        with self._lock:
            plan.bad.update(bad)
            plan.skipped = plan.skipped or skipped
            plan.error = plan.error or error
            self._remaining[position] -= 1
            last = self._remaining[position] == 0
        if last:
            self._deliver(position, plan)

    def _deliver(self, position: int, plan: LayerPlan) -> None:
        try:
            outcome: LayerResult | BaseException = self._finalize(plan)
        except Exception as exc:
            outcome = exc
        if plan.error is not None:
            outcome = plan.error
        try:
            self.handle._finish(plan.layer, outcome)
        finally:
            if position == 0:
                try:
                    self._after_first(plan)
                finally:
                    if len(self.order) > 1:
                        self._submit(1, len(self.order))

    def _copy_stripe(self, plan: LayerPlan, low: int, high: int) -> dict[int, str]:
        if plan.only is not None:  # every read from one slot tier: no sorting by source
            pool = self._pools[plan.only]
            copy_rows(plan.dest, plan.rows[low:high], pool, plan.where[low:high])
            self._synchronize(plan.dest, pool)
            return {}
        source, copied = plan.source[low:high], []
        for tier in (Tier.HBM, Tier.DRAM):
            mine = source == tier
            if not mine.any():
                continue
            copied.append(self._pools[tier])
            copy_rows(plan.dest, plan.rows[low:high][mine], self._pools[tier], plan.where[low:high][mine])
        ssd_reads = np.flatnonzero(source == Tier.SSD) + low
        bad = self._read_ssd(plan, ssd_reads.tolist()) if len(ssd_reads) else {}
        self._synchronize(plan.dest, *copied)
        return bad

    @staticmethod
    def _synchronize(*tensors: torch.Tensor) -> None:
        # Copies to or from device memory are asynchronous: the bytes must have landed before the
        # layer is reported (and its source pages unpinned).
        for tensor in tensors:
            if tensor.device.type == "cuda":
                torch.cuda.current_stream(tensor.device).synchronize()

    def _read_ssd(self, plan: LayerPlan, positions: list[int]) -> dict[int, str]:
        """Read pages straight into the destination rows (CPU) or through pinned staging (device),
        verifying each page's checksum; a page that fails is zeroed and reported, never delivered."""
        dest = plan.dest
        direct = dest.device.type == "cpu" and dest.is_contiguous()
        staging = (
            dest
            if direct
            else torch.empty(len(positions), self._page_words, dtype=torch.int64, pin_memory=dest.device.type == "cuda")
        )
        staging_rows = plan.rows[positions].tolist() if direct else list(range(len(positions)))
        failed = read_verified_pages(
            self._ssd,
            self._ssd.segments,
            plan.layer,
            [plan.keys[plan.index[j]] for j in positions],
            plan.where[positions].tolist(),
            plan.ssd_page[positions].tolist(),
            plan.checksums[positions].tolist(),  # stable: the pages are pinned
            row_views(staging, staging_rows, self._page_words * 8),
        )
        bad = {positions[k]: reason for k, reason in failed.items()}
        if direct:
            for k in failed:
                staging[staging_rows[k]].zero_()  # a failed row must not keep unverified bytes
        else:
            good = [k for k in range(len(positions)) if k not in failed]
            if good:
                copy_rows(dest, plan.rows[[positions[k] for k in good]], staging, np.asarray(good))
        return bad
