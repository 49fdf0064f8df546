"""Load-only policies: least load (the default vLLM-fleet baseline), its no-tiers variant
`recompute` (vLLM alone), and round robin."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from scheduler.routing import (
    NO_NODE,
    NodeSnapshot,
    NoSettings,
    PolicyTraits,
    RouteDecision,
    RouteRequest,
    available,
    kv_usage,
)


def least_loaded(candidates: Sequence[NodeSnapshot], rotation: int) -> NodeSnapshot:
    """Least (running + waiting) requests; ties broken by KV usage, then in rotation (which spreads
    an idle cluster's first requests instead of piling them on the first node)."""
    best_load = min(n.load for n in candidates)
    tied = [n for n in candidates if n.load == best_load]
    best_kv = min(kv_usage(n) for n in tied)
    tied = [n for n in tied if kv_usage(n) == best_kv]
    return tied[rotation % len(tied)]


class LeastLoadPolicy(NoSettings):
    name = "least_load"
    traits = PolicyTraits()

    def __init__(self) -> None:
        self._rotation = itertools.count()

    def choose(self, request: RouteRequest, nodes: Sequence[NodeSnapshot]) -> RouteDecision:
        candidates = available(nodes)
        if not candidates:
            return NO_NODE
        chosen = least_loaded(candidates, next(self._rotation))
        return RouteDecision(chosen.node_id, self.name, {n.node_id: float(n.load) for n in candidates})

    def observe(self, request: RouteRequest, node_id: str) -> None:
        pass


class RecomputePolicy(LeastLoadPolicy):
    """vLLM without Symphony: least load, and every request recomputes what vLLM's own prefix cache
    on the chosen node lacks (the connector neither loads nor saves for it)."""

    name = "recompute"
    traits = PolicyTraits(uses_tiers=False)


class RoundRobinPolicy(NoSettings):
    name = "round_robin"
    traits = PolicyTraits()

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RouteRequest, nodes: Sequence[NodeSnapshot]) -> RouteDecision:
        candidates = available(nodes)
        if not candidates:
            return NO_NODE
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return RouteDecision(chosen.node_id, self.name)

    def observe(self, request: RouteRequest, node_id: str) -> None:
        pass
