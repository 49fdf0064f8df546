"""Scenario 1 of the fault suite: processes of a live cluster killed (SIGKILL) or frozen
(SIGSTOP, then SIGCONT) under load, one fault at a time, in an order and with targets and hold
times drawn from a seed.

Before the faults, probes (one-token chats, each a session of its own) measure how long a probe
takes under the load: `slow_s` is `SLOW_FACTOR` times their p99, and at least `MIN_SLOW_S`. After
each fault, a probe starts every `PROBE_EVERY_S` while fewer than `PROBES_IN_FLIGHT` are in flight,
until the cluster is whole again. A probe that failed, or took longer than `slow_s`, found the
cluster unavailable; a fault's recovery time is how long after it such a probe ended (0 when none
did). When the cluster hangs, the few probes it holds end late, and count then.
Before a node manager is killed, every session the load ran is looked up on its SSD tier; after it
restarted, each must still have as many leading blocks there (`lost_sessions`).
The network scenario's link faults (`eval.faults.network`) run through the same runner.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from eval.faults import CRASH_KINDS, LINK_KINDS
from eval.faults.chats import ChatLoad
from eval.faults.checker import RequestOutcome, lost_sessions, percentile
from eval.faults.network import NodeLinks
from symphony.cluster_tls import ClusterTLS, grpc_channel
from symphony.process import process_tree
from symphony.rpc import kv_pb2, kv_pb2_grpc

PROBE_EVERY_S = 0.1
PROBE_TOKENS = 1
# Few: probes must measure the cluster, not a queue of probes. With 32 in flight they saturated the
# 2-core host's engines, took up to 9 s in long probing spells against a bound set by the 5 s
# baseline's (shorter queue), and counted a healthy cluster as down. A frozen cluster holds these few.
PROBES_IN_FLIGHT = 4
SETTLE_S = 2.0  # probes go on this long after the cluster is whole again
# The cluster counts as whole again once it stays whole this long, and at least twice as long as a
# scheduler takes to see a node go (`stable_s`), so that a node killed a moment ago is not read as ready.
STABLE_S = 2.0


def stable_s(node_down_after_ms: int) -> float:
    return max(STABLE_S, 2.0 * node_down_after_ms / 1000.0)


LISTED_PROBES = 10  # unavailable probes listed per fault
MIN_SLOW_S = 1.0  # a probe slower than this (or than SLOW_FACTOR x the baseline p99, if more) found no service
# A node lost halves what serves the load (2x), and the 2-core host adds noise: a healthy recovery
# had probes at up to 2.4x the baseline p99 with PROBES_IN_FLIGHT probes (3.0-3.4x with 32, which
# queued behind each other). 4x keeps a margin over that; a stall longer than the rest counts.
SLOW_FACTOR = 4.0
BASELINE_S = 5.0  # probes before the first fault, under the load: what a probe takes
HOLD_S = (1.0, 3.0)  # how long a SIGSTOP lasts, drawn uniformly
# How long a link fault lasts, drawn uniformly: past the schedulers' node_down_after_ms (1 s by
# default), so that a node cut off is seen gone before it heals.
LINK_HOLD_S = (2.0, 6.0)


@dataclass(frozen=True)
class Fault:
    kind: str  # one of CRASH_KINDS
    target: int  # node index (engine_*, node_*) or replica index (replica_*); 0 for etcd
    hold_s: float  # SIGSTOP kinds: frozen this long; 0 for kills

    def describe(self) -> str:
        kind = "node" if self.kind in LINK_KINDS else self.kind.split("_")[0]
        where = "etcd" if self.kind.startswith("etcd") else f"{kind}-{self.target}"
        return f"{self.kind} {where}" + (f" for {self.hold_s:.1f} s" if self.hold_s else "")


def schedule(seed: int, nodes: int, replicas: int, rounds: int, kinds: Sequence[str] = CRASH_KINDS) -> list[Fault]:
    """`rounds` passes over `kinds`, each pass in an order of its own; targets and hold times
    drawn from `seed` (the same seed, the same schedule)."""
    rng = random.Random(seed)
    faults = []
    for _ in range(rounds):
        order = list(kinds)
        rng.shuffle(order)
        for kind in order:
            target = (
                rng.randrange(replicas if kind.startswith("replica") else nodes) if not kind.startswith("etcd") else 0
            )
            spread = HOLD_S if kind.endswith("_stop") else LINK_HOLD_S if kind in LINK_KINDS else None
            hold = round(rng.uniform(*spread), 2) if spread else 0.0
            faults.append(Fault(kind, target, hold))
    return faults


def unavailable(probe: RequestOutcome, slow_s: float) -> bool:
    """A probe that failed, or took longer than `slow_s`: the cluster did not serve it."""
    return probe.kind != "ok" or probe.elapsed_s > slow_s


def recovery_ms(fault_at: float, probes: Sequence[RequestOutcome], slow_s: float) -> float:
    """How long after `fault_at` (monotonic s) a probe found the cluster unavailable: the latest
    end of such a probe that started after the fault (module docstring); 0 when there was none."""
    ends = [p.started_s + p.elapsed_s for p in probes if p.started_s >= fault_at and unavailable(p, slow_s)]
    return max(0.0, (max(ends) - fault_at) * 1000.0) if ends else 0.0


def slow_bound_s(probes: Sequence[RequestOutcome]) -> float:
    """The slow-probe bound: SLOW_FACTOR x the p99 of the baseline probes that succeeded, at least
    MIN_SLOW_S."""
    p99 = percentile([p.elapsed_s for p in probes if p.kind == "ok"], 99)
    return MIN_SLOW_S if p99 is None else max(MIN_SLOW_S, SLOW_FACTOR * p99)


class Target:
    """The processes a fault can hit, as the bench's cluster runs them now (pids change as they
    restart)."""

    def __init__(
        self,
        node_pid: Callable[[int], int | None],
        replica_pid: Callable[[int], int | None],
        etcd_pid: Callable[[], int | None],
        engine_port: Callable[[int], int],
    ) -> None:
        self.node_pid, self.replica_pid, self.etcd_pid, self.engine_port = node_pid, replica_pid, etcd_pid, engine_port

    def engine_pid(self, node: int) -> int | None:
        leader = self.node_pid(node)
        if leader is None:
            return None
        port = str(self.engine_port(node))
        for pid in process_tree(leader):
            try:
                argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")  # noqa: SIM115
            except OSError:
                continue
            words = [a.decode(errors="replace") for a in argv]
            if "vllm.entrypoints.openai.api_server" in words and port in words:
                return pid
        return None

    def pid_of(self, fault: Fault) -> int | None:
        if fault.kind.startswith("engine"):
            return self.engine_pid(fault.target)
        if fault.kind.startswith("node"):
            return self.node_pid(fault.target)
        if fault.kind.startswith("replica"):
            return self.replica_pid(fault.target)
        return self.etcd_pid()


def _ssd_prefix(status: kv_pb2.SessionStatus) -> int:
    return next((t.complete_prefix_blocks for t in status.tiers if t.tier == kv_pb2.TIER_SSD), 0)


async def saved_histories(
    address: str, tls: ClusterTLS | None, sessions: Sequence[tuple[str, str]]
) -> dict[tuple[str, str], tuple[list[int], int]]:
    """Each (tenant, session) the node knows: its token ids and its leading blocks on SSD."""
    found: dict[tuple[str, str], tuple[list[int], int]] = {}
    async with grpc_channel(address, tls) as channel:
        stub = kv_pb2_grpc.KVStoreStub(channel)
        for tenant, session in sessions:
            ref = kv_pb2.SessionRef(tenant=tenant, session_id=session)
            request = kv_pb2.SessionStatusRequest(session=ref, include_token_ids=True)
            try:
                status = await stub.GetSessionStatus(request, timeout=10)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    continue
                raise
            found[(tenant, session)] = (list(status.token_ids), _ssd_prefix(status))
    return found


async def ssd_blocks_found(
    address: str, tls: ClusterTLS | None, histories: dict[tuple[str, str], tuple[list[int], int]]
) -> dict[str, int]:
    """Leading blocks of each history the node finds on SSD, asked the way a returning session's
    next turn asks (its whole history registered again: a node keeps pages, keyed by content, not
    its session table, across a restart). Keyed "tenant/session"."""
    held: dict[str, int] = {}
    async with grpc_channel(address, tls) as channel:
        stub = kv_pb2_grpc.KVStoreStub(channel)
        for (tenant, session), (token_ids, _) in histories.items():
            # Under a name of its own: the live session's record is the load's, left as it is.
            ref = kv_pb2.SessionRef(tenant=tenant, session_id=f"{session}-survived")
            status = await stub.PutSession(kv_pb2.PutSessionRequest(session=ref, token_ids=token_ids), timeout=10)
            held[f"{tenant}/{session}"] = _ssd_prefix(status)
    return held


class CrashRunner:
    """Runs a fault schedule against a cluster under `load`, one fault at a time."""

    def __init__(
        self,
        load: ChatLoad,
        target: Target,
        whole: Callable[[], Awaitable[bool]],
        node_address: Callable[[int], str],
        tls: ClusterTLS | None,
        probe_tenant: str,
        recover_timeout_s: float,
        node_down_after_ms: int,
        links: NodeLinks | None = None,
    ) -> None:
        """`links`: the nodes' links, for faults of `LINK_KINDS` (eval.faults.network)."""
        self.stable_s = stable_s(node_down_after_ms)
        self.links = links
        self.load, self.target, self.whole = load, target, whole
        self.node_address, self.tls = node_address, tls
        self.probe_tenant = probe_tenant
        self.recover_timeout_s = recover_timeout_s
        self.probes: list[RequestOutcome] = []
        self.faults: list[dict[str, Any]] = []
        self.origin_s = 0.0
        self.slow_s = MIN_SLOW_S
        self.baseline: list[RequestOutcome] = []

    async def measure_baseline(self) -> None:
        """Probe for BASELINE_S under the load, before any fault: sets `slow_s`."""
        done = asyncio.Event()
        prober = asyncio.create_task(self._probe(self.baseline, done))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), BASELINE_S)
        done.set()
        await prober
        self.slow_s = slow_bound_s(self.baseline)

    async def run(self, faults: Sequence[Fault], progress: Callable[[str], None], origin_s: float) -> None:
        """Inject `faults` in turn; each record's `at_s` is its time after `origin_s` (monotonic)."""
        self.origin_s = origin_s
        for number, fault in enumerate(faults, 1):
            progress(f"fault {number}/{len(faults)}: {fault.describe()}")
            self.faults.append(await self.one(fault))

    def _sessions_on(self, node: int) -> list[tuple[str, str]]:
        """The (tenant, session) pairs the load had answered on node `node`."""
        name = f"node-{node}"
        return sorted({(o.tenant, o.session) for o in self.load.outcomes if o.node == name and o.kind == "ok"})

    async def one(self, fault: Fault) -> dict[str, Any]:
        record: dict[str, Any] = {"fault": fault.describe(), "kind": fault.kind}
        links = self.links if fault.kind in LINK_KINDS else None
        assert links is not None or fault.kind not in LINK_KINDS, "a link fault needs the nodes' links"
        pid = None if links is not None else self.target.pid_of(fault)
        if pid is None and links is None:
            record["skipped"] = "no such process running"
            return record
        histories: dict[tuple[str, str], tuple[list[int], int]] = {}
        if fault.kind == "node_kill":
            sessions = self._sessions_on(fault.target)
            try:
                histories = await saved_histories(self.node_address(fault.target), self.tls, sessions)
            except grpc.aio.AioRpcError as exc:  # nothing to compare with: counted as no session checked
                record["ssd_check_error"] = exc.code().name
        probes: list[RequestOutcome] = []
        probing = asyncio.Event()
        prober = asyncio.create_task(self._probe(probes, probing))
        fault_at = time.monotonic()
        record["at_s"] = round(fault_at - self.origin_s, 2)
        try:
            if links is not None:
                links.cut(fault.target, fault.kind)
            elif pid is not None:
                os.kill(pid, signal.SIGSTOP if fault.hold_s else signal.SIGKILL)
            if fault.hold_s:
                await asyncio.sleep(fault.hold_s)
        except ProcessLookupError:
            record["skipped"] = "the process ended before the fault"
        finally:
            if links is not None:
                links.heal(fault.target)  # whatever happened, no link stays broken
            elif fault.hold_s and pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)  # whatever happened, nothing stays frozen
        whole = "skipped" not in record and await self._wait_whole(fault, pid)
        whole_ms = (time.monotonic() - fault_at - self.stable_s) * 1000.0  # when it became whole
        await asyncio.sleep(SETTLE_S)
        probing.set()
        await prober
        self.probes.extend(probes)
        down = [p for p in probes if unavailable(p, self.slow_s)]
        record.update(
            {
                "recovered": whole,
                "whole_after_ms": round(whole_ms) if whole else None,
                "probes": len(probes),
                "probes_unavailable": len(down),
                "probe_ms_p99": round(1000.0 * (percentile([p.elapsed_s for p in probes], 99) or 0.0), 1),
                "recovery_ms": round(recovery_ms(fault_at, probes, self.slow_s), 1),
                "unavailable_probes": [
                    {
                        "after_ms": round((p.started_s - fault_at) * 1000.0),
                        "took_ms": round(p.elapsed_s * 1000.0),
                        "kind": p.kind,
                        "status": p.status,
                        "detail": p.detail,
                    }
                    for p in down
                ][:LISTED_PROBES],
            }
        )
        if fault.kind == "node_kill":
            saved = {f"{t}/{s}": blocks for (t, s), (_, blocks) in histories.items()}
            try:
                after = await ssd_blocks_found(self.node_address(fault.target), self.tls, histories)
            except grpc.aio.AioRpcError as exc:  # the node did not answer: nothing was found there
                record["ssd_check_error"] = exc.code().name
                after = {}
            record["ssd_sessions_before"] = sum(1 for b in saved.values() if b > 0)
            record["ssd_blocks_before"] = sum(saved.values())
            record["ssd_blocks_after"] = sum(after.values())
            record["lost_sessions"] = lost_sessions(saved, after)
        return record

    async def _wait_whole(self, fault: Fault, pid: int | None) -> bool:
        """Wait until a killed process was replaced (another pid runs in its place), then until the
        cluster is whole for `stable_s` in a row: a scheduler still reads a node killed a moment
        ago as ready until its next poll. Faults held for a while (a SIGSTOP, a link's) end healed."""
        deadline = time.monotonic() + self.recover_timeout_s
        while not fault.hold_s and self.target.pid_of(fault) in (None, pid):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)
        since: float | None = None
        while time.monotonic() < deadline:
            if await self.whole():
                since = since if since is not None else time.monotonic()
                if time.monotonic() - since >= self.stable_s:
                    return True
            else:
                since = None
            await asyncio.sleep(0.1)
        return False

    async def _probe(self, probes: list[RequestOutcome], done: asyncio.Event) -> None:
        pending: set[asyncio.Task[RequestOutcome]] = set()
        number = 0
        while not done.is_set():
            if len(pending) < PROBES_IN_FLIGHT:
                number += 1
                session = f"probe-{len(self.faults)}-{number}"
                messages = [{"role": "user", "content": "Say OK."}]
                pending.add(asyncio.create_task(self.load.send(self.probe_tenant, session, messages, PROBE_TOKENS)))
            finished = {t for t in pending if t.done()}
            probes.extend(t.result() for t in finished)
            pending -= finished
            await asyncio.sleep(PROBE_EVERY_S)
        probes.extend(await asyncio.gather(*pending))
