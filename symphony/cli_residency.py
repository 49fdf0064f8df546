"""`symphony admin residency`: a tenant's allowed regions, set at every process that enforces them
(each regional scheduler first, then the global layer). Regional schedulers keep the rule across a
restart; the global layer, until it restarts."""

from __future__ import annotations

import argparse
import json
from typing import Any

from symphony.cli_args import CliError, add_config_args, add_token_args, admin_token, load_from_args

ADMIN_READ_TIMEOUT_S = 10.0  # an admin call is a table update: a process slower than this is stuck


def add_residency_parser(admin_sub: Any) -> None:
    residency = admin_sub.add_parser("residency", help="the regions each tenant's requests and KV may enter")
    actions = residency.add_subparsers(dest="residency_command", metavar="ACTION", required=True)
    allow = actions.add_parser("set", help="allow a tenant these regions only")
    allow.add_argument("--tenant", required=True, help="the tenant (as its API key names it)")
    allow.add_argument("--regions", required=True, help="comma-separated region names")
    clear = actions.add_parser("clear", help="remove a tenant's rule: it may use every region")
    clear.add_argument("--tenant", required=True, help="the tenant")
    shown = actions.add_parser("list", help="print the rules every process holds")
    for action in (allow, clear, shown):
        add_config_args(action)
        add_token_args(action)
        action.set_defaults(func=cmd_admin_residency)


def cmd_admin_residency(args: argparse.Namespace) -> int:
    import httpx

    config = load_from_args(args)
    topology = config.topology()
    if topology is None:
        raise CliError("regions.layout is empty: residency rules are for a cluster of several regions")
    token = admin_token(args, config)
    regions: list[str] | None = None
    if args.residency_command == "set":
        regions = [name.strip() for name in args.regions.split(",") if name.strip()]
        unknown = [name for name in regions if name not in topology.names]
        if not regions or unknown:
            named = f"unknown {', '.join(unknown)}; " if unknown else ""
            raise CliError(f"--regions {args.regions!r}: {named}regions are {', '.join(topology.names)}")
    host = config.scheduler.host
    # The schedulers first: they refuse at once whatever reaches them; the global layer then
    # stops sending it.
    targets = {
        f"{region.name} scheduler": f"http://{host}:{config.regions.scheduler_port_base + region.index}"
        for region in topology.regions
    }
    targets["global layer"] = f"http://{host}:{config.scheduler.port}"
    headers = {"Authorization": f"Bearer {token}"}
    timeout = httpx.Timeout(ADMIN_READ_TIMEOUT_S, connect=config.scheduler.connect_timeout_s)
    done: list[str] = []
    failed: list[str] = []
    listed: dict[str, Any] = {}
    # Every process is asked, whatever the others answered: a process that missed the change is
    # named, to be asked again (`list` shows what each holds).
    with httpx.Client(timeout=timeout, headers=headers) as client:
        for name, url in targets.items():
            try:
                if args.residency_command == "list":
                    reply = client.get(url + "/admin/v1/residency")
                else:
                    reply = client.put(url + "/admin/v1/residency", json={"tenant": args.tenant, "regions": regions})
                if reply.status_code == 200:
                    rules = reply.json()["rules"] if args.residency_command == "list" else None
                    listed[name] = rules
                    done.append(name)
                    continue
                why = f"{reply.status_code} {_message(reply)}"
            except httpx.HTTPError as exc:
                why = f"unreachable ({type(exc).__name__})"
            except (ValueError, KeyError, TypeError):
                why = "answered 200 with no rules"
            failed.append(f"the {name} at {url}: {why}")
            listed[name] = None
    if args.residency_command == "list":
        print(json.dumps(listed, indent=2))
    elif done:
        allowed = ", ".join(regions) if regions is not None else "every region"
        print(f"tenant {args.tenant!r} may use {allowed} (set at {', '.join(done)})")
    if failed:
        raise CliError("not every process took it; run it again once they answer: " + "; ".join(failed))
    return 0


def _message(reply: Any) -> str:
    try:
        return str(reply.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return reply.text[:200]
