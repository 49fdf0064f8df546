"""Regions on the simulator: one `ClusterSim` per region on one clock, and above them the global
layer's policies (`global_layer.policies`, the code the live entries run) choosing each request's
region from the regions' summaries (`scheduler.region_summary.load_of`, the code the live
schedulers report with), refreshed every probe period.

A user lives in one region and talks to its nearest entry. Each turn:
- its typing advisory (when the user sends one) is ranked as an advisory: the region chosen is
  bound to the turn, as the live entry binds it, and that region's scheduler picks a node for it
  (`ClusterSim.advise`). When the policy moves KV across regions and names a copy to move, the
  copy travels over the WAN link (its round trip, then its bytes at the link's bandwidth) to that
  node;
- the request reaches its region half a client round trip later and is routed there by the region's
  own policy. A WAN move still under way is waited for up to the scheduler's pull wait, as the live
  node's pull joins the prefetch; after that the request computes what is missing;
- the client sees the first token half a round trip after the region sent it (its TTFT is the
  region's plus the round trip), and starts reading once the answer is back.

Kept simple, and said so: summaries are exact when read (the live ones are a link's half round trip
old as well), regions never go down, and a session's KV moves whole (live, a remote pull copies the
gap in one stream too).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from eval.sim.cluster import ClusterSim
from eval.sim.engine import SimRequest
from eval.sim.events import EventLoop
from eval.sim.presets import Preset, sim_cost_profile, sim_policy
from eval.sim.turns import Script, Turn
from eval.stats import percentile
from global_layer.costs import move_ms
from global_layer.policies import RegionPolicy, RegionRequest, RegionView, rank_regions
from scheduler.region_summary import load_of
from scheduler.routing import move_sources
from symphony.config import SchedulerConfig
from symphony.finish_rate import FinishRate
from symphony.region_load import session_digest
from symphony.regions import RegionTopology

# What SkyWalker's prefix tree sees of a prompt: a chat template's opening, shared by every prompt,
# then the conversation's own text (here its digest: conversations share nothing else).
_TEMPLATE = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
_PULL_WAIT_MS = float(SchedulerConfig().route_pull_wait_ms)


@dataclass(frozen=True, slots=True)
class RegionUser:
    """A user of the regions: where they are, what they send, under which tenant."""

    region: str
    script: Script  # its chain of conversations (`Script.after`)
    tenant: str = "default"
    home: str = ""  # where its figures are reported (per-window SLO cells); "": `region`


@dataclass(slots=True)
class ClientRecord:
    """One request as its client saw it."""

    request: SimRequest
    client_region: str
    region: str  # where it was served
    rtt_ms: float  # between the client and that region
    tenant: str
    sent_ms: float  # when the client sent it (it reached the region half a round trip later, or
    # later still when it waited there for a move of its KV)
    home: str = ""  # the client's home as reported (RegionUser.home, else its region)

    @property
    def ttft_ms(self) -> float:
        assert self.request.first_token_ms is not None
        return self.request.first_token_ms + self.rtt_ms / 2 - self.sent_ms

    @property
    def e2e_ms(self) -> float:
        assert self.request.finished_ms is not None
        return self.request.finished_ms + self.rtt_ms / 2 - self.sent_ms


@dataclass(slots=True)
class _Session:
    user: RegionUser
    script: Script
    step: int = 0
    history: int = 0  # tokens of the conversation so far (its last prompt and answer)


@dataclass(slots=True)
class RegionsResult:
    records: list[ClientRecord]
    refused: list[tuple[RegionUser, SimRequest | None]]  # refused by a region, or with no region allowed
    busy_ms: dict[str, float]  # region -> its engines' busy time, summed
    cross_region_kv_bytes: int
    kv_moves: int
    residency_violations: int
    served_by_region: dict[str, int] = field(default_factory=dict)
    # Stopped once enough requests had a TTFT past the SLO that p95 was past it whatever came next
    # (about 5% of the most requests the users could send).
    stopped_past_slo: bool = False


class RegionsSim:
    def __init__(
        self,
        topology: RegionTopology,
        policy: RegionPolicy,
        preset: Preset,
        replicas: int,
        *,
        local_policy: str = "symphony",
        probe_interval_ms: float = 100.0,
    ) -> None:
        self.topology = topology
        self.policy = policy
        self.preset = preset
        self.loop = EventLoop()
        self.probe_interval_ms = probe_interval_ms
        self.profile = sim_cost_profile(preset.engine, preset.link, f"simulator preset {preset.name}")
        self.clusters = {
            name: ClusterSim(
                sim_policy(local_policy, preset),
                {f"{name}/node-{i}": preset.engine for i in range(replicas)},
                preset.link,
                loop=self.loop,
            )
            for name in topology.names
        }
        self._views: list[RegionView] = []
        self._finishes = {name: FinishRate() for name in topology.names}  # as each scheduler counts them
        self._advised: dict[str, str] = {}  # session -> the region its moving advisory binds it to
        self._advisory_at: dict[str, str] = {}  # session -> the region whose scheduler took its advisory
        self._moves_due: dict[tuple[str, str], float] = {}  # (session, region) -> when a WAN move lands
        self._until_ms = 0.0
        self._slo_ms: float | None = None
        self._late_limit = 0
        self._late = 0
        self._stopped = False
        self.records: list[ClientRecord] = []
        self.refused: list[tuple[RegionUser, SimRequest | None]] = []
        self.cross_region_kv_bytes = 0
        self.kv_moves = 0
        self.residency_violations = 0

    # -- the loop --------------------------------------------------------------------------------
    def run(
        self,
        users: Sequence[RegionUser],
        until_ms: float,
        slo_ms: float | None = None,
        window_ms: float | None = None,
    ) -> RegionsResult:
        """Every user's conversations, closed loop; no turn arrives after `until_ms`. With
        `slo_ms`, stops as soon as the p95 TTFT cannot end within it (`stopped_past_slo`): over the
        whole day, and with `window_ms` in some window of some client home as well (`worst_window`)."""
        self._until_ms = until_ms
        self._slo_ms = slo_ms
        # p95 (linear between ranks, eval.stats.percentile) of n values is within the SLO only if
        # the value of rank floor(0.95 (n - 1)) is: at most n - 1 - floor(0.95 (n - 1)) < 0.05 (n - 1)
        # + 1 of them are past it. Over the day (n <= `most`) it misses once ceil(0.05 (most - 1) + 1)
        # are late; summed over C cells (window, home) of n_c values, every cell meets it only if at
        # most 0.05 (most - C) + C are late, so more than that means some cell misses it too.
        most = sum(len(s.steps) for user in users for s in _chain(user.script))
        self._late_limit = math.ceil(0.05 * (most - 1) + 1)
        if window_ms:
            cells = len({user.home or user.region for user in users}) * _windows(until_ms, window_ms)
            self._late_limit = max(self._late_limit, math.floor(0.05 * (most - cells) + cells) + 1)
        for cluster in self.clusters.values():
            cluster.start()
        self._probe()
        for user in users:
            self._begin(user, user.script, user.script.start_ms)
        self.loop.run()
        served: dict[str, int] = defaultdict(int)
        for record in self.records:
            served[record.region] += 1
        return RegionsResult(
            self.records,
            self.refused,
            {name: sum(c.result().busy_ms.values()) for name, c in self.clusters.items()},
            self.cross_region_kv_bytes,
            self.kv_moves,
            self.residency_violations,
            dict(served),
            self._stopped,
        )

    def _probe(self) -> None:
        """Every region's summary, as the entries read it each probe period."""
        now = self.loop.now_ms
        self._views = [
            RegionView(
                name,
                True,
                load_of(*cluster.load(), self.profile, self._finishes[name].per_s(now), self.preset.engine.max_batch),
            )
            for name, cluster in self.clusters.items()
        ]
        if self.loop.now_ms < self._until_ms:  # no turn is ranked after it
            self.loop.at(self.loop.now_ms + self.probe_interval_ms, self._probe)

    # -- a user's turns --------------------------------------------------------------------------
    def _begin(self, user: RegionUser, script: Script, arrival_ms: float) -> None:
        if script.steps:
            self._turn(_Session(user, script), arrival_ms)

    def _turn(self, session: _Session, arrival_ms: float) -> None:
        if arrival_ms > self._until_ms:
            return
        step = session.script.steps[session.step]
        prompt = session.history + step.new_tokens
        if step.advised:
            self.loop.at(max(self.loop.now_ms, arrival_ms - step.typing_ms), lambda: self._advise(session, prompt))
        self.loop.at(arrival_ms, lambda: self._arrive(session, prompt))

    def _request(self, session: _Session, prompt: int, advisory: bool) -> RegionRequest:
        name = session.script.session
        held: dict[str, int] = {}
        holders: dict[str, str] = {}
        for region, cluster in self.clusters.items():
            kv = cluster.kv_of(name)
            if kv:
                tokens, holders[region] = max((t, node) for node, t in kv.items())
                held[region] = tokens
        digest = session_digest(session.user.tenant, name)
        return RegionRequest(
            session.user.tenant,
            session.user.region,
            session=digest,
            text=_TEMPLATE + digest,
            prompt_tokens=prompt,
            held=held,
            holders=holders,
            advisory=advisory,
        )

    def _sim_turn(self, session: _Session, arrival_ms: float, prompt: int) -> Turn:
        step = session.script.steps[session.step]
        return Turn(session.script.session, arrival_ms, prompt, step.output_tokens, tenant=session.user.tenant)

    def _advise(self, session: _Session, prompt: int) -> None:
        request = self._request(session, prompt, advisory=True)
        ranking = rank_regions(self.policy, request, self._views, self.topology)
        if not ranking.regions:
            return
        region = ranking.regions[0]
        candidates = [v for v in self._views if v.name in ranking.regions]
        source = self.policy.move_source(request, region, candidates, self.topology) if self.policy.moves_kv else None
        if source is not None:  # as the live entry: only a moving advisory binds its request
            self._advised[session.script.session] = region
        self.policy.observe(request, region)
        one_way = self.topology.rtt_ms(session.user.region, region) / 2
        self.loop.at(self.loop.now_ms + one_way, lambda: self._advised_at_region(session, prompt, region, source))

    def _advised_at_region(self, session: _Session, prompt: int, region: str, source: tuple[str, int] | None) -> None:
        cluster = self.clusters[region]
        name = session.script.session
        node = cluster.advise(self._sim_turn(session, self.loop.now_ms, prompt))
        if node is None:
            if self._advised.get(name) == region:
                del self._advised[name]
            return
        self._advisory_at[name] = region
        if source is None:
            return
        holder, tokens = source
        from_region = holder.split("/", 1)[0]
        if not self.topology.allowed(session.user.tenant, from_region):
            self.residency_violations += 1
        # As the live move (`move_sources`): a node of this region holding whole blocks of the
        # session beyond `node`'s sends them first, over the region's network; the WAN the rest.
        held = cluster.kv_of(name)
        block_size = cluster.engines[node].model.block_size
        sources = move_sources(held, node, source, block_size)
        if sources.source is not source:
            return  # a copy here is as long: the region's own pull brings it
        near_ms, here = 0.0, held.get(node, 0)
        if sources.near is not None:
            near_ms = cluster.link.move_ms(sources.near_blocks * block_size - here)
            here = sources.near_blocks * block_size
        gap = tokens - here
        if gap <= 0:
            return
        wan_ms = move_ms(self.topology, from_region, region, gap, self.profile.kv_bytes_per_token)
        due = self.loop.now_ms + near_ms + wan_ms
        key = (session.script.session, region)
        self._moves_due[key] = due
        self.kv_moves += 1
        self.cross_region_kv_bytes += gap * self.profile.kv_bytes_per_token

        def landed() -> None:
            cluster.seed_kv(session.script.session, node, tokens)
            if self._moves_due.get(key) == due:
                del self._moves_due[key]

        self.loop.at(due, landed)

    def _arrive(self, session: _Session, prompt: int) -> None:
        name = session.script.session
        advised = self._advised.pop(name, None)
        allowed = [v.name for v in self._views if self.topology.allowed(session.user.tenant, v.name)]
        if advised in allowed:
            region = advised
            request = self._request(session, prompt, advisory=False)
        else:
            request = self._request(session, prompt, advisory=False)
            ranking = rank_regions(self.policy, request, self._views, self.topology)
            if not ranking.regions:
                self.refused.append((session.user, None))  # no allowed region: the entry's 503
                return
            region = ranking.regions[0]
        self.policy.observe(request, region)
        if not self.topology.allowed(session.user.tenant, region):
            self.residency_violations += 1
        advised_at = self._advisory_at.pop(name, None)
        if advised_at is not None and advised_at != region:  # that scheduler's advisory goes unused
            self.clusters[advised_at].retract(name)
        rtt = self.topology.rtt_ms(session.user.region, region)
        sent = self.loop.now_ms
        at_region = sent + rtt / 2
        due = self._moves_due.get((name, region))
        if due is not None and due > at_region:  # the region's pull joins the move, for a while
            at_region = min(due, at_region + _PULL_WAIT_MS)
        self.clusters[region].submit(
            self._sim_turn(session, at_region, prompt),
            lambda served: self._answered(session, served, region, rtt, sent),
            lambda refused: self.refused.append((session.user, refused)),  # its user leaves
        )

    def _answered(self, session: _Session, request: SimRequest, region: str, rtt: float, sent: float) -> None:
        self._finishes[region].finished(self.loop.now_ms)
        if self._stopped:
            return  # the rest of the step that stopped the run: its figures end where it stopped
        user = session.user
        record = ClientRecord(request, user.region, region, rtt, user.tenant, sent, user.home or user.region)
        self.records.append(record)
        if self._slo_ms is not None and record.ttft_ms > self._slo_ms:
            self._late += 1
            if self._late >= self._late_limit:
                self._stopped = True
                self.loop.stop()
                return
        back = self.loop.now_ms + rtt / 2  # the answer's last token reaches the client
        session.history = request.prompt_tokens + request.generated
        session.step += 1
        if session.step < len(session.script.steps):
            self._turn(session, back + session.script.steps[session.step].think_ms)
        elif session.script.after is not None and session.script.after.steps:
            following = session.script.after
            self._begin(session.user, following, back + following.steps[0].think_ms)


def _chain(script: Script | None) -> Iterator[Script]:
    while script is not None:
        yield script
        script = script.after


def _windows(duration_ms: float, window_ms: float) -> int:
    """The windows a day of `duration_ms` is judged in (a request sent at its very end counts in the last)."""
    return max(1, math.ceil(duration_ms / window_ms))


def worst_window(records: Sequence[ClientRecord], window_ms: float, duration_ms: float) -> dict[str, Any] | None:
    """The worst p95 TTFT of any (window of the day, client home) cell: requests grouped by when
    they were sent (`window_ms` apart) and where their clients live. A fleet sized for its peak hour
    keeps every cell within the SLO; a p95 over the whole day lets one region's peak hour miss it
    while the other regions' quiet hours make up the count."""
    last = _windows(duration_ms, window_ms) - 1
    cells: dict[tuple[int, str], list[float]] = defaultdict(list)
    for record in records:
        cells[(min(int(record.sent_ms // window_ms), last), record.home)].append(record.ttft_ms)
    if not cells:
        return None
    p95 = {cell: percentile(ttfts, 95) for cell, ttfts in cells.items()}
    (window, home), worst = max(p95.items(), key=lambda item: (item[1], item[0]))
    return {
        "ttft_ms_p95": worst,
        "window_start_s": window * window_ms / 1000,
        "client_home": home,
        "requests": len(cells[(window, home)]),
        "cells": len(cells),
    }


def summarize_regions(result: RegionsResult, duration_ms: float, window_ms: float | None = None) -> dict[str, Any]:
    """The live bench's keys (eval.bench_regions), from the client's side; with `window_ms`, the
    worst window's p95 as well (`worst_window`)."""
    ttft = [r.ttft_ms for r in result.records]
    e2e = [r.e2e_ms for r in result.records]
    computed = sum(r.request.prompt_tokens - r.request.cached_tokens for r in result.records)
    total = sum(r.request.prompt_tokens for r in result.records)
    busy = list(result.busy_ms.values())
    mean_busy = statistics.fmean(busy) if busy else 0.0
    return {
        "stopped_past_slo": result.stopped_past_slo,  # the figures below cover the run until then
        "completed": len(result.records),
        "errors": len(result.refused),
        "ttft_ms_p50": percentile(ttft, 50) if ttft else None,
        "ttft_ms_p95": percentile(ttft, 95) if ttft else None,
        "e2e_ms_p95": percentile(e2e, 95) if e2e else None,
        "output_tokens_per_s": sum(r.request.generated for r in result.records) / (duration_ms / 1000),
        "cross_region_kv_bytes": result.cross_region_kv_bytes,
        "kv_moves_across_regions": result.kv_moves,
        "prefill_tokens_computed": computed,
        "prefill_tokens_total": total,
        "max_over_mean_load": max(busy) / mean_busy if mean_busy else None,
        "busy_ms_by_region": {name: round(ms, 1) for name, ms in result.busy_ms.items()},
        "served_by_region": result.served_by_region,
        "served_away_from_client": sum(1 for r in result.records if r.region != r.client_region),
        "residency_violations": result.residency_violations,
        "worst_window": worst_window(result.records, window_ms, duration_ms) if window_ms else None,
    }
