"""What a routing policy sees and answers: plain values, no I/O, no clocks.

The scheduler builds a `RouteRequest` (from the request, its session's entry in the session table
and the priority table) and `NodeSnapshot`s (from polled node status and its own in-flight counts),
then asks the policy (`scheduler.policies`). The cluster simulator in eval/ builds the same values
from its engine models and calls the same policy objects, so a policy is tested once and measured
at any scale.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, Self

from scheduler.cost_profile import CostProfile
from symphony.config import SchedulerConfig
from symphony.priority import PRIORITIES, Priority

PRIORITY_RANK: dict[str, int] = {p: p.rank for p in PRIORITIES}  # also by plain name: members equal them


@dataclass(frozen=True, slots=True)
class PrefillWork:
    """The size of one or more prefills: the prompt tokens they compute, and the sum of those tokens'
    positions in their prompts (their attention's share: `CostProfile.prefill_ms` summed over them)."""

    tokens: int = 0
    positions: float = 0.0  # sum over the tokens computed of their position in the prompt (tokens x tokens)

    def __add__(self, other: PrefillWork) -> PrefillWork:
        return PrefillWork(self.tokens + other.tokens, self.positions + other.positions)

    def __sub__(self, other: PrefillWork) -> PrefillWork:
        return PrefillWork(self.tokens - other.tokens, self.positions - other.positions)


NO_WORK = PrefillWork()


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    node_id: str
    available: bool  # engine ready and status fresh
    running: int  # engine-reported requests being decoded/prefilled
    waiting: int  # engine-reported requests queued inside the engine
    inflight: int  # requests this scheduler sent there that have not finished
    kv_usage: float  # 0..1
    announced: int = 0  # advisories routed here whose request has not arrived yet
    high_sessions: int = 0  # high-priority sessions whose KV or next turn is here
    # Requests this scheduler sent there that are still in (or queued for) their prefill, which a
    # new request's own prefill would wait behind: streams until their first token (exact and
    # current, unlike the engine's gauges), plain requests until the engine's gauges count them.
    prefilling: int = 0
    # The size of those requests' prefills, as the scheduler estimated each when it sent it
    # (`prefill_work`); none (0 tokens) with `prefilling` > 0: not known.
    prefilling_work: PrefillWork = NO_WORK
    # Tokens the engine's KV cache holds, what `kv_usage` is a fraction of, as the node reports it;
    # 0: not reported (a policy takes its cost profile's `engine_kv_tokens`).
    kv_tokens: int = 0
    max_running: int = 0  # requests the engine runs at once (its --max-num-seqs); 0: not known

    @property
    def load(self) -> int:
        # The engine's gauges lag by up to one poll period, while the scheduler's own in-flight count
        # is exact for traffic it sent; taking the larger keeps a burst between two polls from all
        # landing on the node that looked idle (the "load never tracked" failure of other routers).
        # Announced requests are load about to land; counting them spreads a burst of advisories.
        return max(self.running + self.waiting, self.inflight) + self.announced

    @property
    def pending(self) -> int:
        """Requests queued inside the engine (not running). The engine's own count: between two
        polls a request just sent is not yet running, but a vLLM engine with room admits it at its
        next step, so counting it as pending would hold requests back for a poll period. With
        `max_running` known, at least this scheduler's requests there beyond it: the engine queues
        those whatever its gauge says yet (it updates once a step, seconds apart on a loaded CPU
        engine, when a burst of requests can go out on a stale 0)."""
        if self.max_running > 0:
            return max(self.waiting, self.inflight - self.max_running)
        return self.waiting

    @property
    def rooms(self) -> int:
        """Requests it would start at once: with nothing pending, one (the engine's batch size not
        known: it admits a request at its next step), or the free places in a known batch
        (`max_running` less this scheduler's requests there); 0 with anything pending."""
        if self.pending:
            return 0
        return max(0, self.max_running - self.inflight) if self.max_running > 0 else 1


class HeldPrefix(NamedTuple):
    """How much of a request's prompt one node holds, in tokens: the prompt's leading tokens that
    some tier of the node has (every layer of their blocks), each counted once, in the fastest tier
    holding it. Contiguous: together they are the prompt's first `total` tokens. Which positions each
    tier holds is not recorded; the faster tiers are taken to hold the leading ones (engine, then
    HBM, DRAM, SSD), as the engine and the store evict a session's later blocks first.
    (A named tuple: one per holding node per request, built and hashed in C.)"""

    engine: int = 0  # in the engine's own prefix cache (vLLM's KV blocks): nothing to load
    hbm: int = 0  # staged in the store's pool in engine device memory
    dram: int = 0  # in the store's shared-memory arena
    ssd: int = 0  # only in SSD segment files

    @property
    def total(self) -> int:
        return self.engine + self.hbm + self.dram + self.ssd

    def between(self, start: int, end: int) -> HeldPrefix:
        """The tokens at positions [start, end) of the prefix, by tier (tier order as above)."""
        parts = []
        low = 0
        for tokens in (self.engine, self.hbm, self.dram, self.ssd):
            high = low + tokens
            parts.append(max(0, min(end, high) - max(start, low)))
            low = high
        return HeldPrefix(*parts)


NOTHING_HELD = HeldPrefix()


def hints_as_held(kv_tokens: Mapping[str, int]) -> dict[str, HeldPrefix]:
    """The session table's hints (node -> history tokens its tiers hold) as held prefixes, all in
    DRAM. The table knows a node computed or was sent the history, not where it is now: the connector
    saves every block into the node's DRAM arena as it is computed and a route pull lands there, so
    DRAM is where the hint was true when recorded. Counting it as the engine's cache would make a
    stale hint look free; the difference is a DRAM load (~1.5 us a token on the development host)."""
    return {node: HeldPrefix(dram=tokens) for node, tokens in kv_tokens.items() if tokens > 0}


@dataclass(frozen=True, slots=True)
class RouteRequest:
    tenant: str
    session_id: str | None
    model: str
    priority: Priority = Priority.NORMAL
    history_tokens: int = 0  # estimated tokens of history the request carries (its prompt)
    kv_tokens: Mapping[str, int] = field(default_factory=dict)  # node id -> history tokens its tiers hold
    routing_text: str = ""  # the prompt's leading text, for prefix-aware policies (bounded)
    # The prompt's tokens, counted exactly (the scheduler's tokenizer); 0: `history_tokens` estimates them.
    prompt_tokens: int = 0
    # Node id -> the prefix of this prompt it holds, by tier (`scheduler.kv_locator`: the cluster KV
    # index, or a node's hint where the index is not current for it); a node absent holds none.
    # None: not located, the session table's `kv_tokens` stand in for every node (`hints_as_held`).
    held: Mapping[str, HeldPrefix] | None = None
    # Another session of the tenant whose history starts with this prompt's longest held prefix
    # (`scheduler.kv_locator`: a shared system prompt), and node id -> the tokens of this prompt's
    # prefix a pull of that session's first blocks from the node brings. A pull fetches a session's
    # pages by name, so another session's prefix moves between nodes only under its donor's name;
    # None: none known.
    prefix_donor: str | None = None
    prefix_copies: Mapping[str, int] = field(default_factory=dict)
    # How long after this decision the request is expected (ms): an advisory's lead; 0, a request
    # here now. Work a node will have finished by then does not delay it.
    lead_ms: float = 0.0

    @property
    def prompt_size(self) -> int:
        """Tokens of the prompt, exact or estimated."""
        return self.prompt_tokens or self.history_tokens

    def holdings(self) -> Mapping[str, HeldPrefix]:
        """Node id -> the prompt's prefix it holds: the KV index's when given, else the table's hints."""
        return self.held if self.held is not None else hints_as_held(self.kv_tokens)

    def movable(self) -> Mapping[str, int]:
        """Node id -> the tokens of the prompt's prefix a pull from that node brings: the session's
        own history there (`kv_tokens`) or its donor's copy of the prefix (`prefix_copies`), the longer."""
        if not self.prefix_copies:
            return self.kv_tokens
        merged = dict(self.kv_tokens)
        for node, tokens in self.prefix_copies.items():
            if tokens > merged.get(node, 0):
                merged[node] = tokens
        return merged


def prefill_work(request: RouteRequest, node_id: str, pulls: bool) -> PrefillWork:
    """The prefill `node_id` runs for `request`: the prompt but the prefix it holds, or, where the
    request first waits for a pull (`pulls`), but the longest prefix any node holds; at least the last
    token, which an engine always computes. An estimate, as the holdings are."""
    held = request.holdings()
    covered = held.get(node_id, NOTHING_HELD).total
    if pulls and held:  # a pull brings what `movable` names: the session's own copy or its donor's
        movable = request.movable()
        covered = max(covered, max(min(h.total, movable.get(n, 0)) for n, h in held.items()))
    prompt = max(1, request.prompt_size)
    computed = max(1, prompt - covered)
    return PrefillWork(computed, computed * (prompt - computed / 2))


@dataclass(frozen=True, slots=True)
class RouteDecision:
    node_id: str | None  # None: no node takes it now (see `queue`)
    reason: str
    scores: dict[str, float] = field(default_factory=dict)  # lower is better, per candidate
    # Selective pushing: nodes are available but every one has requests waiting; the request waits
    # in the scheduler's queue (FIFO within its priority tier) instead of in an engine's.
    queue: bool = False


@dataclass(frozen=True, slots=True)
class PolicyTraits:
    """How the rest of the scheduler treats a policy's requests."""

    uses_tiers: bool = True  # requests load from and save to Symphony's KV tiers (False: vLLM alone)
    prefetch_on_advisory: bool = False  # an advisory moves the session's KV to the chosen node ahead
    needs_routing_text: bool = False  # fill RouteRequest.routing_text
    # Fill RouteRequest.prompt_tokens and .held from the request's token ids and the cluster KV
    # index (`scheduler.kv_locator`); costs a tokenization per request.
    locates_kv: bool = False


class RoutingPolicy(Protocol):
    name: str
    traits: PolicyTraits

    def choose(self, request: RouteRequest, nodes: Sequence[NodeSnapshot]) -> RouteDecision:
        """Pick a node among `nodes` (already filtered to those serving request.model)."""
        ...

    def observe(self, request: RouteRequest, node_id: str) -> None:
        """The request was sent to `node_id` (policies that learn from traffic update here)."""
        ...


class PolicyClass(Protocol):
    """A policy's class, as `scheduler.policies.POLICIES` holds it: its name, and how it builds
    itself from the scheduler's configuration (the bounds of its tables, its settings) and the
    cluster's measured costs (which only cost-based policies use)."""

    name: str

    def from_config(self, config: SchedulerConfig, profile: CostProfile) -> RoutingPolicy: ...


class NoSettings:
    """For policies that take nothing from the configuration or the cost profile."""

    @classmethod
    def from_config(cls, config: SchedulerConfig, profile: CostProfile) -> Self:
        return cls()


def available(nodes: Sequence[NodeSnapshot]) -> list[NodeSnapshot]:
    return [n for n in nodes if n.available]


def kv_usage(node: NodeSnapshot) -> float:
    """KV usage for comparisons; an unknown (NaN) reading counts as full rather than breaking min()."""
    return node.kv_usage if node.kv_usage == node.kv_usage else 1.0


NO_NODE = RouteDecision(None, "no_available_node")


def advisory_holds(node_id: str, nodes: Sequence[NodeSnapshot]) -> bool:
    """Whether a request goes to the node its advisory picked (seconds ago, when loads were
    different) without asking the policy again: that node serves, has nothing waiting or in
    prefill (the request's prefill would start behind them), and carries no more requests than
    any other available node. Otherwise the policy chooses afresh, counting the cost of moving the
    KV, which the advisory already put on that node. Shared by the scheduler and the simulator."""
    up = available(nodes)
    advised = next((n for n in up if n.node_id == node_id), None)
    return (
        advised is not None
        and advised.rooms > 0
        and advised.prefilling == 0
        and advised.load <= min(n.load for n in up)
    )


def kv_source(
    kv_tokens: Mapping[str, int], node_id: str, at_least: int = 1, reachable: Callable[[str], bool] = lambda _node: True
) -> tuple[str, int] | None:
    """Where `node_id` would pull a session's KV from: the reachable node holding the most history
    tokens, if that is at least `at_least` more than `node_id` holds; else None. (node, its tokens)."""
    held_here = kv_tokens.get(node_id, 0)
    holders = {n: t for n, t in kv_tokens.items() if t - held_here >= max(1, at_least) and reachable(n)}
    if not holders:
        return None
    source = max(holders, key=holders.__getitem__)
    return source, holders[source]


@dataclass(frozen=True, slots=True)
class MoveSources:
    """Where a move to a node pulls a session's KV from: `source` (a node here or, when another
    region's copy is longer than any here, that region's node), and with a far source, `near` (a
    node here holding the session's first `near_blocks` full blocks, beyond what the node itself
    holds: pulled first over the region's own network, so the far link carries only the rest)."""

    source: tuple[str, int] | None  # (node, its tokens); None: the node's own tiers
    near: str | None = None
    near_blocks: int = 0


def move_sources(
    kv_tokens: Mapping[str, int],
    node_id: str,
    remote: tuple[str, int] | None,
    block_size: int,
    reachable: Callable[[str], bool] = lambda _node: True,
) -> MoveSources:
    """`kv_tokens`: this region's nodes' copies; `remote`: another region's node and its copy (the
    global layer's pick), taken only if longer than every copy here."""
    block_size = max(1, block_size)  # 0 from a node that has not reported its engine's yet
    local = kv_source(kv_tokens, node_id, reachable=reachable)
    here = local[1] if local is not None else kv_tokens.get(node_id, 0)
    if remote is None or remote[1] <= here:
        return MoveSources(local)
    if local is None or local[1] // block_size <= kv_tokens.get(node_id, 0) // block_size:
        return MoveSources(remote)  # no node here holds a whole block more than the node itself
    return MoveSources(remote, local[0], local[1] // block_size)
