"""Load planning: which tier each page of a load comes from, pinned before any byte moves, and the
bookkeeping once it has moved. All of it under the store's lock, none of it I/O: the bytes move on
the copy lanes (`memory_load`, `ssd_load`, `loader`) with the pages pinned, so eviction skips them
instead of waiting.

Three paths, the first that fits:
- the DRAM fast path: a load into rows whose every page sits in DRAM and none in HBM, planned and
  pinned for all its layers at once (`plan_from_dram`, then `finish_dram_load`);
- the SSD path: a load into plain CPU rows whose every page sits only on SSD, likewise planned as a
  whole (`plan_from_ssd`, then `finish_ssd_load`);
- the general path, one layer at a time: any mix of sources, missing pages, and promotions into a
  tier (`plan_rows_layer` / `plan_promotion_layer`, then `finish_rows_layer` /
  `finish_promotion_layer`).
Every plan's pins are released exactly once, by its finish (or at once if planning raises).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from node_manager.kv.eviction import PageMeta
from node_manager.kv.loader import LayerPlan, LayerResult, LayerwiseLoad, RowTarget
from node_manager.kv.memory_load import PreparedDramLoad
from node_manager.kv.pages import Tier
from node_manager.kv.sessions import SessionRecord
from node_manager.kv.ssd_load import BadPage, PreparedSsdLoad
from node_manager.kv.ssd_tier import Segment
from node_manager.kv.store_front import StoreFront
from symphony.kv_addressing import BlockKey
from symphony.logs import get_logger

log = get_logger(__name__)


class LoadPlanner:
    def __init__(self, front: StoreFront) -> None:
        self._front = front

    # ---- loads planned as a whole (DRAM fast path, SSD path) --------------------------------------

    def plan_from_dram(
        self, keys: Sequence[BlockKey], order: list[int], target: RowTarget, rows: np.ndarray, plain_rows: bool
    ) -> PreparedDramLoad | None:
        """The common resume: every page the load wants sits in DRAM and none in HBM. Planned and
        pinned for all layers at once, so the lanes spend their time copying, not planning. None,
        with nothing changed, when some page needs the general path. Caller holds the lock."""
        d = self._front.directory
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
        self._front.touches.add(Tier.DRAM, tuple(keys), tuple(order))
        return PreparedDramLoad(keys, target.tensors, order, ids, slots, rows, consecutive, plain_rows)

    def finish_dram_load(self, prepared: PreparedDramLoad, copied_layers: int) -> None:
        """Every layer of a load planned as a whole is copied (or skipped): metrics for the load as
        one I/O batch, then its pins and in-flight jobs released. Takes the lock."""
        front = self._front
        pages = copied_layers * len(prepared.block_rows)
        if pages:
            front.meters.count_hits(Tier.DRAM, pages)
            front.meters.observe_io(Tier.DRAM, "read", pages, prepared.started)
        with front.lock:
            self._pin_whole_load(prepared.block_rows, prepared.order, -1)
            front.jobs_done(len(prepared.order))

    def plan_from_ssd(
        self, keys: Sequence[BlockKey], order: list[int], target: RowTarget, rows: np.ndarray
    ) -> PreparedSsdLoad | None:
        """A cold load: every page the load wants sits on SSD and in no faster tier; only for
        destinations of plain CPU rows. Planned and pinned for all layers at once, as
        `plan_from_dram` is; None, with nothing changed, when some page needs the general path (a
        copy in a faster tier, a page missing). Caller holds the lock."""
        d, ssd = self._front.directory, self._front.ssd
        found = self._whole_load_rows(keys, order)
        if found is None:
            return None
        ids, columns = found
        seqs = d.ssd_seq[ids][:, columns]
        if seqs.min() < 0 or d.dram[ids][:, columns].max() >= 0 or d.hbm[ids][:, columns].max() >= 0:
            return None
        segments: dict[int, Segment] = {}
        for seq in sorted(set(seqs.ravel().tolist())):
            segment = ssd.pin(seq)
            if segment is None:  # not on disk any more: let the general path report those pages
                for pinned in segments.values():
                    ssd.unpin(pinned)
                return None
            segments[seq] = segment
            ssd.touch(seq)
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

    def finish_ssd_load(self, prepared: PreparedSsdLoad, pages_read: int, bad: list[BadPage]) -> None:
        """Every layer of a load planned as a whole is read (or skipped): metrics for the load as one
        I/O batch, bad copies dropped (never served again), then its pins released. Takes the lock."""
        front = self._front
        if pages_read:
            front.meters.count_hits(Tier.SSD, pages_read)
            front.meters.observe_io(Tier.SSD, "read", pages_read, prepared.started)
        with front.lock:
            self._pin_whole_load(prepared.block_rows, prepared.order, -1)
            for segment in prepared.segments.values():
                front.ssd.unpin(segment)
            for page in bad:  # as `_release_layer` does: unpinned first, then dropped
                self._drop_bad_ssd_copy(
                    prepared.keys[page.block],
                    int(prepared.block_rows[page.block]),
                    prepared.order[page.position],
                    int(prepared.seqs[page.block, page.position]),
                    int(prepared.pages[page.block, page.position]),
                    page.reason,
                )
            front.jobs_done(len(prepared.order))

    def _whole_load_rows(
        self, keys: Sequence[BlockKey], order: list[int]
    ) -> tuple[np.ndarray, slice | np.ndarray] | None:
        """For a load planned as a whole: the directory row of each key and the columns of its
        layers, or None if some key has no row. Every layer in order (the usual load) selects whole
        rows, with no column gather. Caller holds the lock."""
        ids = self._front.directory.rows(keys)
        if not len(ids) or ids.min() < 0:
            return None
        return ids, slice(None) if order == list(range(self._front.geometry.num_layers)) else np.asarray(order)

    def _pin_whole_load(self, ids: np.ndarray, order: list[int], delta: int) -> None:
        """Take (+1) or release (-1) the pins of a load planned as a whole: whole rows when every
        layer comes, in any order. Caller holds the lock."""
        if len(order) == self._front.geometry.num_layers:
            self._front.directory.pins[ids] += delta
        else:
            self._front.directory.pins[np.ix_(ids, np.asarray(order, dtype=np.intp))] += delta

    # ---- the general path, layer by layer ---------------------------------------------------------

    def plan_rows_layer(
        self, handle: LayerwiseLoad, layer: int, keys: Sequence[BlockKey], target: RowTarget, rows: np.ndarray
    ) -> LayerPlan:
        """Plan one layer of a load into the caller's rows `rows` of `target`: each page from the
        fastest tier holding it, pinned. Takes the lock."""
        plan = LayerPlan(layer, target.tensors[layer], keys)
        if self._skip_cancelled(handle, plan):
            return plan
        with self._planning(plan):
            self._choose_sources(plan, None)
            plan.rows = rows[plan.index]
        return plan

    def plan_promotion_layer(
        self, handle: LayerwiseLoad, record: SessionRecord, layer: int, keys: Sequence[BlockKey], tier: Tier
    ) -> LayerPlan:
        """Plan one layer of a promotion into `tier` (HBM or DRAM): pages it holds already count as
        loaded, the others come from the fastest tier below holding them into slots allocated now.
        Takes the lock."""
        plan = LayerPlan(layer, self._slot_pages(tier), keys)
        if self._skip_cancelled(handle, plan):
            return plan
        with self._planning(plan):
            self._choose_sources(plan, tier)
            if plan.reads:
                self._allocate_promotion(plan, tier, record)
        return plan

    def _slot_pages(self, tier: Tier) -> torch.Tensor:
        return self._front.hbm.pages if tier is Tier.HBM else self._front.dram.pages

    @staticmethod
    def _skip_cancelled(handle: LayerwiseLoad, plan: LayerPlan) -> bool:
        """A cancelled load plans nothing more: the layer reports every block failed."""
        if not handle.cancelled:
            return False
        plan.failed = list(range(len(plan.keys)))
        plan.skipped = True
        return True

    @contextlib.contextmanager
    def _planning(self, plan: LayerPlan) -> Iterator[None]:
        """Hold the lock while `plan` is built; a half-built plan must not keep its pins."""
        with self._front.lock:
            try:
                yield
            except BaseException:
                self._unpin(plan)
                raise

    def _choose_sources(self, plan: LayerPlan, already_in: Tier | None) -> None:
        """Any mix of sources, missing pages. Each page comes from the fastest tier holding it, never
        from `already_in` (the tier a promotion fills: pages there count as loaded). Caller holds
        the lock."""
        front = self._front
        d, ssd, layer, keys = front.directory, front.ssd, plan.layer, plan.keys
        ids = d.rows(keys)  # looked up per layer: a row unpinned meanwhile may be reused
        hbm, dram, seq = (d.lookup(table, ids, layer) for table in (d.hbm, d.dram, d.ssd_seq))
        already = np.zeros(len(ids), np.bool_)
        if already_in is not None:
            already = (hbm if already_in is Tier.HBM else dram) >= 0
        from_hbm = (hbm >= 0) & ~already
        from_dram = (dram >= 0) & ~already & ~from_hbm
        from_ssd = (seq >= 0) & ~already & ~from_hbm & ~from_dram
        # sorted(set()), not np.unique: np.unique imports numpy.ma on its first call, inside a load.
        for segment_seq in sorted(set(seq[from_ssd].tolist())):
            segment = ssd.pin(segment_seq)
            if segment is None:  # evicted meanwhile: those pages are not on SSD any more
                from_ssd &= seq != segment_seq
                continue
            plan.segments.append(segment)
            ssd.touch(segment_seq)
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
        for tier, used in ((already_in, already), (Tier.HBM, from_hbm), (Tier.DRAM, from_dram)):
            if tier is not None and used.any():
                front.touches.add(tier, tuple(keys[i] for i in np.flatnonzero(used).tolist()), (layer,))
        if plan.failed:
            front.metrics.misses.inc(len(plan.failed))

    def _allocate_promotion(self, plan: LayerPlan, tier: Tier, record: SessionRecord) -> None:
        """Slots in `tier` for the plan's reads. Never evicts this session's own pages to make room
        for more of it: what does not fit (its later layers, as layers run in order) is reported as
        not loaded. Caller holds the lock."""
        front = self._front
        slots = front.allocate(tier, plan.reads, protect=record.key)
        if slots is None:
            room = front.allocatable(tier, protect=record.key)
            slots = front.allocate(tier, room, protect=record.key) or []
            kept = len(slots)
            plan.failed.extend(plan.index[kept:].tolist())
            front.directory.pins[plan.block_rows[kept:], plan.layer] -= 1
            plan.keep_reads(kept)
        plan.rows = np.asarray(slots, dtype=np.int64)

    def finish_rows_layer(self, plan: LayerPlan, handle: LayerwiseLoad) -> LayerResult:
        """A layer's copies into the caller's rows are done (or failed): unpin, drop bad SSD copies,
        report. Takes the lock."""
        with self._front.lock:
            self._front.jobs_done(1)
            self._release_layer(plan)
        return self._layer_result(plan, handle, None)

    def finish_promotion_layer(
        self, plan: LayerPlan, handle: LayerwiseLoad, record: SessionRecord, tier: Tier
    ) -> LayerResult:
        """A layer's copies into `tier` are done (or failed): install the promoted copies, unpin,
        drop bad SSD copies, report. Takes the lock."""
        delivered = not plan.skipped and plan.error is None
        with self._front.lock:
            self._front.jobs_done(1)
            self._install_promoted(plan, tier, record, delivered)  # before unpinning: rows stay put
            self._release_layer(plan)
            self._front.refresh_gauges()
        return self._layer_result(plan, handle, tier)

    def _release_layer(self, plan: LayerPlan) -> None:
        """Unpin the plan's pages, then drop the SSD copies its reads found bad. Caller holds the lock."""
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

    def _layer_result(self, plan: LayerPlan, handle: LayerwiseLoad, already_in: Tier | None) -> LayerResult:
        """What one finished layer delivered, counted by source tier (metrics too); `already_in`: the
        tier a promotion filled, whose pages held before count as loaded from it."""
        front = self._front
        failed = list(plan.failed)
        by_tier: dict[Tier, int] = {}
        if not plan.skipped and plan.error is None:
            sources = plan.source
            if plan.bad:
                bad = list(plan.bad)
                failed.extend(plan.index[bad].tolist())
                sources = np.delete(sources, bad)
            for tier, pages in enumerate(np.bincount(sources, minlength=len(Tier) + 1).tolist()):
                if pages:
                    by_tier[Tier(tier)] = pages
                    front.meters.count_hits(Tier(tier), pages)
                    front.meters.observe_io(Tier(tier), "read", pages, plan.started)
        else:
            failed.extend(plan.index.tolist())
        if plan.already and already_in is not None:
            by_tier[already_in] = by_tier.get(already_in, 0) + plan.already
        first = handle.first_block
        failed_abs = tuple(sorted(first + i for i in failed))
        loaded = failed_abs[0] - first if failed_abs else handle.num_blocks
        return LayerResult(plan.layer, loaded, failed_abs, by_tier)

    def _install_promoted(self, plan: LayerPlan, tier: Tier, record: SessionRecord, delivered: bool) -> None:
        """Give the promoted copies their slots; a slot whose read failed, or whose page changed or
        gained a copy there meanwhile, goes back. Caller holds the lock, plan still pinned."""
        front = self._front
        d, layer = front.directory, plan.layer
        policy = front.policy(tier)
        table = d.slots(tier)
        before = front.holdings.complete(tier, plan.block_rows)  # the rows are distinct
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
        front.release_slots(tier, unused)
        front.holdings.stored(tier, plan.block_rows, before)

    def _unpin(self, plan: LayerPlan) -> None:
        self._front.directory.pins[plan.block_rows, plan.layer] -= 1
        for segment in plan.segments:
            self._front.ssd.unpin(segment)
        plan.segments = []

    def _drop_bad_ssd_copy(self, key: BlockKey, row: int, layer: int, seq: int, index: int, reason: str) -> None:
        """A page read from segment `seq`, entry `index`, failed ("checksum" or "io_error"): counted,
        and that copy is never served again: dropped (and the page, if it was the last copy), unless
        the page has moved to another copy since. Caller holds the lock, the page unpinned."""
        front = self._front
        front.metrics.load_errors.labels(reason).inc()
        if reason == "checksum":
            log.warning("KV page failed its checksum on SSD; dropped", layer=layer, segment=seq)
        d = front.directory
        if d.keys[row] == key and d.ssd_seq[row, layer] == seq and d.ssd_page[row, layer] == index:
            front.drop_copy(key, layer, Tier.SSD, "corrupt")
