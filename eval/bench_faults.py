"""`symphony bench faults`: a private cluster broken on purpose while greedy chats run through it.

The cluster is the one a careful operator would deploy on one host: two nodes with real vLLM
engines, two scheduler replicas over an etcd of its own (`cluster.ha`), mutual TLS between its
members (`cluster.tls`), tenants' API keys and an admin token. Its clients are the SDK's failover
clients, given both replicas.

Scenarios (the issue's numbering):
1. `crashes`: SIGKILL and SIGSTOP/SIGCONT of an engine, a node manager, a scheduler replica and
   etcd, on a schedule drawn from `--seed` (`eval.faults.crashes`);
2. `network`: each node reached through an emulated link (`eval.faults.network`), partitioned,
   blackholed or slowed on a schedule drawn from `--seed`, then healed. With this scenario, the
   other scenarios' traffic to the nodes crosses the (healthy) links too;
3. `disk`: the last node's SSD tier on a small tmpfs: segments damaged, the disk filled to ENOSPC,
   the node restarted with another dtype on the same home (`eval.faults.disk`). With this scenario
   the whole bench runs in a mount namespace of its own, where that tmpfs is mounted;
4. `attacks`: unauthenticated and wrong-certificate calls to every listener, and cross-tenant calls
   naming a live victim session (`eval.faults.attacks`);
6. `overload`: open-loop load at twice the measured capacity, and one tenant flooding requests
   and advisories beside a quiet one (`eval.faults.overload`).
Each ends with the checker (`eval.faults.checker`): bounded, well-formed request outcomes, greedy
answers equal to their recompute reference, no session lost from SSD, gauges back to zero, and
bounded fds, memory, /dev/shm files and SSD bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import shutil
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from eval.faults import CRASH_KINDS, DISK_KINDS, LINK_KINDS, SCENARIOS
from eval.faults.attacks import AttackTargets, Victim, run_attacks, summary
from eval.faults.chats import ANSWER_TOKENS, ChatLoad, Tenant, references
from eval.faults.checker import (
    Resources,
    check_requests,
    fd_leaks,
    fds_settled,
    leaks,
    other_leaks,
    recovery_summary,
)
from eval.faults.cluster_config import ATTACKER, TENANTS, faults_config
from eval.faults.crashes import CrashRunner, Fault, Target, schedule
from eval.faults.disk import (
    DiskRunner,
    DiskTarget,
    in_namespace,
    mount_small_disk,
    private_shm,
    reexec_in_namespace,
    small_disk_bytes,
    unmount,
)
from eval.faults.host import host_resources
from eval.faults.network import NodeLinks
from eval.faults.overload import OverloadPlan, distinct_references, run_overload
from eval.faults.soak import run_soak
from eval.faults.targets import targets
from symphony.cluster_tls import grpc_channel
from symphony.config import SymphonyConfig
from symphony.launcher import LocalCluster
from symphony.models import ModelInfo, fetch_default_model, resolve_model
from symphony.rpc import kv_pb2, kv_pb2_grpc
from symphony.tenancy import engine_key, internal_headers

VICTIM_QUESTION = "Thank you. Now summarise your answer in one sentence."
# Idle connections in the replicas' pools (to engines: 4 s of keep-alive, swept about as often) are
# gone within this: fds a process holds beyond the bounds after it are a leak. A replica that took
# over the other's load holds more of them for a while (seen: 26 fds to 60 after a failover).
POOLS_IDLE_S = 15.0
BUSY_GAUGES = ("symphony_queued_requests", "symphony_node_inflight", "symphony_advisories_pending")


@dataclasses.dataclass(frozen=True)
class FaultSettings:
    scenarios: tuple[str, ...] = SCENARIOS
    seed: int = 0
    rounds: int = 2  # passes over the crash kinds
    kinds: tuple[str, ...] = CRASH_KINDS
    disk_kinds: tuple[str, ...] = DISK_KINDS
    sessions: int = 4
    warmup_turns: int = 8  # answered turns before the first fault or attack
    bound_s: float = 120.0  # every request ends within this (the clients' timeout)
    recover_timeout_s: float = 300.0  # for the cluster to be whole again after a fault (an engine restart)
    overload_s: float = 60.0  # the flood's length (the capacity and quiet phases: half of it each)
    soak_s: float = 1800.0  # `symphony bench soak` (eval.faults.soak)
    fault_every_s: float = 120.0


class FaultBench:
    def __init__(
        self,
        cluster: LocalCluster,
        keys: dict[str, str],
        settings: FaultSettings,
        say: Callable[[str], None],
        links: NodeLinks | None = None,
    ):
        self.cluster, self.keys, self.settings, self.say = cluster, keys, settings, say
        self.links = links  # the nodes' links (the network scenario's), when they run
        self.config = cluster.config
        self.model = cluster.model.served_name
        self.internal = internal_headers(self.config.cluster.secret)
        self.http = httpx.AsyncClient(timeout=10.0, headers=self.internal)
        self.started_wall = time.time()  # shared memory made before the bench is not its doing
        key = engine_key(self.config.cluster.secret.encode())
        self.engines = [
            openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{self.config.engine_port(i)}/v1", api_key=key, max_retries=2, timeout=600
            )
            for i in range(self.config.cluster.nodes)
        ]

    async def whole(self) -> bool:
        """Every replica answers and routes to every node, every child process is ready."""
        for url in self.cluster.scheduler_urls:
            try:
                ready = (await self.http.get(url + "/readyz")).json()
            except (httpx.HTTPError, ValueError):
                return False
            if not isinstance(ready, dict) or ready.get("ready_nodes") != self.config.cluster.nodes:
                return False
        children = [*self.cluster.nodes, *self.cluster.schedulers, *([self.cluster.etcd] if self.cluster.etcd else [])]
        return all(p.state.value == "ready" for p in children)

    async def resources(self) -> Resources:
        fds, rss, anon, shm, segments, most, orphans, processes = await asyncio.to_thread(
            host_resources, self.cluster, self.started_wall
        )
        busy = 0.0
        for url in self.cluster.scheduler_urls:
            try:
                text = (await self.http.get(url + "/metrics")).text
            except httpx.HTTPError:
                busy = math.nan  # a replica that does not answer cannot say it is idle
                continue
            for family in text_string_to_metric_families(text):
                if family.name in BUSY_GAUGES:
                    busy += sum(sample.value for sample in family.samples)
        return Resources(fds, rss, shm, segments, most, busy, orphans, rss_anon_bytes=anon, processes=processes)

    async def settled(self, timeout_s: float = 60.0) -> Resources:
        """Resources once the busy gauges read zero (or `timeout_s` passed: then as they are)."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = await self.resources()
            if found.busy_gauges == 0 or time.monotonic() > deadline:
                return found
            await asyncio.sleep(0.5)

    def load(self, scenario: str) -> ChatLoad:
        tenants = [Tenant(name, self.keys[name]) for name in TENANTS]
        return ChatLoad(
            self.cluster.scheduler_urls,
            tenants,
            self.model,
            self.settings.sessions,
            scenario=scenario,
            timeout_s=self.settings.bound_s,
        )

    async def warm(self, load: ChatLoad) -> Resources:
        """Run `load` for its warm-up turns, let the cluster go idle, take the resources it holds
        then (what the checker compares with: connection pools and caches are filled by then),
        and start `load` again."""
        load.start()
        if not await load.wait_turns(self.settings.warmup_turns, self.settings.recover_timeout_s):
            raise RuntimeError(f"the load answered {load.turns_done()} turns in {self.settings.recover_timeout_s} s")
        await load.stop()
        before = await self.settled()
        load.start()
        return before

    async def checked(self, load: ChatLoad, before: Resources, distinct: bool = False) -> dict[str, Any]:
        """Stop `load`, wait for the cluster to be whole and idle, check everything (`distinct`: one
        reference per distinct prompt, for outcomes that repeat a few)."""
        await load.stop()
        await load.close()
        if not await self._wait_whole():
            self.say("the cluster was not whole again within the timeout; checking as it is")
        first = await self.settled()
        after, looks = first, [fd_leaks(before, first)]
        deadline = time.monotonic() + POOLS_IDLE_S
        # Looked at again while a finding stands (not CLEAN_LOOKS clean looks in a row yet).
        while (fds_found := fds_settled(looks)[1]) and time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            after = await self.resources()
            looks.append(fd_leaks(before, after))
        self.say(f"computing the recompute reference of {load.turns_done()} answers")
        refs = await (distinct_references if distinct else references)(self.engines, self.model, load.outcomes)
        report = check_requests(load.outcomes, refs, self.settings.bound_s, origin_s=load.origin_s or 0.0)
        report["resources_before"] = dataclasses.asdict(before)
        report["resources_after"] = dataclasses.asdict(first)
        # fds as they settled; every other bound at the first look (module checker: CLEAN_LOOKS).
        report["leaks"] = fds_found + other_leaks(before, first, self.config.kv.ssd_bytes)
        report["leaks_first_look"] = leaks(before, first, self.config.kv.ssd_bytes)
        report["fd_looks"] = len(looks)
        if first.shm_files > before.shm_files:  # which, to tell whose: those made during the run
            made = []
            for entry in os.scandir("/dev/shm"):
                with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                    if entry.stat(follow_symlinks=False).st_ctime >= self.started_wall:
                        made.append(entry.name)
            report["shm_files_after"] = sorted(made)
        if after is not first:
            report["fds_settled_at"] = [after.fds, [list(p) for p in after.processes]]
        return report

    async def _wait_whole(self) -> bool:
        deadline = time.monotonic() + self.settings.recover_timeout_s
        while time.monotonic() < deadline:
            if await self.whole():
                return True
            await asyncio.sleep(0.5)
        return False

    async def crashes(self) -> dict[str, Any]:
        s = self.settings
        faults = schedule(s.seed, self.config.cluster.nodes, self.config.scheduler.replicas, s.rounds, s.kinds)
        return await self._faults("crashes", faults)

    async def network(self) -> dict[str, Any]:
        s = self.settings
        faults = schedule(s.seed, self.config.cluster.nodes, self.config.scheduler.replicas, s.rounds, LINK_KINDS)
        report = await self._faults("network", faults)
        assert self.links is not None
        report["links"] = self.links.counters()
        return report

    async def _faults(self, scenario: str, faults: list[Fault]) -> dict[str, Any]:
        """`faults` injected one at a time under the scenario's load (eval.faults.crashes)."""
        s = self.settings
        self.say(f"{scenario}: seed {s.seed}, {len(faults)} faults")
        load = self.load(scenario)
        before = await self.warm(load)
        runner = self.crash_runner(load)
        await runner.measure_baseline()
        self.say(f"{len(runner.baseline)} probes under load; one slower than {runner.slow_s:.2f} s is unavailability")
        await runner.run(faults, self.say, load.origin_s or 0.0)
        report = await self.checked(load, before)
        kill_recoveries = [
            f["recovery_ms"] for f in runner.faults if f["kind"] in ("node_kill", "replica_kill") and "recovery_ms" in f
        ]
        report.update(
            {
                "seed": s.seed,
                "faults": runner.faults,
                "probes": len(runner.probes),
                "probes_failed": sum(1 for p in runner.probes if p.kind != "ok"),
                "probes_unavailable": sum(f.get("probes_unavailable", 0) for f in runner.faults),
                "lost_sessions": sorted({x for f in runner.faults for x in f.get("lost_sessions", [])}),
                "ssd_sessions_checked": sum(f.get("ssd_sessions_before", 0) for f in runner.faults),
                **recovery_summary(f["recovery_ms"] for f in runner.faults if "recovery_ms" in f),
                "kill_recovery_ms_p99": recovery_summary(kill_recoveries)["recovery_ms_p99"],
                "probe_slow_s": round(runner.slow_s, 3),
                "probe_kinds": dict(Counter(p.kind for p in runner.probes)),
                "baseline_probes": len(runner.baseline),
            }
        )
        return report

    def crash_runner(self, load: ChatLoad) -> CrashRunner:
        """A runner of kills, freezes and link faults of this cluster's processes under `load`."""
        s = self.settings
        target = Target(
            node_pid=lambda i: self.cluster.nodes[i].pid,
            replica_pid=lambda i: self.cluster.schedulers[i].pid,
            etcd_pid=lambda: self.cluster.etcd.pid if self.cluster.etcd else None,
            engine_port=self.config.engine_port,
        )
        return CrashRunner(
            load,
            target,
            self.whole,
            self.config.node_grpc_address,
            self.cluster.tls,
            TENANTS[0],
            s.recover_timeout_s,
            self.config.scheduler.node_down_after_ms,
            self.links,
        )

    async def disk(self) -> dict[str, Any]:
        s, node = self.settings, self.config.cluster.nodes - 1  # the node on the small disk
        load = self.load("disk")
        before = await self.warm(load)
        metrics_url = f"http://127.0.0.1:{self.config.kv_metrics_port(node)}/metrics"
        where = DiskTarget(
            node,
            self.cluster.nodes[node],
            self.config.kv_ssd_dir(node),
            metrics_url,
            self.config,
            self.cluster.config_path,
            self.whole,
        )
        crashes = self.crash_runner(load)
        runner = DiskRunner(load, where, crashes, s.seed, s.warmup_turns, s.recover_timeout_s, self.say)
        await crashes.measure_baseline()
        await runner.run(s.disk_kinds)
        report = await self.checked(load, before)
        report.update({"seed": s.seed, "kinds": list(s.disk_kinds), "faults": runner.faults})
        report["small_disk_bytes"] = small_disk_bytes(self.config)
        return report

    async def soak(self) -> dict[str, Any]:
        """`symphony bench soak`: not one of `SCENARIOS` (eval.faults.soak)."""
        load = self.load("soak")
        return await run_soak(self, load, await self.warm(load), TENANTS[0])

    async def attacks(self) -> dict[str, Any]:
        load = self.load("attacks")
        before = await self.warm(load)
        # The victim is a conversation of the restarted load, still going: its next turns (one
        # sent below, after the attacks) load its history from wherever it is kept.
        restarted = len(load.outcomes)
        if not await load.wait_turns(load.turns_done() + 1, self.settings.recover_timeout_s):
            raise RuntimeError("the restarted load answered no turn")
        victim_turn = next(o for o in reversed(load.outcomes[restarted:]) if o.answer is not None)
        victim = Victim(victim_turn.tenant, victim_turn.session, victim_turn.messages)
        infos = []  # each node's, asked as a member: its page stream's port, the model's fingerprint
        for i in range(self.config.cluster.nodes):
            async with grpc_channel(self.config.node_grpc_address(i), self.cluster.tls) as channel:
                stub = kv_pb2_grpc.KVStoreStub(channel)
                infos.append(await stub.GetStoreInfo(kv_pb2.StoreInfoRequest(), timeout=10))
        targets = AttackTargets(
            node_grpc=[self.config.node_grpc_address(i) for i in range(self.config.cluster.nodes)],
            node_data_ports=[info.data_port for info in infos if info.data_port],
            engine_urls=[f"http://127.0.0.1:{self.config.engine_port(i)}" for i in range(self.config.cluster.nodes)],
            scheduler_urls=list(self.cluster.scheduler_urls),
            model=self.model,
            attacker_key=self.keys[ATTACKER],
            fingerprint=infos[0].model_fingerprint,
            member_tls=self.cluster.tls,
        )
        self.say(f"attacks: victim {victim.tenant}/{victim.session}")
        attempts = await run_attacks(targets, victim)
        # The victim's next turn, and the load's turns after the attacks: checked like every other.
        assert victim_turn.answer is not None
        history = [*victim.messages, {"role": "assistant", "content": "".join(victim_turn.answer.tokens)}]
        after = await load.send(
            victim.tenant, victim.session, [*history, {"role": "user", "content": VICTIM_QUESTION}], ANSWER_TOKENS
        )
        load.outcomes.append(after)
        resumed = await load.wait_turns(load.turns_done() + self.settings.warmup_turns, self.settings.recover_timeout_s)
        report = await self.checked(load, before)
        report.update(summary(attempts))
        report["victim"] = f"{victim.tenant}/{victim.session}"
        report["victim_next_turn"] = after.kind
        report["load_resumed"] = resumed
        return report

    async def overload(self) -> dict[str, Any]:
        s, nodes = self.settings, self.config.cluster.nodes
        load = self.load("overload")
        before = await self.warm(load)
        await load.stop()  # the phases send on their own
        workers = nodes * self.config.engine.max_running()  # every engine's batch full
        plan = OverloadPlan(s.overload_s / 2, s.overload_s / 2, s.overload_s, workers, 2 * s.bound_s, seed=s.seed)
        self.say(f"overload: {workers} closed-loop clients measure the capacity; then a {s.overload_s:g} s flood at 2x")
        outcomes, summary = await run_overload(
            load, self.advise, plan, TENANTS[0], TENANTS[1], self.config.scheduler.queue_wait_bound_s
        )
        load.outcomes.extend(outcomes)
        report = await self.checked(load, before, distinct=True)
        report.update(summary)
        return report

    async def advise(self, tenant: str, session: str) -> int:
        """An advisory for the tenant's `session`, to the first replica; its status (0: no answer)."""
        body = {"model": self.model, "session_id": session, "kind": "typing"}
        headers = {"authorization": f"Bearer {self.keys[tenant]}"}
        try:
            reply = await self.http.post(self.cluster.scheduler_urls[0] + "/v1/advisories", json=body, headers=headers)
        except httpx.HTTPError:
            return 0
        return reply.status_code

    async def close(self) -> None:
        await self.http.aclose()
        for engine in self.engines:
            await engine.close()


async def _run(
    config: SymphonyConfig, model: ModelInfo, keys: dict[str, str], settings: FaultSettings, scenarios: dict[str, Any]
) -> None:
    """Start the cluster, run the scenarios, put each one's report in `scenarios` as it ends (so
    that a run cut short keeps the scenarios it finished), shut the cluster down."""
    say: Callable[[str], None] = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    cluster = LocalCluster(config, model, sys.stderr)
    bench: FaultBench | None = None
    # Up before the nodes, which advertise them; closed after the cluster's shutdown.
    links = NodeLinks(config, settings.seed) if config.node.advertise_grpc_port_base else None
    small_disk = config.kv_ssd_dir(config.cluster.nodes - 1)  # the disk scenario's node's
    try:
        if links is not None:
            await links.start()
        if not await cluster.start_etcd():
            raise RuntimeError("the benchmark cluster's etcd did not start")
        if in_namespace():  # the disk scenario's (run_faults_bench)
            private_shm()
            mount_small_disk(small_disk, small_disk_bytes(config))
        cluster.spawn()
        if not await cluster.wait_ready(asyncio.Event()):
            raise RuntimeError("the benchmark cluster did not become ready")
        bench = FaultBench(cluster, keys, settings, say, links)
        if not await bench._wait_whole():
            raise RuntimeError("the benchmark cluster's replicas did not both route to every node")
        for name in settings.scenarios:
            started = time.monotonic()
            report = await getattr(bench, name)()
            report["run_s"] = round(time.monotonic() - started, 1)
            scenarios[name] = report
    finally:
        try:
            if bench is not None:
                await bench.close()
            await cluster.shutdown()
        finally:
            if links is not None:
                await links.close()
            if in_namespace():
                unmount(small_disk)  # so that the home can go


def run_faults_bench(config: SymphonyConfig, *, out: Path, settings: FaultSettings) -> int:
    """Start the private cluster, run the scenarios, write the report; 0 when every target held.
    With the disk scenario, first runs this very command again in a mount namespace of its own."""
    if "disk" in settings.scenarios and not in_namespace():
        reexec_in_namespace()
    if not config.engine.model:
        fetch_default_model(config.home_path, progress=lambda m: print(m, file=sys.stderr))
    model = resolve_model(config.engine.model, config.engine.served_model_name, config.home_path)
    home = config.home_path / "bench" / f"faults-{uuid.uuid4().hex[:8]}"
    private, keys = faults_config(config, home, model, linked=bool({"network", "soak"} & set(settings.scenarios)))
    started = time.monotonic()
    scenarios: dict[str, Any] = {}
    result: dict[str, Any] = {
        "settings": {**dataclasses.asdict(settings), "nodes": 2, "replicas": 2, "tls": True, "ha": True},
        "scenarios": scenarios,
    }
    try:
        asyncio.run(_run(private, model, keys, settings, scenarios))
    except BaseException as exc:
        result.update({"complete": False, "error": repr(exc), "run_s": round(time.monotonic() - started, 1)})
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"the run stopped; what it finished is in {out}; logs in {home / 'logs'}", file=sys.stderr)
        raise
    result.update({"complete": True, "run_s": round(time.monotonic() - started, 1)})
    result["targets"] = targets(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    missed = [name for name, held in result["targets"].items() if not held]
    if missed:
        print(f"targets missed: {', '.join(missed)}; the cluster's logs are kept in {home / 'logs'}", file=sys.stderr)
        return 1
    # The logs stay (a few MB): what a request that failed within the rules met is read there.
    for entry in home.iterdir():
        if entry.is_dir() and entry.name != "logs":
            shutil.rmtree(entry, ignore_errors=True)
        elif not entry.is_dir():
            entry.unlink(missing_ok=True)
    print(f"every target held; {out}; the cluster's logs are in {home / 'logs'}", file=sys.stderr)
    return 0
