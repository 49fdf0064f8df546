"""Which region serves a request: the global layer's policies. Pure (no I/O, no clocks): the live
entries (global_layer.entry) and the simulator call the same functions.

Data residency is not a policy's business: `rank_regions` drops every region the tenant may not
enter before a policy sees the candidates, so no policy can send a tenant's request across.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from symphony.region_load import RegionLoad
from symphony.regions import RegionTopology


@dataclass(frozen=True, slots=True)
class RegionView:
    """What an entry knows of one region: whether its scheduler answered lately, and its load."""

    name: str
    up: bool
    load: RegionLoad | None  # None until the first summary arrived


@dataclass(frozen=True, slots=True)
class RegionRequest:
    tenant: str
    client_region: str  # where the client is (X-Client-Region, else the entry it called)


# A policy orders the candidate regions (up, allowed) best first; the entry tries them in that
# order, so the rest of the list is the failover order.
RegionPolicy = Callable[[RegionRequest, Sequence[RegionView], RegionTopology], list[str]]


def nearest(request: RegionRequest, candidates: Sequence[RegionView], topology: RegionTopology) -> list[str]:
    """The client's own region, then the others by round trip from the client (a GKE
    multi-cluster-gateway-like baseline: load is the regional scheduler's business)."""
    ranked = sorted(candidates, key=lambda v: (topology.rtt_ms(request.client_region, v.name), v.name))
    return [v.name for v in ranked]


REGION_POLICIES: dict[str, RegionPolicy] = {"nearest": nearest}


@dataclass(frozen=True, slots=True)
class Ranking:
    regions: list[str]  # where to try, in order; empty: nowhere
    forbidden_up: list[str]  # regions that could serve but the tenant may not enter


def rank_regions(
    policy: RegionPolicy, request: RegionRequest, views: Sequence[RegionView], topology: RegionTopology
) -> Ranking:
    """The regions to try for `request`: those up and allowed to its tenant, in the policy's order."""
    allowed = [v for v in views if v.up and topology.allowed(request.tenant, v.name)]
    forbidden = [v.name for v in views if v.up and not topology.allowed(request.tenant, v.name)]
    return Ranking(policy(request, allowed, topology) if allowed else [], forbidden)
