"""Symphony's policy: every request (not session) goes where it will start soonest, counting the
queue it joins and the cost of bringing its session's KV there; an advisory moves the KV ahead of
the request, so balancing load costs no recompute. When every node already has requests waiting,
the request waits in the scheduler instead (selective pushing, SkyWalker): a request pushed into a
busy engine's queue is stuck there even if another node frees up first."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True)
class CostModel:
    """Milliseconds, only ever compared between candidate nodes. Tokens of history no node holds cost
    the same recompute everywhere, so they do not appear."""

    request_ms: float = 400.0  # what each request already on a node adds to a new one's start
    # What a request still in its prefill adds on top: the new one's prefill runs after (or
    # batched with) its remaining prompt, ~5 ms a token on a CPU engine for a few hundred tokens.
    prefill_ms: float = 800.0
    move_ms_per_token: float = 0.05  # pulling a token's KV from the node holding it (~23 KB/token at ~0.5 GB/s)
    high_spread: float = 0.5  # high-priority sessions already on a node, in requests: spreads them out


class SymphonyPolicy(NoSettings):
    name = "symphony"
    traits = PolicyTraits(prefetch_on_advisory=True)

    def __init__(self, cost: CostModel | None = None, selective_push: bool = True) -> None:
        self.cost = cost or CostModel()
        self.selective_push = selective_push
        self._rotation = itertools.count()

    def choose(self, request: RouteRequest, nodes: Sequence[NodeSnapshot]) -> RouteDecision:
        candidates = available(nodes)
        if not candidates:
            return NO_NODE
        if self.selective_push:
            # Only into an engine with nothing waiting: there the request starts at the engine's next
            # step, behind a queue it would wait however the costs compare.
            candidates = [n for n in candidates if n.pending == 0]
            if not candidates:
                return RouteDecision(None, "queued", queue=True)
        scores = {n.node_id: self.score(request, n) for n in candidates}
        best = min(scores.values())
        # Equal costs: the emptier KV cache (fewer blocks for vLLM to evict), then in rotation, which
        # spreads an idle cluster's first requests instead of piling them on the first node.
        tied = [n for n in candidates if scores[n.node_id] == best]
        emptiest = min(kv_usage(n) for n in tied)
        tied = [n for n in tied if kv_usage(n) == emptiest]
        chosen = tied[next(self._rotation) % len(tied)]
        held = request.kv_tokens.get(chosen.node_id, 0)
        reason = "symphony_local_kv" if held and held >= max(request.kv_tokens.values()) else "symphony"
        return RouteDecision(chosen.node_id, reason, scores)

    def score(self, request: RouteRequest, node: NodeSnapshot) -> float:
        c = self.cost
        queue = node.load * c.request_ms + node.prefilling * c.prefill_ms
        held_best = max(request.kv_tokens.values(), default=0)
        move = max(0, held_best - request.kv_tokens.get(node.node_id, 0)) * c.move_ms_per_token
        spread = node.high_sessions * c.high_spread * c.request_ms if request.priority == "high" else 0.0
        return queue + move + spread

    def observe(self, request: RouteRequest, node_id: str) -> None:
        pass
