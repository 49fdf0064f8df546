"""`symphony bench route`: what one routing decision costs each policy at fleet scale.

The real policy objects (`scheduler.policies`) and the real session table (`scheduler.sessions`), fed
`--sessions` sessions spread over `--tenants` tenants on `--nodes` nodes. A decision is what the
scheduler does per request once its node snapshots are built: look the session up, build the
`RouteRequest`, locate the prompt's KV for policies that price by content (`PolicyTraits.locates_kv`),
`choose`, `observe`, and record the turn. Per policy, first every session's first turn is routed
(filling the policy's, the session table's and the locator's state), then `--requests` later turns
of random sessions are timed one by one.

Locating is the scheduler's own (`scheduler.kv_locator.KVLocator` over a `ClusterKVIndex` holding
`--index-blocks` blocks, fed by the nodes' block event snapshots: `eval.route_kv`): the prompt's block
keys (only the blocks a session's cached previous prompt lacks are hashed), the index's prefix per
node, the held prefixes the request carries. Token ids are synthetic: tokenization is excluded (a
`TokenService` call precedes locating in the scheduler; it is not timed here). After each routed turn
the chosen node reports the prompt's blocks stored, as a live batch (not timed: the scheduler
applies those between requests).

Prompts are synthetic but shaped like chat traffic: each tenant has its own system prompt, each
session its own history, and a turn's prompt is the session's history so far; the text the
prefix-aware policy reads is capped like the scheduler caps it (`MAX_ROUTING_TEXT`). Node load
changes every `POLL_EVERY` decisions, as a status poll would change it.

Memory is the peak Python allocation while a policy's state is built (tracemalloc, which then stops,
so timing runs without it): the policy's tables, the session table and the locator's cached keys.
The index's is reported once (`index_bytes`, see `_build_index`).
"""

from __future__ import annotations

import random
import statistics
import sys
import time
import tracemalloc
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from eval.plots import plot_route
from eval.results import write_result
from eval.route_kv import FINGERPRINT, FleetIndex, Streams, cluster_index
from eval.stats import percentile
from scheduler.kv_locator import KVLocator
from scheduler.policies import make_policy
from scheduler.routing import NodeSnapshot, RouteRequest, RoutingPolicy
from scheduler.sessions import SessionTable
from symphony.config import EngineConfig, SchedulerConfig
from symphony.prompt_text import MAX_ROUTING_TEXT

DEFAULT_POLICIES = ("symphony", "least_load", "round_robin", "consistent_hash", "sticky", "prefix_trie")
TARGETS_P99_US = {"symphony": 500.0, "prefix_trie": 1000.0}
POLL_EVERY = 100  # decisions between two changes of node load
BLOCKS_PER_SESSION = 100  # the index's blocks by default: 10M at 100,000 sessions
_WORDS = (
    "the",
    "model",
    "cache",
    "token",
    "request",
    "answer",
    "session",
    "history",
    "prompt",
    "user",
    "agent",
    "tool",
    "plan",
    "code",
    "test",
    "review",
    "write",
    "read",
    "table",
    "join",
    "index",
    "query",
    "result",
    "error",
    "retry",
    "node",
    "layer",
    "block",
    "page",
    "memory",
    "disk",
    "network",
    "region",
    "price",
    "latency",
    "budget",
    "deploy",
    "build",
    "ship",
    "fix",
    "explain",
    "summarize",
)


@dataclass(frozen=True, slots=True)
class RouteWorkload:
    nodes: int
    sessions: int
    tenants: int
    requests: int
    seed: int = 0
    index_blocks: int = 0  # blocks the nodes' snapshots put in the index (0: no index)


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


class _Traffic:
    """Deterministic sessions and turns: the same for every policy of a run."""

    def __init__(self, workload: RouteWorkload) -> None:
        self.workload = workload
        rng = random.Random(workload.seed)
        self.system = [f"You are assistant {t} of tenant {t}. " + _text(rng, 60) for t in range(workload.tenants)]
        self.node_ids = [f"node-{i}" for i in range(workload.nodes)]
        # Token ids (synthetic; their lengths are every policy's prompt sizes).
        self.streams = Streams(
            sessions=workload.sessions,
            tenants=workload.tenants,
            nodes=workload.nodes,
            index_blocks=workload.index_blocks,
            block_size=EngineConfig().block_size,
            seed=workload.seed,
        )

    def tenant(self, session: int) -> str:
        return f"tenant-{session % self.workload.tenants}"

    def prompt(self, session: int, turn: int) -> str:
        """The session's history through `turn`: its tenant's system prompt, then one message per turn."""
        rng = random.Random(session * 1_000_003 + 17)
        parts = [self.system[session % self.workload.tenants]]
        for _ in range(turn + 1):
            parts.append(_text(rng, rng.randint(20, 120)))
        return " ".join(parts)[:MAX_ROUTING_TEXT]

    def snapshots(self, rng: random.Random) -> list[NodeSnapshot]:
        """One poll's view of the fleet: most nodes busy, a few with requests waiting, one down."""
        down = rng.randrange(len(self.node_ids))
        views = []
        for index, node_id in enumerate(self.node_ids):
            running = rng.randint(0, 12)
            views.append(
                NodeSnapshot(
                    node_id,
                    index != down or len(self.node_ids) == 1,
                    running,
                    rng.choice((0, 0, 0, 1)),
                    running,
                    rng.random(),
                    announced=rng.randint(0, 2),
                    high_sessions=rng.randint(0, 3),
                )
            )
        return views


@dataclass(slots=True)
class _Locating:
    """A locating policy's view of the index: its locator (fresh per policy) and the fleet's index."""

    fleet: FleetIndex
    locator: KVLocator


def _decide(
    policy: RoutingPolicy,
    table: SessionTable,
    traffic: _Traffic,
    session: int,
    turn: int,
    nodes: list[NodeSnapshot],
    text: str,
    ids: np.ndarray | None = None,
    locating: _Locating | None = None,
) -> tuple[str | None, RouteRequest]:
    """One request's routing, as the dispatcher does it (minus the network and the tokenizer)."""
    tenant = traffic.tenant(session)
    key = (tenant, f"s{session}")
    entry = table.get(key)
    history = traffic.streams.tokens(session, turn) if ids is None else len(ids)
    kv_tokens = dict(entry.kv_tokens) if entry is not None else {}
    request = RouteRequest(
        tenant, key[1], "model", "normal", history, kv_tokens, text if policy.traits.needs_routing_text else ""
    )
    if locating is not None and ids is not None:
        request = locating.fleet.locate(
            locating.locator, request, ids, nodes, traffic.streams.block_size, partial(_copies, table, tenant)
        )
    decision = policy.choose(request, nodes)
    node_id = decision.node_id
    if node_id is None:  # selective pushing held it: the dispatcher would queue it; route it unqueued
        return None, request
    policy.observe(request, node_id)
    table.served(key, node_id, history, fingerprint=FINGERPRINT)
    return node_id, request


def _copies(table: SessionTable, tenant: str, session_id: str) -> dict[str, int]:
    """A session's copies as the dispatcher's session table gives them (`SchedulerState.session_copies`)."""
    entry = table.get((tenant, session_id))
    return dict(entry.kv_tokens) if entry is not None else {}


def _served(locating: _Locating | None, traffic: _Traffic, session: int, ids: np.ndarray | None, node: str) -> None:
    """The node reports the prompt's blocks stored (a live batch; keys from the locator's cache)."""
    if locating is None or ids is None:
        return
    tenant, block_size = traffic.tenant(session), traffic.streams.block_size
    locating.fleet.served(node, locating.locator.block_keys(tenant, f"s{session}", ids, FINGERPRINT, block_size))


def measure_policy(
    name: str, traffic: _Traffic, progress: tqdm | None = None, fleet: FleetIndex | None = None
) -> dict[str, Any]:
    workload = traffic.workload
    config = SchedulerConfig(max_sessions=max(workload.sessions, 1))
    rng = random.Random(workload.seed + 1)
    tracemalloc.start()
    started = time.perf_counter()
    policy = make_policy(name, config)
    table = SessionTable(config.max_sessions, ttl_s=86_400.0)
    locating = None
    if fleet is not None and policy.traits.locates_kv:
        locating = _Locating(fleet, fleet.locator(config.tokenizer_cache_sessions, config.prefix_donor_blocks))
    nodes = traffic.snapshots(rng)
    turns = [0] * workload.sessions
    for session in range(workload.sessions):
        if session % POLL_EVERY == 0:
            nodes = traffic.snapshots(rng)
        ids = traffic.streams.ids(session, 0) if locating is not None else None
        chosen, _ = _decide(policy, table, traffic, session, 0, nodes, traffic.prompt(session, 0), ids, locating)
        if chosen is not None:
            _served(locating, traffic, session, ids, chosen)
        if progress is not None and session % 1000 == 999:
            progress.update(1000)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    build_s = time.perf_counter() - started
    samples_us: list[float] = []
    cpu_us: list[float] = []  # the thread's CPU time: the decision's own cost, less time preempted
    queued = 0
    hashed_before = locating.locator.keys_hashed if locating is not None else 0
    located: list[float] = []  # the longest prefix any node holds, per located request (tokens)
    prompts: list[int] = []
    for decision in range(workload.requests):
        if decision % POLL_EVERY == 0:
            nodes = traffic.snapshots(rng)
        session = rng.randrange(workload.sessions)
        turns[session] += 1
        text = traffic.prompt(session, turns[session])  # built outside the timed region
        ids = traffic.streams.ids(session, turns[session]) if locating is not None else None
        cpu_begun = time.thread_time_ns()
        begun = time.perf_counter_ns()
        chosen, request = _decide(policy, table, traffic, session, turns[session], nodes, text, ids, locating)
        samples_us.append((time.perf_counter_ns() - begun) / 1000)
        cpu_us.append((time.thread_time_ns() - cpu_begun) / 1000)
        queued += chosen is None
        if chosen is not None:
            _served(locating, traffic, session, ids, chosen)
        if request.held is not None:
            located.append(max((h.total for h in request.held.values()), default=0))
            prompts.append(request.prompt_size)
        if progress is not None and decision % 1000 == 999:
            progress.update(1000)
    row: dict[str, Any] = {
        "decision_us_p50": percentile(samples_us, 50),
        "decision_us_p99": percentile(samples_us, 99),
        "decision_us_mean": statistics.fmean(samples_us),
        "decision_cpu_us_p50": percentile(cpu_us, 50),
        "decision_cpu_us_p99": percentile(cpu_us, 99),
        "peak_memory_mb": peak / 1e6,
        "build_s": build_s,
        "queued": queued,
        "sessions_tracked": len(table),
    }
    if locating is not None:
        row |= {
            "located_requests": len(located),
            "located_prefix_tokens_mean": statistics.fmean(located) if located else 0.0,
            "located_prefix_frac_mean": statistics.fmean(h / p for h, p in zip(located, prompts, strict=True))
            if located
            else 0.0,
            "prompt_tokens_mean": statistics.fmean(prompts) if prompts else 0.0,
            "blocks_hashed_per_decision": (locating.locator.keys_hashed - hashed_before) / max(1, workload.requests),
            "locator_sessions": config.tokenizer_cache_sessions,
        }
    return row


def _build_index(traffic: _Traffic) -> tuple[FleetIndex, dict[str, Any]]:
    """The fleet's index, populated from the nodes' snapshots. Its memory: tracemalloc's count of
    what constructing it allocates (the table's arrays, allocated in full then whatever the fill, and
    the index's Python objects), plus what the arrays grew by while populating (the clear log, as
    nbytes). Population runs without tracemalloc, which would make it ~5x slower."""
    workload = traffic.workload
    default = SchedulerConfig().kv_index_max_blocks
    max_blocks = max(default, traffic.streams.blocks)
    tracemalloc.start()
    index = cluster_index(workload.nodes, max_blocks)
    constructed, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    fleet = FleetIndex(traffic.streams, index)
    arrays_before = fleet.index.table.approx_bytes()
    with tqdm(
        total=traffic.streams.blocks, desc="index: node snapshots", unit="block", unit_scale=True, file=sys.stderr
    ) as progress:
        population = fleet.populate(progress)
    arrays = fleet.index.table.approx_bytes()
    index_bytes = constructed + arrays - arrays_before
    info = {
        "index_blocks": population.blocks,
        "index_bytes": index_bytes,
        "index_array_bytes": arrays,
        "index_bytes_per_block": index_bytes / max(1, population.blocks),
        "index_bytes_how": "tracemalloc over construction (arrays allocated in full, Python objects) "
        "+ the arrays' growth while populating (nbytes)",
        "kv_index_max_blocks": max_blocks,
        "kv_index_max_blocks_default": default,
        "populate_s": population.seconds,
        "populate_batches": population.batches,
        "populate_block_events": population.block_events,
        "block_size": traffic.streams.block_size,
        "target_blocks": workload.index_blocks,
    }
    return fleet, info


def run_route_bench(
    *,
    out: Path,
    nodes: int = 64,
    sessions: int = 100_000,
    tenants: int = 100,
    requests: int = 20_000,
    policies: tuple[str, ...] = DEFAULT_POLICIES,
    index_blocks: int | None = None,  # None: BLOCKS_PER_SESSION per session
    seed: int = 0,
    plot: Path | None = None,
) -> dict[str, Any]:
    if index_blocks is None:
        index_blocks = BLOCKS_PER_SESSION * sessions
    workload = RouteWorkload(nodes, sessions, tenants, requests, seed, index_blocks)
    traffic = _Traffic(workload)
    fleet, index = None, {}
    if index_blocks and any(make_policy(name, SchedulerConfig()).traits.locates_kv for name in policies):
        fleet, index = _build_index(traffic)
    results: dict[str, Any] = {}
    with tqdm(
        total=len(policies) * (sessions + requests),
        desc="bench route",
        unit="decision",
        file=sys.stderr,
        unit_scale=True,
    ) as progress:
        for name in policies:
            results[name] = measure_policy(name, traffic, progress, fleet)
    targets = {
        f"{name}_p99_le_{bound:g}us": results[name]["decision_us_p99"] <= bound
        for name, bound in TARGETS_P99_US.items()
        if name in results
    }
    settings_needed = {}
    if index and index["kv_index_max_blocks"] > index["kv_index_max_blocks_default"]:
        settings_needed["scheduler.kv_index_max_blocks"] = index["kv_index_max_blocks"]
    result = {
        "nodes": nodes,
        "sessions": sessions,
        "tenants": tenants,
        "requests": requests,
        "seed": seed,
        "prefix_trie_max_chars": SchedulerConfig().prefix_trie_max_chars,
        "tokenization": "excluded: synthetic token ids",
        **index,
        "index_live_batches": fleet.live_batches if fleet is not None else 0,
        "index_blocks_after": fleet.index.blocks if fleet is not None else 0,
        "index_evictions": fleet.index.evictions if fleet is not None else 0,
        "settings_needed": settings_needed,
        "policies": results,
        "targets": targets,
    }
    write_result(result, out, table=_print_table, plot=plot, plotter=plot_route)
    return result


def _print_table(result: dict[str, Any]) -> None:
    print(f"{result['nodes']} nodes, {result['sessions']} sessions, {result['requests']} timed decisions")
    print(f"  {'policy':<16}{'p50 us':>9}{'p99 us':>9}{'mean us':>9}{'peak MB':>9}")
    for name, row in result["policies"].items():
        print(
            f"  {name:<16}{row['decision_us_p50']:>9.1f}{row['decision_us_p99']:>9.1f}"
            f"{row['decision_us_mean']:>9.1f}{row['peak_memory_mb']:>9.1f}"
        )
    for name, ok in result["targets"].items():
        print(f"  target {name}: {'met' if ok else 'NOT met'}")
