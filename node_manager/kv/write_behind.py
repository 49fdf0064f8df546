"""Write-behind: every page saved into DRAM gets a persistent copy on SSD, written by background
threads so that no save waits on the disk.

Queue: the pages (block key, layer) installed in DRAM with no SSD copy, in install order, which is
layer order within a save. Each holds a pin and its directory cell's `persisting` flag from install
until its write lands or degrades, so its row, checksum and DRAM copy stay put meanwhile.
Lock: the store's (`StoreFront.lock`); `_wake` is a condition on it, notified when pages are queued,
a transfer ends, a write finishes or the store closes. Segment files are written without it.
Failure: a write the SSD tier refuses (full, I/O error) leaves its pages in DRAM only, counted in
symphony_kv_save_degraded_total and logged once per episode (`degraded` until a write lands again).
"""

from __future__ import annotations

import contextlib
import errno
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator

import numpy as np

from node_manager.kv.pages import PageId, Tier
from node_manager.kv.segments import SegmentEntry
from node_manager.kv.slots import consecutive_runs
from node_manager.kv.ssd_tier import Segment, SsdFullError, SsdLocation
from node_manager.kv.store_front import StoreFront
from symphony.kv_addressing import BlockKey
from symphony.logs import get_logger

log = get_logger(__name__)

WritePending = tuple[BlockKey, int, int]  # (block key, layer, directory row) owed an SSD copy


class WriteBehind:
    def __init__(self, front: StoreFront) -> None:
        self._front = front
        self._queue: deque[PageId] = deque()
        self._wake = threading.Condition(front.lock)
        self._writes_in_progress = 0
        self._foreground_transfers = 0
        self._held = 0  # writer threads in `_yield_to_foreground` (stats, tests)
        self._flush_waiters = 0
        self._degraded = False
        self._stopping = False
        # More than one writer keeps the device busy while another segment waits on its fsync.
        self._threads = [
            threading.Thread(target=self._loop, name=f"kv-write-behind-{i}", daemon=True)
            for i in range(front.config.ssd_writers)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def queue(self, pages: Iterable[PageId]) -> None:
        """Owe `pages` an SSD copy; each already holds its pin and `persisting` flag. Caller holds the
        lock and calls `wake` once it has queued what it installs."""
        self._queue.extend(pages)

    def wake(self) -> None:
        """Wake the writers and any flush waiting. Caller holds the lock."""
        self._wake.notify_all()

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def holding_off(self) -> bool:
        """Whether some writer is holding off for a foreground transfer."""
        return self._held > 0

    @property
    def degraded(self) -> bool:
        """The last SSD write failed: saves are kept in DRAM only until one succeeds."""
        return self._degraded

    @contextlib.contextmanager
    def foreground_transfer(self) -> Iterator[None]:
        """Mark a latency-critical transfer (a peer pull) in progress: the write-behind yields to it."""
        with self._front.lock:
            self._foreground_transfers += 1
        try:
            yield
        finally:
            with self._front.lock:
                self._foreground_transfers -= 1
                self._wake.notify_all()

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every page saved so far has been written to SSD (or degraded) and no I/O job
        (a save still copying, a load) is in flight. True if drained within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._front.lock:
            self._flush_waiters += 1
            self._wake.notify_all()  # a write-behind holding off for a transfer goes now
            try:
                while self._queue or self._writes_in_progress or self._front.jobs_in_flight:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    self._wake.wait(min(remaining, 0.05))
                return True
            finally:
                self._flush_waiters -= 1

    def stop(self, timeout: float) -> None:
        """Let the writers finish what is queued and exit; waits up to `timeout` seconds for each."""
        with self._front.lock:
            self._stopping = True
            self._wake.notify_all()
        for thread in self._threads:
            thread.join(timeout=timeout)

    def _loop(self) -> None:
        front = self._front
        max_pages = max(1, front.config.segment_max_bytes // front.geometry.page_bytes)
        d = front.directory
        while True:
            with front.lock:
                while not self._queue and not self._stopping:
                    self._wake.wait()
                if self._stopping and not self._queue:
                    return
                self._yield_to_foreground()
                batch: list[WritePending] = []
                while self._queue and len(batch) < max_pages:
                    key, layer = self._queue.popleft()
                    row = d.row(key)
                    if row is not None and d.persisting[row, layer]:
                        batch.append((key, layer, row))
                self._writes_in_progress += 1
            try:
                if batch:
                    self._persist(batch)
            finally:
                with front.lock:
                    self._writes_in_progress -= 1
                    self._wake.notify_all()

    def _yield_to_foreground(self) -> None:
        """Hold the next segment write while a foreground transfer runs: persisting competes for CPU
        and memory bandwidth with the transfer a request waits on, and the SSD copy is a backstop on
        no request's path. Bounded: never longer than write_behind_max_delay_s, never while a flush
        waits, never once a quarter of DRAM waits to be persisted. Caller holds the lock."""
        front = self._front
        deadline = time.monotonic() + front.config.write_behind_max_delay_s
        high_water = max(1, front.dram.num_slots // 4)
        self._held += 1  # a count: each writer holds off on its own
        try:
            while (
                self._foreground_transfers
                and not self._flush_waiters
                and not self._stopping
                and len(self._queue) < high_water
            ):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._wake.wait(remaining)
        finally:
            self._held -= 1

    def _persist(self, batch: list[WritePending]) -> None:
        # The persisting pin keeps each page's row, checksum and DRAM copy in place until the end.
        # The batch's pages are distinct, so its bookkeeping runs as whole-array operations: the
        # lock is shared with the saves this write trails.
        front = self._front
        d, ssd = front.directory, front.ssd
        nbytes = ssd.segment_bytes(len(batch))
        rows = np.fromiter((row for _, _, row in batch), np.int64, len(batch))
        layers = np.fromiter((layer for _, layer, _ in batch), np.int64, len(batch))
        with front.lock:
            checksums = d.checksum[rows, layers]
            slots = d.dram[rows, layers]
            tails = d.tail[rows]
        entries = [
            SegmentEntry(key, layer, checksum, tail)
            for (key, layer, _), checksum, tail in zip(batch, checksums.tolist(), tails.tolist(), strict=True)
        ]
        # One buffer per run of consecutive slots (a save's slots mostly are): fewer, longer writes.
        views = [front.dram.run_view(int(slots[start]), stop - start) for start, stop in consecutive_runs(slots)]
        try:
            with front.lock:
                seq, evicted = ssd.reserve(nbytes)
                self._forget_segments(evicted)
        except SsdFullError as exc:
            self._degrade(batch, "ssd_full", exc)
            return
        started = time.perf_counter()
        for attempt in range(2):
            try:
                ssd.write(seq, entries, views)
                break
            except OSError as exc:
                full = exc.errno == errno.ENOSPC
                retry = False
                with front.lock:
                    ssd.release_reservation(nbytes)
                    if full and attempt == 0:
                        # The disk is fuller than it said: older segments make room, and it writes again.
                        freed = ssd.evict_for(nbytes)
                        self._forget_segments(freed, "disk_full")
                        if freed:
                            with contextlib.suppress(SsdFullError):
                                seq, evicted = ssd.reserve(nbytes)
                                self._forget_segments(evicted)
                                retry = True
                if not retry:
                    self._degrade(batch, "ssd_full" if full else "ssd_error", exc)
                    return
        front.meters.observe_io(Tier.SSD, "write", len(batch), started)
        with front.lock:
            segment = ssd.commit(seq, entries)
            d.persisting[rows, layers] = False
            d.pins[rows, layers] -= 1
            keys = d.keys
            # A page replaced while it was written (another key on its row, other bytes) keeps no SSD copy.
            current = d.checksum[rows, layers] == checksums
            current &= np.fromiter((keys[row] == key for key, _, row in batch), np.bool_, len(batch))
            written = np.flatnonzero(current)
            blocks = np.fromiter(dict.fromkeys(rows[written].tolist()), np.int64)
            before = front.holdings.complete(Tier.SSD, blocks)
            d.ssd_seq[rows[written], layers[written]] = seq
            d.ssd_page[rows[written], layers[written]] = written
            front.holdings.stored(Tier.SSD, blocks, before)
            for index in np.flatnonzero(~current).tolist():
                ssd.drop_page(SsdLocation(seq, index))
            if self._degraded:
                self._degraded = False
                log.info("KV saves reach SSD again", segment=segment.path.name)
            front.refresh_gauges()

    def _forget_segments(self, segments: list[Segment], reason: str = "capacity") -> None:
        """Segments the SSD tier evicted to make room (`reason`: for its capacity, or for a disk
        found full): their pages lose their SSD copy. Caller holds the lock."""
        front = self._front
        d = front.directory
        for segment in segments:
            gone: list[tuple[BlockKey, int, int]] = []  # (key, layer, row) whose SSD copy is this one
            for index in list(segment.live):
                entry_meta = segment.header.entries[index]
                row = d.row(entry_meta.block_key)
                if row is not None and d.ssd_location(row, entry_meta.layer) == SsdLocation(segment.seq, index):
                    gone.append((entry_meta.block_key, entry_meta.layer, row))
            front.holdings.removing_keys(Tier.SSD, [key for key, _, _ in gone])
            for _, layer, row in gone:  # a row keeps a copy of each layer still to clear: none is released early
                d.set_ssd(row, layer, None)
                front.metrics.evictions.labels(Tier.SSD.name, reason).inc()
                front.after_copy_dropped(row, layer, reason)

    def _degrade(self, batch: list[WritePending], reason: str, exc: BaseException) -> None:
        front = self._front
        front.metrics.save_degraded.labels(reason).inc(len(batch))
        d = front.directory
        with front.lock:
            for _, layer, row in batch:
                d.persisting[row, layer] = False
                d.pins[row, layer] -= 1
            if not self._degraded:
                self._degraded = True  # one line per degraded episode, not one per batch
                log.warning(
                    "KV saves stay in DRAM only: the SSD tier refused a write",
                    reason=reason,
                    error=str(exc),
                    directory=str(front.ssd.directory),
                )
