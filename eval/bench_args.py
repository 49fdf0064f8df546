"""Command-line arguments and checks that several `symphony bench` commands share (`eval.cli`,
`eval.cli_cluster`): the private cluster's configuration, the ShareGPT replay's options, policy
names, the --workload file. Heavy imports happen inside the checks that need them."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from symphony.cli_args import CliError, add_config_args, positive_int


def add_replay_args(
    parser: argparse.ArgumentParser,
    *,
    users: int,
    duration: int,
    duration_is: str,
    max_tokens: int,
    miss_rate: bool,
    workload_help: str = "ShareGPT-format conversations (default: the vendored sample, eval/data/sharegpt)",
) -> None:
    """The replay of ShareGPT users on a live cluster that `bench cluster` and `bench validate` share
    (`--miss-rate` hidden where the comparison needs every advisory)."""
    parser.add_argument("--users", type=positive_int, default=users, help=f"simulated users ({users})")
    parser.add_argument("--duration", type=positive_int, default=duration, help=f"{duration_is} ({duration})")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=0.05,
        help="human reading and typing time, scaled (0.05: a minute becomes 3 s)",
    )
    parser.add_argument("--max-tokens", type=positive_int, default=max_tokens, help=f"answer length cap ({max_tokens})")
    parser.add_argument(
        "--miss-rate",
        type=float,
        default=0.0,
        help="share of turns without an advisory (0)" if miss_rate else argparse.SUPPRESS,
    )
    parser.add_argument("--workload", type=Path, help=workload_help)


def refuse_given(args: argparse.Namespace, names: Iterable[str], why: str) -> None:
    """A CliError naming each flag of `names` (attribute names) given on the command line (not None)."""
    given = [f"--{name.replace('_', '-')}" for name in names if getattr(args, name, None) is not None]
    if given:
        raise CliError(f"{', '.join(given)}: {why}")


def fill_defaults(args: argparse.Namespace, defaults: Mapping[str, Any]) -> None:
    """Each of `defaults` not given on the command line (None) takes its default."""
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def add_bench_cluster_args(parser: argparse.ArgumentParser) -> None:
    """What every benchmark that starts a private cluster takes: its configuration and model."""
    add_config_args(parser)
    parser.add_argument("--model", type=Path, metavar="PATH", help="serve this local HF model directory")
    parser.add_argument("--served-model-name", help=argparse.SUPPRESS)


def known_names(flag: str, text: str, known: Iterable[str]) -> tuple[str, ...]:
    """`flag`'s value: comma-separated names, at least one, each of `known`."""
    choices = tuple(known)
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [n for n in names if n not in choices]
    if not names or unknown:
        raise CliError(f"{flag}: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(choices)}")
    return names


def policy_names(text: str) -> tuple[str, ...]:
    """--policies: comma-separated names of routing policies, all known."""
    from scheduler.policies import POLICIES

    return known_names("--policies", text, POLICIES)


def check_human_timing(args: argparse.Namespace) -> None:
    if not 0 < args.time_scale <= 10:
        raise CliError(f"--time-scale {args.time_scale}: expected a number in (0, 10]")
    if not 0 <= args.miss_rate <= 1:
        raise CliError(f"--miss-rate {args.miss_rate}: expected a share in [0, 1]")


def workload_file(args: argparse.Namespace) -> Path:
    """--workload, or the vendored ShareGPT sample; it must exist."""
    from eval.workloads import SHAREGPT_SAMPLE

    workload: Path = args.workload or SHAREGPT_SAMPLE
    if not workload.is_file():
        raise CliError(f"--workload {workload}: no such file")
    return workload


def load_conversations(args: argparse.Namespace, *, min_turns: int, max_turns: int) -> tuple[Path, list[Any]]:
    """The --workload file and its conversations of min_turns..max_turns user turns (cut to max_turns)."""
    from eval.workloads import load_sharegpt

    workload = workload_file(args)
    try:
        conversations = load_sharegpt(workload, min_turns=min_turns, max_turns=max_turns)
    except ValueError as exc:
        raise CliError(f"--workload {exc}") from None
    if not conversations:
        raise CliError(f"--workload {workload}: no conversation has {min_turns} user turns or more")
    return workload, conversations
