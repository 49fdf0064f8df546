"""A load whose every page sits only on SSD, read straight into the caller's rows: a node sending a
session it holds only on disk to a peer (`transfer`), or any caller loading rows from a cold store.

`load_plan` plans and pins such a load for all its layers at once (`PreparedSsdLoad`); this module
reads it. Why a path of its own, as `memory_load` is for DRAM: the general path (`StripedLoad`)
plans, pins and finishes every layer under the store lock, and its lanes then wait on each other's
GIL while the disk sits idle (docs/design-notes.md#ssd-load-path).

Here a layer costs its reads, its checksums and one future. The first layer is read alone, so a
consumer waiting on it does not share the disk with the rest of the session; once it is delivered
the kernel is asked to read the rest ahead (`after_first`) and the lanes take the other layers
whole (lane k: layers 1 + k, 1 + k + lanes, ...), each layer one `preadv` per run of consecutive
pages in a segment, scattered straight into the destination rows. Every page is checked against its
checksum before its layer is reported; a page that fails is zeroed and reported, never delivered.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from node_manager.kv.loader import LayerResult, LayerwiseLoad, read_verified_pages, row_views
from node_manager.kv.pages import Tier
from node_manager.kv.ssd_tier import Segment
from node_manager.kv.tiers import SegmentTier
from symphony.kv_addressing import BlockKey
from symphony.logs import get_logger

log = get_logger(__name__)


@dataclass(slots=True)
class PreparedSsdLoad:
    """A load whose every page sits only on SSD, planned and pinned for all its layers at once (see
    `LoadPlanner.plan_from_ssd`): `[blocks, columns]` arrays, column `c` being layer `order[c]`."""

    keys: Sequence[BlockKey]
    tensors: Sequence[torch.Tensor]  # CPU, contiguous: read into by byte offset
    order: list[int]
    block_rows: np.ndarray  # directory row of each block: holds its pins
    seqs: np.ndarray  # [blocks, columns] segment of each page
    pages: np.ndarray  # [blocks, columns] index of each page in its segment
    checksums: np.ndarray  # [blocks, columns]
    rows: np.ndarray  # destination row of each block
    segments: dict[int, Segment]  # every segment read, pinned
    started: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True, slots=True)
class BadPage:
    position: int  # column of the load (layer `order[position]`)
    block: int  # index into the load's blocks
    reason: str  # "checksum" | "io_error"


class SsdLoad:
    """Reads a `PreparedSsdLoad` from `ssd` on `lanes` lanes of `executor`.

    `after_first()` runs once the first layer is delivered. `on_read(pages_read, bad)` is the store's
    bookkeeping for the whole load (metrics, dropping corrupt copies, pins) and runs once every lane
    is done, before the last layer is delivered, so a consumer that has all layers also sees the pins
    released. A cancelled load skips the layers not yet started."""

    def __init__(
        self,
        handle: LayerwiseLoad,
        prepared: PreparedSsdLoad,
        ssd: SegmentTier,
        executor: concurrent.futures.Executor,
        lanes: int,
        page_bytes: int,
        after_first: Callable[[], object],
        on_read: Callable[[int, list[BadPage]], None],
    ) -> None:
        self.handle = handle
        self.prepared = prepared
        self._ssd = ssd
        self._executor = executor
        self._page_bytes = page_bytes
        self._after_first = after_first
        self._on_read = on_read
        later = len(prepared.order) - 1
        self._lanes = max(1, min(lanes, later))
        self._lanes_left = self._lanes if later else 0
        first, count = handle.first_block, handle.num_blocks
        self._none_loaded = tuple(range(first, first + count))
        self._lock = threading.Lock()
        self._read = 0
        self._bad: list[BadPage] = []
        self._held: tuple[int, LayerResult] | None = None

    def start(self) -> None:
        self._submit(self._run_first)

    def _submit(self, task: Callable[..., None], *args: int) -> None:
        try:
            self._executor.submit(task, *args)
        except RuntimeError:  # the store is closing: finish the layers as not loaded
            task(*args, skip=True)

    def _run_first(self, skip: bool = False) -> None:
        layer, result = self._layer(0, skip)
        if not self._lanes_left:  # a one-layer load: its only layer is also its last
            self._finish_load(layer, result)
            return
        self.handle._finish(layer, result)
        try:
            self._after_first()
        except Exception:
            log.exception("KV load could not start its read-ahead")
        for lane in range(self._lanes):
            self._submit(self._run_lane, lane)

    def _run_lane(self, lane: int, skip: bool = False) -> None:
        order = self.prepared.order
        held: tuple[int, LayerResult] | None = None
        for position in range(1 + lane, len(order), self._lanes):
            layer, result = self._layer(position, skip)
            if position == len(order) - 1:
                held = (layer, result)  # the load is not complete until the bookkeeping is done
            else:
                self.handle._finish(layer, result)
        with self._lock:
            if held is not None:
                self._held = held
            self._lanes_left -= 1
            if self._lanes_left:
                return
            last = self._held
        assert last is not None
        self._finish_load(*last)

    def _finish_load(self, layer: int, result: LayerResult) -> None:
        try:
            self._on_read(self._read, self._bad)
        except Exception:
            log.exception("KV load could not release its pages")
        self.handle._finish(layer, result)

    def _layer(self, position: int, skip: bool) -> tuple[int, LayerResult]:
        layer = self.prepared.order[position]
        if skip or self.handle.cancelled:
            return layer, LayerResult(layer, 0, self._none_loaded)
        try:
            bad = self._read_layer(position)
        except Exception:  # a lane must finish every layer, or the load never completes
            log.exception("KV load lane failed on a layer", layer=layer)
            self._zero_rows(position, range(len(self.prepared.rows)))
            return layer, LayerResult(layer, 0, self._none_loaded)
        blocks = len(self.prepared.rows)
        with self._lock:
            self._read += blocks - len(bad)
            self._bad.extend(bad)
        if not bad:
            return layer, LayerResult(layer, blocks, (), {Tier.SSD: blocks})
        first = self.handle.first_block
        failed = tuple(sorted(first + page.block for page in bad))
        return layer, LayerResult(layer, failed[0] - first, failed, {Tier.SSD: blocks - len(bad)})

    def _read_layer(self, position: int) -> list[BadPage]:
        prepared = self.prepared
        layer = prepared.order[position]
        failed = read_verified_pages(
            self._ssd,
            prepared.segments,
            layer,
            prepared.keys,
            prepared.seqs[:, position].tolist(),
            prepared.pages[:, position].tolist(),
            prepared.checksums[:, position].tolist(),
            row_views(prepared.tensors[layer], prepared.rows.tolist(), self._page_bytes),
        )
        bad = [BadPage(position, block, reason) for block, reason in failed.items()]
        if bad:
            self._zero_rows(position, [page.block for page in bad])  # never leave unverified bytes
        return bad

    def _zero_rows(self, position: int, blocks: Sequence[int]) -> None:
        dest = self.prepared.tensors[self.prepared.order[position]]
        for block in blocks:
            dest[int(self.prepared.rows[block])].zero_()
