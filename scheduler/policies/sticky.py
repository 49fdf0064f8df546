"""InferCept-like session stickiness: a session's first turn goes to the least-loaded node, every
later turn to the same node (its KV stays in that node's memory), re-pinned only if it is down."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from scheduler.cost_profile import CostProfile
from scheduler.policies.least_load import least_loaded
from scheduler.routing import NO_NODE, NodeSnapshot, PolicyTraits, RouteDecision, RouteRequest, available
from symphony.config import SchedulerConfig

MAX_PINNED_SESSIONS = 100_000


class StickyPolicy:
    name = "sticky"
    traits = PolicyTraits()

    def __init__(self, max_sessions: int = MAX_PINNED_SESSIONS) -> None:
        self.max_sessions = max_sessions
        self._pinned: OrderedDict[tuple[str, str], str] = OrderedDict()  # LRU-bounded
        self._rotation = itertools.count()

    @classmethod
    def from_config(cls, config: SchedulerConfig, profile: CostProfile) -> StickyPolicy:
        return cls(max_sessions=config.max_sessions)

    def choose(self, request: RouteRequest, nodes: Sequence[NodeSnapshot]) -> RouteDecision:
        candidates = available(nodes)
        if not candidates:
            return NO_NODE
        if request.session_id is not None:
            pinned = self._pinned.get((request.tenant, request.session_id))
            if pinned is not None and any(n.node_id == pinned for n in candidates):
                return RouteDecision(pinned, "sticky")
        return RouteDecision(least_loaded(candidates, next(self._rotation)).node_id, "sticky_first_turn")

    def observe(self, request: RouteRequest, node_id: str) -> None:
        if request.session_id is None:
            return
        key = (request.tenant, request.session_id)
        self._pinned[key] = node_id
        self._pinned.move_to_end(key)
        while len(self._pinned) > self.max_sessions:
            self._pinned.popitem(last=False)
