"""Paper-scale scenarios on the simulator (`symphony bench sim --scenario NAME`).

`missed_advisories`: Symphony at one user count with 0, 10, 25 and 50% of typing advisories missed
(figure 17): `latency_increase_at_10pct`, the relative rise of mean normalized latency at 10%.

`imbalance`: sticky (InferCept-like) and Symphony at one user count: per-node busy time, busiest
over median (`sticky_max_over_median`, `symphony_max_over_median`).

`priority`: 10, 30 and 50% of the users high priority, Symphony against recompute with vLLM's
priority scheduling in every engine: the high-priority users' TPOT and throughput.

`agents`: MetaGPT-like projects (architect, engineers, QA review rounds), Symphony with predecessor
hints against recompute: `makespan_ratio_vs_recompute`.

`trace`: a Mooncake or Azure trace replayed at its recorded times under each policy.

`users`: N nodes of a preset serve a growing number of users (ShareGPT, a Mooncake trace's sessions
or tool-calling agents) under each policy (Symphony's figure 12); each point is `run_scripts`, and
`eval.sim.users_scenario` searches the counts and computes the ratios.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from eval.sim.agents import ProjectRun, agent_projects
from eval.sim.cluster import ClusterSim, SimResult
from eval.sim.engine import EngineModel, SimRequest
from eval.sim.presets import Preset, sim_policy
from eval.sim.turns import Script, Turn
from eval.sim.workload import sharegpt_users
from eval.stats import percentile
from eval.traces import TraceRequest, sessions_of
from eval.workloads import Conversation, HumanTiming
from scheduler.routing import PRIORITY_RANK

HIGH_SHARES = (0.1, 0.3, 0.5)


def _engines(preset: Preset, nodes: int) -> dict[str, EngineModel]:
    return {f"node-{i}": preset.engine for i in range(nodes)}


def summarize(result: SimResult, duration_ms: float) -> dict[str, Any]:
    done = [r for r in result.requests if r.finished_ms is not None]
    ttft = [r.ttft_ms for r in done]
    tpot = [r.tpot_ms for r in done if r.generated > 1]
    busy = list(result.busy_ms.values())
    mean_busy = statistics.fmean(busy) if busy else 0.0
    median_busy = statistics.median(busy) if busy else 0.0
    computed = sum(r.prefilled_tokens for r in done)
    total = sum(r.prompt_tokens for r in done)
    return {
        "completed": len(done),
        "refused": len(result.refused),
        "ttft_ms_p50": percentile(ttft, 50) if ttft else None,
        "ttft_ms_p95": percentile(ttft, 95) if ttft else None,
        "ttft_ms_mean": statistics.fmean(ttft) if ttft else None,
        "tpot_ms_mean": statistics.fmean(tpot) if tpot else None,
        "norm_latency_ms_per_token_mean": statistics.fmean([(r.finished_ms - r.arrival_ms) / r.generated for r in done])
        if done
        else None,  # type: ignore[operator]
        "output_tokens_per_s": sum(r.generated for r in done) / (duration_ms / 1000),
        "prefill_tokens_computed": computed,
        "prefill_tokens_total": total,
        "preemptions": result.preemptions,
        "max_over_mean_load": max(busy) / mean_busy if mean_busy else None,
        "max_over_median_load": max(busy) / median_busy if median_busy else None,
        "busy_ms_by_node": dict(result.busy_ms),
    }


def turn_work_ms(request: SimRequest, model: EngineModel) -> float:
    """The engine time a served turn added to the steps it shared (`EngineModel.turn_work_ms`)."""
    return model.turn_work_ms(request.prompt_tokens, request.prefilled_tokens, request.generated)


def run_point(
    preset: Preset,
    nodes: int,
    policy: str,
    conversations: Sequence[Conversation],
    users: int,
    duration_ms: float,
    timing: HumanTiming,
    seed: int,
) -> dict[str, Any]:
    """`users` ShareGPT users under `policy` (`run_scripts`)."""
    return run_scripts(preset, nodes, policy, sharegpt_users(conversations, users, timing, seed=seed), duration_ms)


def run_scripts(
    preset: Preset,
    nodes: int,
    policy: str,
    scripts: Sequence[Script],
    duration_ms: float,
    prefix_caching: bool = True,
) -> dict[str, Any]:
    """`scripts` played closed loop on `nodes` engines under `policy`, no turn arriving after
    `duration_ms` (`prefix_caching`: the engines' own, `ClusterSim`): `summarize`'s figures and the
    mean engine work per served turn."""
    engines = _engines(preset, nodes)
    sim = ClusterSim(sim_policy(policy, preset), engines, preset.link, prefix_caching=prefix_caching)
    result = sim.run(scripts=scripts, until_ms=duration_ms)
    row = summarize(result, duration_ms)
    done = [r for r in result.requests if r.finished_ms is not None]
    row["work_ms_per_turn_mean"] = statistics.fmean(turn_work_ms(r, preset.engine) for r in done) if done else None
    return row


def priority(
    preset: Preset,
    nodes: int,
    conversations: Sequence[Conversation],
    users: int,
    duration_ms: float,
    time_scale: float,
    seed: int,
) -> dict[str, Any]:
    """10, 30 and 50% of the users high priority; Symphony (priority tiers in its queue and routing)
    against recompute, every engine with vLLM's priority scheduling. Per share and policy: the
    high-priority users' mean TPOT and output throughput, and everyone's; and Symphony's high-priority
    TPOT over recompute's (`high_tpot_ratio_vs_recompute`, lower is better) per share."""
    timing = HumanTiming(time_scale=time_scale)
    engines = _engines(preset, nodes)
    points: dict[str, dict[str, Any]] = {}
    for share in HIGH_SHARES:
        for policy in ("symphony", "recompute"):
            sim = ClusterSim(sim_policy(policy, preset), engines, preset.link, engine_priority_scheduling=True)
            scripts = sharegpt_users(conversations, users, timing, seed=seed, high_share=share)
            result = sim.run(scripts=scripts, until_ms=duration_ms)
            row = summarize(result, duration_ms)
            high = [r for r in result.requests if r.priority_rank == PRIORITY_RANK["high"]]
            row.update(_class_figures(high, duration_ms, "high_"))
            points[f"{policy}@{share:g}"] = row
    ratios = {}
    for share in HIGH_SHARES:
        base = points[f"recompute@{share:g}"]["high_tpot_ms_mean"]
        ours = points[f"symphony@{share:g}"]["high_tpot_ms_mean"]
        ratios[f"{share:g}"] = ours / base if base and ours is not None else None
    return {"points": points, "high_tpot_ratio_vs_recompute": ratios}


def _class_figures(requests: Sequence[SimRequest], duration_ms: float, prefix: str) -> dict[str, Any]:
    done = [r for r in requests if r.finished_ms is not None]
    tpot = [r.tpot_ms for r in done if r.generated > 1]
    return {
        f"{prefix}completed": len(done),
        f"{prefix}tpot_ms_mean": statistics.fmean(tpot) if tpot else None,
        f"{prefix}ttft_ms_p95": percentile([r.ttft_ms for r in done], 95) if done else None,
        f"{prefix}output_tokens_per_s": sum(r.generated for r in done) / (duration_ms / 1000),
    }


Points = dict[str, dict[int, dict[str, Any]]]  # policy -> users -> that run's summary


def work_ratio(points: Points, policy: str, baseline: str = "recompute") -> float | None:
    """The baseline's mean engine work per turn over `policy`'s, at the fewest users, as served:
    what the runs reached of `eval.sim.users_scenario.work_ratio_bound` (which assumes recompute
    finds nothing cached and the other policy everything its session left)."""
    fewest = min(points[baseline])
    ours = points[policy][fewest].get("work_ms_per_turn_mean")
    base = points[baseline][fewest].get("work_ms_per_turn_mean")
    return base / ours if ours and base is not None else None


MISS_RATES = (0.0, 0.1, 0.25, 0.5)


def missed_advisories(
    preset: Preset,
    nodes: int,
    conversations: Sequence[Conversation],
    users: int,
    duration_ms: float,
    time_scale: float,
    seed: int,
) -> dict[str, Any]:
    rows = {
        rate: run_point(
            preset,
            nodes,
            "symphony",
            conversations,
            users,
            duration_ms,
            HumanTiming(time_scale=time_scale, advisory_miss_rate=rate),
            seed,
        )
        for rate in MISS_RATES
    }
    base = rows[0.0]["norm_latency_ms_per_token_mean"]
    at_10 = rows[0.1]["norm_latency_ms_per_token_mean"]
    return {
        "points": {f"{rate:g}": row for rate, row in rows.items()},
        "latency_increase_at_10pct": at_10 / base - 1 if base and at_10 is not None else None,
    }


def imbalance(
    preset: Preset,
    nodes: int,
    conversations: Sequence[Conversation],
    users: int,
    duration_ms: float,
    time_scale: float,
    seed: int,
) -> dict[str, Any]:
    timing = HumanTiming(time_scale=time_scale)
    rows = {
        policy: run_point(preset, nodes, policy, conversations, users, duration_ms, timing, seed)
        for policy in ("sticky", "symphony")
    }
    return {
        "points": rows,
        "sticky_max_over_median": rows["sticky"]["max_over_median_load"],
        "symphony_max_over_median": rows["symphony"]["max_over_median_load"],
    }


# (name, policy, predecessor hints)
AGENT_RUNS = (
    ("symphony", "symphony", True),
    ("symphony_no_hints", "symphony", False),
    ("recompute", "recompute", False),
)


def agents(preset: Preset, nodes: int, projects: int, duration_ms: float, seed: int) -> dict[str, Any]:
    """`projects` MetaGPT-like projects (`eval.sim.agents`) started within `duration_ms`: Symphony with
    predecessor hints, Symphony without them, and recompute. Per run: the projects' makespans;
    `makespan_ratio_vs_recompute`: Symphony's mean makespan (with hints) over recompute's."""
    engines = _engines(preset, nodes)
    points: dict[str, dict[str, Any]] = {}
    for name, policy, hints in AGENT_RUNS:
        sim = ClusterSim(sim_policy(policy, preset), engines, preset.link)
        runs = [
            ProjectRun(sim, project, hints) for project in agent_projects(projects, stagger_ms=duration_ms, seed=seed)
        ]
        for run in runs:
            run.start()
        result = sim.run()
        makespans = [run.makespan_ms for run in runs if run.makespan_ms is not None]
        end_ms = max((r.finished_ms or 0.0 for r in result.requests), default=duration_ms)
        row = summarize(result, end_ms)
        row.update(
            {
                "projects_finished": len(makespans),
                "makespan_ms_mean": statistics.fmean(makespans) if makespans else None,
                "makespan_ms_p95": percentile(makespans, 95) if makespans else None,
            }
        )
        points[name] = row
    ours, base = points["symphony"]["makespan_ms_mean"], points["recompute"]["makespan_ms_mean"]
    return {
        "points": points,
        "projects": projects,
        "makespan_ratio_vs_recompute": ours / base if ours is not None and base else None,
    }


def trace_replay(
    preset: Preset,
    nodes: int,
    requests: Sequence[TraceRequest],
    policies: Sequence[str],
) -> dict[str, Any]:
    """A recorded trace (`eval.traces`) replayed open loop at its arrival times under each policy:
    the usual figures per policy. Sessions are prefix groups (`eval.traces.sessions_of`); the
    traces carry no advisories."""
    turns = [
        Turn(session, r.arrival_ms, r.input_tokens, r.output_tokens)
        for session, r in zip(sessions_of(list(requests)), requests, strict=True)
    ]
    end_ms = max((t.arrival_ms for t in turns), default=0.0) or 1.0
    engines = _engines(preset, nodes)
    points = {
        policy: summarize(ClusterSim(sim_policy(policy, preset), engines, preset.link).run(turns=turns), end_ms)
        for policy in policies
    }
    return {"points": points, "requests": len(turns)}
