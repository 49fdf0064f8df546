"""`symphony bench route`: what one routing decision costs each policy at fleet scale.

The real policy objects (`scheduler.policies`) and the real session table (`scheduler.sessions`), fed
`--sessions` sessions spread over `--tenants` tenants on `--nodes` nodes. A decision is what the
scheduler does per request once its node snapshots are built: look the session up, build the
`RouteRequest`, `choose`, `observe`, and record the turn. Per policy, first every session's first
turn is routed (filling the policy's and the session table's state), then `--requests` later turns
of random sessions are timed one by one.

Prompts are synthetic but shaped like chat traffic for the prefix-aware policy: each tenant has its
own system prompt, each session its own opening, and a turn's text is the session's history so far
(capped like the scheduler caps it, `MAX_ROUTING_TEXT`). Node load changes every `POLL_EVERY`
decisions, as a status poll would change it.

Memory is the peak Python allocation while the state is built (tracemalloc, which then stops, so
timing runs without it): the policy's tables plus the session table.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from eval.plots import plot_route
from eval.results import write_result
from eval.stats import percentile
from scheduler.policies import make_policy
from scheduler.routing import NodeSnapshot, RouteRequest, RoutingPolicy
from scheduler.sessions import SessionTable
from scheduler.validation import MAX_ROUTING_TEXT
from symphony.config import SchedulerConfig

DEFAULT_POLICIES = ("symphony", "least_load", "round_robin", "consistent_hash", "sticky", "prefix_trie")
TARGETS_P99_US = {"symphony": 500.0, "prefix_trie": 1000.0}
POLL_EVERY = 100  # decisions between two changes of node load
SIM_FINGERPRINT = bytes(32)  # every simulated node serves one model
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


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


class _Traffic:
    """Deterministic sessions and turns: the same for every policy of a run."""

    def __init__(self, workload: RouteWorkload) -> None:
        self.workload = workload
        rng = random.Random(workload.seed)
        self.system = [f"You are assistant {t} of tenant {t}. " + _text(rng, 60) for t in range(workload.tenants)]
        self.node_ids = [f"node-{i}" for i in range(workload.nodes)]

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


def _decide(
    policy: RoutingPolicy,
    table: SessionTable,
    traffic: _Traffic,
    session: int,
    turn: int,
    nodes: list[NodeSnapshot],
    text: str,
) -> str | None:
    """One request's routing, as the dispatcher does it (minus the network)."""
    tenant = traffic.tenant(session)
    key = (tenant, f"s{session}")
    entry = table.get(key)
    history = len(text) // 4  # ~4 characters a token
    kv_tokens = dict(entry.kv_tokens) if entry is not None else {}
    request = RouteRequest(
        tenant, key[1], "model", "normal", history, kv_tokens, text if policy.traits.needs_routing_text else ""
    )
    decision = policy.choose(request, nodes)
    node_id = decision.node_id
    if node_id is None:  # selective pushing held it: the dispatcher would queue it; route it unqueued
        return None
    policy.observe(request, node_id)
    table.served(key, node_id, history, fingerprint=SIM_FINGERPRINT)
    return node_id


def measure_policy(name: str, traffic: _Traffic, progress: tqdm | None = None) -> dict[str, Any]:
    workload = traffic.workload
    config = SchedulerConfig(max_sessions=max(workload.sessions, 1))
    rng = random.Random(workload.seed + 1)
    tracemalloc.start()
    started = time.perf_counter()
    policy = make_policy(name, config)
    table = SessionTable(config.max_sessions, ttl_s=86_400.0)
    nodes = traffic.snapshots(rng)
    turns = [0] * workload.sessions
    for session in range(workload.sessions):
        if session % POLL_EVERY == 0:
            nodes = traffic.snapshots(rng)
        _decide(policy, table, traffic, session, 0, nodes, traffic.prompt(session, 0))
        if progress is not None and session % 1000 == 999:
            progress.update(1000)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    build_s = time.perf_counter() - started
    samples_us: list[float] = []
    queued = 0
    for decision in range(workload.requests):
        if decision % POLL_EVERY == 0:
            nodes = traffic.snapshots(rng)
        session = rng.randrange(workload.sessions)
        turns[session] += 1
        text = traffic.prompt(session, turns[session])  # built outside the timed region
        begun = time.perf_counter_ns()
        chosen = _decide(policy, table, traffic, session, turns[session], nodes, text)
        samples_us.append((time.perf_counter_ns() - begun) / 1000)
        queued += chosen is None
        if progress is not None and decision % 1000 == 999:
            progress.update(1000)
    return {
        "decision_us_p50": percentile(samples_us, 50),
        "decision_us_p99": percentile(samples_us, 99),
        "decision_us_mean": statistics.fmean(samples_us),
        "peak_memory_mb": peak / 1e6,
        "build_s": build_s,
        "queued": queued,
        "sessions_tracked": len(table),
    }


def run_route_bench(
    *,
    out: Path,
    nodes: int = 64,
    sessions: int = 100_000,
    tenants: int = 100,
    requests: int = 20_000,
    policies: tuple[str, ...] = DEFAULT_POLICIES,
    seed: int = 0,
    plot: Path | None = None,
) -> dict[str, Any]:
    workload = RouteWorkload(nodes, sessions, tenants, requests, seed)
    traffic = _Traffic(workload)
    results: dict[str, Any] = {}
    with tqdm(
        total=len(policies) * (sessions + requests),
        desc="bench route",
        unit="decision",
        file=sys.stderr,
        unit_scale=True,
    ) as progress:
        for name in policies:
            results[name] = measure_policy(name, traffic, progress)
    targets = {
        f"{name}_p99_le_{bound:g}us": results[name]["decision_us_p99"] <= bound
        for name, bound in TARGETS_P99_US.items()
        if name in results
    }
    result = {
        "nodes": nodes,
        "sessions": sessions,
        "tenants": tenants,
        "requests": requests,
        "seed": seed,
        "prefix_trie_max_chars": SchedulerConfig().prefix_trie_max_chars,
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
