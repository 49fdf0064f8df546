"""`symphony admin quotas`: a tenant's quotas at a running scheduler (symphony.tenant_quotas), until
it restarts (`[quotas]` is what a start reads)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from symphony.cli_args import CliError, add_config_args, add_token_args, admin_token, load_from_args, refusal_message


def add_quotas_parser(admin_sub: Any) -> None:
    quotas = admin_sub.add_parser("quotas", help="each tenant's rate limits, in-flight and queue caps, weight")
    actions = quotas.add_subparsers(dest="quotas_command", metavar="ACTION", required=True)
    change = actions.add_parser("set", help="change some of a tenant's limits (the others stay)")
    change.add_argument("--tenant", required=True, help="the tenant (as its API key names it)")
    change.add_argument(
        "limits", nargs="+", metavar="KEY=VALUE", help="as [quotas]: requests_per_s=5 max_inflight=8 ..."
    )
    clear = actions.add_parser("clear", help="a tenant back to the [quotas] defaults")
    clear.add_argument("--tenant", required=True, help="the tenant")
    shown = actions.add_parser("list", help="print the defaults and every tenant's own limits")
    for action in (change, clear, shown):
        add_config_args(action)
        action.add_argument("--url", help="scheduler URL (default from config)")
        add_token_args(action)
        action.set_defaults(func=cmd_admin_quotas)


def cmd_admin_quotas(args: argparse.Namespace) -> int:
    import openai

    from client_sdk import AdminClient
    from symphony.tenancy import tenant_name_error
    from symphony.tenant_quotas import TenantLimits, parse_overrides

    config = load_from_args(args)
    token = admin_token(args, config)
    changes: dict[str, float | int] | None = None
    if args.quotas_command == "set":
        if (invalid := tenant_name_error(args.tenant)) is not None or ":" in args.tenant:
            raise CliError(f"--tenant: {invalid or 'no colon in a tenant name'}")
        settings = ",".join(args.limits)  # KEY=VALUE arguments, or [quotas]' own comma-separated form
        try:  # checked here as [quotas] checks them, so a typo is named before anything is sent
            parsed = parse_overrides([f"{args.tenant}:{settings}"], TenantLimits())[args.tenant]
        except ValueError as exc:
            raise CliError(f"limits: {exc}") from None
        given = {part.partition("=")[0].strip() for part in settings.split(",")}
        changes = {key: getattr(parsed, key) for key in given}
    url = args.url or config.scheduler_url
    admin = AdminClient(url, token=token)
    try:
        if args.quotas_command == "list":
            print(json.dumps(admin.quotas(), indent=2))
        else:
            reply = admin.set_quotas(args.tenant, changes)
            print(f"tenant {args.tenant!r}: {json.dumps(reply['limits'])}")
    except openai.APIStatusError as exc:
        raise CliError(f"the scheduler refused: {exc.status_code} {refusal_message(exc)}") from None
    except openai.APIConnectionError:
        raise CliError(f"cannot reach the scheduler at {url}") from None
    finally:
        admin.close()
    return 0
