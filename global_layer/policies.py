"""Which region serves a request: the global layer's policies, behind one interface
(global_layer.views.RegionPolicy). Pure: the live entries (global_layer.entry) and the simulator
call the same code.

Data residency is not a policy's business: `rank_regions` drops every region the tenant may not
enter before a policy sees the candidates, so no policy can send a tenant's request across.

- `nearest`: the client's region, then the others by round trip (a GKE multi-cluster-gateway-like
  baseline; load is the regional scheduler's business).
- `skywalker` (SkyWalker, EuroSys'26): a bounded prefix tree of the text sent to each region; the
  region with the longest match (the nearest of those tied) if it has an idle node, else the
  client's region if it has one, else the consistent-hash owner among regions with one (selective
  pushing: a region whose every node has a queue is passed over while another has room); all
  saturated: the shortest wait.
- `gorgo` (GORGO): `w_rtt`·RTT + residual prefill + `w_queue`·queue wait, static weights;
  `gorgo_no_queue` drops the queue term, which piles requests onto the region holding the best
  prefix (the reward hacking GORGO's paper reports).
- `symphony`: the full cost (global_layer.costs): round trip, queue wait, overhead, loading the
  region's copy from its tiers, and the cheaper of computing what the region lacks or moving a
  longer copy over the WAN first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from global_layer.costs import prompt_tokens, region_cost
from global_layer.views import RegionPolicy, RegionRequest, RegionView
from symphony.hash_ring import HashRing
from symphony.prefix_tree import PrefixTree
from symphony.region_load import RegionLoad
from symphony.regions import RegionTopology

__all__ = [
    "REGION_POLICIES",
    "Gorgo",
    "Nearest",
    "Ranking",
    "RegionPolicy",
    "RegionRequest",
    "RegionView",
    "SkyWalker",
    "SymphonyRegions",
    "make_region_policy",
    "rank_regions",
]

DEFAULT_TRIE_CHARS = 4_000_000  # SkyWalker's tree of text sent to regions (~1M tokens)
KEY_PREFIX_CHARS = 256  # without a session, the prompt's first characters key the hash ring


def _by_rtt(request: RegionRequest, views: Sequence[RegionView], topology: RegionTopology) -> list[RegionView]:
    return sorted(views, key=lambda v: (topology.rtt_ms(request.client_region, v.name), v.name))


def _loads(views: Sequence[RegionView]) -> dict[str, RegionLoad]:
    return {v.name: v.load for v in views if v.load is not None}


def _queue_ms(view: RegionView) -> float:
    return view.load.queue_ms if view.load is not None else 0.0


class _Baseline:
    """A policy that learns nothing from where requests went and never moves KV across regions."""

    moves_kv = False

    def observe(self, request: RegionRequest, region: str) -> None:
        pass

    def move_source(
        self, request: RegionRequest, region: str, candidates: Sequence[RegionView], topology: RegionTopology
    ) -> tuple[str, int] | None:
        return None


class Nearest(_Baseline):
    name = "nearest"
    needs_body = False

    def rank(self, request: RegionRequest, candidates: Sequence[RegionView], topology: RegionTopology) -> list[str]:
        return [v.name for v in _by_rtt(request, candidates, topology)]


class SkyWalker(_Baseline):
    name = "skywalker"
    needs_body = True

    def __init__(self, trie_chars: int = DEFAULT_TRIE_CHARS) -> None:
        self.tree = PrefixTree(trie_chars)
        self.ring = HashRing()

    def rank(self, request: RegionRequest, candidates: Sequence[RegionView], topology: RegionTopology) -> list[str]:
        self.ring.members(topology.names)
        room = {v.name for v in candidates if v.load is not None and v.load.idle_nodes > 0}
        first: str | None = None
        if request.text:
            _, matched = self.tree.match(request.text)
            longest = max((chars for name, chars in matched.items() if name in room), default=0)
            # Of the regions with the longest match, the nearest: a tie (the chat template every
            # prompt opens with) is no reason to cross the world.
            tied = [name for name, chars in matched.items() if name in room and longest and chars == longest]
            if tied:
                first = min(tied, key=lambda n: (topology.rtt_ms(request.client_region, n), n))
        if first is None and request.client_region in room:
            first = request.client_region
        if first is None and room:
            key = request.session or request.text[:KEY_PREFIX_CHARS]
            first = self.ring.owner(f"{request.tenant}/{key}", room)
        if first is None:  # every region saturated: the shortest wait
            first = min(candidates, key=lambda v: (_queue_ms(v), v.name)).name
        rest = [v.name for v in _by_rtt(request, candidates, topology) if v.name != first]
        return [first, *rest]

    def observe(self, request: RegionRequest, region: str) -> None:
        if request.text:
            self.tree.insert(request.text, region)


@dataclass
class Gorgo(_Baseline):
    """GORGO's cost with static weights: `w_rtt`·RTT + residual prefill + `w_queue`·queue wait."""

    w_rtt: float = 1.0
    w_queue: float = 0.5
    name: str = "gorgo"
    needs_body = True

    def rank(self, request: RegionRequest, candidates: Sequence[RegionView], topology: RegionTopology) -> list[str]:
        total = prompt_tokens(request)

        def score(v: RegionView) -> tuple[float, str]:
            load = v.load
            if load is None:
                return (float("inf"), v.name)
            residual = load.prefill_ms_per_token * (total - request.held.get(v.name, 0))
            rtt = topology.rtt_ms(request.client_region, v.name)
            return (self.w_rtt * rtt + residual + self.w_queue * load.queue_ms, v.name)

        return [v.name for v in sorted(candidates, key=score)]


class SymphonyRegions:
    """The full cost (global_layer.costs.region_cost). A move of KV across regions is priced for an
    advisory (the entry then names the copy to pull, `move_source`); a request pays for what its
    region lacks, unless `moves_on_requests` (a region pulling at a request's arrival)."""

    name = "symphony"
    needs_body = True
    moves_kv = True

    def __init__(self, moves_on_requests: bool = False) -> None:
        self.moves_on_requests = moves_on_requests

    def _can_move(self, request: RegionRequest) -> bool:
        return request.advisory or self.moves_on_requests

    def rank(self, request: RegionRequest, candidates: Sequence[RegionView], topology: RegionTopology) -> list[str]:
        priced = [v for v in candidates if v.load is not None]
        can_move = self._can_move(request)
        loads = _loads(priced)
        costs = {v.name: region_cost(request, v, topology, can_move=can_move, sources=loads).total_ms for v in priced}
        ordered = sorted(priced, key=lambda v: (costs[v.name], topology.rtt_ms(request.client_region, v.name)))
        unpriced = [v.name for v in _by_rtt(request, candidates, topology) if v.load is None]
        return [v.name for v in ordered] + unpriced

    def observe(self, request: RegionRequest, region: str) -> None:
        pass

    def move_source(
        self, request: RegionRequest, region: str, candidates: Sequence[RegionView], topology: RegionTopology
    ) -> tuple[str, int] | None:
        """The copy `region` should pull before `request` comes: (node, tokens), when moving it
        beats recomputing; None otherwise."""
        view = next((v for v in candidates if v.name == region and v.load is not None), None)
        if view is None or not self._can_move(request):
            return None
        cost = region_cost(request, view, topology, can_move=True, sources=_loads(candidates))
        node = request.holders.get(cost.source or "", "")
        return (node, request.held[cost.source]) if cost.source and node else None


REGION_POLICIES: dict[str, Callable[[], RegionPolicy]] = {
    "nearest": Nearest,
    "skywalker": SkyWalker,
    "gorgo": Gorgo,
    "gorgo_no_queue": lambda: Gorgo(w_queue=0.0, name="gorgo_no_queue"),
    "symphony": SymphonyRegions,
}


def make_region_policy(name: str) -> RegionPolicy:
    return REGION_POLICIES[name]()


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
    return Ranking(policy.rank(request, allowed, topology) if allowed else [], forbidden)
