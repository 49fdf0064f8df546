"""Ingest: pages entering the store, saved by the engine or streamed in by a peer, in four steps.

1. reserve: DRAM slots set aside for the pages (`PageReservation`), invisible to loads and eviction;
2. fill: the bytes land in those slots with no lock held (a save's copy on a copy lane, a peer's
   stream through `reserved_views`);
3. verify: the pages' checksums are taken on the bytes as they sit in DRAM and checked against the
   sender's (`verify_reserved`), no lock held: the slots are the reservation's alone;
4. install: under the store's lock the pages get their directory cells, their DRAM copies join the
   eviction order and those without an SSD copy are queued for the write-behind.

A reservation ends in exactly one install (`install_verified`, `commit_pages`, `commit_many`) or
`release_pages`. A save the store cannot take (no DRAM room, too much I/O in flight, a checksum that
differs, a page busy under I/O) degrades instead of waiting: counted in
symphony_kv_save_degraded_total, the pages not kept.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from node_manager.kv.errors import InvalidRequest
from node_manager.kv.eviction import PageMeta
from node_manager.kv.pages import Tier
from node_manager.kv.sessions import SessionRecord, addressed_keys, check_range
from node_manager.kv.slots import consecutive_runs, copy_rows
from node_manager.kv.store_front import StoreFront
from node_manager.kv.write_behind import WriteBehind
from symphony.kv_addressing import BlockKey


@dataclass(slots=True)
class PageReservation:
    """DRAM slots set aside for pages of one layer that a caller fills itself (a peer's stream read
    straight into the arena): slot `slots[i]` will hold block `keys[i]`. Invisible to loads and
    eviction until committed; a reservation must end in `commit_pages` or `release_pages`.
    `tail_key`: the one of `keys` that is a partial tail block's (the last), None if none is."""

    record: SessionRecord
    layer: int
    keys: list[BlockKey]
    slots: list[int]
    tail_key: BlockKey | None = None


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
    tail_key: BlockKey | None = None


class PageIngest:
    def __init__(self, front: StoreFront, write_behind: WriteBehind) -> None:
        self._front = front
        self._write_behind = write_behind

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

        Never blocks: the copy into DRAM runs on a copy lane and the write to SSD behind it. The
        future gives the number of pages kept; `pages` must stay unchanged until it resolves. When
        the store is saturated the save degrades (counted in symphony_kv_save_degraded_total)
        rather than making the caller wait. With `expected_checksums` (pages from a peer), a page
        whose copy in DRAM does not match is not kept: the check runs on the bytes the store keeps,
        and costs no extra pass because every save checksums its pages anyway. `tail_tokens`: the
        last page is a partial block (`addressed_keys`)."""
        front = self._front
        geometry = front.geometry
        record = front.sessions.get(tenant, session_id)
        check_range(geometry, record, layer, first_block, pages.shape[0] if pages.dim() else -1, tail_tokens)
        if pages.dim() != 2 or pages.shape[1] != geometry.page_words or pages.dtype != torch.int64:
            raise InvalidRequest(
                f"pages must be int64 [n, {geometry.page_words}], got {pages.dtype} {list(pages.shape)}"
            )
        if expected_checksums is not None and len(expected_checksums) != pages.shape[0]:
            raise InvalidRequest(f"{len(expected_checksums)} checksums for {pages.shape[0]} pages")
        keys = addressed_keys(record, first_block, pages.shape[0], None, tail_tokens)
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        if not front.admit_jobs(1):
            front.metrics.save_degraded.labels("io_backpressure").inc(len(keys))
            future.set_result(0)
            return future
        job = front.io.submit(
            self._save_pages, record, layer, list(keys), pages, expected_checksums, keys[-1] if tail_tokens else None
        )
        job.add_done_callback(lambda done: self._chain(done, future))
        return future

    def _chain(self, done: concurrent.futures.Future[int], future: concurrent.futures.Future[int]) -> None:
        with self._front.lock:
            self._front.jobs_done(1)
        if done.exception() is not None:
            future.set_exception(done.exception())
        else:
            future.set_result(done.result())

    def _save_pages(
        self,
        record: SessionRecord,
        layer: int,
        keys: list,
        pages: torch.Tensor,
        expected: Sequence[int] | None,
        tail_key: BlockKey | None,
    ) -> int:
        reservation = self._reserve(record, layer, keys, tail_key)
        if reservation is None:
            return 0
        started = time.perf_counter()
        copy_rows(self._front.dram.pages, reservation.slots, pages.to("cpu"), list(range(len(keys))))
        self._front.meters.observe_io(Tier.DRAM, "write", len(keys), started)
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
        record = self._front.sessions.get(tenant, session_id)
        check_range(self._front.geometry, record, layer, first_block, count, tail_tokens)
        keys = list(addressed_keys(record, first_block, count, last_key, tail_tokens))
        return self._reserve(record, layer, keys, keys[-1] if tail_tokens else None)

    def _reserve(
        self, record: SessionRecord, layer: int, keys: list[BlockKey], tail_key: BlockKey | None
    ) -> PageReservation | None:
        with self._front.lock:
            slots = self._front.allocate(Tier.DRAM, len(keys))
        if slots is None:
            self._front.metrics.save_degraded.labels("dram_full").inc(len(keys))
            return None
        return PageReservation(record, layer, keys, slots, tail_key)

    def reserved_views(self, reservation: PageReservation) -> list[memoryview]:
        """Writable byte views covering the reserved slots in page order, one per run of consecutive
        slots (usually one: fresh slots come off the free stack in order)."""
        slots = reservation.slots
        return [self._front.dram.run_view(slots[start], stop - start) for start, stop in consecutive_runs(slots)]

    def reserved_checksums(self, reservation: PageReservation, first: int, data: memoryview) -> list[int]:
        """The checksums of the reservation's pages first, first + 1, ... given their bytes back to
        back: for a receiver that checksums pages the moment they land, still in the CPU cache."""
        page_bytes = self._front.geometry.page_bytes
        return self._front.ssd.mac.run_tags(
            reservation.keys[first : first + len(data) // page_bytes], reservation.layer, data, page_bytes
        )

    def commit_pages(self, reservation: PageReservation, expected: Sequence[int] | None = None) -> int:
        """Checksum the reserved pages as they sit in DRAM and install them; with `expected`, a page
        whose checksum differs is dropped instead (counted). Returns the pages kept."""
        return self.commit_many([(reservation, expected)])

    def commit_many(self, batch: Sequence[tuple[PageReservation, Sequence[int] | None]]) -> int:
        """`commit_pages` for several reservations at once, under one lock: the layers of one block
        range go into the directory together, a few whole-array operations instead of a few per
        layer (a peer stream and the connector's saves commit a session's layers this way).
        Raises before installing anything (every reservation still held) if a list of expected
        checksums has the wrong length: `verify_reserved` checks each before any is installed."""
        return self.install_verified([self.verify_reserved(reservation, expected) for reservation, expected in batch])

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
        checksums = actual if actual is not None else self._checksums_in_dram(reservation)
        if expected is None or checksums == list(expected):
            return VerifiedPages(reservation.record, layer, keys, slots, checksums, [], reservation.tail_key)
        bad = {i for i, (got, want) in enumerate(zip(checksums, expected, strict=True)) if got != want}
        self._front.metrics.save_degraded.labels("checksum_mismatch").inc(len(bad))
        keep = [i for i in range(len(keys)) if i not in bad]
        return VerifiedPages(
            reservation.record,
            layer,
            [keys[i] for i in keep],
            [slots[i] for i in keep],
            [checksums[i] for i in keep],
            [slots[i] for i in sorted(bad)],
            reservation.tail_key,
        )

    def _checksums_in_dram(self, reservation: PageReservation) -> list[int]:
        """The reservation's page checksums as its pages sit in DRAM, a run of consecutive slots at a time."""
        checksums: list[int] = []
        for view in self.reserved_views(reservation):
            checksums += self.reserved_checksums(reservation, len(checksums), view)
        return checksums

    def install_verified(self, verified: Sequence[VerifiedPages]) -> int:
        """Install pages `verify_reserved` checked (and give back the slots of those that failed):
        one lock, and the layers of one block range go into the directory together. Returns the
        pages kept."""
        front = self._front
        with front.lock:
            for pages in verified:
                if pages.rejected_slots:
                    front.release_slots(Tier.DRAM, pages.rejected_slots)
            for group in _same_blocks(verified):
                first = group[0]
                self._install_saved(
                    first.keys,
                    [pages.layer for pages in group],
                    np.array([pages.slots for pages in group], np.int64),
                    np.array([pages.checksums for pages in group], np.uint64),
                    first.record,
                    first.tail_key,
                )
            self._write_behind.wake()  # the writers, not only a waiting flush
        return sum(len(pages.keys) for pages in verified)

    def release_pages(self, reservation: PageReservation) -> None:
        """Give back the slots of a reservation that will not be committed."""
        with self._front.lock:
            self._front.release_slots(Tier.DRAM, reservation.slots)

    def _install_saved(
        self,
        keys: list[BlockKey],
        layers: list[int],
        slots: np.ndarray,
        checksums: np.ndarray,
        record: SessionRecord,
        tail_key: BlockKey | None,
    ) -> None:
        """Give saved pages their DRAM copies: slot `slots[j, i]` holds page (keys[i], layers[j]).
        Pages no tier holds yet, a new turn's blocks being the common save, are installed with
        whole-array operations over all the layers; if some tier holds any of them, each layer's
        pages are settled one by one first (`_keep_saved_copy`). Caller holds the lock."""
        d = self._front.directory
        ids = d.rows(keys)
        known = ids[ids >= 0]
        if len(known) and any(d.held_rows(known, layer).any() for layer in layers):
            for j, layer in enumerate(layers):
                self._install_layer_over_copies(keys, layer, slots[j].tolist(), checksums[j].tolist(), record, tail_key)
            return
        self._install_new(keys, layers, slots, checksums, record, tail_key)

    def _install_layer_over_copies(
        self,
        keys: list[BlockKey],
        layer: int,
        slots: list[int],
        checksums: list[int],
        record: SessionRecord,
        tail_key: BlockKey | None,
    ) -> None:
        d = self._front.directory
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
            tail_key,
        )

    def _install_new(
        self,
        keys: list[BlockKey],
        layers: list[int],
        slots: np.ndarray,
        checksums: np.ndarray,
        record: SessionRecord,
        tail_key: BlockKey | None,
    ) -> None:
        """Install pages that no tier holds (see `_install_saved`). Caller holds the lock."""
        front = self._front
        d = front.directory
        rows = d.rows(keys)  # looked up now: settling copies may have released a row
        for at in np.flatnonzero(rows < 0).tolist():  # blocks new to the directory
            rows[at] = d.ensure_row(keys[at], record.key, record.priority, keys[at] == tail_key)
        cells = np.ix_(rows, np.asarray(layers, dtype=np.intp))
        d.checksum[cells] = checksums.T
        d.dram[cells] = slots.T
        d.priority[rows] = record.priority
        owed = (d.ssd_seq[cells] < 0) & ~d.persisting[cells]  # [block, layer]
        d.persisting[cells] |= owed
        d.pins[cells] += owed  # held in DRAM until the write-behind has it on SSD
        owners = d.owners
        for row in rows.tolist():
            owners[row] = record.key
        policy = front.policy(Tier.DRAM)
        for j, layer in enumerate(layers):  # layer order: the write-behind persists early layers first
            pages = list(zip(keys, itertools.repeat(layer)))
            policy.insert_many(pages, PageMeta(layer, record.key, record.priority))
            self._write_behind.queue(itertools.compress(pages, owed[:, j].tolist()))
        front.publish_complete(rows)
        # The cells filled held no DRAM copy (`_install_saved` settles held pages first): no row was
        # whole in DRAM before.
        front.holdings.stored(Tier.DRAM, rows, None)

    def _keep_saved_copy(self, key: BlockKey, layer: int, slot: int, checksum: int) -> bool:
        """A saved page that some tier already holds: True if its new DRAM copy should be installed
        (copies with other bytes dropped first), False if the slot went back unused. Caller holds
        the lock."""
        front = self._front
        d = front.directory
        row = d.row(key)
        assert row is not None
        same = int(d.checksum[row, layer]) == checksum
        if same and d.dram[row, layer] >= 0:
            front.release_slots(Tier.DRAM, [slot])  # identical bytes already cached
            front.touches.add(Tier.DRAM, (key,), (layer,))
            return False
        if not same and d.pins[row, layer]:
            # Different bytes for a page under I/O: keep the copy being read or persisted intact.
            front.release_slots(Tier.DRAM, [slot])
            front.metrics.save_degraded.labels("page_busy").inc()
            return False
        if not same:
            # New bytes under the same key: engines are deterministic per key, so this is rare (a
            # different model or dtype); the newest copy wins everywhere.
            for tier in Tier:
                front.drop_copy(key, layer, tier, "superseded")
        return True


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
