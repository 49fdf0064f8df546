"""`symphony bench regions`: the global layer's policies on a live 3-region cluster on this host.

The cluster: one SmolLM2 node per region (us-east, eu-west, ap-south), a scheduler per region
(policy `symphony` in every run: the regional layer is the same for all), the WAN links of the
configured matrix (issue 37's public-cloud figures by default), started once. Each policy gets a
global layer of its own (`symphony global` with `regions.policy` set, on fresh entry ports) in front
of the same regions, in turn; every engine's prefix cache is emptied between policies, and each
(policy, repeat) has tenants of its own, so nothing one run left is another's input.

The load: ShareGPT users with typing advisories (eval.loadgen), each homed in a region and calling
its region's entry; `hot_share` of them in us-east (its daytime), the rest split between the
others. Some eu-west users belong to an EU-only tenant (`regions.residency`): a request of theirs
served outside eu-west is a residency violation (`residency_violations`), and so is a byte of
theirs on a link out of eu-west, as the links read their own traffic
(`residency_violation_bytes`, symphony.link_tenants); the bytes the links could not place
(`residency_unplaced_bytes`, any link: they could be anyone's) must be 0 for the bar to hold.

Per policy, over the records: eval.cluster_summary's figures (TTFT, errors, prefill computed over
total, max over mean load across regions: one node per region), `e2e_ms_p95`, and from the links
and the entries: `cross_region_kv_bytes` (bytes through the links to nodes: pulls of KV) and the
advisories that moved KV across regions.
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
from pathlib import Path
from typing import Any

import httpx

from eval.bench_cluster import on_private_cluster, reset_prefix_caches
from eval.child_process import await_ready, stop_child
from eval.cluster_summary import summarize
from eval.live_workloads import ChatWorkload
from eval.loadgen import LoadSettings, RequestRecord
from eval.ports import free_port_run, private_cluster_config
from eval.protocol import aggregate, comparisons, order_balance, rotation
from eval.results import write_result
from eval.stats import percentile
from eval.workloads import Conversation, HumanTiming
from scheduler.tokenizer_load import tokenizer_dirs
from symphony.config import SymphonyConfig, dump_toml
from symphony.config_secrets import scrubbed_env, write_private
from symphony.link_tenants import OTHER, PENDING, UNATTRIBUTED, residency_crossings
from symphony.models import ModelInfo, fetch_default_model, resolve_model
from symphony.regions import RegionTopology
from symphony.tenancy import internal_headers

REGIONS = ("us-east:1", "eu-west:1", "ap-south:1")
HOT_REGION, EU_REGION = "us-east", "eu-west"
POLICIES = ("nearest", "skywalker", "gorgo", "symphony")
# The bars: symphony's p95 TTFT against the better of the prefix-aware baselines, and nearest.
P95_VS_BEST_BASELINE = 0.85
P95_VS_NEAREST = 0.7


@dataclasses.dataclass(frozen=True)
class RegionLoadSettings:
    users: int = 6
    duration_s: float = 40.0
    hot_share: float = 0.6  # of the users, homed in us-east
    eu_only_users: int = 1  # of eu-west's users, of the EU-only tenant (at most all of them)
    max_answer_tokens: int = 32
    seed: int = 7

    def users_by_region(self, names: tuple[str, ...]) -> dict[str, int]:
        """At least one user per region; the hot region its share, the rest split evenly."""
        hot = max(1, min(self.users - (len(names) - 1), round(self.users * self.hot_share)))
        rest = [n for n in names if n != HOT_REGION]
        counts = {HOT_REGION: hot} | {n: (self.users - hot) // len(rest) for n in rest}
        for n in rest[: (self.users - hot) % len(rest)]:
            counts[n] += 1
        return {n: max(1, c) for n, c in counts.items()}


def tenants(policies: list[str], repeats: int) -> dict[tuple[str, int, bool], tuple[str, str]]:
    """(policy, repeat, EU-only) -> (tenant, key): every run's tenants, known to the schedulers at start."""
    return {
        (p, k, eu): (f"r{k}-{p}" + ("-eu" if eu else ""), uuid.uuid4().hex)
        for p in policies
        for k in range(repeats)
        for eu in (False, True)
    }


def regions_config(
    config: SymphonyConfig, home: Path, model: ModelInfo, keys: dict[tuple[str, int, bool], tuple[str, str]]
) -> SymphonyConfig:
    """The private 3-region cluster: `config`'s settings with its own home and ports, the run's
    tenants (the EU-only ones restricted to eu-west), pulls over gRPC (through the links)."""
    private = private_cluster_config(config, home, len(REGIONS), regions=len(REGIONS))  # a node per region
    return dataclasses.replace(
        private,
        scheduler=dataclasses.replace(
            private.scheduler,
            policy="symphony",  # the regional layer, the same under every global policy
            api_keys=[f"{tenant}:{key}" for tenant, key in keys.values()],
            tokenizer="",
            tokenizers=[f"{name}={path}" for name, path in tokenizer_dirs(config).items()],
        ),
        kv=dataclasses.replace(private.kv, data_plane="grpc"),
        engine=dataclasses.replace(
            config.engine, kv_connector=True, model=str(model.path), served_model_name=model.served_name
        ),
        regions=dataclasses.replace(
            private.regions,
            layout=list(REGIONS),
            residency=[f"{tenant}={EU_REGION}" for (_, _, eu), (tenant, _) in keys.items() if eu],
        ),
    )


class _GlobalLayer:
    """`symphony global` with one policy, its entries on fresh ports, over the running regions."""

    def __init__(self, config: SymphonyConfig, policy: str, home: Path, repeat: int) -> None:
        port = free_port_run(len(REGIONS))
        self.config = dataclasses.replace(
            config,
            scheduler=dataclasses.replace(config.scheduler, port=port),
            regions=dataclasses.replace(config.regions, policy=policy),  # type: ignore[arg-type]
        )
        path = home / "run" / f"global-{policy}-r{repeat}.toml"
        write_private(path, dump_toml(self.config))  # holds the API keys
        self.log = (home / "logs" / f"global-{policy}-r{repeat}.log").open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "symphony.cli", "global", "--effective-config", str(path)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=scrubbed_env(),  # its keys are in its file
        )
        host = config.scheduler.host
        self.entries = {name.split(":")[0]: f"http://{host}:{port + i}" for i, name in enumerate(REGIONS)}
        self.internal = internal_headers(config.cluster.secret)  # /regions, once keys are set

    async def ready(self, within_s: float = 60.0) -> None:
        """Every entry answers and sees every region up."""

        async def every_region_up(client: httpx.AsyncClient) -> bool:
            views = [
                (await client.get(url + "/regions", headers=self.internal)).json()["regions"]
                for url in self.entries.values()
            ]
            return all(info["up"] for view in views for info in view.values())

        await await_ready(
            self.process,
            "the global layer",
            self.log,
            every_region_up,
            "the global layer's entries did not see every region up",
            within_s,
        )

    async def kv_moves(self) -> int:
        async with httpx.AsyncClient(timeout=5.0) as client:
            views = [
                (await client.get(url + "/regions", headers=self.internal)).json()["regions"]
                for url in self.entries.values()
            ]
        return sum(info["kv_moves_in"] for view in views for info in view.values())

    def stop(self) -> None:
        stop_child(self.process, self.log)


async def _links(config: SymphonyConfig) -> list[dict[str, Any]]:
    """The links' `GET /links` (symphony.region_links): their counters so far."""
    url = f"http://{config.scheduler.host}:{config.regions.link_port_base}/links"
    async with httpx.AsyncClient(timeout=5.0) as client:
        reply = await client.get(url, headers=internal_headers(config.cluster.secret))
        links: list[dict[str, Any]] = reply.json()["links"]
        return links


async def _links_kv_bytes(config: SymphonyConfig) -> int:
    """Bytes the links have carried to and from nodes so far (pulls of KV between regions)."""
    return sum(link["kv_bytes"] for link in await _links(config))


async def _settled_kv_bytes(config: SymphonyConfig, quiet_s: float = 2.0, within_s: float = 90.0) -> int:
    """The links' KV bytes once no move has carried any for `quiet_s` (moves an advisory started
    go on for up to its lead after the load ends), or after `within_s`."""
    deadline = time.monotonic() + within_s
    last, since = await _links_kv_bytes(config), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet_s:
        await asyncio.sleep(0.25)  # sampling a counter
        now = await _links_kv_bytes(config)
        if now != last:
            last, since = now, time.monotonic()
    return last


def _wire_residency(links: list[dict[str, Any]], tenant: str, topology: RegionTopology) -> tuple[int, int, int]:
    """From the links' own reading of their traffic (symphony.link_tenants), counters so far:
    `tenant`'s bytes on links touching a region it may not enter; the bytes no link could place
    (unattributed, or a tenant's past a link's label bound), which could be anyone's; and the
    connections the links' readers gave up on."""
    allowed = topology.residency.get(tenant)
    if allowed is None:
        raise ValueError(f"tenant {tenant!r} has no residency rule")
    own = residency_crossings(links, {tenant: allowed}, unresolved=False)[tenant]
    unplaced = sum(
        n
        for link in links
        for lane in link["tenant_bytes"].values()
        for label, n in lane.items()
        if label in (UNATTRIBUTED, OTHER)
    )
    return own, unplaced, sum(link["sniff_errors"] for link in links)


async def _settled_links(config: SymphonyConfig, within_s: float = 30.0) -> list[dict[str, Any]]:
    """The links' counters once no byte is pending an owner (a request half read), or after
    `within_s` (then pending bytes count as unplaced)."""
    deadline = time.monotonic() + within_s
    while True:
        links = await _links(config)
        pending = any(PENDING in lane for link in links for lane in link["tenant_bytes"].values())
        if not pending or time.monotonic() > deadline:
            return links
        await asyncio.sleep(0.1)  # polling a counter


def _region_conversations(conversations: list[Conversation], names: tuple[str, ...]) -> dict[str, list[Conversation]]:
    """Each region its own conversations (none shared across regions: no prefix any two regions'
    users have in common)."""
    return {name: conversations[i :: len(names)] or conversations for i, name in enumerate(names)}


def summarize_regions(
    records: list[RequestRecord], eu_prefix: str, eu_tenant: str, topology: RegionTopology, node_ids: list[str]
) -> dict[str, Any]:
    """eval.cluster_summary's figures (the node of each region standing for the region), and the
    regions' own: e2e p95, requests by region, residency violations (a request of the EU-only
    tenant's sessions, named from `eu_prefix`, answered by a node outside its allowed regions)."""
    summary = summarize(records, node_ids)
    ok = [r for r in records if r.ok]
    region_of = {node: topology.region_of_node(i) for i, node in enumerate(node_ids)}
    summary["e2e_ms_p95"] = percentile([r.e2e_s * 1000 for r in ok], 95) if ok else float("nan")
    summary["requests_by_region"] = {
        name: sum(1 for r in ok if region_of.get(r.node) == name) for name in topology.names
    }
    summary["residency_violations"] = sum(
        1 for r in ok if r.session.startswith(eu_prefix) and not topology.allowed(eu_tenant, region_of.get(r.node, ""))
    )
    return summary


async def measure_region_policies(
    config: SymphonyConfig,
    model: str,
    home: Path,
    order: list[str],
    load: RegionLoadSettings,
    timing: HumanTiming,
    conversations: list[Conversation],
    keys: dict[tuple[str, int, bool], tuple[str, str]],
    repeat: int,
) -> dict[str, Any]:
    """Each policy in `order` on the running regions: {policy: summary}."""
    topology = config.topology()
    assert topology is not None
    node_ids = [config.node_id(i) for i in range(config.cluster.nodes)]
    users = load.users_by_region(topology.names)
    by_region = _region_conversations(conversations, topology.names)
    results: dict[str, Any] = {}
    for policy in order:
        await reset_prefix_caches(config)
        layer = _GlobalLayer(config, policy, home, repeat)
        try:
            await layer.ready()
            print(
                f"repeat {repeat}, policy {policy}: {sum(users.values())} users, {load.duration_s:.0f} s",
                file=sys.stderr,
            )
            (tenant, key), (eu_tenant, eu_key) = keys[(policy, repeat, False)], keys[(policy, repeat, True)]
            # Session names: tenant, ".", region ("r0-symphony.eu-west-u0-c0"): no tenant's prefix
            # is another's.
            eu_prefix = f"{eu_tenant}."
            runners = []
            for region, count in users.items():
                eu_users = min(load.eu_only_users, count) if region == EU_REGION else 0
                for group, n, group_key, prefix in (
                    ("all", count - eu_users, key, f"{tenant}.{region}"),
                    ("eu", eu_users, eu_key, f"{eu_prefix}{region}"),
                ):
                    if n <= 0:
                        continue
                    settings = LoadSettings(
                        users=n,
                        duration_s=load.duration_s,
                        max_answer_tokens=load.max_answer_tokens,
                        seed=load.seed + repeat * 101 + topology.region(region).index * 11 + (group == "eu"),
                    )
                    prepared = ChatWorkload(by_region[region], timing).prepare(settings)
                    runners.append(prepared.make(layer.entries[region], model, group_key, prefix))
            kv_before = await _settled_kv_bytes(config)  # the run before's moves ended
            wire_before = _wire_residency(await _settled_links(config), eu_tenant, topology)
            batches = await asyncio.gather(*(runner.run() for runner in runners))
            records = [record for batch in batches for record in batch]
            summary = summarize_regions(records, eu_prefix, eu_tenant, topology, node_ids)
            summary["cross_region_kv_bytes"] = await _settled_kv_bytes(config) - kv_before
            # The same bar read from the wire: the EU-only tenant's bytes on links out of eu-west,
            # and the bytes the links could not place (which could be its: the bar needs 0 too).
            wire = _wire_residency(await _settled_links(config), eu_tenant, topology)
            crossed, unplaced, sniff_errors = (now - then for now, then in zip(wire, wire_before, strict=True))
            summary["residency_violation_bytes"] = crossed
            summary["residency_unplaced_bytes"] = unplaced
            summary["link_sniff_errors"] = sniff_errors
            summary["kv_moves_across_regions"] = await layer.kv_moves()
            summary["users_by_region"] = users
            results[policy] = summary
        finally:
            layer.stop()
    return results


def region_targets(policies: dict[str, Any]) -> dict[str, Any]:
    """The issue's bars on the aggregated figures (None where a policy was not run)."""
    out: dict[str, Any] = {
        "residency_violations_zero": all(
            p["residency_violations"] == 0
            and p.get("residency_violation_bytes", 0) == 0
            and p.get("residency_unplaced_bytes", 0) == 0
            for p in policies.values()
        ),
    }
    if "symphony" not in policies:
        return out
    p95 = {name: p["ttft_ms_p95"] for name, p in policies.items()}
    best = min((p95[n] for n in ("skywalker", "gorgo") if n in p95), default=None)
    out["symphony_errors_zero"] = policies["symphony"]["errors"] == 0
    out["symphony_p95_vs_best_of_skywalker_gorgo"] = p95["symphony"] / best if best else None
    out["symphony_p95_vs_best_met"] = best is not None and p95["symphony"] <= P95_VS_BEST_BASELINE * best
    out["symphony_p95_vs_nearest"] = p95["symphony"] / p95["nearest"] if "nearest" in p95 else None
    out["symphony_p95_vs_nearest_met"] = "nearest" in p95 and p95["symphony"] <= P95_VS_NEAREST * p95["nearest"]
    return out


def run_regions_bench(
    config: SymphonyConfig,
    *,
    out: Path,
    policies: list[str],
    repeats: int,
    load: RegionLoadSettings,
    timing: HumanTiming,
    conversations: list[Conversation],
    header: dict[str, Any],
) -> int:
    """Start the private regions, measure every policy `repeats` times in rotated orders, write the
    result (written after each repeat too: a run cut short keeps what it finished)."""
    if not config.engine.model:
        fetch_default_model(config.home_path, progress=lambda m: print(m, file=sys.stderr))
    model = resolve_model(config.engine.model, config.engine.served_model_name, config.home_path)
    home = config.home_path / "bench" / f"regions-{uuid.uuid4().hex[:8]}"
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # the engines' /reset_prefix_cache, between policies
    started = time.monotonic()
    keys = tenants(policies, repeats)
    private = regions_config(config, home, model, keys)
    topology = private.topology()
    assert topology is not None
    header = {
        **header,
        "regions": list(REGIONS),
        "links": {"~".join(sorted(pair)): dataclasses.asdict(shape) for pair, shape in topology.links.items()},
        "load": dataclasses.asdict(load),
        "users_by_region": load.users_by_region(topology.names),
        "regional_policy": private.scheduler.policy,
    }

    def result(runs: list[dict[str, Any]], complete: bool) -> dict[str, Any]:
        by_policy = {p: [run["policies"][p] for run in runs] for p in policies}
        aggregated = {p: aggregate(by_policy[p]) for p in policies}
        return {
            **header,
            "repeats": len(runs),
            "orders": [run["order"] for run in runs],
            "order_balance": order_balance([run["order"] for run in runs]),
            "policies": aggregated,
            "comparisons": comparisons(by_policy),
            "targets": region_targets(aggregated),
            "runs": runs,
            "complete": complete,
            "run_s": time.monotonic() - started,
        }

    def keep(runs: list[dict[str, Any]]) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result(runs, complete=False), indent=2) + "\n")

    async def work() -> list[dict[str, Any]]:
        runs: list[dict[str, Any]] = []
        for k, order in enumerate(rotation(policies, repeats)):
            by_policy = await measure_region_policies(
                private, model.served_name, home, order, load, timing, conversations, keys, k
            )
            runs.append({"repeat": k, "order": order, "policies": by_policy})
            keep(runs)
        return runs

    try:
        runs = asyncio.run(on_private_cluster(private, model, work))
    except BaseException:
        print(f"the benchmark cluster's logs are kept in {home / 'logs'}", file=sys.stderr)
        raise
    shutil.rmtree(home, ignore_errors=True)
    write_result(result(runs, complete=True), out, table=print_regions_table)
    return 0


def print_regions_table(result: dict[str, Any]) -> None:
    print(
        f"{'policy':<11} {'ttft p50':>9} {'ttft p95':>9} {'e2e p95':>9} {'errors':>6} {'computed':>9} "
        f"{'max/mean':>8} {'kv moved':>10} {'residency':>9}"
    )
    for name, p in result["policies"].items():
        computed = (
            p["prefill_tokens_computed"] / p["prefill_tokens_total"] if p["prefill_tokens_total"] else float("nan")
        )
        print(
            f"{name:<11} {p['ttft_ms_p50']:>9.0f} {p['ttft_ms_p95']:>9.0f} {p['e2e_ms_p95']:>9.0f} {p['errors']:>6} "
            f"{computed:>9.2f} {p['max_over_mean_load']:>8.2f} {p['cross_region_kv_bytes'] / 1e6:>8.1f}MB "
            f"{p['residency_violations']:>9}"
        )
    for key, value in result["targets"].items():
        print(f"  {key}: {value}")
