"""Loads: the entry points that bring a session's pages to a caller, checked, admitted and started
on the copy lanes. `into_rows` fills caller-owned tensors (the engine's KV, a staging buffer);
`promote` moves pages up into HBM or DRAM (a prefetch). Both return a `LayerwiseLoad` at once,
whose per-layer futures report what arrived, in layer order.

Which pages come from where is `load_plan`'s (under the store's lock); the bytes move in
`memory_load` (the DRAM fast path), `ssd_load` (the SSD path) and `loader` (the general path).
Raises, before anything is pinned or started: SessionNotFound, InvalidRequest, HistoryChanged
(`addressed_keys`), StoreBusy (kv.max_inflight_jobs reached).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence

import numpy as np
import torch

from node_manager.kv.errors import InvalidRequest, StoreBusy
from node_manager.kv.load_plan import LoadPlanner
from node_manager.kv.loader import LayerPlan, LayerResult, LayerwiseLoad, RowTarget, StripedLoad
from node_manager.kv.memory_load import MemoryLoad
from node_manager.kv.pages import Tier
from node_manager.kv.sessions import SessionRecord, addressed_keys, check_range
from node_manager.kv.ssd_load import SsdLoad
from node_manager.kv.store_front import StoreFront
from symphony.kv_addressing import BlockKey


class Loads:
    def __init__(self, front: StoreFront) -> None:
        self._front = front
        self.planner = LoadPlanner(front)
        self._readahead_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-readahead")

    def into_rows(
        self,
        tenant: str,
        session_id: str,
        first_block: int = 0,
        num_blocks: int | None = None,
        *,
        target: RowTarget,
        layers: Sequence[int] | None = None,
        last_key: BlockKey | None = None,
        tail_tokens: int = 0,
    ) -> LayerwiseLoad:
        """Copy blocks [first_block, first_block + num_blocks) of every layer (or of `layers`, in that
        order) into `target`'s rows, layer by layer from whichever tier holds each page (fastest
        first). Pages no tier holds are reported failed; their rows are left as they were, or
        zeroed. `last_key`, `tail_tokens`: see `addressed_keys`."""
        front = self._front
        record, count = self._block_range(tenant, session_id, first_block, num_blocks, tail_tokens)
        if len(target.rows) != count or len(target.tensors) != front.geometry.num_layers:
            raise InvalidRequest("row target needs one tensor per layer and one row per block")
        rows, plain_rows = self._target_rows(target)
        order, keys, handle = self._begin(record, first_block, count, layers, last_key, tail_tokens)
        if not order:
            return handle
        planner = self.planner
        with front.lock:
            prepared = planner.plan_from_dram(keys, order, target, rows, plain_rows)
            prepared_ssd = planner.plan_from_ssd(keys, order, target, rows) if prepared is None and plain_rows else None
        if prepared is not None:
            MemoryLoad(
                handle,
                prepared,
                front.dram.pages,
                front.io,
                front.config.io_threads,
                on_copied=lambda copied: planner.finish_dram_load(prepared, copied),
            ).start()
        elif prepared_ssd is not None:
            SsdLoad(
                handle,
                prepared_ssd,
                front.ssd,
                front.io,
                front.config.io_threads,
                front.geometry.page_bytes,
                after_first=lambda: self._readahead_pool.submit(self._readahead, keys, order[1:]),
                on_read=lambda read, bad: planner.finish_ssd_load(prepared_ssd, read, bad),
            ).start()
        else:
            self._by_layer(
                handle,
                order,
                keys,
                plan=lambda layer: self.planner.plan_rows_layer(handle, layer, keys, target, rows),
                finish=lambda plan: self.planner.finish_rows_layer(plan, handle),
            )
        return handle

    def promote(
        self,
        tenant: str,
        session_id: str,
        first_block: int = 0,
        num_blocks: int | None = None,
        *,
        tier: Tier,
        layers: Sequence[int] | None = None,
        last_key: BlockKey | None = None,
        tail_tokens: int = 0,
    ) -> LayerwiseLoad:
        """Bring blocks [first_block, first_block + num_blocks) of every layer (or of `layers`) into
        `tier` (HBM or DRAM), layer by layer from the fastest tier below holding each page. Pages
        the tier holds already count as loaded; what it has no room for is reported failed (never
        by evicting this session's own pages). `last_key`, `tail_tokens`: see `addressed_keys`."""
        record, count = self._block_range(tenant, session_id, first_block, num_blocks, tail_tokens)
        if tier not in (Tier.HBM, Tier.DRAM):
            raise InvalidRequest(f"cannot load into {tier.name}")
        order, keys, handle = self._begin(record, first_block, count, layers, last_key, tail_tokens)
        if order:
            self._by_layer(
                handle,
                order,
                keys,
                plan=lambda layer: self.planner.plan_promotion_layer(handle, record, layer, keys, tier),
                finish=lambda plan: self.planner.finish_promotion_layer(plan, handle, record, tier),
            )
        return handle

    def close(self) -> None:
        """Wait for the read-ahead hints under way; the copy lanes are the store's to shut down."""
        self._readahead_pool.shutdown(wait=True)

    def _block_range(
        self, tenant: str, session_id: str, first_block: int, num_blocks: int | None, tail_tokens: int
    ) -> tuple[SessionRecord, int]:
        """The session's record and the load's block count (to the end of the history by default)."""
        record = self._front.sessions.get(tenant, session_id)
        count = record.blocks.num_blocks - first_block if num_blocks is None else num_blocks
        check_range(self._front.geometry, record, 0, first_block, count, tail_tokens)
        return record, count

    def _begin(
        self,
        record: SessionRecord,
        first_block: int,
        count: int,
        layers: Sequence[int] | None,
        last_key: BlockKey | None,
        tail_tokens: int,
    ) -> tuple[list[int], tuple[BlockKey, ...], LayerwiseLoad]:
        """Check the layers, resolve the keys and admit one job per layer; the layers not asked for
        are delivered at once as loading nothing. Returns (layer order, keys, handle)."""
        num_layers = self._front.geometry.num_layers
        order = list(range(num_layers)) if layers is None else list(layers)
        if layers is not None and (
            len(set(order)) != len(order) or not all(0 <= layer < num_layers for layer in order)
        ):
            raise InvalidRequest(f"layers must be distinct and within 0..{num_layers - 1}")
        keys = addressed_keys(record, first_block, count, last_key, tail_tokens)
        handle = LayerwiseLoad(num_layers, first_block, count)
        if not self._front.admit_jobs(len(order)):
            raise StoreBusy("too many KV transfers in flight; retry or recompute")
        if len(order) < num_layers:
            for layer in set(range(num_layers)).difference(order):
                handle._finish(layer, LayerResult(layer, 0, ()))
        return order, keys, handle

    def _target_rows(self, target: RowTarget) -> tuple[np.ndarray, bool]:
        """The destination rows, checked against every destination tensor: loads copy into them by
        address, so a row outside a tensor would write over memory that is not the caller's. Also
        whether every tensor is plain CPU memory laid out row by row (copied into by raw address).
        One pass, reading each attribute once: this runs on every load."""
        rows = np.asarray(target.rows, dtype=np.int64)
        words = self._front.geometry.page_words
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

    def _by_layer(
        self,
        handle: LayerwiseLoad,
        order: list[int],
        keys: Sequence[BlockKey],
        plan: Callable[[int], LayerPlan],
        finish: Callable[[LayerPlan], LayerResult],
    ) -> None:
        """Start the general path: each layer planned by `plan` as a lane reaches it, and finished
        by `finish` once its copies are done."""
        front = self._front
        StripedLoad(
            handle,
            order,
            front.io,
            front.config.io_threads,
            {Tier.HBM: front.hbm.pages, Tier.DRAM: front.dram.pages},
            front.ssd,
            front.geometry.page_words,
            plan=plan,
            finalize=finish,
            after_first=lambda first: self._after_first_layer(first, keys, order[1:]),
        ).start()

    def _after_first_layer(self, plan: LayerPlan, keys: Sequence[BlockKey], later: list[int]) -> None:
        if later and (plan.source == Tier.SSD).any():
            # fadvise(WILLNEED) blocks while it queues the reads: on its own thread.
            self._readahead_pool.submit(self._readahead, keys, later)

    def _readahead(self, keys: Sequence[BlockKey], layers: list[int]) -> None:
        """Ask the kernel to start reading every SSD-only page of this load now, in file order.

        Lanes then find their pages arriving or arrived instead of each paying a cold read in turn;
        segments hold a save's pages layer-major, so the disk reads the next layers first. Takes the
        lock to find the pages, then advises without it."""
        front = self._front
        d = front.directory
        with front.lock:
            ids = d.rows(keys)
            ids = ids[ids >= 0]
            seqs, pages = d.ssd_seq[ids][:, layers], d.ssd_page[ids][:, layers]
            ssd_only = (seqs >= 0) & (d.dram[ids][:, layers] < 0) & (d.hbm[ids][:, layers] < 0)
            seqs, pages = seqs[ssd_only], pages[ssd_only]
            ranges = []
            for seq in sorted(set(seqs.tolist())):
                segment = front.ssd.segments.get(seq)
                if segment is not None:
                    in_segment = pages[seqs == seq]
                    ranges.append((segment, int(in_segment.min()), int(in_segment.max())))
        for segment, low, high in sorted(ranges, key=lambda r: r[0].seq):
            front.ssd.advise_willneed(segment, low, high)
