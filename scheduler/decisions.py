"""The dispatcher's decisions as plain functions and small classes: which node an advisory picks,
where a request goes (its advisory's node, the policy's choice, or held back), whether and how long
it waits for its session's KV to be pulled. The order in which held-back requests get another try
is `scheduler.held_queue`'s.

No I/O, no clocks, no asyncio: callers pass the cluster as they see it (`NodeSnapshot`s) and any
time as a number. The scheduler's dispatcher (`scheduler.dispatch`) and the cluster simulator
(`eval.sim.cluster`) both decide through this module, so the simulator measures the rules the
scheduler runs; `tests/unit/test_decision_parity.py` checks that they decide alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from scheduler.cost_profile import CostProfile
from scheduler.routing import (
    HeldPrefix,
    NodeSnapshot,
    PolicyTraits,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    advisory_holds,
    kv_source,
)

# What an advisory asks of its node: a move into its engine's cache ("hbm", ending in a warm-up
# pass), a pull into its DRAM ("dram"), or nothing (the request loads what the node has).
AdvisoryMove = Literal["hbm", "dram", "loads_on_arrival"]


# -- advisories -------------------------------------------------------------------------------------
def advisory_choice(policy: RoutingPolicy, request: RouteRequest, nodes: Sequence[NodeSnapshot]) -> RouteDecision:
    """The node an advisory picks for the session's next request. An advisory reserves no slot, so
    selective pushing does not hold it back: when the policy would queue the request, it chooses
    again as if no node had requests waiting (every other cost, the KV move's included, still
    counts). `node_id` None: no node serves the model."""
    decision = policy.choose(request, nodes)
    if decision.queue:
        decision = policy.choose(request, [replace(n, waiting=0, max_running=0) for n in nodes])
    return decision


def advisory_move(profile: CostProfile, held: HeldPrefix, from_peer: bool) -> AdvisoryMove:
    """What an advisory asks of its node for the session's KV, which the node holds as `held` (by
    tier, tokens; with `from_peer`, as it will once pulled from a node holding more: in DRAM).
    A move into the engine's own cache ends in a warm-up pass: one more request on the engine,
    `request_overhead_ms` outside its steps and a step, which the requests beside it wait for. It
    pays only where the advised request would otherwise spend longer loading, at its arrival, what
    the node's tiers hold below the engine's cache (the profile's tier load costs). Else a pull from
    a peer still lands in DRAM ("dram"), and KV the node has already stays where it is."""
    tiers = profile.tier_load_ms_per_token
    saved_ms = held.hbm * tiers.hbm + held.dram * tiers.dram + held.ssd * tiers.ssd
    if saved_ms > profile.request_overhead_ms + profile.step_ms:
        return "hbm"
    return "dram" if from_peer else "loads_on_arrival"


# -- routing a request ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Placement:
    """One routing attempt's outcome."""

    node_id: str | None  # None: held back (`queue`) or no node serves the model
    reason: str
    queue: bool = False  # selective pushing: wait for room in the held-back queue, then try again
    followup: str | None = None  # "honored" | "rerouted": what this attempt made of the advisory


@dataclass(slots=True)
class Routing:
    """One request on its way to a node, over as many attempts as it is held back. Its advisory's
    node binds while `advisory_holds` says so; the first attempt where it does not drops it, and
    every later choice is the policy's (its reason marked `_after_advisory`)."""

    request: RouteRequest
    advised_node: str | None = None
    rerouted: bool = False

    def attempt(self, policy: RoutingPolicy, nodes: Sequence[NodeSnapshot]) -> Placement:
        followup = None
        if self.advised_node is not None:
            if advisory_holds(self.advised_node, nodes):
                return Placement(self.advised_node, "advisory", followup="honored")
            self.advised_node, self.rerouted, followup = None, True, "rerouted"
        decision = policy.choose(self.request, nodes)
        reason = f"{decision.reason}_after_advisory" if self.rerouted else decision.reason
        return Placement(decision.node_id, reason, decision.queue, followup)


def rooms(nodes: Iterable[NodeSnapshot]) -> int:
    """How many held-back requests get another try when room may have opened: each available
    node's `NodeSnapshot.rooms`."""
    return sum(n.rooms for n in nodes if n.available)


# -- pulling a request's KV before it is sent -------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Pull:
    """Bring `node_id`'s copy of the session's KV up to `tokens` history tokens from `source`."""

    source: str
    tokens: int  # history tokens `source` holds
    wait_ms: float  # the longest the request waits for it before it is sent

    def lands(self, pull_ms: float) -> bool:
        """Whether a pull taking `pull_ms` arrives before the request goes (else the engine
        recomputes what did not arrive)."""
        return pull_ms <= self.wait_ms

    def waited_ms(self, pull_ms: float) -> float:
        """How long the request waits for a pull taking `pull_ms`."""
        return min(pull_ms, self.wait_ms)


@dataclass(frozen=True, slots=True)
class PullRule:
    """A request sent to a node holding less of its session's KV than another node does (no advisory
    moved it there, or the move is still under way) first waits for the KV to be pulled over, at most
    `wait_ms`: recomputing the history costs the engine far more than pulling it. Less than
    `min_tokens` more elsewhere is recomputed rather than pulled."""

    wait_ms: float  # milliseconds; 0 or less: never wait
    min_tokens: int

    def plan(
        self,
        traits: PolicyTraits,
        kv_tokens: Mapping[str, int],
        node_id: str,
        usable: Callable[[str], bool] = lambda _node: True,
    ) -> Pull | None:
        """The pull a request routed to `node_id` waits for, if any. `kv_tokens`: node -> tokens of the
        prompt's prefix a pull from it brings (the session's own history there, or a donor's copy of
        a shared prefix; for `node_id`, what it holds already); `usable`: whether a node's copy may
        be pulled (reachable, same model). Only policies that move KV on advisories pull."""
        if not traits.prefetch_on_advisory or self.wait_ms <= 0:
            return None
        source = kv_source(kv_tokens, node_id, self.min_tokens, usable)
        return Pull(source[0], source[1], self.wait_ms) if source is not None else None
