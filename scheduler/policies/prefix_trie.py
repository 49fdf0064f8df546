"""Prefix-aware routing (SGLang router's cache-aware policy, SkyWalker's prefix trie): a request goes
to the node that was sent the longest prefix of its prompt when that prefix is a large enough share
of it, to the node with the least cached text when not, and to the least-loaded node whenever the
load is too uneven for cache affinity to pay (the "cache-miss death spiral" of affinity-first
routers: sglang #14305)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.cost_profile import CostProfile
from scheduler.policies.least_load import least_loaded
from scheduler.routing import NO_NODE, NodeSnapshot, PolicyTraits, RouteDecision, RouteRequest, available
from symphony.config import SchedulerConfig
from symphony.prefix_tree import PrefixTree


@dataclass(frozen=True, slots=True)
class PrefixTrieSettings:
    # SGLang model gateway's defaults (lightseekorg/smg router_args.py): a match must cover this
    # share of the prompt; load is uneven when max - min > balance_abs and max > balance_rel x min.
    cache_threshold: float = 0.3
    balance_abs: int = 64
    balance_rel: float = 1.5
    max_chars: int = 4_000_000  # the tree's bound, ~1M tokens of text


class PrefixTriePolicy:
    name = "prefix_trie"
    traits = PolicyTraits(needs_routing_text=True)

    def __init__(self, settings: PrefixTrieSettings | None = None) -> None:
        self.settings = settings or PrefixTrieSettings()
        self.tree = PrefixTree(self.settings.max_chars)
        self._rotation = itertools.count()

    @classmethod
    def from_config(cls, config: SchedulerConfig, profile: CostProfile) -> PrefixTriePolicy:
        return cls(PrefixTrieSettings(max_chars=config.prefix_trie_max_chars))

    def choose(self, request: RouteRequest, nodes: Sequence[NodeSnapshot]) -> RouteDecision:
        candidates = available(nodes)
        if not candidates:
            return NO_NODE
        s = self.settings
        loads = [n.load for n in candidates]
        if max(loads) - min(loads) > s.balance_abs and max(loads) > s.balance_rel * min(loads):
            return RouteDecision(least_loaded(candidates, next(self._rotation)).node_id, "prefix_trie_balance")
        text = _keyed(request)
        matched, owners = self.tree.match(text)
        up = {n.node_id: n for n in candidates}
        holders = [up[owner] for owner, length in owners.items() if owner in up and length == matched]
        if holders and matched > len(request.tenant) + 1 and matched / len(text) > s.cache_threshold:
            return RouteDecision(
                least_loaded(holders, next(self._rotation)).node_id,
                "prefix_trie_hit",
                {owner: float(length) for owner, length in owners.items()},
            )
        smallest = min(self.tree.sizes.get(n.node_id, 0) for n in candidates)
        return RouteDecision(
            least_loaded(
                [n for n in candidates if self.tree.sizes.get(n.node_id, 0) == smallest], next(self._rotation)
            ).node_id,
            "prefix_trie_smallest",
        )

    def observe(self, request: RouteRequest, node_id: str) -> None:
        self.tree.insert(_keyed(request), node_id)


def _keyed(request: RouteRequest) -> str:
    """Prefixes are shared within a tenant only: its name leads every path."""
    return f"{request.tenant}\x00{request.routing_text}"
