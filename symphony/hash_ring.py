"""A consistent-hash ring with virtual nodes: each key hashes to a point and belongs to the first
member clockwise that is wanted, so adding or losing a member moves only its own share of keys.
Used by the scheduler's `consistent_hash` policy (nodes) and the global layer's `skywalker` policy
(regions)."""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Collection

VIRTUAL_NODES = 160  # points per member: keeps shares within a few percent of even at 2..64 members


def ring_point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Rebuilt only when the set of members changes (`members`), not per lookup."""

    def __init__(self, virtual_nodes: int = VIRTUAL_NODES) -> None:
        self.virtual_nodes = virtual_nodes
        self._members: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def members(self, names: Collection[str]) -> None:
        wanted = tuple(sorted(names))
        if wanted == self._members:
            return
        ring = sorted((ring_point(f"{name}#{i}"), name) for name in wanted for i in range(self.virtual_nodes))
        self._members = wanted
        self._points = [point for point, _ in ring]
        self._owners = [owner for _, owner in ring]

    def owner(self, key: str, eligible: Collection[str]) -> str | None:
        """The first eligible member clockwise from `key`'s point (None: none is eligible). A member
        that is not eligible hands its keys to its ring successors only while it is not."""
        if not self._owners:
            return None
        start = bisect.bisect(self._points, ring_point(key))
        for step in range(len(self._owners)):
            owner = self._owners[(start + step) % len(self._owners)]
            if owner in eligible:
                return owner
        return None

    def order(self, key: str, eligible: Collection[str]) -> list[str]:
        """Every eligible member, in the order the ring hands `key` to them (each once)."""
        if not self._owners:
            return []
        start = bisect.bisect(self._points, ring_point(key))
        seen: list[str] = []
        for step in range(len(self._owners)):
            owner = self._owners[(start + step) % len(self._owners)]
            if owner in eligible and owner not in seen:
                seen.append(owner)
                if len(seen) == len(eligible):
                    break
        return seen
