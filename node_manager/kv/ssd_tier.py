"""The SSD tier: segment files in one directory, their index, and LRU space management.

Bookkeeping methods (`rebuild`, `reserve`, `commit`, `drop_page`, `touch`, `pin`/`unpin`) are called
under the store's lock and do no I/O beyond unlinking; `write` and `read_into` do the file I/O and
are called without it, on the store's I/O threads.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from node_manager.kv.eviction import LRUPolicy
from node_manager.kv.pages import PageId, PageMac
from node_manager.kv.segments import (
    ALIGN,
    SUFFIX,
    TMP_SUFFIX,
    OutdatedSegment,
    SegmentEntry,
    SegmentFormatError,
    SegmentHeader,
    decode_header,
    encode_header,
    fixed_header_size,
    header_length,
    parse_header,
    segment_name,
)
from symphony.kv_addressing import ModelFingerprint
from symphony.logs import get_logger

log = get_logger(__name__)


QUARANTINE_DIR = "quarantine"  # under the tier's directory: segments a rebuild could not read
MAX_QUARANTINED = 64  # kept there, newest first


def _aligned_copy(data: bytes) -> mmap.mmap:
    """`data` in page-aligned memory, as O_DIRECT requires of every buffer it writes."""
    buffer = mmap.mmap(-1, len(data))
    buffer[:] = data
    return buffer


def _disk_free(directory: Path) -> int:
    """Bytes free to an unprivileged writer on `directory`'s filesystem."""
    return shutil.disk_usage(directory).free


def _unlink(path: Path) -> None:
    """Delete a file the rebuild does not load; one that cannot be deleted is left (never loaded, seen
    again at the next rebuild) rather than failing the node's start."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot delete a KV segment that is not loaded", path=str(path), error=str(exc))


class SsdFullError(OSError):
    """No room on the SSD tier for a segment, even after evicting every unpinned one."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)


@dataclass(slots=True)
class Segment:
    header: SegmentHeader
    path: Path
    live: set[int] = field(default_factory=set)  # entry indexes still referenced by the page directory
    pins: int = 0  # reads in progress

    @property
    def seq(self) -> int:
        return self.header.seq

    @property
    def file_bytes(self) -> int:
        return self.header.file_bytes


@dataclass(frozen=True, slots=True)
class SsdLocation:
    seq: int
    index: int


@dataclass(slots=True)
class RebuildReport:
    """What `SsdTier.rebuild` found: the pages it indexed and the segments it did not load."""

    # (page, location, checksum, partial tail block), oldest segment first
    pages: list[tuple[PageId, SsdLocation, int, bool]]
    damaged: int = 0  # segments that fail the format's checks (bad bytes, too short), deleted
    quarantined: int = 0  # segments that could not be read (an I/O error, not their bytes), moved aside
    outdated: int = 0  # segments of an older format, deleted
    other_models: dict[ModelFingerprint, int] = field(default_factory=dict)  # segments per foreign fingerprint
    kept_other_models: bool = False  # those were kept on disk (else deleted)


class SsdTier:
    def __init__(
        self,
        directory: Path,
        page_bytes: int,
        capacity_bytes: int,
        model: ModelFingerprint,
        *,
        direct_io: bool = False,
        keep_other_models: bool = False,
        headroom_bytes: int = 0,
        disk_free: Callable[[Path], int] | None = None,
        mac: PageMac | None = None,
    ) -> None:
        """`model`: the fingerprint of the model whose pages this tier holds; segments of any other
        are never loaded. At `rebuild` they are deleted, or with `keep_other_models` left on disk
        unloaded (for a rollback to that model) as the least recently used segments: they count
        against the capacity and are the first to go when room is needed.
        `direct_io`: the caller's page buffers are page-aligned (the DRAM arena's are when a page
        is a whole number of 4 KiB), so segments may bypass the page cache (see `write`).
        `headroom_bytes`: what the tier leaves free on its filesystem. Every reservation is held
        under the capacity and under what the disk has free (`disk_free`, default its statvfs)
        less the headroom, evicting segments as for the capacity: a disk that others fill, or one
        smaller than the capacity, shrinks the tier instead of failing its writes.
        `mac`: the pages' MAC (default: no secret); another key's segments count as another model's."""
        self.directory = Path(directory)
        self.page_bytes = page_bytes
        self.capacity_bytes = capacity_bytes
        self.model = model
        self.mac = mac or PageMac(b"")
        self.owner = model + self.mac.key_id  # `SegmentHeader.owner` of the segments it may load
        self.keep_other_models = keep_other_models
        self.headroom_bytes = headroom_bytes
        self._disk_free = disk_free or _disk_free
        self.other_model_segments = 0  # kept segments of other models on disk (not loaded)
        self.segments: dict[int, Segment] = {}
        self.used_bytes = 0  # bytes of committed segments plus reservations
        self._lru: LRUPolicy[int] = LRUPolicy()  # segment numbers
        self._next_seq = 1
        self._direct = direct_io and page_bytes % ALIGN == 0 and hasattr(os, "O_DIRECT")
        self.directory.mkdir(parents=True, exist_ok=True)

    # ---- restart ----------------------------------------------------------------------------------

    def rebuild(self) -> RebuildReport:
        """Index every whole segment of this tier's model on disk (oldest first, so newer copies of a
        page win) and delete leftovers of interrupted writes. Segments of another model are not
        indexed (see `__init__`)."""
        report = RebuildReport(pages=[], kept_other_models=self.keep_other_models)
        for tmp in self.directory.glob(f"*{TMP_SUFFIX}"):
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        headers: list[tuple[SegmentHeader, Path]] = []
        foreign: list[tuple[SegmentHeader, Path]] = []
        for path in self.directory.glob(f"*{SUFFIX}"):
            try:
                header = self._read_header(path)
                if header.owner != self.owner:
                    # Before the page size check: another model's pages may well be another size.
                    report.other_models[header.model] = report.other_models.get(header.model, 0) + 1
                    if self.keep_other_models:
                        foreign.append((header, path))
                    else:
                        _unlink(path)
                    continue
                if header.page_bytes != self.page_bytes:
                    raise SegmentFormatError(f"page size {header.page_bytes} is not {self.page_bytes}")
            except OutdatedSegment:
                # Not damage: an upgrade. One line for all of them, below, not one per file.
                report.outdated += 1
                _unlink(path)
                continue
            except SegmentFormatError as exc:
                report.damaged += 1
                log.warning("dropping a damaged KV segment", path=str(path), error=str(exc))
                _unlink(path)
                continue
            except FileNotFoundError:
                continue  # gone meanwhile
            except OSError as exc:
                # Its bytes were never judged: a disk error, a permission. Not loaded, not deleted:
                # moved aside for an operator to look at, up to MAX_QUARANTINED a start (a whole
                # unreadable disk is left in place beyond that, never loaded).
                report.quarantined += 1
                if report.quarantined <= MAX_QUARANTINED:
                    self._quarantine(path)
                log.warning("a KV segment could not be read; not loaded, not deleted", path=str(path), error=str(exc))
                continue
            headers.append((header, path))
        if report.quarantined:
            log.warning(
                "KV segments that could not be read were moved aside",
                segments=report.quarantined,
                quarantine=str(self.directory / QUARANTINE_DIR),
            )
        if report.outdated:
            log.warning(
                "dropped KV segments written in an older format; their sessions recompute",
                segments=report.outdated,
                directory=str(self.directory),
            )
        if report.other_models:
            log.warning(
                "KV segments of another model or cluster secret were not loaded"
                + (
                    "; kept on disk for a rollback (kv.ssd_keep_other_models)"
                    if self.keep_other_models
                    else "; deleted (kv.ssd_keep_other_models = true keeps them for a rollback)"
                ),
                segments=sum(report.other_models.values()),
                their_models=",".join(fp.hex()[:12] for fp in sorted(report.other_models)),
                this_model=self.model.hex()[:12],
                directory=str(self.directory),
            )
        # Kept segments first: the least recently used, so the first evicted when room is needed.
        for header, path in sorted(foreign, key=lambda hp: hp[0].seq):
            self._add(Segment(header, path))
        for header, path in sorted(headers, key=lambda hp: hp[0].seq):
            self._add(Segment(header, path, live=set(range(len(header.entries)))))
            for index, entry in enumerate(header.entries):
                location = SsdLocation(header.seq, index)
                report.pages.append(((entry.block_key, entry.layer), location, entry.checksum, entry.tail))
        room = self.room_bytes()
        if room < self.capacity_bytes:
            log.warning(
                "the SSD tier's disk is short of its capacity: the tier holds what fits",
                directory=str(self.directory),
                capacity_bytes=self.capacity_bytes,
                room_bytes=max(room, 0),
                headroom_bytes=self.headroom_bytes,
            )
        return report

    def _quarantine(self, path: Path) -> None:
        """Move `path` into QUARANTINE_DIR under the tier's directory, keeping the newest
        MAX_QUARANTINED there (the oldest deleted beyond). Its bytes still take disk room, which
        `room_bytes` sees; a file that cannot be moved stays where it is (seen again next start)."""
        aside = self.directory / QUARANTINE_DIR
        # A name of its own (a later segment may take this one's number) and the time it came in.
        moved = aside / f"{path.stem}-{time.time_ns()}{path.suffix}"
        try:
            aside.mkdir(exist_ok=True)
            path.rename(moved)
            os.utime(moved)
            kept = sorted(aside.iterdir(), key=lambda p: p.stat().st_mtime)
        except OSError as exc:
            log.warning("cannot quarantine a KV segment", path=str(path), error=str(exc))
            return
        for old in kept[: max(0, len(kept) - MAX_QUARANTINED)]:
            _unlink(old)

    def _add(self, segment: Segment) -> None:
        self.segments[segment.seq] = segment
        self._lru.insert(segment.seq)
        self.used_bytes += segment.file_bytes
        self._next_seq = max(self._next_seq, segment.seq + 1)  # kept segments' names stay taken
        self.other_model_segments += segment.header.owner != self.owner

    def _read_header(self, path: Path) -> SegmentHeader:
        """The segment's header: SegmentFormatError for bytes that fail the format's checks (a
        header or pages past the file's end among them), OSError for a file that cannot be read."""
        with path.open("rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            prefix = fh.read(fixed_header_size())
            _, header_len = decode_header(prefix)
            if header_len > size:  # before reading it: a forged length must not allocate gigabytes
                raise SegmentFormatError(f"a {header_len}-byte header in a {size}-byte file")
            header = parse_header(prefix + fh.read(header_len - len(prefix)))
        if size < header.file_bytes:
            raise SegmentFormatError("file shorter than its header says")
        return header

    # ---- space ------------------------------------------------------------------------------------

    def segment_bytes(self, pages: int) -> int:
        return header_length(pages) + pages * self.page_bytes

    def reserve(self, nbytes: int) -> tuple[int, list[Segment]]:
        """Claim room for a segment of `nbytes`, evicting least recently used unpinned segments.
        Returns (seq for the new segment, evicted segments whose live pages are now gone)."""
        if nbytes > self.capacity_bytes:
            raise SsdFullError(f"a {nbytes}-byte segment exceeds the SSD tier capacity {self.capacity_bytes}")
        evicted: list[Segment] = []
        excess = self.used_bytes + nbytes - self.room_bytes()
        if excess > 0:
            for seq in self._lru.oldest_first():
                segment = self.segments[seq]
                if segment.pins:
                    continue
                evicted.append(segment)
                excess -= segment.file_bytes
                if excess <= 0:
                    break
            if excess > 0:  # evicting all it could would not make room: it evicts nothing
                raise SsdFullError("no room on the SSD tier: its segments are under I/O or its disk is full")
            for segment in evicted:
                self._remove(segment)
        seq = self._next_seq
        self._next_seq += 1
        self.used_bytes += nbytes
        return seq, evicted

    def room_bytes(self) -> int:
        """What the tier may hold now: its capacity, or less when the disk is short of room (its
        segments and reservations, plus what the disk has free beyond the headroom). A reservation
        not yet written is still in the disk's free bytes, so writers reserving at once may each
        count the same free bytes: the headroom must cover `ssd_writers` segments (the default 1 GiB
        does, many times), or a write can still end in ENOSPC (the batch is then degraded)."""
        try:
            free = self._disk_free(self.directory)
        except OSError:
            return self.capacity_bytes  # cannot tell: the capacity, and writes report ENOSPC if it comes
        return min(self.capacity_bytes, self.used_bytes + free - self.headroom_bytes)

    def evict_for(self, nbytes: int) -> list[Segment]:
        """Evict least recently used unpinned segments holding at least `nbytes`, whatever the
        capacity and the disk say: a write found the disk full all the same (others filled it
        since, or writers counted the same free bytes). Fewer when fewer can go. Returns them."""
        evicted: list[Segment] = []
        for seq in self._lru.oldest_first():
            if nbytes <= 0:
                break
            segment = self.segments[seq]
            if segment.pins:
                continue
            evicted.append(segment)
            nbytes -= segment.file_bytes
        for segment in evicted:
            self._remove(segment)
        return evicted

    def release_reservation(self, nbytes: int) -> None:
        self.used_bytes -= nbytes

    def commit(self, seq: int, entries: list[SegmentEntry]) -> Segment:
        header = SegmentHeader(
            seq, self.page_bytes, header_length(len(entries)), self.model, tuple(entries), self.mac.key_id
        )
        segment = Segment(header, self.directory / segment_name(seq), live=set(range(len(entries))))
        self.segments[seq] = segment
        self._lru.insert(seq)
        return segment

    def drop_page(self, location: SsdLocation) -> None:
        """A page's SSD copy is superseded or evicted; a segment with no live page is deleted."""
        segment = self.segments.get(location.seq)
        if segment is None:
            return
        segment.live.discard(location.index)
        if not segment.live and not segment.pins:
            self._remove(segment)

    def _remove(self, segment: Segment) -> None:
        if self.segments.get(segment.seq) is segment:
            self.other_model_segments -= segment.header.owner != self.owner
        self.segments.pop(segment.seq, None)
        self._lru.remove(segment.seq)
        self.used_bytes -= segment.file_bytes
        with contextlib.suppress(FileNotFoundError):
            segment.path.unlink()

    def touch(self, seq: int) -> None:
        self._lru.touch(seq)

    def pin(self, seq: int) -> Segment | None:
        segment = self.segments.get(seq)
        if segment is not None:
            segment.pins += 1
        return segment

    def unpin(self, segment: Segment) -> None:
        segment.pins -= 1
        if not segment.pins and not segment.live and segment.seq in self.segments:
            self._remove(segment)

    # ---- I/O (no lock held) -----------------------------------------------------------------------

    def write(self, seq: int, entries: list[SegmentEntry], pages: list[memoryview]) -> None:
        """Write a whole segment durably: temp file, fsync, rename, fsync the directory.

        Pages go to the device with O_DIRECT where the file system takes it: a buffered write first
        copies every byte into the page cache and then waits for writeback at fsync, which costs a
        core that the DRAM saves it trails need too (docs/design-notes.md#ssd-direct-io). A file
        system that refuses it (tmpfs) gets buffered writes."""
        final = self.directory / segment_name(seq)
        tmp = final.with_suffix(TMP_SUFFIX)
        header = encode_header(seq, self.page_bytes, self.model, entries, self.mac.key_id)
        try:
            if self._direct:
                try:
                    self._write_file(tmp, _aligned_copy(header), pages, os.O_DIRECT)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self._direct = False
                    log.info(
                        "the SSD tier writes through the page cache: O_DIRECT was refused",
                        directory=str(self.directory),
                        error=str(exc),
                    )
                    self._write_file(tmp, header, pages, 0)
            else:
                self._write_file(tmp, header, pages, 0)
            os.rename(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()  # a part written (a full disk) holds room the retry needs
            raise
        try:
            dir_fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                final.unlink()  # not durable: the caller counts it unwritten, so it must not stay
            raise

    @staticmethod
    def _write_file(path: Path, header: bytes | mmap.mmap, pages: list[memoryview], flags: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o600)
        try:
            buffers: list[bytes | mmap.mmap | memoryview] = [header, *pages]
            expected = sum(len(b) for b in buffers)
            written = 0
            while buffers:
                # writev caps at IOV_MAX buffers and may write short; keep going from where it stopped.
                chunk = buffers[:512]
                n = os.writev(fd, chunk)
                written += n
                while n and buffers:
                    head = buffers[0]
                    if n >= len(head):
                        n -= len(head)
                        buffers.pop(0)
                    else:
                        buffers[0] = memoryview(head)[n:]
                        n = 0
            if written != expected:  # pragma: no cover - writev contract
                raise OSError(errno.EIO, f"short segment write ({written} of {expected} bytes)")
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            raise
        os.close(fd)

    def read_into(self, segment: Segment, reads: list[tuple[int, memoryview]]) -> None:
        """Read entries (index, destination) of one segment; runs of adjacent entries become one
        scattered `preadv`, straight into the destination buffers."""
        reads = sorted(reads, key=lambda r: r[0])
        fd = os.open(segment.path, os.O_RDONLY)
        try:
            start = 0
            while start < len(reads):
                end = start + 1
                while end < len(reads) and reads[end][0] == reads[end - 1][0] + 1 and end - start < 512:
                    end += 1
                run = [dest for _, dest in reads[start:end]]
                offset = segment.header.page_offset(reads[start][0])
                expected = len(run) * self.page_bytes
                got = os.preadv(fd, run, offset)
                if got != expected:
                    raise OSError(errno.EIO, f"short read from {segment.path.name} ({got} of {expected} bytes)")
                start = end
        finally:
            os.close(fd)

    def advise_willneed(self, segment: Segment, first: int, last: int) -> None:
        """Start asynchronous reads of entries first..last (best effort: a failure only loses the hint)."""
        with contextlib.suppress(OSError):
            fd = os.open(segment.path, os.O_RDONLY)
            try:
                start = segment.header.page_offset(first)
                os.posix_fadvise(fd, start, segment.header.page_offset(last + 1) - start, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def drop_cache(self) -> None:
        """Evict this tier's files from the OS page cache (benchmarks measure uncached reads)."""
        for segment in list(self.segments.values()):
            with contextlib.suppress(OSError):
                fd = os.open(segment.path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
