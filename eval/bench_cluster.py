"""`symphony bench cluster`: routing policies compared on one live local cluster.

One 2-node cluster (real vLLM engines with Symphony's connector) is started once. Each policy then
gets a scheduler of its own (`symphony scheduler` with that policy, on a free port), and the same
users replay the same ShareGPT conversations through it with human reading and typing time and a
typing advisory per turn (`eval.loadgen`). Policies run one after the other on a clean slate: every
policy is its own tenant (API key), so no policy finds another's KV in Symphony's tiers, and both
engines' prefix caches are emptied before each.

Keys per policy: TTFT p50/p95, mean TPOT, mean normalized latency (end-to-end time per output token),
requests completed and failed, `max_over_mean_load` (per node busy time: the sum of its requests'
durations, busiest over mean), prompt tokens computed and in total, and `kv_ready_at_arrival_frac`
(resumed turns that found at least 90% of their history cached when they arrived), and the typing
advisories' round trips as the load generator saw them (`advisory_ms_p50`, `advisory_ms_p99`) and
the scheduler's own time to answer them (`advisory_server_ms_p99_bound`: the histogram bucket bound
under which 99% fell), and the CPU seconds the cluster's engines, node managers and the policy's
scheduler spent meanwhile (`cpu_s_by_role`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx

from eval.child_process import stop_child
from eval.loadgen import LoadGenerator, LoadSettings, RequestRecord, write_records
from eval.plots import plot_cluster
from eval.ports import free_port_run
from eval.process_cpu import cpu_seconds_between, cpu_seconds_by_role
from eval.results import write_result
from eval.stats import percentile
from eval.workloads import Conversation, HumanTiming
from symphony.config import SymphonyConfig, dump_toml
from symphony.launcher import LocalCluster
from symphony.models import ModelInfo, fetch_default_model, resolve_model

T = TypeVar("T")
READY_FRACTION = 0.9  # of a resumed turn's history, cached at arrival, to count as "ready"
BLOCK_SLACK_TOKENS = 32  # the history's last block may not be reusable (the answer's end re-templated)


def summarize(records: list[RequestRecord], nodes: list[str]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    busy = {node: 0.0 for node in nodes}
    for r in records:
        if r.node in busy:
            busy[r.node] += r.e2e_s
    mean_busy = statistics.fmean(busy.values()) if busy else 0.0
    advisory_ms = [r.advisory_ms for r in records if r.advisory_ms > 0]
    ready, resumed, new_tokens = 0, 0, 0
    history: dict[str, int] = {}  # session -> tokens its last turn left (prompt + answer)
    for r in sorted(ok, key=lambda r: (r.session, r.turn)):
        if r.session in history:
            resumed += 1
            ready += r.cached_tokens >= READY_FRACTION * history[r.session] - BLOCK_SLACK_TOKENS
        new_tokens += max(0, r.prompt_tokens - history.get(r.session, 0))
        history[r.session] = r.prompt_tokens + r.output_tokens
    return {
        "ttft_ms_p50": percentile([r.ttft_s * 1000 for r in ok], 50),
        "ttft_ms_p95": percentile([r.ttft_s * 1000 for r in ok], 95),
        "tpot_ms_mean": statistics.fmean(r.tpot_s * 1000 for r in ok) if ok else float("nan"),
        "norm_latency_ms_per_token_mean": (
            statistics.fmean(r.e2e_s * 1000 / max(1, r.output_tokens) for r in ok) if ok else float("nan")
        ),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "busy_s_by_node": busy,
        "max_over_mean_load": max(busy.values()) / mean_busy if mean_busy else float("nan"),
        "prefill_tokens_computed": sum(r.computed_tokens for r in ok),
        "prefill_tokens_total": sum(r.prompt_tokens for r in ok),
        # What no cache can hold: first turns' prompts, later turns' new messages. Its share of the
        # total is the floor of computed/total for the workload as this policy's run replayed it.
        "prefill_tokens_new": new_tokens,
        "kv_ready_at_arrival_frac": ready / resumed if resumed else float("nan"),
        "resumed_turns": resumed,
        # Client-side round trips (an upper bound on the scheduler's own time to answer).
        "advisory_ms_p50": percentile(advisory_ms, 50) if advisory_ms else float("nan"),
        "advisory_ms_p99": percentile(advisory_ms, 99) if advisory_ms else float("nan"),
        "requests_by_node": {node: sum(1 for r in ok if r.node == node) for node in nodes},
        # The scheduler's share of TTFT: routing, the push queue, waiting for a pull of the KV.
        "routed_ms_p50": percentile([r.routed_ms for r in ok], 50) if ok else float("nan"),
        "routed_ms_p95": percentile([r.routed_ms for r in ok], 95) if ok else float("nan"),
        "routes": {reason: sum(1 for r in ok if r.route == reason) for reason in sorted({r.route for r in ok})},
    }


def targets(result: dict[str, Any]) -> dict[str, bool]:
    """Issue 5's bars, for the policies the run measured."""
    by = result["policies"]
    out: dict[str, bool] = {}
    if "symphony" not in by:
        return out
    s = by["symphony"]
    out["symphony_errors_zero"] = s["errors"] == 0
    out["symphony_prefill_computed_le_0.1"] = s["prefill_tokens_computed"] <= 0.1 * s["prefill_tokens_total"]
    if "recompute" in by:
        out["symphony_ttft_p95_le_half_recompute"] = s["ttft_ms_p95"] <= 0.5 * by["recompute"]["ttft_ms_p95"]
    if "sticky" in by:
        out["symphony_ttft_p95_le_sticky"] = s["ttft_ms_p95"] <= by["sticky"]["ttft_ms_p95"]
        out["symphony_load_balance_le_sticky"] = s["max_over_mean_load"] <= by["sticky"]["max_over_mean_load"]
    return out


class _PolicyScheduler:
    """`symphony scheduler` with one policy, in front of the cluster's nodes; one tenant's key."""

    def __init__(self, config: SymphonyConfig, policy: str, home: Path, key: str) -> None:
        self.port = free_port_run(1)
        self.tenant = f"bench-{policy}"
        scheduler = dataclasses.replace(
            config.scheduler,
            port=self.port,
            policy=policy,
            node_addresses=config.scheduler_node_addresses(),
            api_keys=[f"{self.tenant}:{key}"],
        )
        path = home / "run" / f"scheduler-{policy}.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dump_toml(dataclasses.replace(config, scheduler=scheduler)))
        log_path = home / "logs" / f"scheduler-{policy}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "symphony.cli", "scheduler", "--effective-config", str(path)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.url = f"http://{config.scheduler.host}:{self.port}"

    async def ready(self, nodes: int, within_s: float = 60.0) -> None:
        deadline = time.monotonic() + within_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the {self.tenant} scheduler exited; see {self.log.name}")
                try:
                    if (await client.get(self.url + "/readyz")).json().get("ready_nodes") == nodes:
                        return
                except (httpx.HTTPError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the {self.tenant} scheduler did not see {nodes} ready nodes")
                await asyncio.sleep(0.2)  # polling a starting child process

    async def metrics(self) -> str:
        async with httpx.AsyncClient(timeout=5.0) as client:
            return (await client.get(self.url + "/metrics")).text

    def stop(self) -> None:
        stop_child(self.process, self.log)


async def _reset_prefix_caches(config: SymphonyConfig, timeout_s: float = 30.0) -> None:
    """Empty every engine's prefix cache. vLLM refuses while a request holds blocks, and a finished
    request holds them one engine step longer while its partial last block is copied out: asked
    again until every engine agrees."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=60.0) as client:
        for i in range(config.cluster.nodes):
            url = f"http://{config.node.host}:{config.engine_port(i)}/reset_prefix_cache"
            while True:
                reply = await client.post(url)
                if reply.status_code != 200:
                    raise RuntimeError(f"{url} answered {reply.status_code}")
                if reply.json().get("success", True):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url} kept refusing: some request still holds KV blocks")
                await asyncio.sleep(0.05)


def _advised_ready(metrics: str) -> dict[str, float]:
    counts = {"yes": 0.0, "no": 0.0}
    for line in metrics.splitlines():
        if line.startswith("symphony_advised_requests_total{"):
            for ready in counts:
                if f'kv_ready="{ready}"' in line:
                    counts[ready] += float(line.rsplit(" ", 1)[1])
    return counts


def advisory_p99_bound_ms(metrics: str) -> float:
    """From the scheduler's `symphony_advisory_seconds` histogram: the bucket bound (ms) under which
    99% of advisories were answered (inf past the last bucket, nan without advisories)."""
    buckets: list[tuple[float, float]] = []
    for line in metrics.splitlines():
        if line.startswith('symphony_advisory_seconds_bucket{le="'):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(bound), float(line.rsplit(" ", 1)[1])))
    total = buckets[-1][1] if buckets else 0.0
    if not total:
        return float("nan")
    return next(bound * 1000 for bound, count in buckets if count >= 0.99 * total)


async def measure_policies(
    config: SymphonyConfig,
    model: str,
    home: Path,
    policies: list[str],
    settings: LoadSettings,
    timing: HumanTiming,
    conversations: list[Conversation],
    records_dir: Path | None = None,
    records_by_policy: dict[str, list[RequestRecord]] | None = None,
) -> dict[str, Any]:
    """Each policy in turn, on the running cluster `config` describes (its engines must serve
    /reset_prefix_cache: VLLM_SERVER_DEV_MODE=1): {policy: summary}. Each policy's per-request
    records go to `records_dir` (files) and `records_by_policy`, when given."""
    nodes = [config.node_id(i) for i in range(config.cluster.nodes)]
    results: dict[str, Any] = {}
    for policy in policies:
        await _reset_prefix_caches(config)
        key = uuid.uuid4().hex
        scheduler = _PolicyScheduler(config, policy, home, key)
        try:
            await scheduler.ready(config.cluster.nodes)
            print(f"policy {policy}: {settings.users} users for {settings.duration_s:.0f} s", file=sys.stderr)
            generator = LoadGenerator(
                scheduler.url, model, conversations, timing, settings, api_key=key, session_prefix=f"{policy}-{key[:6]}"
            )
            cpu_before = cpu_seconds_by_role()
            records = await generator.run()
            summary = summarize(records, nodes)
            summary["cpu_s_by_role"] = cpu_seconds_between(cpu_before, cpu_seconds_by_role())
            metrics = await scheduler.metrics()
            summary["advised_requests_kv_ready"] = _advised_ready(metrics)
            summary["advisory_server_ms_p99_bound"] = advisory_p99_bound_ms(metrics)
            results[policy] = summary
            if records_by_policy is not None:
                records_by_policy[policy] = records
            if records_dir is not None:
                write_records(records, records_dir / f"{policy}.json", records_dir / f"{policy}.csv")
        finally:
            scheduler.stop()
    return results


async def on_private_cluster(config: SymphonyConfig, model: ModelInfo, work: Callable[[], Awaitable[T]]) -> T:
    """Start the cluster `config` describes, run `work` once it is ready, shut the cluster down."""
    cluster = LocalCluster(config, model, sys.stderr)
    cluster.spawn()
    try:
        if not await cluster.wait_ready(asyncio.Event()):
            raise RuntimeError("the benchmark cluster did not become ready")
        return await work()
    finally:
        await cluster.shutdown()


def bench_cluster_config(config: SymphonyConfig, home: Path) -> SymphonyConfig:
    return dataclasses.replace(
        config,
        home=str(home),
        cluster=dataclasses.replace(config.cluster, nodes=2),
        scheduler=dataclasses.replace(config.scheduler, port=free_port_run(1), node_addresses=[]),
        node=dataclasses.replace(config.node, grpc_port_base=free_port_run(2), engine_port_base=free_port_run(2)),
        kv=dataclasses.replace(config.kv, metrics_port_base=free_port_run(2), ssd_dir="", data_port_base=0),
        engine=dataclasses.replace(config.engine, kv_connector=True),
    )


def run_cluster_bench(
    config: SymphonyConfig,
    *,
    out: Path,
    policies: list[str],
    users: int,
    duration_s: float,
    time_scale: float,
    max_answer_tokens: int,
    workload: Path,
    conversations: list[Conversation],
    miss_rate: float = 0.0,
    plot: Path | None = None,
    records_dir: Path | None = None,
) -> int:
    if not config.engine.model:
        fetch_default_model(config.home_path, progress=lambda m: print(m, file=sys.stderr))
    model = resolve_model(config.engine.model, config.engine.served_model_name, config.home_path)
    home = config.home_path / "bench" / f"cluster-{uuid.uuid4().hex[:8]}"
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # the engines' /reset_prefix_cache, between policies
    settings = LoadSettings(users=users, duration_s=duration_s, max_answer_tokens=max_answer_tokens)
    timing = HumanTiming(time_scale=time_scale, advisory_miss_rate=miss_rate)
    if records_dir is not None:
        records_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        private = bench_cluster_config(config, home)

        async def work() -> dict[str, Any]:
            return await measure_policies(
                private, model.served_name, home, policies, settings, timing, conversations, records_dir
            )

        by_policy = asyncio.run(on_private_cluster(private, model, work))
    except BaseException:
        print(f"the benchmark cluster's logs are kept in {home / 'logs'}", file=sys.stderr)
        raise
    shutil.rmtree(home, ignore_errors=True)
    result: dict[str, Any] = {
        "users": users,
        "duration_s": duration_s,
        "time_scale": time_scale,
        "max_answer_tokens": max_answer_tokens,
        "advisory_miss_rate": miss_rate,
        "workload": str(workload),
        "conversations": len(conversations),
        "run_s": time.monotonic() - started,
        "policies": by_policy,
    }
    result["targets"] = targets(result)
    write_result(result, out, table=_print_table, plot=plot, plotter=plot_cluster)
    return 0


def _print_table(result: dict[str, Any]) -> None:
    print(f"{result['users']} users, {result['duration_s']:.0f} s per policy, time scale {result['time_scale']:g}")
    columns = (
        "ttft_ms_p50",
        "ttft_ms_p95",
        "tpot_ms_mean",
        "norm_latency_ms_per_token_mean",
        "completed",
        "errors",
        "max_over_mean_load",
        "kv_ready_at_arrival_frac",
    )
    print(
        f"{'policy':<14}" + "".join(f"{c[:16]:>18}" for c in columns) + f"{'computed/total':>16}" + f"{'new/total':>11}"
    )
    for policy, s in result["policies"].items():
        total = s["prefill_tokens_total"] or float("nan")
        print(
            f"{policy:<14}"
            + "".join(f"{s[c]:>18.2f}" if isinstance(s[c], float) else f"{s[c]:>18}" for c in columns)
            + f"{s['prefill_tokens_computed'] / total:>16.3f}{s['prefill_tokens_new'] / total:>11.3f}"
        )
    for name, ok in result["targets"].items():
        print(f"  target {name}: {'met' if ok else 'NOT met'}")
