"""What every `symphony` command and the benchmark commands (`eval.cli`) share: argument types, the
configuration flags and their loading, and the one error a command reports to its user."""

from __future__ import annotations

import argparse
import os
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


def add_token_args(parser: argparse.ArgumentParser) -> None:
    """An admin command's token flags (`admin_token` reads them)."""
    given = parser.add_mutually_exclusive_group()
    given.add_argument(
        "--token-file", metavar="FILE", help="read the admin token from FILE ('-': stdin), out of sight of `ps`"
    )
    given.add_argument("--token", help="admin token (visible to `ps`: prefer --token-file or $SYMPHONY_ADMIN_TOKEN)")


def admin_token(args: argparse.Namespace, config: SymphonyConfig) -> str:
    """The admin token: --token-file, --token, $SYMPHONY_ADMIN_TOKEN, then scheduler.admin_token."""
    from symphony.config_secrets import ADMIN_TOKEN_ENV, read_token_file

    token = args.token
    if args.token_file is not None:
        try:
            token = read_token_file(args.token_file)
        except ValueError as exc:
            raise CliError(f"--token-file: {exc}") from None
    token = token or os.environ.get(ADMIN_TOKEN_ENV) or config.scheduler.admin_token
    if not token:
        raise CliError(f"no admin token: pass --token-file or --token, set ${ADMIN_TOKEN_ENV} or scheduler.admin_token")
    return str(token)


def refusal_message(exc: Any) -> str:
    """The message of an OpenAI-style error body an API call was refused with (else the error)."""
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
    return str(exc)
