"""The common resume, moved: a load whose every page sits in one memory pool (the DRAM arena).

`load_plan` plans and pins such a load for all its layers at once (`PreparedDramLoad`); this
module copies it. Each lane claims the next layer no lane has claimed yet, so a lane whose thread
wakes late copies fewer layers instead of finishing last; a layer is delivered as soon as its copy is
done, in layer order (`LayerwiseLoad`).

Why a path of its own: a resume from DRAM is bound by Python per layer, not by bytes. The general
path (`StripedLoad`) builds a plan object, takes a lock twice and updates metrics for every layer,
which over a session's layers adds a large fraction of a plain copy's time
(docs/design-notes.md#dram-fast-path). Here a layer costs one copy call and one future: every
per-layer decision (runs of consecutive rows, byte addresses, results) is made up front or once per
load, metrics are updated once per load, and CPU-to-CPU runs are copied with `memmove` on raw
addresses (no tensor views; `ctypes` releases the GIL during the call, so both lanes copy at once).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from node_manager.kv.loader import LayerResult, LayerwiseLoad
from node_manager.kv.pages import Tier
from node_manager.kv.slots import copy_rows, paired_runs
from symphony.kv_addressing import BlockKey
from symphony.logs import get_logger

log = get_logger(__name__)


@dataclass(slots=True)
class PreparedDramLoad:
    """A load whose every page sits in DRAM, planned and pinned for all its layers at once (see
    `LoadPlanner.plan_from_dram`): `[blocks, columns]` arrays, column `c` being layer `order[c]`."""

    keys: Sequence[BlockKey]
    tensors: Sequence[torch.Tensor]
    order: list[int]
    block_rows: np.ndarray  # directory row of each block: holds its pins
    slots: np.ndarray  # [blocks, columns] DRAM slot of each page
    rows: np.ndarray  # destination row of each block
    consecutive: list[bool]  # per column: rows and slots both consecutive (one run)
    plain_rows: bool  # every tensor plain CPU memory laid out row by row (`Loads._target_rows`)
    started: float = field(default_factory=time.perf_counter)


class MemoryLoad:
    """Copies a `PreparedDramLoad` from `pool` on `lanes` lanes of `executor`.

    `on_copied(layers_copied)` is the store's bookkeeping for the whole load (metrics, pins, in-flight
    slots) and runs once every lane is done, before the last layer is delivered, so a consumer that
    has all layers also sees the pins released. A cancelled load skips the layers not yet started."""

    def __init__(
        self,
        handle: LayerwiseLoad,
        prepared: PreparedDramLoad,
        pool: torch.Tensor,
        executor: concurrent.futures.Executor,
        lanes: int,
        on_copied: Callable[[int], None],
    ) -> None:
        self.handle = handle
        self.prepared = prepared
        self._pool = pool
        self._executor = executor
        self._lanes = max(1, min(lanes, len(prepared.order)))
        self._on_copied = on_copied
        self._page_bytes = pool.shape[1] * pool.element_size()
        # memmove on raw addresses only where every tensor is plain CPU memory laid out row by row;
        # the store checked that every row is inside its tensor.
        self._raw = pool.is_cpu and pool.is_contiguous() and prepared.plain_rows
        first, count = handle.first_block, handle.num_blocks
        self._failed = tuple(range(first, first + count))
        self._lock = threading.Lock()
        self._copied = 0
        self._lanes_left = self._lanes
        self._positions = itertools.count()  # next() is atomic under the GIL: each position claimed once
        self._held: tuple[int, LayerResult] | None = None

    def start(self) -> None:
        for _ in range(self._lanes):
            try:
                self._executor.submit(self._run_lane)
            except RuntimeError:  # the store is closing: finish the unclaimed layers as not loaded
                self._run_lane(skip=True)

    def _run_lane(self, skip: bool = False) -> None:
        order = self.prepared.order
        held: tuple[int, LayerResult] | None = None
        copied = 0
        blocks = len(self.prepared.rows)
        for position in self._positions:
            if position >= len(order):
                break
            layer = order[position]
            if skip or self.handle.cancelled:
                result = LayerResult(layer, 0, self._failed)
            else:
                try:
                    self._copy(position)
                    copied += 1
                    # Built here, not up front: on a lane it overlaps the other lane's copy.
                    result = LayerResult(layer, blocks, (), {Tier.DRAM: blocks})
                except Exception:  # a lane must finish every layer, or the load never completes
                    log.exception("KV load lane failed on a layer", layer=layer)
                    result = LayerResult(layer, 0, self._failed)
            if position == len(order) - 1:
                held = (layer, result)  # the load is not complete until the bookkeeping below is done
            else:
                self.handle._finish(layer, result)
        with self._lock:
            if held is not None:
                self._held = held
            self._copied += copied
            self._lanes_left -= 1
            last_lane = self._lanes_left == 0
        if not last_lane:
            return
        try:
            self._on_copied(self._copied)
        except Exception:
            log.exception("KV load could not release its pages")
        assert self._held is not None  # some lane ran the last position
        self.handle._finish(*self._held)

    def _copy(self, position: int) -> None:
        prepared = self.prepared
        dest = prepared.tensors[prepared.order[position]]
        slots = prepared.slots[:, position]
        if prepared.consecutive[position]:
            runs = [(int(prepared.rows[0]), int(slots[0]), len(slots))]
        else:
            runs = paired_runs(prepared.rows, slots)
        if self._raw:
            dst_base, src_base, page = dest.data_ptr(), self._pool.data_ptr(), self._page_bytes
            for dst_row, src_row, count in runs:
                ctypes.memmove(dst_base + dst_row * page, src_base + src_row * page, count * page)
            return
        copy_rows(dest, prepared.rows, self._pool, slots)
        if dest.device.type == "cuda" or self._pool.device.type == "cuda":
            # Device copies are asynchronous: the bytes must land before the layer is reported.
            torch.cuda.current_stream(dest.device if dest.device.type == "cuda" else self._pool.device).synchronize()
