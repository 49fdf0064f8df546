"""`symphony bench cluster`: routing policies compared on one live local cluster.

One 2-node cluster (real vLLM engines with Symphony's connector) is started once. Each policy then
gets a scheduler of its own (`symphony scheduler` with that policy, on a free port), and the same
workload (`eval.live_workloads`: ShareGPT users with human timing and typing advisories, skewed
users, shared-prefix groups or a Mooncake trace) replays through it. Policies run one after the
other on a clean slate: every (policy, repeat) is its own tenant (API key), so no run finds another's
KV in Symphony's tiers, and both engines' prefix caches are emptied before each.

With `repeats` R, the whole comparison runs R times, each time in another order of the policies
(`eval.protocol.rotation`) and with the next seed (every policy of a repeat replays the same
workload); the result keeps every run (`runs`), each policy's figures over the repeats (`policies`)
and every pair's per-repeat ratios with their interval and verdict (`comparisons`). The figures of
one run are `eval.cluster_summary.summarize`'s, plus the CPU seconds the cluster's engines, node
managers and the policy's scheduler spent meanwhile (`cpu_s_by_role`) and the scheduler's own time
to answer advisories (`advisory_server_ms_p99_bound`: the histogram bucket bound under which 99%
fell).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from eval.child_process import await_ready, stop_child
from eval.cluster_summary import INDEX_LAG_NOTE, print_table, summarize, targets
from eval.live_workloads import ChatWorkload, LiveWorkload, Prepared
from eval.loadgen import LoadSettings, RequestRecord, write_records
from eval.plots import plot_cluster
from eval.ports import free_port_run, private_cluster_config
from eval.process_cpu import cpu_seconds_between, cpu_seconds_by_role
from eval.protocol import aggregate, comparisons, order_balance, rotation
from eval.results import write_result
from eval.workloads import Conversation, HumanTiming
from scheduler.tokenizer_load import tokenizer_dirs
from symphony.config import SymphonyConfig, dump_toml
from symphony.config_secrets import scrubbed_env, write_private
from symphony.launcher import LocalCluster
from symphony.models import ModelInfo, fetch_default_model, resolve_model
from symphony.tenancy import engine_headers, internal_headers

T = TypeVar("T")


class _PolicyScheduler:
    """`symphony scheduler` with one policy, in front of the cluster's nodes; one tenant's key."""

    def __init__(self, config: SymphonyConfig, policy: str, home: Path, key: str, repeat: int = 0) -> None:
        self.port = free_port_run(1)
        self.tenant = f"bench-{policy}-r{repeat}"
        # Named, not "auto": a scheduler given node addresses would take them for a remote cluster's
        # and load no tokenizer, and route on session hints alone.
        tokenizers = [f"{name}={path}" for name, path in tokenizer_dirs(config).items()]
        scheduler = dataclasses.replace(
            config.scheduler,
            port=self.port,
            policy=policy,
            node_addresses=config.scheduler_node_addresses(),
            api_keys=[f"{self.tenant}:{key}"],
            tokenizer="",
            tokenizers=tokenizers,
        )
        path = home / "run" / f"scheduler-{policy}-r{repeat}.toml"
        write_private(path, dump_toml(dataclasses.replace(config, scheduler=scheduler)))  # holds its API key
        log_path = home / "logs" / f"scheduler-{policy}-r{repeat}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "symphony.cli", "scheduler", "--effective-config", str(path)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=scrubbed_env(),  # its keys are in its file
        )
        self.url = f"http://{config.scheduler.host}:{self.port}"
        # With its tenant's key set, /readyz's details and /metrics are for the cluster's own token.
        self.internal = internal_headers(config.cluster.secret)

    async def ready(self, nodes: int, within_s: float = 60.0) -> None:
        async def every_node_ready(client: httpx.AsyncClient) -> bool:
            ready = (await client.get(self.url + "/readyz", headers=self.internal)).json()
            # Every policy starts with its tokenizer loaded: none routes its first requests blind.
            tokenizers = ready.get("tokenizers", {})
            if "none" in tokenizers.values():  # the benchmark names the model's directory
                raise RuntimeError(f"the {self.tenant} scheduler has no tokenizer ({tokenizers}); see {self.log.name}")
            return bool(ready.get("ready_nodes") == nodes and "loading" not in tokenizers.values())

        await await_ready(
            self.process,
            f"the {self.tenant} scheduler",
            self.log,
            every_node_ready,
            f"the {self.tenant} scheduler did not see {nodes} ready nodes",
            within_s,
        )

    async def metrics(self) -> str:
        async with httpx.AsyncClient(timeout=5.0) as client:
            return (await client.get(self.url + "/metrics", headers=self.internal)).text

    def stop(self) -> None:
        stop_child(self.process, self.log)


async def reset_prefix_caches(config: SymphonyConfig, timeout_s: float = 30.0) -> None:
    """Empty every engine's prefix cache. vLLM refuses while a request holds blocks, and a finished
    request holds them one engine step longer while its partial last block is copied out: asked
    again until every engine agrees."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=60.0, headers=engine_headers(config.cluster.secret)) as client:
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


def counter_by_label(metrics: str, name: str, label: str) -> dict[str, float]:
    """The scheduler's counter `name` (without `_total`), summed per value of one of its labels."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics):
        if family.name == name:
            for sample in family.samples:
                if sample.name == name + "_total":
                    value = sample.labels.get(label, "")
                    totals[value] = totals.get(value, 0.0) + sample.value
    return totals


def histogram_p99_bound_ms(metrics: str, name: str) -> float:
    """From one of the scheduler's histograms in seconds (`name`, unlabelled): the bucket bound (ms)
    under which 99% of its observations fell (inf past the last bucket, nan without observations)."""
    buckets: list[tuple[float, float]] = []
    prefix = f'{name}_bucket{{le="'
    for line in metrics.splitlines():
        if line.startswith(prefix):
            bound = line[len(prefix) :].split('"', 1)[0]
            buckets.append((float(bound), float(line.rsplit(" ", 1)[1])))
    total = buckets[-1][1] if buckets else 0.0
    if not total:
        return float("nan")
    return next(bound * 1000 for bound, count in buckets if count >= 0.99 * total)


def advisory_p99_bound_ms(metrics: str) -> float:
    """The bound under which 99% of advisories were answered (`histogram_p99_bound_ms`)."""
    return histogram_p99_bound_ms(metrics, "symphony_advisory_seconds")


def index_lag_p99_bound_ms(metrics: str) -> float:
    """The bound under which 99% of the nodes' block event batches reached the scheduler's index,
    from their publication (`histogram_p99_bound_ms`)."""
    return histogram_p99_bound_ms(metrics, "symphony_kv_index_lag_seconds")


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
    *,
    prepared: Prepared | None = None,
    repeat: int = 0,
) -> dict[str, Any]:
    """Each policy in turn, in the order given, on the running cluster `config` describes (its
    engines must serve /reset_prefix_cache: VLLM_SERVER_DEV_MODE=1): {policy: summary}. The
    workload is `prepared` (one repeat's), or else the ShareGPT replay of `conversations` with
    `timing`. Each policy's per-request records go to `records_dir` (files `<policy>-r<repeat>.json`
    and `.csv`) and `records_by_policy`, when given."""
    nodes = [config.node_id(i) for i in range(config.cluster.nodes)]
    if prepared is None:
        prepared = ChatWorkload(conversations, timing).prepare(settings)
    results: dict[str, Any] = {}
    for policy in policies:
        await reset_prefix_caches(config)
        key = uuid.uuid4().hex
        scheduler = _PolicyScheduler(config, policy, home, key, repeat)
        try:
            await scheduler.ready(config.cluster.nodes)
            print(
                f"repeat {repeat}, policy {policy}: {prepared.info['kind']}, {settings.duration_s:.0f} s",
                file=sys.stderr,
            )
            generator = prepared.make(scheduler.url, model, key, f"{policy}-{key[:6]}")
            cpu_before = cpu_seconds_by_role()
            records = await generator.run()
            summary = summarize(records, nodes)
            summary["cpu_s_by_role"] = cpu_seconds_between(cpu_before, cpu_seconds_by_role())
            metrics = await scheduler.metrics()
            ready = counter_by_label(metrics, "symphony_advised_requests", "kv_ready")
            summary["advised_requests_kv_ready"] = {"yes": ready.get("yes", 0.0), "no": ready.get("no", 0.0)}
            # What advisories and routing moved (empty for policies that move nothing).
            summary["prefetches_by_outcome"] = counter_by_label(metrics, "symphony_prefetches", "outcome")
            summary["route_pulls_by_outcome"] = counter_by_label(metrics, "symphony_route_pulls", "outcome")
            summary["prefix_pulls_by_outcome"] = counter_by_label(metrics, "symphony_route_prefix_pulls", "outcome")
            summary["advisory_server_ms_p99_bound"] = advisory_p99_bound_ms(metrics)
            summary["index_lag_ms_p99"] = index_lag_p99_bound_ms(metrics)
            results[policy] = summary
            if records_by_policy is not None:
                records_by_policy[policy] = records
            if records_dir is not None:
                stem = f"{policy}-r{repeat}"
                write_records(records, records_dir / f"{stem}.json", records_dir / f"{stem}.csv")
        finally:
            scheduler.stop()
    return results


async def measure_repeats(
    config: SymphonyConfig,
    model: str,
    home: Path,
    policies: list[str],
    repeats: int,
    settings: LoadSettings,
    workload: LiveWorkload,
    records_dir: Path | None = None,
    after_repeat: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """`repeats` runs of every policy (`measure_policies`), repeat k in order `rotation(policies)[k]`
    with seed `settings.seed + k`: [{repeat, order, seed, workload, policies: {policy: summary}}].
    `after_repeat` gets the runs so far after each repeat."""
    runs: list[dict[str, Any]] = []
    for k, order in enumerate(rotation(policies, repeats)):
        seeded = dataclasses.replace(settings, seed=settings.seed + k)
        prepared = workload.prepare(seeded)
        by_policy = await measure_policies(
            config, model, home, order, seeded, HumanTiming(), [], records_dir, prepared=prepared, repeat=k
        )
        runs.append(
            {"repeat": k, "order": order, "seed": seeded.seed, "workload": prepared.info, "policies": by_policy}
        )
        if after_repeat is not None:
            after_repeat(runs)
    return runs


def cluster_result(runs: list[dict[str, Any]], policies: list[str], header: dict[str, Any]) -> dict[str, Any]:
    """The result file's content: `header` (the run's settings), every run, each policy over the
    repeats (in the order given), the pairwise comparisons and the targets."""
    by_policy_runs = {p: [run["policies"][p] for run in runs] for p in policies}
    result: dict[str, Any] = {
        **header,
        "repeats": len(runs),
        "orders": [run["order"] for run in runs],
        "order_balance": order_balance([run["order"] for run in runs]),
        "policies": {p: aggregate(by_policy_runs[p]) for p in policies},
        "comparisons": comparisons(by_policy_runs),
        "runs": runs,
        "notes": {"index_lag_ms_p99": INDEX_LAG_NOTE},
    }
    result["targets"] = targets(result)
    return result


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


def bench_cluster_config(config: SymphonyConfig, home: Path, model: ModelInfo) -> SymphonyConfig:
    """The private cluster's configuration: `config`'s, with its own home, ports and 2 nodes, and
    the model it serves named (its schedulers find the tokenizer there, not under the new home)."""
    private = private_cluster_config(config, home, 2)
    return dataclasses.replace(
        private,
        engine=dataclasses.replace(
            config.engine, kv_connector=True, model=str(model.path), served_model_name=model.served_name
        ),
    )


def run_cluster_bench(
    config: SymphonyConfig,
    *,
    out: Path,
    policies: list[str],
    repeats: int,
    settings: LoadSettings,
    workload: LiveWorkload,
    header: dict[str, Any],
    plot: Path | None = None,
    records_dir: Path | None = None,
) -> int:
    """Start the private cluster, measure every policy `repeats` times, write the result (`header`:
    the settings to record at its top)."""
    if not config.engine.model:
        fetch_default_model(config.home_path, progress=lambda m: print(m, file=sys.stderr))
    model = resolve_model(config.engine.model, config.engine.served_model_name, config.home_path)
    home = config.home_path / "bench" / f"cluster-{uuid.uuid4().hex[:8]}"
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # the engines' /reset_prefix_cache, between policies
    if records_dir is not None:
        records_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    header = {**header, "workload_kind": workload.kind}

    def keep(runs: list[dict[str, Any]]) -> None:
        """The repeats so far, written as they end: a run cut short keeps every finished repeat."""
        partial = {**cluster_result(runs, policies, header), "complete": False}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(partial, indent=2) + "\n")

    try:
        private = bench_cluster_config(config, home, model)

        async def work() -> list[dict[str, Any]]:
            return await measure_repeats(
                private, model.served_name, home, policies, repeats, settings, workload, records_dir, keep
            )

        runs = asyncio.run(on_private_cluster(private, model, work))
    except BaseException:
        print(f"the benchmark cluster's logs are kept in {home / 'logs'}", file=sys.stderr)
        raise
    shutil.rmtree(home, ignore_errors=True)
    result = {**cluster_result(runs, policies, header), "complete": True, "run_s": time.monotonic() - started}
    write_result(result, out, table=print_table, plot=plot, plotter=plot_cluster)
    return 0
