"""The order in which prefetched KV inside vLLM gives its memory back.

A warm-up (`node_manager.engine_warmup`) leaves a session's blocks in vLLM's prefix cache, cached
but free. vLLM hands out free blocks from the head of its free queue (evicting their cached content
then), so a block's place in that queue decides when it yields. vLLM appends a finished request's
blocks at the tail, which files warmed sessions in plain LRU order; this module re-files them in
Symphony's order (`session_yield_key`): lower priority first, then smaller sessions, and within a
session later blocks first, so what a session keeps longest is a prefix that still hits.

A finished warm-up's blocks go to the tail, and every warmed session that should outlast it is
moved behind it, so the warmed sessions stay sorted among themselves; the work is bounded by the
blocks moved (`max_moves`). They sit behind vLLM's other cached blocks: a warmed session is one an
advisory says is about to resume, where other cached blocks are past turns that Symphony's tiers
keep anyway. Only blocks still free and still holding the warm-up's content move; a session whose
request has arrived is forgotten (its blocks are that request's, then ordinary cache).

Bookkeeping only, over vLLM's block objects and free-queue operations (`remove`, `append_n`); the
connector calls it from the scheduler's thread, which owns the queue.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from node_manager.kv.eviction import session_yield_key
from node_manager.kv.pages import Priority
from symphony.logs import get_logger

log = get_logger(__name__)


class Block(Protocol):
    """What is read of vLLM's KVCacheBlock."""

    ref_cnt: int

    @property
    def block_hash(self) -> Any: ...


class FreeQueue(Protocol):
    """What is used of vLLM's FreeKVCacheBlockQueue."""

    def remove(self, block: Any) -> None: ...
    def append_n(self, blocks: list[Any]) -> None: ...


@dataclass(slots=True)
class _Warmed:
    key: tuple[int, int]  # session_yield_key: smaller yields first
    blocks: list[tuple[Block, Any]]  # (block, the hash it had when the warm-up ended), in yielding order
    seq: int  # ties: the earlier warm-up yields first


class WarmedBlocks:
    def __init__(self, max_sessions: int = 4096, max_moves: int = 16_384) -> None:
        self.max_sessions = max_sessions
        self.max_moves = max_moves
        self._sessions: OrderedDict[Hashable, _Warmed] = OrderedDict()
        self._pending: list[Hashable] = []  # warm-ups finished, their blocks not yet re-filed
        self._seq = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def finished(self, session: Hashable, priority: Priority, blocks: Sequence[Block]) -> None:
        """A warm-up of `session` ended holding `blocks` (in token order). vLLM frees them right
        after; `refile` files them once it has."""
        cached = [(block, block.block_hash) for block in reversed(blocks) if block.block_hash is not None]
        self._sessions.pop(session, None)
        self._seq += 1
        self._sessions[session] = _Warmed(session_yield_key(priority, len(cached)), cached, self._seq)
        while len(self._sessions) > self.max_sessions:  # bounded: the oldest warm-up's record goes
            self._sessions.popitem(last=False)
        self._pending.append(session)

    def arrived(self, session: Hashable) -> None:
        """The session's own request came: its warmed blocks are that request's from now on."""
        self._sessions.pop(session, None)

    def refile(self, queue: FreeQueue) -> int:
        """File the blocks of warm-ups finished since the last call in yielding order; the number
        of blocks moved."""
        moved = 0
        for session in self._pending:
            warmed = self._sessions.get(session)
            if warmed is not None:
                moved += self._file(warmed, queue)
        self._pending.clear()
        return moved

    def _file(self, new: _Warmed, queue: FreeQueue) -> int:
        later = sorted(
            (w for w in self._sessions.values() if (w.key, w.seq) > (new.key, new.seq)), key=lambda w: (w.key, w.seq)
        )
        batches = [new, *later]
        if sum(len(w.blocks) for w in batches) > self.max_moves:
            log.debug("warmed blocks left in LRU order: too many to move", sessions=len(batches))
            return 0
        moved = 0
        for warmed in batches:
            still = [block for block, digest in warmed.blocks if block.ref_cnt == 0 and block.block_hash == digest]
            warmed.blocks = [(block, block.block_hash) for block in still]  # evicted or taken: forgotten
            for block in still:
                queue.remove(block)
            queue.append_n(still)
            moved += len(still)
        for session in [s for s, w in self._sessions.items() if not w.blocks]:
            del self._sessions[session]  # nothing of it left to order
        return moved
