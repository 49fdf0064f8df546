"""Routing policies behind one interface (`scheduler.routing.RoutingPolicy`), chosen per run by
`scheduler.policy`. Pure: the scheduler and the cluster simulator call the same objects."""

from __future__ import annotations

from scheduler.cost_profile import DEFAULT_PROFILE, CostProfile
from scheduler.policies.consistent_hash import ConsistentHashPolicy
from scheduler.policies.least_load import LeastLoadPolicy, RecomputePolicy, RoundRobinPolicy
from scheduler.policies.prefix_trie import PrefixTriePolicy
from scheduler.policies.sticky import StickyPolicy
from scheduler.policies.symphony import CostModel, SymphonyPolicy
from scheduler.routing import PolicyClass, RoutingPolicy
from symphony.config import ConfigError, SchedulerConfig

POLICIES: dict[str, PolicyClass] = {
    SymphonyPolicy.name: SymphonyPolicy,
    RecomputePolicy.name: RecomputePolicy,
    StickyPolicy.name: StickyPolicy,
    RoundRobinPolicy.name: RoundRobinPolicy,
    LeastLoadPolicy.name: LeastLoadPolicy,
    ConsistentHashPolicy.name: ConsistentHashPolicy,
    PrefixTriePolicy.name: PrefixTriePolicy,
}

__all__ = ["POLICIES", "CostModel", "make_policy"]


def make_policy(
    name: str, config: SchedulerConfig | None = None, profile: CostProfile = DEFAULT_PROFILE
) -> RoutingPolicy:
    """The policy `name`, with the bounds of its tables from `config` (defaults without one) and the
    cluster's costs from `profile` (the built-in defaults without one)."""
    if name not in POLICIES:
        raise ConfigError(f"scheduler.policy: unknown policy {name!r} (known: {', '.join(sorted(POLICIES))})")
    return POLICIES[name].from_config(config or SchedulerConfig(), profile)
