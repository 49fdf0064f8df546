"""node_manager.connector.warm_order: warmed sessions' blocks filed in Symphony's yielding order.

The free queue here is a list with vLLM's two operations (head = next to be handed out), so the
ordering logic runs without importing vLLM (seconds); tests/e2e/test_cooperative_memory.py runs
it on vLLM's own queue."""

from __future__ import annotations

from dataclasses import dataclass

from node_manager.connector.warm_order import WarmedBlocks
from node_manager.kv.pages import Priority


@dataclass(eq=False)
class _Block:
    name: str
    block_hash: bytes | None
    ref_cnt: int = 0


class _Queue:
    def __init__(self, blocks: list[_Block]) -> None:
        self.order = list(blocks)

    def remove(self, block: _Block) -> None:
        self.order.remove(block)

    def append_n(self, blocks: list[_Block]) -> None:
        self.order.extend(blocks)

    def names(self) -> list[str]:
        return [block.name for block in self.order]


def _session(prefix: str, count: int) -> list[_Block]:
    return [_Block(f"{prefix}{i}", f"{prefix}{i}".encode()) for i in range(count)]


def _warm(warmed: WarmedBlocks, queue: _Queue, session: str, priority: Priority, blocks: list[_Block]) -> int:
    """As vLLM does it: the warm-up ends (finished), its blocks are freed to the tail, last first;
    then the next step re-files them."""
    warmed.finished(("acme", session), priority, blocks)
    queue.append_n(list(reversed(blocks)))
    return warmed.refile(queue)


def test_warmed_sessions_yield_lower_priority_then_smaller_first_later_blocks_first() -> None:
    other = _session("x", 2)  # vLLM's own cached blocks of past turns
    queue, warmed = _Queue(other), WarmedBlocks()
    big, small, high, low = _session("b", 3), _session("s", 1), _session("h", 1), _session("l", 2)
    _warm(warmed, queue, "big", Priority.NORMAL, big)
    _warm(warmed, queue, "high", Priority.HIGH, high)
    _warm(warmed, queue, "small", Priority.NORMAL, small)  # moves ahead of big and high
    _warm(warmed, queue, "low", Priority.LOW, low)  # yields before every normal and high one
    assert queue.names() == ["x0", "x1", "l1", "l0", "s0", "b2", "b1", "b0", "h0"]
    assert len(warmed) == 4


def test_taken_or_evicted_blocks_stay_where_vllm_put_them() -> None:
    queue, warmed = _Queue([]), WarmedBlocks()
    first, second = _session("a", 2), _session("c", 1)
    _warm(warmed, queue, "a", Priority.HIGH, first)
    queue.remove(first[0])  # another request hit block a0: vLLM took it off the free queue
    first[0].ref_cnt = 1
    queue.remove(first[1])  # a1 was handed out and now holds other content
    first[1].block_hash = b"other"
    queue.append_n([first[1]])
    _warm(warmed, queue, "c", Priority.LOW, second)
    assert queue.names() == ["a1", "c0"]  # nothing of a's is moved behind c
    assert warmed.refile(queue) == 0  # and nothing pending


def test_an_arrived_session_is_forgotten_and_the_records_are_bounded() -> None:
    queue, warmed = _Queue([]), WarmedBlocks(max_sessions=2)
    a, b, c = _session("a", 1), _session("b", 1), _session("c", 1)
    _warm(warmed, queue, "a", Priority.HIGH, a)
    warmed.arrived(("acme", "a"))
    _warm(warmed, queue, "b", Priority.HIGH, b)
    _warm(warmed, queue, "c", Priority.LOW, c)
    assert queue.names() == ["a0", "c0", "b0"]  # a is ordinary cache now: not moved behind c
    _warm(warmed, queue, "d", Priority.LOW, _session("d", 1))
    assert len(warmed) == 2  # b's record gave way


def test_moves_beyond_the_bound_leave_lru_order() -> None:
    queue, warmed = _Queue([]), WarmedBlocks(max_moves=3)
    _warm(warmed, queue, "big", Priority.HIGH, _session("b", 3))
    assert _warm(warmed, queue, "low", Priority.LOW, _session("l", 1)) == 0
    assert queue.names() == ["b2", "b1", "b0", "l0"]


def test_unhashed_blocks_are_not_filed() -> None:
    queue, warmed = _Queue([]), WarmedBlocks()
    blocks = [*_session("a", 2), _Block("tail", None)]  # the warm-up's partial last block
    warmed.finished(("acme", "a"), Priority.NORMAL, blocks)
    queue.order = [blocks[2], blocks[1], blocks[0]]  # vLLM: unhashed to the head (reused first)
    assert warmed.refile(queue) == 2
    assert queue.names() == ["tail", "a1", "a0"]
