"""Routing policies: pure functions of (request, cluster snapshot) -> decision. No I/O, no clocks.

The scheduler builds the snapshot from polled node status and its own in-flight counts; the cluster
simulator planned for eval/ is to build it from its engine models and call the same policy objects.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from symphony.config import ConfigError


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    node_id: str
    available: bool  # engine ready and status fresh
    running: int  # engine-reported requests being decoded/prefilled
    waiting: int  # engine-reported requests queued inside the engine
    inflight: int  # requests this scheduler sent there that have not finished
    kv_usage: float  # 0..1
    announced: int = 0  # advisories routed here whose request has not arrived yet

    @property
    def load(self) -> int:
        # The engine's gauges lag by up to one poll period, while the scheduler's own in-flight count
        # is exact for traffic it sent; taking the larger keeps a burst between two polls from all
        # landing on the node that looked idle (the "load never tracked" failure of other routers).
        # Announced requests are load about to land; counting them spreads a burst of advisories.
        return max(self.running + self.waiting, self.inflight) + self.announced


@dataclass(frozen=True, slots=True)
class RouteRequest:
    tenant: str
    session_id: str | None
    model: str


@dataclass(frozen=True, slots=True)
class RouteDecision:
    node_id: str | None  # None: no node can take it
    reason: str
    scores: dict[str, float] = field(default_factory=dict)  # lower is better, per candidate


class RoutingPolicy(Protocol):
    name: str

    def choose(self, request: RouteRequest, nodes: Sequence[NodeSnapshot]) -> RouteDecision:
        """Pick a node among `nodes` (already filtered to those serving request.model)."""
        ...


class LeastLoadPolicy:
    """Least (running + waiting) requests; ties broken by KV usage, then in rotation."""

    name = "least_load"

    def __init__(self) -> None:
        # Rotating the tie-break spreads an idle cluster's first requests instead of piling on node 0.
        self._tiebreak = itertools.count()

    def choose(self, request: RouteRequest, nodes: Sequence[NodeSnapshot]) -> RouteDecision:
        candidates = [n for n in nodes if n.available]
        if not candidates:
            return RouteDecision(None, "no_available_node")
        scores = {n.node_id: float(n.load) for n in candidates}
        best_load = min(n.load for n in candidates)
        tied = [n for n in candidates if n.load == best_load]
        best_kv = min(_kv(n) for n in tied)
        tied = [n for n in tied if _kv(n) == best_kv]
        chosen = tied[next(self._tiebreak) % len(tied)]
        return RouteDecision(chosen.node_id, "least_load", scores)


def _kv(node: NodeSnapshot) -> float:
    """KV usage for comparisons; an unknown (NaN) reading counts as full rather than breaking min()."""
    return node.kv_usage if node.kv_usage == node.kv_usage else 1.0


POLICIES: dict[str, type] = {LeastLoadPolicy.name: LeastLoadPolicy}


def make_policy(name: str) -> RoutingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ConfigError(f"scheduler.policy: unknown policy {name!r} (known: {', '.join(sorted(POLICIES))})") from None
