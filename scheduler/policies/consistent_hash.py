"""Consistent hashing: each session hashes to a point on a ring of virtual nodes and goes to the
first available node clockwise, so adding or losing a node moves only its own share of sessions."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.routing import NO_NODE, NodeSnapshot, NoSettings, PolicyTraits, RouteDecision, RouteRequest
from symphony.hash_ring import VIRTUAL_NODES, HashRing

# Without a session, the prompt's first characters are the key: a conversation's later turns start
# like its first, so they meet on the node that computed it.
KEY_PREFIX_CHARS = 256


class ConsistentHashPolicy(NoSettings):
    name = "consistent_hash"
    traits = PolicyTraits(needs_routing_text=True)

    def __init__(self, virtual_nodes: int = VIRTUAL_NODES) -> None:
        self.ring = HashRing(virtual_nodes)

    def choose(self, request: RouteRequest, nodes: Sequence[NodeSnapshot]) -> RouteDecision:
        self.ring.members([n.node_id for n in nodes])
        up = {n.node_id for n in nodes if n.available}
        if not up:
            return NO_NODE
        key = (
            f"{request.tenant}/{request.session_id}"
            if request.session_id
            else f"{request.tenant}/{request.routing_text[:KEY_PREFIX_CHARS]}"
        )
        owner = self.ring.owner(key, up)
        return NO_NODE if owner is None else RouteDecision(owner, self.name)

    def observe(self, request: RouteRequest, node_id: str) -> None:
        pass
