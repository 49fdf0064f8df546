"""Symphony's policy: every request (not session) goes where its first token would come soonest, by
an estimate in milliseconds from the cluster's measured costs (`scheduler.cost_profile`): the queue
it joins, the prefill of what the node lacks, the load of what the node holds from each tier, and
bringing over what another node holds (or recomputing it, whichever is cheaper). An advisory moves
the KV ahead of the request, so balancing load costs no recompute. When every node already has
requests waiting, the request waits in the scheduler instead (selective pushing, SkyWalker): a
request pushed into a busy engine's queue is stuck there even if another node frees up first.

The estimate for node n, in ms (`TtftEstimate`; p is the profile, P the prompt's tokens):

- overhead: `p.request_overhead_ms` (HTTP, tokenizing), the same on every node;
- queue: half of the step under way (if n has requests), then the step that prefills the request:
  `p.step_with(decoding, context)` for the requests decoding beside it (running, in flight or
  announced, less those still in prefill; their context is n's KV usage of its own cache,
  `NodeSnapshot.kv_tokens`, or of `p.engine_kv_tokens` where the node does not report it),
  plus the prefills ahead of it (`NodeSnapshot.prefilling_work`, priced as `p.prefill_ms` sums;
  requests whose size the scheduler does not know count as `CostModel.unknown_prefill_tokens`).
  This term keeps the router from piling requests onto the node with the best prefix (GORGO's
  "reward hacking"). For a request expected later (an advisory's, `RouteRequest.lead_ms`), the step
  under way and the prefills ahead count only for what will be left of them, and the requests in
  prefill now decode beside it then;
- load: the prefix n holds, per tier, times `p.tier_load_ms_per_token`;
- fetch + prefill: the cheapest of recomputing what n lacks (`p.prefill_ms(P - h, P)`) and, for
  each node m holding a longer prefix, bringing m's extra tokens X over, priced as the cheaper of
  moving them (`p.link(m, n)`: RTT + X x KV bytes / bandwidth, plus reading them from m's tiers and
  loading them from n's DRAM, where a pull lands) and recomputing them, then prefilling the rest;
- spread (high-priority requests only): each high-priority session already on n counts as
  `CostModel.high_spread_requests` requests of unknown size ahead.

The policy minimizes that estimate plus one term that is not the request's own: the delay, the
prefill n's engine would run for it (recomputed fetch and prefill) times
`CostModel.prefill_delay_weight`, as every request queued behind it on n waits that long too.

Pure: no I/O, no clocks; the scheduler and the simulator (with a profile built from its preset)
call the same object.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scheduler.cost_profile import DEFAULT_PROFILE, KILO, CostProfile, LinkCost
from scheduler.routing import (
    NO_NODE,
    NOTHING_HELD,
    HeldPrefix,
    NodeSnapshot,
    PolicyTraits,
    RouteDecision,
    RouteRequest,
    available,
    kv_usage,
)
from symphony.config import SchedulerConfig


@dataclass(frozen=True, slots=True)
class CostModel:
    """How the policy prices what the profile does not measure (the workload's part)."""

    # A request ahead whose prefill size the scheduler does not know (queued in the engine beyond the
    # streams it counts, or counted without a size) is priced as a prefill of this many new tokens:
    # a chat turn's new message and template, give or take.
    unknown_prefill_tokens: int = 256
    high_spread_requests: float = 0.5  # per high-priority session already on a node, for a high-priority request
    # The prefill a node runs for the request is counted again, times this: every request that
    # queues behind it there waits that long too. Without it, the router recomputes a prefix another
    # node holds whenever the holder's queue is a little longer, and the cluster spends its time
    # computing the same prefixes twice (the shared-prefix workload: prefix hits 0.80 against
    # prefix_trie's 0.99, docs/benchmarks.md). 0: each request's own TTFT alone.
    prefill_delay_weight: float = 1.0


@dataclass(frozen=True, slots=True)
class TtftEstimate:
    """One node's estimated time to first token for one request, by part (ms)."""

    overhead_ms: float
    queue_ms: float
    load_ms: float  # the node's own prefix, from its tiers
    fetch_ms: float  # bringing another node's longer prefix over (moved or recomputed); 0 if none is
    prefill_ms: float  # the tokens no holder gives it
    spread_ms: float = 0.0
    # Not the request's own: the node's prefill for it (recomputed fetch included) times
    # `CostModel.prefill_delay_weight`, the wait it adds for the requests after it there.
    delay_ms: float = 0.0

    @property
    def total_ms(self) -> float:
        """The request's estimated time to first token."""
        return self.overhead_ms + self.queue_ms + self.load_ms + self.fetch_ms + self.prefill_ms + self.spread_ms

    @property
    def score_ms(self) -> float:
        """What the policy minimizes: the time to first token and the delay it puts on others."""
        return self.total_ms + self.delay_ms


def prompt_tokens(request: RouteRequest, holdings: Mapping[str, HeldPrefix]) -> int:
    """The request's prompt in tokens: its size, but at least one token more than any prefix of it a
    node holds (an advisory's prompt is not known yet; its history is, and the prompt extends it)."""
    return max(request.prompt_size, 1 + longest_held(holdings))


def longest_held(holdings: Mapping[str, HeldPrefix]) -> int:
    """The longest prefix any node holds, in tokens (0: none)."""
    return max(map(sum, holdings.values()), default=0)  # a HeldPrefix sums to its total


def movable_sources(
    holdings: Mapping[str, HeldPrefix], movable: Mapping[str, int], prompt: int
) -> list[tuple[str, HeldPrefix, int]]:
    """The nodes a longer prefix could be brought from, each with its holding and the end of what
    would move: what a pull from there brings (`movable`, node -> tokens, `RouteRequest.movable`: a
    pull fetches a session's pages by name, the request's own session's or the donor's whose history
    starts with the prefix); and never the last token, which the engine computes."""
    if not movable:
        return []
    sources = []
    for source, held in holdings.items():  # in the holdings' order: the first of equal costs wins
        tokens = movable.get(source, 0)
        if tokens > 0:
            end = min(held.total, tokens, prompt - 1)
            if end > 0:
                sources.append((source, held, end))
    return sources


# An engine whose KV cache is this full may have requests waiting for memory (vLLM admits a request
# only when its blocks fit), which `queue_ms` cannot see: it prices each waiting request as a prefill.
NEARLY_FULL_KV = 0.95


def _pushable(
    candidates: Sequence[NodeSnapshot], holdings: Mapping[str, HeldPrefix], movable: Mapping[str, int]
) -> list[NodeSnapshot]:
    """Selective pushing: the nodes a request may be sent to now. An engine with nothing waiting
    starts it at its next step. An engine with requests waiting would keep it behind them however the
    costs compare later, so it is a candidate only when it holds a longer prefix of the prompt than
    any idle node holds: then its queue is priced against bringing that prefix to an idle node, by a
    pull (as the pulls over that link have taken) or by recomputing it. With its KV cache nearly full
    (`NEARLY_FULL_KV`), whose queue may be waiting for memory, only when no idle node can pull the
    prefix either (`movable`). Empty: every node has requests waiting, and the request waits in the
    scheduler for the first to free up."""
    idle = [n for n in candidates if n.rooms]
    if not idle:
        return []
    reach = max(holdings.get(n.node_id, NOTHING_HELD).total for n in idle)
    pull_reach = max((min(h.total, movable.get(node, 0)) for node, h in holdings.items()), default=0)
    pushable = []
    for n in candidates:
        held = holdings.get(n.node_id, NOTHING_HELD).total
        if n.rooms or (held > reach and (kv_usage(n) < NEARLY_FULL_KV or held > pull_reach)):
            pushable.append(n)
    return pushable


class SymphonyPolicy:
    name = "symphony"
    traits = PolicyTraits(prefetch_on_advisory=True, locates_kv=True)

    def __init__(
        self, profile: CostProfile = DEFAULT_PROFILE, cost: CostModel | None = None, selective_push: bool = True
    ) -> None:
        self.profile = profile
        self.cost = cost or CostModel()
        self.selective_push = selective_push
        self._rotation = itertools.count()
        tokens = self.cost.unknown_prefill_tokens
        self.unknown_prefill_ms = profile.prefill_ms(tokens, tokens)  # a request ahead of unknown size

    @classmethod
    def from_config(cls, config: SchedulerConfig, profile: CostProfile) -> SymphonyPolicy:
        return cls(profile)

    def choose(self, request: RouteRequest, nodes: Sequence[NodeSnapshot]) -> RouteDecision:
        candidates = available(nodes)
        if not candidates:
            return NO_NODE
        holdings = request.holdings()
        movable = request.movable()
        if self.selective_push:
            candidates = _pushable(candidates, holdings, movable)
            if not candidates:
                return RouteDecision(None, "queued", queue=True)
        longest = longest_held(holdings)
        prompt = max(request.prompt_size, 1 + longest)  # prompt_tokens
        high = request.priority == "high"
        spread_ms = self.cost.high_spread_requests * self.unknown_prefill_ms if high else 0.0
        sources = movable_sources(holdings, movable, prompt)
        # What a node pays depends on the prefix it holds and its links from the nodes whose copies
        # could move (when it is none of them): one computation per distinct pair of those (a few,
        # for a fleet on a uniform network, however many nodes hold the tenant's system prompt).
        same: dict[tuple[HeldPrefix, tuple[LinkCost, ...]], float] = {}
        named = {source for source, _, _ in sources}
        scores = {}
        for n in candidates:
            held = holdings.get(n.node_id, NOTHING_HELD)
            if n.node_id in named:
                own = self._own_score(prompt, n.node_id, held, sources)
            else:
                links = (
                    tuple(self.profile.link(source, n.node_id) for source, _, _ in sources)
                    if self.profile.links
                    else ()
                )
                key = (held, links)
                if key not in same:
                    same[key] = self._own_score(prompt, n.node_id, held, sources)
                own = same[key]
            spread = n.high_sessions * spread_ms
            scores[n.node_id] = self.profile.request_overhead_ms + self.queue_ms(n, request.lead_ms) + own + spread
        best = min(scores.values())
        # Equal costs: the emptier KV cache (fewer blocks for vLLM to evict), then in rotation, which
        # spreads an idle cluster's first requests instead of piling them on the first node.
        tied = [n for n in candidates if scores[n.node_id] == best]
        emptiest = min(kv_usage(n) for n in tied)
        tied = [n for n in tied if kv_usage(n) == emptiest]
        chosen = tied[next(self._rotation) % len(tied)]
        chosen_holds = holdings.get(chosen.node_id, NOTHING_HELD).total
        local = chosen_holds and chosen_holds >= longest
        return RouteDecision(chosen.node_id, "symphony_local_kv" if local else "symphony", scores)

    def estimate(self, request: RouteRequest, node: NodeSnapshot) -> TtftEstimate:
        """`request`'s estimated time to first token on `node`, by part."""
        holdings = request.holdings()
        return self._estimate(request, prompt_tokens(request, holdings), node, holdings)

    def _estimate(
        self, request: RouteRequest, prompt: int, node: NodeSnapshot, holdings: Mapping[str, HeldPrefix]
    ) -> TtftEstimate:
        sources = movable_sources(holdings, request.movable(), prompt)
        own = holdings.get(node.node_id, NOTHING_HELD)
        load_ms, fetch_ms, prefill_ms, computed_ms = self._own(prompt, node.node_id, own, sources)
        spread = 0.0
        if request.priority == "high":
            spread = node.high_sessions * self.cost.high_spread_requests * self.unknown_prefill_ms
        overhead = self.profile.request_overhead_ms
        delay = self.cost.prefill_delay_weight * computed_ms
        queue = self.queue_ms(node, request.lead_ms)
        return TtftEstimate(overhead, queue, load_ms, fetch_ms, prefill_ms, spread, delay)

    def queue_ms(self, node: NodeSnapshot, lead_ms: float = 0.0) -> float:
        """From the request's arrival at `node`'s engine to the end of the step that prefills it, but
        its own prefill: the step under way, the prefills ahead of it, and its step's decoding. For a
        request expected `lead_ms` from now (an advisory's), the step under way and the prefills
        ahead count only for what is left of them then, and their requests decode beside it: a
        prefill that ends before the request comes must not move its session's KV elsewhere."""
        p = self.profile
        # Conditional expressions rather than max() of two ints: this runs for every node per request.
        waiting, prefilling, inflight = node.pending, node.prefilling, node.inflight
        ahead = prefilling if prefilling > waiting else waiting
        engine = node.running + waiting
        active = engine if engine > inflight else inflight
        work = node.prefilling_work
        unknown = (waiting - prefilling if waiting > prefilling else 0) + (0 if work.tokens else prefilling)
        ahead_ms = unknown * self.unknown_prefill_ms
        if work.tokens:
            ahead_ms += p.prefill_ms_per_token * work.tokens + p.prefill_ms_per_token_kilotoken * work.positions / KILO
        decoding = (active if lead_ms > 0 else active - ahead if active > ahead else 0) + node.announced
        # The engine's KV in use is its requests' context (vLLM counts cached blocks no request uses as
        # free), a fraction of the node's own cache: an engine given fewer blocks than the profile's
        # (or another host's) would otherwise look busier by the ratio, and sessions would move off it.
        capacity = node.kv_tokens or p.engine_kv_tokens
        step = p.step_with(decoding, kv_usage(node) * capacity if decoding else 0.0)
        before = (step / 2 if active else 0.0) + ahead_ms - lead_ms  # the step under way, the prefills ahead
        return step + before if before > 0 else step

    def _own_score(
        self, prompt: int, node_id: str, own: HeldPrefix, sources: Sequence[tuple[str, HeldPrefix, int]]
    ) -> float:
        """The part of `node_id`'s score that depends on what it holds: load, fetch and prefill, and
        the delay its prefill puts on the requests after it."""
        load, fetch, prefill, computed = self._own(prompt, node_id, own, sources)
        return load + fetch + prefill + self.cost.prefill_delay_weight * computed

    def _own(
        self, prompt: int, node_id: str, own: HeldPrefix, sources: Sequence[tuple[str, HeldPrefix, int]]
    ) -> tuple[float, float, float, float]:
        """(load, fetch, prefill, computed) ms of a `prompt`-token request on `node_id`, which holds
        `own`: its own prefix loaded from its tiers, then the cheapest way to the rest (see the
        module's docstring), bringing over a longer prefix from one of `sources` (`movable_sources`);
        `computed` is the part of fetch and prefill the node's engine computes."""
        p = self.profile
        tiers = p.tier_load_ms_per_token
        start = min(own.total, prompt - 1)  # the engine computes the last token whatever it holds
        mine = own if start == own.total else own.between(0, start)
        load = mine.hbm * tiers.hbm + mine.dram * tiers.dram + mine.ssd * tiers.ssd
        fetch, rest = 0.0, p.prefill_ms(prompt - start, prompt)
        computed = rest
        for source, held, end in sources:
            if source == node_id or end <= start:
                continue
            extra = held.between(start, end)
            tokens = end - start
            # Read from the source's tiers (the engine's cache has its copy in the store, read as DRAM),
            # sent over the link, landed in this node's DRAM and loaded from there.
            read = (extra.engine + extra.dram) * tiers.dram + extra.hbm * tiers.hbm + extra.ssd * tiers.ssd
            move = read + p.link(source, node_id).move_ms(tokens * p.kv_bytes_per_token) + tokens * tiers.dram
            recompute = p.prefill_ms(tokens, end)
            here = min(move, recompute)
            after = p.prefill_ms(prompt - end, prompt)
            if here + after < fetch + rest:
                fetch, rest = here, after
                computed = after + (recompute if recompute <= move else 0.0)
        return load, fetch, rest, computed

    def observe(self, request: RouteRequest, node_id: str) -> None:
        pass
