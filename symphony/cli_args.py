"""What every `symphony` command and the benchmark commands (`eval.cli`) share: argument types, the
configuration flags and their loading, and the one error a command reports to its user."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from symphony.config import SymphonyConfig, load_config
from symphony.logs import configure_logging


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status 2."""


def int_between(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in low..high (high None: no upper bound)."""
    wanted = (
        f"an integer from {low} to {high}"
        if high is not None
        else ("a positive integer" if low == 1 else f"an integer of at least {low}")
    )

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {value}")
        return value

    return parse


positive_int = int_between(1)


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, metavar="FILE", help="TOML configuration file")
    # Internal: children of `symphony up` get a fully resolved file and must not re-apply env vars.
    parser.add_argument("--effective-config", type=Path, help=argparse.SUPPRESS)


def load_from_args(args: argparse.Namespace, overrides: dict[str, dict[str, Any]] | None = None) -> SymphonyConfig:
    if getattr(args, "effective_config", None) is not None:
        config = load_config(args.effective_config, env={}, overrides=overrides)
    else:
        config = load_config(getattr(args, "config", None), overrides=overrides)
    configure_logging(config.logging.level, config.logging.format)
    return config


def engine_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    overrides: dict[str, dict[str, Any]] = {}
    if getattr(args, "model", None):
        overrides.setdefault("engine", {})["model"] = str(args.model)
    if getattr(args, "served_model_name", None):
        overrides.setdefault("engine", {})["served_model_name"] = args.served_model_name
    return overrides
