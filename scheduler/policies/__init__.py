"""Routing policies behind one interface (`scheduler.routing.RoutingPolicy`), chosen per run by
`scheduler.policy`. Pure: the scheduler and the cluster simulator call the same objects."""

from __future__ import annotations

from collections.abc import Callable

from scheduler.policies.consistent_hash import ConsistentHashPolicy
from scheduler.policies.least_load import LeastLoadPolicy, RecomputePolicy, RoundRobinPolicy
from scheduler.policies.prefix_trie import PrefixTriePolicy, PrefixTrieSettings
from scheduler.policies.sticky import StickyPolicy
from scheduler.policies.symphony import CostModel, SymphonyPolicy
from scheduler.routing import RoutingPolicy
from symphony.config import ConfigError, SchedulerConfig

POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    SymphonyPolicy.name: SymphonyPolicy,
    RecomputePolicy.name: RecomputePolicy,
    StickyPolicy.name: StickyPolicy,
    RoundRobinPolicy.name: RoundRobinPolicy,
    LeastLoadPolicy.name: LeastLoadPolicy,
    ConsistentHashPolicy.name: ConsistentHashPolicy,
    PrefixTriePolicy.name: PrefixTriePolicy,
}

__all__ = ["POLICIES", "CostModel", "make_policy"]


def make_policy(name: str, config: SchedulerConfig | None = None) -> RoutingPolicy:
    """The policy `name`, with the bounds of its tables from `config` (defaults without one)."""
    if name not in POLICIES:
        raise ConfigError(f"scheduler.policy: unknown policy {name!r} (known: {', '.join(sorted(POLICIES))})")
    config = config or SchedulerConfig()
    if name == StickyPolicy.name:
        return StickyPolicy(max_sessions=config.max_sessions)
    if name == PrefixTriePolicy.name:
        return PrefixTriePolicy(PrefixTrieSettings(max_chars=config.prefix_trie_max_chars))
    return POLICIES[name]()
