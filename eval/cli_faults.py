"""`symphony bench faults` and `symphony bench soak`: their flags and handlers (the runs are
`eval.bench_faults`'s)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from eval.bench_args import add_bench_cluster_args, known_names
from eval.cli_cluster import positive_float
from eval.faults import CRASH_KINDS, DISK_KINDS, SCENARIOS
from symphony.cli_args import engine_overrides, int_between, load_from_args, positive_int


def add_faults_parser(bench_sub: Any) -> None:
    faults = bench_sub.add_parser(
        "faults",
        help="crash, cut off, break the disk of, attack and overload a private HA+TLS cluster; check outputs, sessions",
    )
    add_bench_cluster_args(faults)
    faults.add_argument("--out", type=Path, required=True, help="JSON results file")
    faults.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)} (all)"
    )
    faults.add_argument("--seed", type=int_between(0), default=0, help="draws the crash and link-fault schedules (0)")
    faults.add_argument("--rounds", type=positive_int, default=2, help="passes over the fault kinds (2)")
    faults.add_argument(
        "--kinds",
        default=",".join(CRASH_KINDS),
        help=f"crash kinds, comma-separated, of {', '.join(CRASH_KINDS)} (all)",
    )
    faults.add_argument(
        "--disk-faults",
        default=",".join(DISK_KINDS),
        help=f"disk scenario's faults, comma-separated, of {', '.join(DISK_KINDS)} (all)",
    )
    faults.add_argument("--sessions", type=positive_int, default=4, help="concurrent chat sessions (4)")
    faults.add_argument(
        "--warmup-turns", type=positive_int, default=8, help="answered turns before the first fault (8)"
    )
    faults.add_argument(
        "--overload-s",
        type=positive_float,
        default=60.0,
        help="overload: the flood's seconds; the capacity and quiet phases take half as long each (60)",
    )
    faults.set_defaults(func=cmd_bench_faults)

    soak = bench_sub.add_parser(
        "soak", help="the fault bench's cluster under mixed load and faults on a schedule; check it stays flat"
    )
    add_bench_cluster_args(soak)
    soak.add_argument("--out", type=Path, required=True, help="JSON results file")
    soak.add_argument("--minutes", type=positive_float, default=30.0, help="how long the load and faults run (30)")
    soak.add_argument("--fault-every-s", type=positive_float, default=120.0, help="seconds between faults (120)")
    soak.add_argument("--seed", type=int_between(0), default=0, help="draws the fault schedule (0)")
    soak.add_argument(
        "--kinds",
        default=",".join(CRASH_KINDS),
        help=f"crash kinds, comma-separated, of {', '.join(CRASH_KINDS)} (all)",
    )
    soak.add_argument("--sessions", type=positive_int, default=4, help="concurrent chat sessions (4)")
    soak.set_defaults(func=cmd_bench_soak)


def cmd_bench_faults(args: argparse.Namespace) -> int:
    from eval.bench_faults import FaultSettings, run_faults_bench

    scenarios = known_names("--scenarios", args.scenarios, SCENARIOS)
    kinds = known_names("--kinds", args.kinds, CRASH_KINDS)
    disk_kinds = known_names("--disk-faults", args.disk_faults, DISK_KINDS)
    config = load_from_args(args, engine_overrides(args))
    settings = FaultSettings(
        scenarios=scenarios,
        seed=args.seed,
        rounds=args.rounds,
        kinds=kinds,
        disk_kinds=disk_kinds,
        sessions=args.sessions,
        warmup_turns=args.warmup_turns,
        overload_s=args.overload_s,
    )
    return run_faults_bench(config, out=args.out, settings=settings)


def cmd_bench_soak(args: argparse.Namespace) -> int:
    from eval.bench_faults import FaultSettings, run_faults_bench

    kinds = known_names("--kinds", args.kinds, CRASH_KINDS)
    config = load_from_args(args, engine_overrides(args))
    settings = FaultSettings(
        scenarios=("soak",),
        seed=args.seed,
        kinds=kinds,
        sessions=args.sessions,
        soak_s=args.minutes * 60.0,
        fault_every_s=args.fault_every_s,
    )
    return run_faults_bench(config, out=args.out, settings=settings)
