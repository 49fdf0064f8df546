"""An approximate prefix tree of the text each node has served, bounded in characters (SGLang
router's cache-aware index: no engine tells it what it caches; it remembers what it sent where).

A radix tree: edges carry strings, each tree node records which cluster nodes were sent a prompt
passing through it and when (a logical tick). Inserting marks the whole path; matching walks down
as far as the text agrees and reports, per cluster node, how many leading characters it was sent.
The tree holds at most `max_chars` characters of edge labels: past that, the least recently used
leaves are cut until it is back under 90% of the bound (an unbounded index is how routers leak
memory: production-stack #687, dynamo #10774).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

MIN_COMPACT_AT = 1024  # leaf-heap entries below which stale ones are left for later


@dataclass(eq=False)
class _Node:
    edge: str = ""
    parent: _Node | None = None
    children: dict[str, _Node] = field(default_factory=dict)  # first character of the child's edge -> child
    owners: dict[str, int] = field(default_factory=dict)  # cluster node -> tick of its last visit
    tick: int = 0  # newest of the owners' ticks (when it was last on a served path)


class PrefixTree:
    def __init__(self, max_chars: int) -> None:
        if max_chars <= 0:
            raise ValueError("max_chars must be positive")
        self.max_chars = max_chars
        self.chars = 0  # characters on all edges
        self.sizes: dict[str, int] = {}  # cluster node -> characters on the paths it owns
        self._root = _Node()
        self._ticks = itertools.count(1)
        self._leaves: list[tuple[int, int, _Node]] = []  # (tick, serial, leaf), stale entries skipped
        self._serial = itertools.count()
        self._compact_at = MIN_COMPACT_AT  # heap size that triggers the next compaction

    def insert(self, text: str, owner: str) -> None:
        tick = next(self._ticks)
        node = self._root
        node.owners[owner] = node.tick = tick
        at = 0
        while at < len(text):
            child = node.children.get(text[at])
            if child is None:
                child = _Node(text[at:], node)
                node.children[text[at]] = child
                self.chars += len(child.edge)
                at = len(text)
            else:
                common = _common_prefix(child.edge, text, at)
                if common < len(child.edge):
                    child = self._split(child, common)
                at += common
            if owner not in child.owners:
                self.sizes[owner] = self.sizes.get(owner, 0) + len(child.edge)
            child.owners[owner] = child.tick = tick
            node = child
        if not node.children and node is not self._root:
            heapq.heappush(self._leaves, (tick, next(self._serial), node))
            if len(self._leaves) > self._compact_at:
                self._compact()
        if self.chars > self.max_chars:
            self._evict(int(self.max_chars * 0.9))

    def match(self, text: str) -> tuple[int, dict[str, int]]:
        """(characters of `text` the tree holds, {cluster node: leading characters it was sent})."""
        matched: dict[str, int] = {}
        node, at = self._root, 0
        while at < len(text):
            child = node.children.get(text[at])
            if child is None:
                break
            common = _common_prefix(child.edge, text, at)
            at += common
            for owner in child.owners:
                matched[owner] = at  # deeper nodes overwrite: owners of a child own its parent too
            if common < len(child.edge):
                break
            node = child
        return at, matched

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut `child`'s edge after `at` characters; returns the new upper part."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.edge[:at], parent, {child.edge[at]: child}, dict(child.owners), child.tick)
        parent.children[child.edge[0]] = upper
        child.edge = child.edge[at:]
        child.parent = upper
        return upper

    def _evict(self, target: int) -> None:
        while self.chars > target and self._leaves:
            tick, _, leaf = heapq.heappop(self._leaves)
            if leaf.children or leaf.parent is None or leaf.tick != tick:
                continue  # no longer a leaf, already removed, or visited since (a newer entry exists)
            self._remove_leaf(leaf)

    def _compact(self) -> None:
        """Drop stale leaf entries (every revisit of a leaf pushes a new one). Run when the heap has
        doubled since the last compaction, so it costs O(1) per insert amortized and the heap stays
        within twice the live leaves (at most one per character held) plus a constant."""
        self._leaves = [entry for entry in self._leaves if _live(entry)]
        heapq.heapify(self._leaves)
        self._compact_at = 2 * len(self._leaves) + MIN_COMPACT_AT

    def _remove_leaf(self, leaf: _Node) -> None:
        parent = leaf.parent
        assert parent is not None
        del parent.children[leaf.edge[0]]
        leaf.parent = None
        self.chars -= len(leaf.edge)
        for owner in leaf.owners:
            self.sizes[owner] -= len(leaf.edge)
            if not self.sizes[owner]:
                del self.sizes[owner]
        if not parent.children and parent.parent is not None:
            heapq.heappush(self._leaves, (parent.tick, next(self._serial), parent))

    def forget(self, owner: str) -> None:
        """Drop a cluster node from the tree (it left the cluster): its paths no longer count."""
        stack = [self._root]
        while stack:
            node = stack.pop()
            node.owners.pop(owner, None)
            stack.extend(node.children.values())
        self.sizes.pop(owner, None)


def _live(entry: tuple[int, int, _Node]) -> bool:
    tick, _, node = entry
    return node.parent is not None and not node.children and node.tick == tick


def _common_prefix(edge: str, text: str, at: int) -> int:
    limit = min(len(edge), len(text) - at)
    if edge[:limit] == text[at : at + limit]:
        return limit  # the common case (a served prefix again), compared in C
    low, high = 0, limit  # binary search for the first difference: O(log n) slice compares
    while low < high:
        mid = (low + high + 1) // 2
        if edge[:mid] == text[at : at + mid]:
            low = mid
        else:
            high = mid - 1
    return low
