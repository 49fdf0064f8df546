"""A shared-memory index of the blocks a node's tiers hold in every layer, read without a round trip.

For every new request, vLLM's scheduler asks the connector how many leading blocks of the request's
history the node's tiers can load. Asked over the node-local channel, that question costs a wake-up
of a node manager thread in the middle of vLLM's scheduling step (docs/design-notes.md#block-index).
So the node manager publishes the set of complete blocks here, and the connector maps it and looks
its request's block keys up itself (it computes them with the same chained hash).

Layout: a header (magic, capacity) and then `capacity` uint64 slots, a power of two: open addressing
with linear probing over 64-bit fingerprints of the block keys (the first 8 bytes of the sha256,
0 reserved for an empty slot). Deleting shifts the entries after it back (no tombstones), so the table
never needs a rebuild and a probe ends at the first empty slot. One writer, the node manager, under its
store's lock; readers take no lock. Aligned 8-byte stores are atomic, so a reader racing the writer
sees each slot either before or after a change: it can miss a block being moved or added (the request
recomputes it) or see one just dropped (the load reports it failed and vLLM recomputes it). Neither
gives wrong KV. Two keys with the same fingerprint (odds ~n²/2⁶⁵) would read as both present, which
costs the same recompute.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from symphony.kv_addressing import BlockKey

_SHM_DIR = Path("/dev/shm")
_MAGIC = b"SYMBIDX1"
_HEADER = struct.Struct("<8sQ")  # magic, capacity in slots
_HEADER_BYTES = 64  # the table starts cache-line aligned
_EMPTY = 0
MIN_SLOTS = 1024
_BATCH_LOOKUP_MIN = 32  # keys from which `leading` looks them up together (see there)


def fingerprint(key: BlockKey) -> int:
    value = int.from_bytes(key[:8], "little")
    return value or 1  # 0 marks an empty slot


def fingerprints(keys: Sequence[BlockKey]) -> np.ndarray:
    """`fingerprint` of every key, as a uint64 array."""
    raw = np.frombuffer(b"".join(keys), dtype="<u8").reshape(len(keys), -1)[:, 0].astype(np.uint64)
    raw[raw == _EMPTY] = 1
    return raw


def slots_for(max_blocks: int) -> int:
    """Table size for up to `max_blocks` entries: a power of two at most half full, so a probe stays
    short (expected ~1.5 slots for a hit at that load)."""
    return max(MIN_SLOTS, 1 << (2 * max(max_blocks, 1) - 1).bit_length())


class _Table:
    """The mapping of one index file, its slots as a uint64 memoryview."""

    def __init__(self, path: Path, *, create_slots: int | None) -> None:
        self.path = path
        self.reader_fd = -1
        if create_slots is not None:
            size = _HEADER_BYTES + 8 * create_slots
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # a node manager killed with -9 leaves its index behind; the name is ours
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)  # zero-filled: every slot empty
                self._mmap = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
            finally:
                os.close(fd)
            self._mmap[: _HEADER.size] = _HEADER.pack(_MAGIC, create_slots)
        else:
            # A reader keeps its descriptor: fstat on it tells whether the file it maps was unlinked.
            self.reader_fd = os.open(path, os.O_RDONLY)
            try:
                self._mmap = mmap.mmap(self.reader_fd, 0, access=mmap.ACCESS_READ)
            except BaseException:
                os.close(self.reader_fd)
                raise
            magic, slots = _HEADER.unpack_from(self._mmap)
            if magic != _MAGIC or len(self._mmap) != _HEADER_BYTES + 8 * slots or slots & (slots - 1):
                self._mmap.close()
                os.close(self.reader_fd)
                raise ValueError(f"{path} is not a Symphony block index")
        self.capacity = _HEADER.unpack_from(self._mmap)[1]
        self.mask = self.capacity - 1
        self._view = memoryview(self._mmap)
        self.slots = self._view[_HEADER_BYTES:].cast("Q")
        # The same slots as an array, for lookups of many keys at once (`leading`).
        self.array = np.frombuffer(self._mmap, dtype=np.uint64, offset=_HEADER_BYTES)

    def find(self, fp: int) -> int:
        """The slot holding `fp`, or -1."""
        slots, mask = self.slots, self.mask
        at = fp & mask
        for _ in range(self.capacity):
            value = slots[at]
            if value == fp:
                return at
            if value == _EMPTY:
                return -1
            at = (at + 1) & mask
        return -1

    def found(self, fps: np.ndarray) -> np.ndarray:
        """Whether each fingerprint is in the table: `find` for all of them at once. Every key's home
        slot is read in one gather (at most half full, the table has most keys at home); the keys
        whose home holds another key go on probing one by one."""
        values = self.array[fps & np.uint64(self.mask)]
        found = values == fps
        for i in np.flatnonzero(~found & (values != _EMPTY)).tolist():
            found[i] = self.find(int(fps[i])) >= 0
        return found

    def close(self) -> None:
        del self.array  # an exported buffer would keep the mapping from closing
        self.slots.release()
        self._view.release()
        self._mmap.close()
        if self.reader_fd >= 0:
            os.close(self.reader_fd)
            self.reader_fd = -1


class BlockIndex:
    """The node manager's side: publishes which blocks are complete. Not thread-safe: the store
    calls it under its lock."""

    def __init__(self, name: str, max_blocks: int) -> None:
        self.name = name
        self.max_blocks = max_blocks
        self._table = _Table(_SHM_DIR / name, create_slots=slots_for(max_blocks))
        self._count = 0
        self.refused = 0  # adds beyond max_blocks (the tiers cannot hold that many; counted if they do)

    @property
    def path(self) -> Path:
        return self._table.path

    def __len__(self) -> int:
        return self._count

    def __contains__(self, key: BlockKey) -> bool:
        return self._table.find(fingerprint(key)) >= 0

    def add(self, keys: Iterable[BlockKey]) -> None:
        table = self._table
        slots, mask = table.slots, table.mask
        for key in keys:
            fp = fingerprint(key)
            at = fp & mask
            while slots[at] != _EMPTY and slots[at] != fp:
                at = (at + 1) & mask
            if slots[at] == fp:
                continue
            if self._count >= self.max_blocks:
                self.refused += 1  # a miss for readers (recompute), never an overfull table
                continue
            slots[at] = fp
            self._count += 1

    def discard(self, key: BlockKey) -> None:
        table = self._table
        at = table.find(fingerprint(key))
        if at < 0:
            return
        slots, mask = table.slots, table.mask
        slots[at] = _EMPTY
        self._count -= 1
        # Backward-shift deletion: move each later entry of the cluster whose home is not in the
        # (hole, entry] arc into the hole, so that every entry stays reachable from its home slot
        # without crossing an empty one. Each entry is written to its new slot before its old one
        # is cleared: a racing reader may miss it for an instant, never find a wrong one.
        hole = at
        probe = at
        while True:
            probe = (probe + 1) & mask
            value = slots[probe]
            if value == _EMPTY:
                return
            home = value & mask
            stays = (hole < home <= probe) if hole <= probe else (home > hole or home <= probe)
            if stays:
                continue
            slots[hole] = value
            slots[probe] = _EMPTY
            hole = probe

    def close(self) -> None:
        self._table.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class BlockIndexReader:
    """A reader's mapping (the connector's scheduler side), read-only."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._table = _Table(_SHM_DIR / name, create_slots=None)

    def replaced(self) -> bool:
        """Whether the node manager that published this index closed it or was replaced (its
        answers are stale): a closing node manager unlinks the file, and so does one that claims
        the name after a kill -9. One fstat, about a microsecond."""
        return os.fstat(self._table.reader_fd).st_nlink == 0

    def leading(self, keys: Sequence[BlockKey]) -> int:
        """How many of `keys`, from the first, the index holds. Many keys are looked up together, as
        one array operation with a fixed cost (docs/design-notes.md#block-index)."""
        if len(keys) < _BATCH_LOOKUP_MIN:
            find = self._table.find
            for count, key in enumerate(keys):
                if find(fingerprint(key)) < 0:
                    return count
            return len(keys)
        found = self._table.found(fingerprints(keys))
        return int(np.argmin(found)) if not found.all() else len(keys)

    def holds(self, key: BlockKey) -> bool:
        """Whether the index holds `key`: one slot read for most keys (the table is at most half
        full), ~0.3 us. The connector checks each block key as it hashes it and stops at the first
        miss, so it hashes no block past what the tiers could load."""
        fp = fingerprint(key)
        table = self._table
        value = table.slots[fp & table.mask]
        if value == fp:
            return True
        return value != _EMPTY and table.find(fp) >= 0

    def run_at_home_of(self, fp: int) -> list[int]:
        """The fingerprints from the home slot of `fp` up to the next empty slot: every held
        fingerprint with that home is among them (linear probing). Keys laid out to share a home
        (a partial block's, by its parent: `kv_addressing.tail_key`) are listed in one read."""
        table = self._table
        slots, mask = table.slots, table.mask
        at = fp & mask
        run = []
        for _ in range(table.capacity):
            value = slots[at]
            if value == _EMPTY:
                break
            run.append(value)
            at = (at + 1) & mask
        return run

    def close(self) -> None:
        self._table.close()
