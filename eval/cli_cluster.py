"""`symphony bench cluster`'s command line: its options (registered by `eval.cli.register`), their
checks, and the workload and settings they make for `eval.bench_cluster.run_cluster_bench`."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from eval.bench_args import (
    add_bench_cluster_args,
    add_replay_args,
    check_human_timing,
    load_conversations,
    policy_names,
)
from symphony.cli_args import CliError, engine_overrides, load_from_args, positive_int

WORKLOAD_KINDS = ("sharegpt", "skewed", "shared-prefix")  # --workload keywords; anything else is a file
CHAT_POLICIES = ("symphony", "recompute", "sticky", "least_load", "prefix_trie")
OPEN_LOOP_POLICIES = ("symphony", "prefix_trie", "least_load", "recompute")  # shared-prefix, --trace


def token_range(text: str) -> tuple[int, int]:
    """LOW-HIGH (or one number N: N-N), positive whole numbers, LOW <= HIGH."""
    low, _, high = text.partition("-")
    try:
        bounds = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LOW-HIGH, whole numbers") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 1 <= LOW <= HIGH")
    return bounds


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive number")
    return value


def add_cluster_parser(bench_sub: Any) -> None:
    cluster = bench_sub.add_parser(
        "cluster", help="routing policies on a live 2-node cluster: chat users with typing advisories, or open loop"
    )
    add_bench_cluster_args(cluster)
    cluster.add_argument("--out", type=Path, required=True, help="JSON results file")
    cluster.add_argument("--plot", type=Path, metavar="PNG", help="also draw the comparison to this PNG")
    cluster.add_argument("--records", type=Path, metavar="DIR", help="also write every request (JSON, CSV) here")
    cluster.add_argument(
        "--policies",
        help=f"comma-separated; the first repeat runs them in this order (default: {','.join(CHAT_POLICIES)}; "
        f"with --workload shared-prefix or --trace: {','.join(OPEN_LOOP_POLICIES)})",
    )
    cluster.add_argument(
        "--repeats",
        type=positive_int,
        help="run the comparison this many times, rotating the policies' order (default: one repeat per policy)",
    )
    cluster.add_argument(
        "--seed", type=int, default=7, help="workload seed of the first repeat; repeat k: seed + k (7)"
    )
    add_replay_args(
        cluster,
        users=8,
        duration=90,
        duration_is="seconds of load per policy run",
        max_tokens=64,
        miss_rate=True,
        workload_help="a ShareGPT-format file, or sharegpt (the vendored sample), skewed (heavy and light users "
        "from it) or shared-prefix (open loop) (default: sharegpt)",
    )
    cluster.add_argument(
        "--typing-time-scale",
        type=float,
        help="scale typing alone by this (default: --time-scale); with --typing-time-scale 1, only the idle "
        "time before typing is compressed and advisories keep human-scale leads",
    )
    cluster.add_argument(
        "--min-turns", type=positive_int, default=2, help="replay only conversations with at least this many turns (2)"
    )
    cluster.add_argument("--max-turns", type=positive_int, default=8, help="cut conversations to this many turns (8)")
    skew = cluster.add_argument_group("--workload skewed")
    skew.add_argument("--heavy-share", type=float, default=0.25, help="share of the users who are heavy (0.25)")
    skew.add_argument(
        "--heavy-pace",
        type=float,
        default=0.25,
        help="a heavy user's reading and typing time over a light one's (0.25)",
    )
    skew.add_argument(
        "--heavy-history-tokens",
        type=positive_int,
        default=4096,
        help="a heavy session chains conversations up to this estimated history (4096)",
    )
    skew.add_argument("--light-turns", type=positive_int, default=2, help="turns of a light session at most (2)")
    shared = cluster.add_argument_group("--workload shared-prefix and --trace (open loop)")
    shared.add_argument("--groups", type=positive_int, default=16, help="shared-prefix groups (16)")
    shared.add_argument(
        "--prefix-tokens", type=token_range, default=(1500, 2000), help="a group's prefix length, LOW-HIGH (1500-2000)"
    )
    shared.add_argument(
        "--question-tokens", type=token_range, default=(100, 200), help="a request's own tokens, LOW-HIGH (100-200)"
    )
    shared.add_argument(
        "--rate", type=positive_float, default=1.0, help="mean arrivals per second: Poisson, or the trace sampled (1)"
    )
    shared.add_argument(
        "--trace",
        type=Path,
        metavar="FILE",
        help="replay this Mooncake trace live (its clock scaled by --time-scale, sessions sampled to --rate)",
    )
    shared.add_argument(
        "--trace-block-tokens", type=positive_int, default=64, help="tokens per trace hash id, down from 512 (64)"
    )
    cluster.set_defaults(func=cmd_bench_cluster)


def _kind(args: argparse.Namespace) -> str:
    if args.trace is not None:
        if args.workload is not None:
            raise CliError("--trace replaces --workload: give one of them")
        return "trace"
    return str(args.workload) if str(args.workload) in WORKLOAD_KINDS else "sharegpt"


def _workload(args: argparse.Namespace, kind: str, max_model_len: int) -> tuple[Any, dict[str, Any]]:
    """The live workload and the settings describing it (for the result's header)."""
    from eval.live_workloads import ChatWorkload, SharedPrefixWorkload, TraceWorkload
    from eval.open_loop import SharedPrefixSettings, TraceReplaySettings
    from eval.skewed import SkewSettings
    from eval.traces import load_mooncake
    from eval.workloads import HumanTiming

    if kind == "shared-prefix":
        shared = SharedPrefixSettings(args.groups, args.prefix_tokens, args.question_tokens, args.rate)
        if shared.prefix_tokens[1] + shared.question_tokens[1] + args.max_tokens > max_model_len:
            raise CliError(f"--prefix-tokens, --question-tokens and --max-tokens pass the context ({max_model_len})")
        return SharedPrefixWorkload(shared), {"workload": kind, "shared_prefix": dataclasses.asdict(shared)}
    if kind == "trace":
        try:
            trace = load_mooncake(args.trace)
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise CliError(f"--trace {exc}") from None
        if not trace:
            raise CliError(f"--trace {args.trace}: no request in the trace")
        replay = TraceReplaySettings(
            args.trace_block_tokens, args.time_scale, args.rate, max_model_len - args.max_tokens - 1
        )
        return TraceWorkload(trace, replay, str(args.trace)), {
            "workload": str(args.trace),
            "trace_replay": dataclasses.asdict(replay),
        }
    if args.min_turns > args.max_turns:
        raise CliError(f"--min-turns {args.min_turns} is above --max-turns {args.max_turns}")
    keyword = str(args.workload) in WORKLOAD_KINDS  # the vendored sample, replayed plain or skewed
    file_args = argparse.Namespace(**{**vars(args), "workload": None if keyword else args.workload})
    path, conversations = load_conversations(file_args, min_turns=args.min_turns, max_turns=args.max_turns)
    timing = HumanTiming(
        time_scale=args.time_scale, advisory_miss_rate=args.miss_rate, typing_time_scale=args.typing_time_scale
    )
    header: dict[str, Any] = {"workload": str(path), "conversations": len(conversations)}
    skew = None
    if kind == "skewed":
        try:
            skew = SkewSettings(args.heavy_share, args.heavy_pace, args.heavy_history_tokens, args.light_turns)
        except ValueError as exc:
            raise CliError(f"--workload skewed: {exc}") from None
        if 1.5 * skew.heavy_history_tokens + args.max_tokens > max_model_len:  # estimates run up to ~1.5x
            raise CliError(f"--heavy-history-tokens {skew.heavy_history_tokens}: too close to the context")
        header["skew"] = dataclasses.asdict(skew)
    return ChatWorkload(conversations, timing, skew), header


def cmd_bench_cluster(args: argparse.Namespace) -> int:
    from eval.bench_cluster import run_cluster_bench
    from eval.loadgen import LoadSettings

    check_human_timing(args)
    if args.typing_time_scale is not None and not 0 < args.typing_time_scale <= 10:
        raise CliError(f"--typing-time-scale {args.typing_time_scale}: expected a number in (0, 10]")
    kind = _kind(args)
    default = OPEN_LOOP_POLICIES if kind in ("shared-prefix", "trace") else CHAT_POLICIES
    policies = list(policy_names(args.policies or ",".join(default)))
    config = load_from_args(args, engine_overrides(args))
    workload, described = _workload(args, kind, config.engine.max_model_len)
    header = {
        "users": args.users,
        "duration_s": args.duration,
        "time_scale": args.time_scale,
        "typing_time_scale": args.typing_time_scale,
        "max_answer_tokens": args.max_tokens,
        "advisory_miss_rate": args.miss_rate,
        "seed": args.seed,
        "conversations": 0,
        **described,
    }
    return run_cluster_bench(
        config,
        out=args.out,
        policies=policies,
        repeats=args.repeats or len(policies),
        settings=LoadSettings(
            users=args.users, duration_s=args.duration, max_answer_tokens=args.max_tokens, seed=args.seed
        ),
        workload=workload,
        header=header,
        plot=args.plot,
        records_dir=args.records,
    )
