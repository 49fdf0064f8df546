"""Fixed-size page slots: the allocator, and the two slot-backed tiers (DRAM arena, device pool).

Both tiers expose their storage as one int64 tensor `[num_slots, page_words]`: a page is one row, so
a layer's worth of pages moves with a single gather/scatter (`index_select`/`index_copy_`), which runs
near memcpy speed where a Python loop over 24 KB pages would not.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from symphony.kv_geometry import KVGeometry
from symphony.logs import get_logger

log = get_logger(__name__)

_SHM_DIR = Path("/dev/shm")
# Linux's madvise advices (5.14+); Python 3.11's mmap module does not name them.
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def consecutive_runs(slots: Sequence[int] | np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) offsets of the runs in which each slot is one more than the one before."""
    if isinstance(slots, list) and slots and slots == list(range(slots[0], slots[0] + len(slots))):
        # The usual case (fresh slots come off the free stack in order), checked in C: the array
        # operations below cost ~50 us per call, paid per layer of every page stream frame.
        return [(0, len(slots))]
    breaks = (np.flatnonzero(np.diff(np.asarray(slots, dtype=np.int64)) != 1) + 1).tolist()
    return list(itertools.pairwise([0, *breaks, len(slots)])) if len(slots) else []


def paired_runs(
    dst_rows: Sequence[int] | np.ndarray, src_rows: Sequence[int] | np.ndarray
) -> list[tuple[int, int, int]]:
    """(first destination row, first source row, rows) of each stretch where both sides run on by
    one; found with array operations (once per layer of every load)."""
    dst_at = np.asarray(dst_rows, dtype=np.int64)
    src_at = np.asarray(src_rows, dtype=np.int64)
    if not len(dst_at):
        return []
    starts = np.concatenate(([0], np.flatnonzero((np.diff(dst_at) != 1) | (np.diff(src_at) != 1)) + 1))
    counts = np.diff(np.append(starts, len(dst_at)))
    return list(zip(dst_at[starts].tolist(), src_at[starts].tolist(), counts.tolist(), strict=True))


def copy_rows(
    dst: torch.Tensor, dst_rows: Sequence[int] | np.ndarray, src: torch.Tensor, src_rows: Sequence[int] | np.ndarray
) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] for all i.

    Runs where both sides are consecutive become slice copies (memcpy speed: slot allocation and
    save order make long runs the common case); scattered rows fall back to one gather + scatter.
    Runs are found with array operations: this sits on every load's path, once per layer and lane.

    With a CUDA tensor on either side the copies are queued on the current stream and may still be
    running on return: the caller waits for that stream (an event, a synchronize) before another
    stream or the host reads `dst`, and before `src`'s memory is reused. Scattered rows between host
    and device memory are queued without waiting on the stream when the host side is one run (a
    load's arena slots, a save's reserved ones), as `_across_devices` says; otherwise this waits.
    """
    dst_at = np.asarray(dst_rows, dtype=np.int64)
    src_at = np.asarray(src_rows, dtype=np.int64)
    if len(dst_at) != len(src_at):
        raise ValueError(f"{len(dst_at)} destination rows for {len(src_at)} source rows")
    if not len(dst_at):
        return
    runs = paired_runs(dst_at, src_at)
    if len(runs) * 4 <= len(dst_at) or len(runs) <= 2:
        for d, s, count in runs:
            dst[d : d + count].copy_(src[s : s + count], non_blocking=True)
        return
    if dst.device != src.device:
        _across_devices(dst, dst_at, src, src_at)
        return
    dst.index_copy_(0, _index_on(dst_at, dst.device), src.index_select(0, _index_on(src_at, src.device)))


def _across_devices(dst: torch.Tensor, dst_at: np.ndarray, src: torch.Tensor, src_at: np.ndarray) -> None:
    """Scattered rows between host and device memory. Host side one run: one copy across, and the
    gather or scatter on the device, all queued on the current stream. Both sides scattered: gathered
    where the rows are, copied across with a wait (the host scatters what has arrived), scattered."""
    if src.device.type == "cpu" and len(consecutive_runs(src_at)) == 1:
        first = int(src_at[0])
        staged = src[first : first + len(src_at)].to(dst.device, non_blocking=True)
        dst.index_copy_(0, _index_on(dst_at, dst.device), staged)
    elif dst.device.type == "cpu" and len(consecutive_runs(dst_at)) == 1:
        first = int(dst_at[0])
        dst[first : first + len(dst_at)].copy_(src.index_select(0, _index_on(src_at, src.device)), non_blocking=True)
    else:
        gathered = src.index_select(0, _index_on(src_at, src.device)).to(dst.device)
        dst.index_copy_(0, _index_on(dst_at, dst.device), gathered)


def _index_on(rows: np.ndarray, device: torch.device) -> torch.Tensor:
    """`rows` as an index tensor on `device`; onto a CUDA device from pinned memory, without a wait."""
    index = torch.from_numpy(rows)
    if device.type == "cpu":
        return index
    return index.pin_memory().to(device, non_blocking=True)


class SlotAllocator:
    """Free-slot stack; LIFO so recently freed (cache-warm) slots are reused first."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """`count` slots, or None (and nothing taken) if fewer are free."""
        if count > len(self._free):
            return None
        taken = self._free[len(self._free) - count :]
        del self._free[len(self._free) - count :]
        return taken[::-1]

    def release(self, slots: list[int]) -> None:
        self._free.extend(slots)


def _populate(mapping: mmap.mmap, *, write: bool, required: bool) -> None:
    """Map every page of `mapping` into this process now, writable if `write`.

    Writable matters: pages populated for reading (what MAP_POPULATE does to a shared mapping) still
    cost the first write to each of them (docs/design-notes.md#dram-arena-population). Kernels
    before 5.14 lack those advices; an arena we create then gets one write per page instead
    (`required`), an attached one nothing.
    """
    advice = _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ
    try:
        mapping.madvise(advice)
        return
    except OSError as exc:
        if not required:
            return
        if exc.errno != errno.EINVAL:  # the advice is known but failed: no memory behind the file
            raise
    view = memoryview(mapping)
    try:
        view[:: mmap.PAGESIZE] = bytes(len(range(0, len(view), mmap.PAGESIZE)))  # fresh file: zeros stay zeros
    finally:
        view.release()


class DramArena:
    """The DRAM tier's storage: a named POSIX shared-memory file of page slots.

    Named (not anonymous) so the vLLM worker process can map it and copy pages straight into its KV
    cache without a round trip through the node manager; `attach` is that consumer's side. On CUDA
    the mapping is registered as pinned host memory so copies to the device run as async DMA.
    """

    def __init__(
        self,
        name: str,
        geometry: KVGeometry,
        capacity_bytes: int,
        *,
        create: bool = True,
        pin_for_cuda: bool = False,
        writable: bool = True,
    ) -> None:
        self.name = name
        self.geometry = geometry
        self.num_slots = capacity_bytes // geometry.page_bytes
        self.path = _SHM_DIR / name
        size = max(self.num_slots, 1) * geometry.page_bytes
        if create:
            # A previous node manager killed with -9 leaves its arena behind; this name is ours.
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            stat = os.statvfs(_SHM_DIR)
            if size > stat.f_bavail * stat.f_frsize:
                # Populating more than /dev/shm holds would fail later with SIGBUS; say so now.
                raise OSError(
                    f"the DRAM arena needs {size >> 20} MiB but {_SHM_DIR} has "
                    f"{stat.f_bavail * stat.f_frsize >> 20} MiB free; lower kv.dram_bytes or "
                    "enlarge /dev/shm (docker: --shm-size)"
                )
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        else:
            fd = os.open(self.path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            if create:
                os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if create or writable else mmap.ACCESS_READ)
        finally:
            os.close(fd)
        if create:
            # Allocate every page now: a tier must not discover at run time that /dev/shm cannot
            # back it, and first-touch faults would otherwise land on the first saves.
            try:
                _populate(self._mmap, write=True, required=True)
            except OSError as exc:
                self._mmap.close()
                self.path.unlink(missing_ok=True)
                raise OSError(
                    exc.errno,
                    f"could not allocate the {size >> 20} MiB DRAM arena in {_SHM_DIR} "
                    f"({exc.strerror}); lower kv.dram_bytes or enlarge /dev/shm",
                ) from None
        else:
            # This process's own page tables: without them its first pass over each page faults
            # (docs/design-notes.md#dram-arena-population).
            _populate(self._mmap, write=writable, required=False)
        self._owner = create
        buffer = self._mmap if create or writable else memoryview(self._mmap)
        # torch.frombuffer over a read-only mapping warns once; such consumers only read it.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(buffer, dtype=torch.int64, count=size // 8)
        self.pages = flat.view(max(self.num_slots, 1), geometry.page_words)
        # run_view runs once per run of slots saved, received or persisted: no per-call mapping view.
        self._page_bytes = geometry.page_bytes
        self._bytes = memoryview(self._mmap)
        self.pinned = False
        if pin_for_cuda and torch.cuda.is_available():
            cudart = torch.cuda.cudart()
            if cudart.cudaHostRegister(self.pages.data_ptr(), size, 0) == 0:
                self.pinned = True
            else:
                log.warning("could not pin the DRAM arena; host-device copies will be synchronous", arena=name)

    @classmethod
    def attach(
        cls, name: str, geometry: KVGeometry, capacity_bytes: int, writable: bool = False, pin_for_cuda: bool = False
    ) -> DramArena:
        """Map an existing arena (the consumer side, e.g. the vLLM worker). Writable for a process
        that fills slots the store reserved for it (`reserve_pages`); read-only otherwise."""
        return cls(name, geometry, capacity_bytes, create=False, writable=writable, pin_for_cuda=pin_for_cuda)

    def run_view(self, first_slot: int, count: int) -> memoryview:
        """The bytes of `count` consecutive slots from `first_slot`."""
        return self._bytes[first_slot * self._page_bytes : (first_slot + count) * self._page_bytes]

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.pages.data_ptr())
            self.pinned = False
        del self.pages
        with contextlib.suppress(BufferError):
            self._bytes.release()
        with contextlib.suppress(BufferError):
            self._mmap.close()
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


class DevicePool:
    """The HBM tier's storage: page slots in the engine device's memory (CPU memory on this machine)."""

    def __init__(self, geometry: KVGeometry, capacity_bytes: int, device: str) -> None:
        self.geometry = geometry
        self.num_slots = capacity_bytes // geometry.page_bytes
        self.device = torch.device(device)
        self.pages = torch.zeros(max(self.num_slots, 1), geometry.page_words, dtype=torch.int64, device=self.device)

    def close(self) -> None:
        del self.pages
