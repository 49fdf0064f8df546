"""`symphony bench faults`: its flags and handler (the run is `eval.bench_faults`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from eval.bench_args import add_bench_cluster_args
from symphony.cli_args import CliError, engine_overrides, int_between, load_from_args, positive_int

SCENARIO_NAMES = ("crashes", "attacks")
CRASH_KINDS = ("engine_kill", "node_kill", "node_stop", "replica_kill", "etcd_kill", "etcd_stop")


def _names(flag: str, known: tuple[str, ...]) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(p.strip() for p in text.split(",") if p.strip())
        unknown = [n for n in names if n not in known]
        if not names or unknown:
            raise argparse.ArgumentTypeError(
                f"{flag}: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(known)}"
            )
        return names

    return parse


def add_faults_parser(bench_sub: Any) -> None:
    faults = bench_sub.add_parser(
        "faults",
        help="crash and attack a private HA+TLS cluster under load; check outputs, sessions, recovery",
    )
    add_bench_cluster_args(faults)
    faults.add_argument("--out", type=Path, required=True, help="JSON results file")
    faults.add_argument(
        "--scenarios",
        type=_names("--scenarios", SCENARIO_NAMES),
        default=SCENARIO_NAMES,
        help=f"comma-separated, of {', '.join(SCENARIO_NAMES)} (all)",
    )
    faults.add_argument("--seed", type=int_between(0), default=0, help="draws the crash schedule (0)")
    faults.add_argument("--rounds", type=positive_int, default=2, help="passes over the crash kinds (2)")
    faults.add_argument(
        "--kinds",
        type=_names("--kinds", CRASH_KINDS),
        default=CRASH_KINDS,
        help=f"crash kinds, comma-separated, of {', '.join(CRASH_KINDS)} (all)",
    )
    faults.add_argument("--sessions", type=positive_int, default=4, help="concurrent chat sessions (4)")
    faults.add_argument(
        "--warmup-turns", type=positive_int, default=8, help="answered turns before the first fault (8)"
    )
    faults.set_defaults(func=cmd_bench_faults)


def cmd_bench_faults(args: argparse.Namespace) -> int:
    from eval.bench_faults import FaultSettings, run_faults_bench
    from eval.faults.crashes import KINDS

    if set(CRASH_KINDS) != set(KINDS):
        raise CliError("internal: the crash kinds listed by the CLI differ from eval.faults.crashes")
    config = load_from_args(args, engine_overrides(args))
    settings = FaultSettings(
        scenarios=args.scenarios,
        seed=args.seed,
        rounds=args.rounds,
        kinds=args.kinds,
        sessions=args.sessions,
        warmup_turns=args.warmup_turns,
    )
    return run_faults_bench(config, out=args.out, settings=settings)
