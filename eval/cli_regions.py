"""`symphony bench regions`'s command line (registered by `eval.cli.register`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from eval.bench_args import (
    add_bench_cluster_args,
    add_replay_args,
    check_human_timing,
    fill_defaults,
    load_conversations,
)
from eval.sim import regions_defaults as scenario
from symphony.cli_args import CliError, engine_overrides, int_between, load_from_args, positive_int


def add_regions_parser(bench_sub: Any) -> None:
    regions = bench_sub.add_parser(
        "regions", help="the global layer's policies on a live 3-region cluster (WAN links emulated here)"
    )
    add_bench_cluster_args(regions)
    # Sized for this 2-core host to run the whole comparison (3 engines, 4 policies, 2 rotated
    # repeats) in about 15 minutes.
    add_replay_args(
        regions, users=6, duration=40, duration_is="seconds of load per policy", max_tokens=32, miss_rate=True
    )
    regions.add_argument("--out", type=Path, required=True, help="JSON results file")
    regions.add_argument(
        "--policies", default="nearest,skywalker,gorgo,symphony", help="global policies, in the first repeat's order"
    )
    regions.add_argument("--repeats", type=positive_int, default=2, help="rotated repeats of every policy (2)")
    regions.add_argument("--hot-share", type=float, default=0.6, help="share of the users homed in us-east (0.6)")
    regions.add_argument(
        "--eu-only-users", type=int_between(0), default=1, help="eu-west users of an EU-only tenant (1)"
    )
    regions.add_argument(
        "--min-turns", type=positive_int, default=2, help="conversations of at least this many turns (2)"
    )
    regions.add_argument("--max-turns", type=positive_int, default=8, help="cut conversations to this many turns (8)")
    regions.add_argument("--seed", type=int, default=7, help="workload seed (7)")
    regions.set_defaults(func=cmd_bench_regions)


def cmd_bench_regions(args: argparse.Namespace) -> int:
    from eval.bench_regions import RegionLoadSettings, run_regions_bench
    from eval.workloads import HumanTiming
    from global_layer.policies import REGION_POLICIES

    check_human_timing(args)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in REGION_POLICIES]
    if not policies or unknown:
        raise CliError(
            f"--policies: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(REGION_POLICIES)}"
        )
    if not 0 < args.hot_share < 1:
        raise CliError(f"--hot-share {args.hot_share}: expected a share in (0, 1)")
    if args.users < 3:
        raise CliError(f"--users {args.users}: at least one per region (3)")
    if args.min_turns > args.max_turns:
        raise CliError(f"--min-turns {args.min_turns} is above --max-turns {args.max_turns}")
    config = load_from_args(args, engine_overrides(args))
    path, conversations = load_conversations(args, min_turns=args.min_turns, max_turns=args.max_turns)
    load = RegionLoadSettings(
        users=args.users,
        duration_s=args.duration,
        hot_share=args.hot_share,
        eu_only_users=args.eu_only_users,
        max_answer_tokens=args.max_tokens,
        seed=args.seed,
    )
    timing = HumanTiming(time_scale=args.time_scale, advisory_miss_rate=args.miss_rate)
    header = {"workload": str(path), "conversations": len(conversations), "time_scale": args.time_scale}
    return run_regions_bench(
        config,
        out=args.out,
        policies=policies,
        repeats=args.repeats,
        load=load,
        timing=timing,
        conversations=conversations,
        header=header,
    )


# `bench sim --scenario regions`'s own flags and their defaults (eval.sim.regions_scenario cites
# them); None on the command line until given, so that the other scenarios can refuse them.
SIM_REGIONS_DEFAULTS: dict[str, Any] = {
    "arrivals_per_min": scenario.ARRIVALS_PER_MIN,
    "amplitude": scenario.AMPLITUDE,
    "slo_ms": scenario.SLO_MS,
    "max_replicas": scenario.MAX_REPLICAS,
    "reference_replicas": scenario.REFERENCE_REPLICAS,
    "pooled_bound": True,
}


def add_sim_regions_args(sim: argparse.ArgumentParser) -> None:
    d = SIM_REGIONS_DEFAULTS
    group = sim.add_argument_group("--scenario regions: 3 regions, a diurnal load, replicas for the SLO")
    group.add_argument(
        "--arrivals-per-min", type=float, help=f"users arriving per region per minute, mean ({d['arrivals_per_min']:g})"
    )
    group.add_argument("--amplitude", type=float, help=f"the diurnal swing around the mean ({d['amplitude']:g})")
    group.add_argument("--slo-ms", type=float, help=f"p95 TTFT the replicas must keep ({d['slo_ms']:g})")
    group.add_argument(
        "--max-replicas", type=positive_int, help=f"replicas per region searched up to ({d['max_replicas']})"
    )
    group.add_argument(
        "--reference-replicas",
        type=positive_int,
        help=f"replicas per region of the figures table ({d['reference_replicas']})",
    )
    group.add_argument(
        "--pooled-bound",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also search the replicas one pool with no round trips would need (on)",
    )


def cmd_bench_sim_regions(args: argparse.Namespace, preset: Any) -> int:
    from eval.bench_sim_regions import run_sim_regions_bench
    from eval.sim.regions_defaults import DAY_S, POLICIES, TIME_SCALE
    from eval.workloads import HumanTiming
    from global_layer.policies import REGION_POLICIES

    if args.time_scale is None:
        args.time_scale = TIME_SCALE
    fill_defaults(args, SIM_REGIONS_DEFAULTS)
    check_human_timing(args)
    given = ",".join(POLICIES) if args.policies is None else args.policies
    policies = [p.strip() for p in given.split(",") if p.strip()]
    unknown = [p for p in policies if p not in REGION_POLICIES]
    if not policies or unknown:
        raise CliError(
            f"--policies: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(REGION_POLICIES)}"
        )
    if not 0 < args.arrivals_per_min <= 1e6:
        raise CliError(f"--arrivals-per-min {args.arrivals_per_min}: expected a rate in (0, 1000000]")
    if not 0 <= args.amplitude <= 1:
        raise CliError(f"--amplitude {args.amplitude}: expected a share in [0, 1]")
    if not 0 < args.slo_ms < 1e7:
        raise CliError(f"--slo-ms {args.slo_ms}: expected milliseconds in (0, 10000000)")
    if args.reference_replicas > args.max_replicas:
        raise CliError(f"--reference-replicas {args.reference_replicas} is above --max-replicas {args.max_replicas}")
    if args.workload is not None:
        args.workload = Path(args.workload)
    path, conversations = load_conversations(args, min_turns=2, max_turns=8)
    run_sim_regions_bench(
        out=args.out,
        preset=preset,
        workload=path,
        conversations=conversations,
        policies=policies,
        arrivals_per_min=args.arrivals_per_min,
        duration_s=float(args.duration or DAY_S),
        timing=HumanTiming(time_scale=args.time_scale, advisory_miss_rate=args.miss_rate),
        slo_ms=args.slo_ms,
        reference_replicas=args.reference_replicas,
        max_replicas=args.max_replicas,
        amplitude=args.amplitude,
        pooled_bound=args.pooled_bound,
        seed=args.seed,
        plot=args.plot,
    )
    return 0
