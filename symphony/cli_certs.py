"""`symphony certs`: the cluster's CA and member certificates for mutual TLS (`cluster.tls`,
symphony.cluster_tls). `init` makes the CA and this host's member certificate ahead of a first
start; `issue` makes a member certificate for another host, to copy there with `ca.pem`."""

from __future__ import annotations

import argparse
from typing import Any

from symphony.cli_args import CliError, add_config_args, load_from_args


def add_certs_parser(sub: Any) -> None:
    certs = sub.add_parser("certs", help="the cluster's CA and member certificates (cluster.tls)")
    actions = certs.add_subparsers(dest="certs_command", metavar="ACTION", required=True)
    init = actions.add_parser("init", help="make the cluster's CA and this host's member certificate")
    issue = actions.add_parser("issue", help="make a member certificate for another host")
    issue.add_argument("name", help="the member's name (its files: NAME.pem, NAME.key)")
    init.add_argument("--hosts", default="", help="more addresses or names this host is dialled at, comma-separated")
    issue.add_argument("--hosts", required=True, help="the addresses or names that host is dialled at, comma-separated")
    for action in (init, issue):
        add_config_args(action)
        action.add_argument("--dir", help="where the certificates live (default cluster.tls_dir, else <home>/tls)")
        action.set_defaults(func=cmd_certs)


def cmd_certs(args: argparse.Namespace) -> int:
    from pathlib import Path

    from symphony.cluster_tls import (
        CA_CERT,
        MEMBER_CERT,
        config_hosts,
        ensure_tls,
        issue_member,
        tls_dir,
    )

    config = load_from_args(args)
    directory = Path(args.dir).expanduser() if args.dir else tls_dir(config)
    hosts = [host.strip() for host in args.hosts.split(",") if host.strip()]
    try:
        if args.certs_command == "init":
            if (directory / CA_CERT).exists():
                raise CliError(
                    f"{directory / CA_CERT} exists: a cluster has one CA (`symphony certs issue` adds members)"
                )
            ensure_tls(directory, [*config_hosts(config), *hosts])
            print(f"CA and member certificate in {directory} ({CA_CERT}, {MEMBER_CERT}; keys owner-only)")
        else:
            if not hosts:
                raise CliError("--hosts: name the addresses the host is dialled at (the loopback ones are added)")
            cert, key = issue_member(directory, args.name, hosts)
            print(
                f"member certificate {cert} and key {key}: on that host, put them in its TLS directory as "
                f"{MEMBER_CERT} and member.key (owner-only), beside a copy of {directory / CA_CERT} (never ca.key)"
            )
    except (OSError, ValueError) as exc:  # TLSSetupError is a ValueError
        raise CliError(f"certs {args.certs_command}: {exc}") from None
    return 0
