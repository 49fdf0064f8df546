"""Consistent hashing: each session hashes to a point on a ring of virtual nodes and goes to the
first available node clockwise, so adding or losing a node moves only its own share of sessions."""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

from scheduler.routing import NO_NODE, NodeSnapshot, NoSettings, PolicyTraits, RouteDecision, RouteRequest

VIRTUAL_NODES = 160  # points per node: keeps shares within a few percent of even at 2..64 nodes
# Without a session, the prompt's first characters are the key: a conversation's later turns start
# like its first, so they meet on the node that computed it.
KEY_PREFIX_CHARS = 256


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class ConsistentHashPolicy(NoSettings):
    name = "consistent_hash"
    traits = PolicyTraits(needs_routing_text=True)

    def __init__(self, virtual_nodes: int = VIRTUAL_NODES) -> None:
        self.virtual_nodes = virtual_nodes
        self._members: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _ring(self, node_ids: tuple[str, ...]) -> None:
        """Rebuilt only when the set of nodes (up or down) changes, not per request."""
        if node_ids == self._members:
            return
        ring = sorted((_point(f"{node_id}#{i}"), node_id) for node_id in node_ids for i in range(self.virtual_nodes))
        self._members = node_ids
        self._points = [point for point, _ in ring]
        self._owners = [owner for _, owner in ring]

    def choose(self, request: RouteRequest, nodes: Sequence[NodeSnapshot]) -> RouteDecision:
        self._ring(tuple(sorted(n.node_id for n in nodes)))
        up = {n.node_id for n in nodes if n.available}
        if not up:
            return NO_NODE
        key = (
            f"{request.tenant}/{request.session_id}"
            if request.session_id
            else f"{request.tenant}/{request.routing_text[:KEY_PREFIX_CHARS]}"
        )
        start = bisect.bisect(self._points, _point(key))
        # The first available owner clockwise: a node that is down hands its sessions to its ring
        # successors only while it is down.
        for step in range(len(self._owners)):
            owner = self._owners[(start + step) % len(self._owners)]
            if owner in up:
                return RouteDecision(owner, self.name)
        return NO_NODE  # pragma: no cover - every available node owns points on the ring

    def observe(self, request: RouteRequest, node_id: str) -> None:
        pass
