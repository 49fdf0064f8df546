"""`symphony bench ...`: the benchmark commands, registered into the `symphony` parser by
`register`. Heavy imports happen inside each handler, so `symphony --help` answers at once."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from eval.bench_args import (
    add_bench_cluster_args,
    add_replay_args,
    check_human_timing,
    fill_defaults,
    load_conversations,
    policy_names,
    refuse_given,
    workload_file,
)
from eval.cli_cluster import add_cluster_parser
from eval.cli_faults import add_faults_parser
from eval.cli_regions import SIM_REGIONS_DEFAULTS, add_regions_parser, add_sim_regions_args, cmd_bench_sim_regions
from symphony.cli_args import (
    CliError,
    engine_overrides,
    int_between,
    load_from_args,
    positive_int,
)

# `bench sim`'s flags that every scenario but regions reads, and their defaults.
SIM_DEFAULTS: dict[str, Any] = {
    "nodes": 8,
    "max_users": 65_536,
    "refine": 2,
    "no_prefix_cache": False,
    "tpot_bound": 1.15,
    "agent_steps": 40,
    "agent_prefix_tokens": 2000,
    "agent_output_tokens": 182,
    "agent_tool_tokens": 400,
    "agent_tool_s": 5.0,
}


def register(sub: Any) -> None:
    """Add the `bench` command and its subcommands to `sub` (the `symphony` parser's subparsers)."""
    bench = sub.add_parser("bench", help="benchmarks (write JSON)")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    proxy = bench_sub.add_parser("proxy", help="TTFT through the scheduler vs straight to the engine")
    add_bench_cluster_args(proxy)
    proxy.add_argument("--out", type=Path, required=True, help="JSON results file")
    proxy.add_argument("--plot", type=Path, metavar="PNG", help="also draw TTFT distributions to this PNG")
    proxy.add_argument("--concurrency", type=positive_int, default=16, help="concurrent streaming chats (16)")
    proxy.add_argument("--rounds", type=positive_int, default=100, help="rounds per path (100)")
    proxy.add_argument("--max-tokens", type=positive_int, default=4, help="tokens per answer (4)")
    proxy.add_argument(
        "--prompt-tokens", type=int_between(0), default=2000, help="context before each question, in tokens (2000)"
    )
    proxy.add_argument(
        "--cpu-requests",
        type=int_between(0),
        default=2000,
        help="requests for the scheduler's CPU per request against a no-op engine (2000; 0: skip)",
    )
    proxy.add_argument(
        "--cpu-shared-tokens",
        type=int_between(0),
        default=0,
        help="of --prompt-tokens, a system prompt all the CPU part's conversations share (0: none)",
    )
    proxy.add_argument("--cpu-only", action="store_true", help="only the CPU part: no engine, no live rounds")
    proxy.add_argument("--scheduler-url", help="use a running scheduler instead of starting a 1-node cluster")
    proxy.add_argument("--engine-url", help="the engine behind --scheduler-url (required with it)")
    proxy.set_defaults(func=cmd_bench_proxy)
    tiers = bench_sub.add_parser("tiers", help="KV tier throughput (DRAM, SSD, peer) against plain bounds")
    tiers.add_argument("--out", type=Path, required=True, help="JSON results file")
    tiers.add_argument("--plot", type=Path, metavar="PNG", help="also draw a bar chart to this PNG")
    tiers.add_argument("--tokens", type=positive_int, default=2048, help="session length in tokens (2048)")
    tiers.add_argument("--trials", type=positive_int, default=9, help="interleaved trials; keys are medians (9)")
    tiers.add_argument("--device", default="cpu", help="HBM tier device: cpu or cuda (cpu)")
    tiers.add_argument("--work-dir", type=Path, help="where the SSD tier's files go (default: the temp dir)")
    tiers.set_defaults(func=cmd_bench_tiers)
    resume = bench_sub.add_parser(
        "resume", help="TTFT of a resumed turn by where its history's KV is (starts a private 2-node cluster)"
    )
    add_bench_cluster_args(resume)
    resume.add_argument("--out", type=Path, required=True, help="JSON results file")
    resume.add_argument("--plot", type=Path, metavar="PNG", help="also draw a bar chart to this PNG")
    resume.add_argument(
        "--context-tokens",
        type=positive_int,
        default=2048,
        help="history length in tokens, a multiple of the block size (2048)",
    )
    resume.add_argument("--trials", type=positive_int, default=5, help="trials per path, interleaved (5)")
    resume.add_argument(
        "--gap-ms",
        type=positive_int,
        default=1000,
        help="think time between a history's turn and the resumed turn, every path alike (1000)",
    )
    resume.add_argument(
        "--conversations",
        type=int_between(0, 80),
        default=0,
        help="also check correctness on this many MT-bench two-turn conversations (of 80): "
        "every path must give the same greedy tokens, logprobs within 1e-2 (0: skip)",
    )
    resume.set_defaults(func=cmd_bench_resume)
    add_cluster_parser(bench_sub)
    add_regions_parser(bench_sub)
    add_faults_parser(bench_sub)
    route = bench_sub.add_parser("route", help="cost of one routing decision per policy at fleet scale (no cluster)")
    route.add_argument("--out", type=Path, required=True, help="JSON results file")
    route.add_argument("--plot", type=Path, metavar="PNG", help="also draw a bar chart to this PNG")
    route.add_argument("--nodes", type=positive_int, default=64, help="nodes in the fleet (64)")
    route.add_argument("--sessions", type=positive_int, default=100_000, help="sessions routed first (100000)")
    route.add_argument("--tenants", type=positive_int, default=100, help="tenants the sessions belong to (100)")
    route.add_argument("--requests", type=positive_int, default=20_000, help="timed decisions per policy (20000)")
    route.add_argument(
        "--index-blocks",
        type=int_between(0),
        help="blocks the nodes' snapshots put in the cluster KV index, for policies that locate KV "
        "(default: 100 per session, 10M at 100000; 0: no index, they route on the session table's hints)",
    )
    route.add_argument(
        "--policies",
        default="symphony,least_load,round_robin,consistent_hash,sticky,prefix_trie",
        help="comma-separated (default: %(default)s)",
    )
    route.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    route.set_defaults(func=cmd_bench_route)
    calibrate = bench_sub.add_parser(
        "calibrate",
        help="fit the simulator's engine model to this host's live engine (starts a private 2-node cluster)",
    )
    add_bench_cluster_args(calibrate)
    calibrate.add_argument("--out", type=Path, required=True, help="JSON results file (samples and fit)")
    calibrate.add_argument(
        "--preset-out",
        type=Path,
        default=Path("local-preset.json"),
        metavar="JSON",
        help="where the fitted preset goes, for bench sim/validate --preset-file (%(default)s)",
    )
    calibrate.add_argument(
        "--profile-out",
        type=Path,
        metavar="JSON",
        help="where the scheduler's cost profile goes (default: scheduler.cost_profile, <home>/cost-profile.json)",
    )
    calibrate.set_defaults(func=cmd_bench_calibrate)
    validate = bench_sub.add_parser(
        "validate", help="the simulator against the live 2-node cluster on the same requests: sim_vs_live_error"
    )
    add_bench_cluster_args(validate)
    validate.add_argument("--out", type=Path, required=True, help="JSON results file")
    validate.add_argument(
        "--preset-file",
        type=Path,
        metavar="JSON",
        help="a preset from bench calibrate (default: calibrate first, on the same cluster)",
    )
    validate.add_argument(
        "--preset-out",
        type=Path,
        default=Path("local-preset.json"),
        metavar="JSON",
        help="where a calibration made here goes (%(default)s)",
    )
    validate.add_argument(
        "--records", type=Path, metavar="DIR", help="also write the live run's requests (JSON, CSV) here"
    )
    validate.add_argument("--policy", default="recompute", help="the routing policy both runs use (recompute)")
    add_replay_args(validate, users=4, duration=120, duration_is="seconds of live load", max_tokens=32, miss_rate=False)
    validate.set_defaults(func=cmd_bench_validate)
    report = bench_sub.add_parser("report", help="a Markdown summary with PNG plots of every result file in DIR")
    report.add_argument("directory", type=Path, metavar="DIR", help="where the bench ... --out JSON files are")
    report.set_defaults(func=cmd_bench_report)
    sim = bench_sub.add_parser("sim", help="paper-scale scenarios on the cluster simulator (no cluster)")
    sim.add_argument(
        "--scenario",
        required=True,
        help="users, missed_advisories, imbalance, priority, agents (--users: projects), trace "
        "(--workload: a Mooncake .jsonl or Azure .csv trace, --time-scale its clock) or regions",
    )
    sim.add_argument("--out", type=Path, required=True, help="JSON results file")
    sim.add_argument("--plot", type=Path, metavar="PNG", help="also draw the scenario to this PNG")
    sim.add_argument(
        "--preset",
        default="a100-llama3.1-8b",
        help="engine and link constants: a100-llama3.1-8b (default) or l4-llama3.1-8b",
    )
    sim.add_argument(
        "--preset-file",
        type=Path,
        metavar="JSON",
        help="engine and link constants from `symphony bench calibrate` (instead of --preset)",
    )
    # Flags one family of scenarios reads default to None, so that the other refuses them when given
    # (`refuse_given`) rather than ignoring them; each family fills in its own defaults.
    sim.add_argument("--nodes", type=positive_int, help=f"engines ({SIM_DEFAULTS['nodes']})")
    sim.add_argument(
        "--users",
        help="user counts, comma-separated; users: where the search starts (by workload: sharegpt "
        "64,128,256,512,1024; mooncake 32,64,128,256; agentic 4,8,16,32); one-point scenarios take the first (64)",
    )
    sim.add_argument(
        "--policies",
        help="comma-separated (symphony,recompute,sticky; regions: the global policies, all five by default)",
    )
    sim.add_argument(
        "--duration",
        type=positive_int,
        help="simulated seconds per point (600; --scenario users --workload mooncake: 3600, the trace's hour; "
        "regions: 360, the simulated day)",
    )
    sim.add_argument("--miss-rate", type=float, default=0.0, help="share of turns without an advisory (0)")
    sim.add_argument(
        "--time-scale",
        type=float,
        help="human reading and typing time, scaled (1: real human speeds; regions: 0.1)",
    )
    sim.add_argument(
        "--workload",
        help="users: sharegpt (default), mooncake (--trace's sessions) or agentic (tool-calling agents), or a "
        "ShareGPT-format file; trace: a trace file; the others: a ShareGPT-format file (default: the vendored sample)",
    )
    sim.add_argument(
        "--trace",
        type=Path,
        help="the Mooncake trace --workload mooncake replays (default: the vendored 300-request sample; "
        "the full one: /work/shared/data/mooncake/conversation_trace.jsonl)",
    )
    sim.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    search = sim.add_argument_group("--scenario users: the search for each policy's limit")
    search.add_argument("--max-users", type=positive_int, help="no more users than this per point (65536)")
    search.add_argument("--refine", type=int_between(0, 10), help="bisections of each policy's crossing (2)")
    search.add_argument(
        "--no-prefix-cache",
        action="store_true",
        default=None,
        help="engines without vLLM's prefix caching: recompute then finds nothing of a history (default: on)",
    )
    search.add_argument(
        "--tpot-bound", type=float, help="the bound: this many times recompute's mean TPOT at the fewest users (1.15)"
    )
    agent = sim.add_argument_group("--workload agentic: one task's shape (eval/sim/tool_agents.py cites the defaults)")
    agent.add_argument("--agent-steps", type=positive_int, help="LLM calls per task (40)")
    agent.add_argument("--agent-prefix-tokens", type=positive_int, help="the opening prompt (2000)")
    agent.add_argument("--agent-output-tokens", type=positive_int, help="answer per call (182)")
    agent.add_argument("--agent-tool-tokens", type=int_between(0), help="tool output per call (400)")
    agent.add_argument("--agent-tool-s", type=float, help="seconds a tool runs between calls (5)")
    add_sim_regions_args(sim)
    sim.set_defaults(func=cmd_bench_sim)


def cmd_bench_proxy(args: argparse.Namespace) -> int:
    from eval.bench_proxy import run_proxy_bench

    if bool(args.scheduler_url) != bool(args.engine_url):
        raise CliError("--scheduler-url and --engine-url go together (the scheduler must front that one engine)")
    if args.cpu_shared_tokens > args.prompt_tokens:
        raise CliError("--cpu-shared-tokens is a part of --prompt-tokens: it cannot be larger")
    if args.cpu_only and not args.cpu_requests:
        raise CliError("--cpu-only with --cpu-requests 0 measures nothing")
    config = load_from_args(args, engine_overrides(args))
    return run_proxy_bench(
        config,
        out=args.out,
        concurrency=args.concurrency,
        rounds=args.rounds,
        max_tokens=args.max_tokens,
        prompt_tokens=args.prompt_tokens,
        cpu_requests=args.cpu_requests,
        scheduler_url=args.scheduler_url,
        engine_url=args.engine_url,
        plot=args.plot,
        cpu_only=args.cpu_only,
        cpu_shared_tokens=args.cpu_shared_tokens,
    )


def cmd_bench_calibrate(args: argparse.Namespace) -> int:
    from eval.bench_calibrate import run_calibrate_bench

    config = load_from_args(args, engine_overrides(args))
    profile_out = args.profile_out or config.cost_profile_path
    return run_calibrate_bench(config, out=args.out, preset_out=args.preset_out, profile_out=profile_out)


def cmd_bench_validate(args: argparse.Namespace) -> int:
    from eval.bench_calibrate import run_validate_bench
    from eval.sim.calibration import load_preset
    from scheduler.policies import POLICIES

    if args.policy not in POLICIES:
        raise CliError(f"--policy {args.policy!r}: known policies are {', '.join(POLICIES)}")
    check_human_timing(args)
    if args.preset_file is not None:
        try:
            load_preset(args.preset_file)
        except ValueError as exc:
            raise CliError(f"--preset-file {exc}") from None
    workload, conversations = load_conversations(args, min_turns=2, max_turns=8)
    config = load_from_args(args, engine_overrides(args))
    return run_validate_bench(
        config,
        out=args.out,
        policy=args.policy,
        users=args.users,
        duration_s=args.duration,
        time_scale=args.time_scale,
        max_answer_tokens=args.max_tokens,
        workload=workload,
        conversations=conversations,
        preset_file=args.preset_file,
        preset_out=args.preset_out,
        records_dir=args.records,
    )


def cmd_bench_report(args: argparse.Namespace) -> int:
    from eval.report import build_report

    if not args.directory.is_dir():
        raise CliError(f"DIR {args.directory}: not a directory")
    print(f"wrote {build_report(args.directory)}")
    return 0


def cmd_bench_route(args: argparse.Namespace) -> int:
    from eval.bench_route import BLOCKS_PER_SESSION, run_route_bench

    policies = policy_names(args.policies)
    run_route_bench(
        out=args.out,
        nodes=args.nodes,
        sessions=args.sessions,
        tenants=args.tenants,
        requests=args.requests,
        policies=policies,
        index_blocks=args.index_blocks if args.index_blocks is not None else BLOCKS_PER_SESSION * args.sessions,
        seed=args.seed,
        plot=args.plot,
    )
    return 0


def cmd_bench_sim(args: argparse.Namespace) -> int:
    from eval.bench_sim import SCENARIOS, run_sim_bench
    from eval.sim.calibration import load_preset
    from eval.sim.presets import PRESETS
    from eval.sim.tool_agents import AgentShape
    from eval.sim.users_scenario import WORKLOADS
    from eval.traces import MOONCAKE_SAMPLE

    if args.scenario not in (*SCENARIOS, "regions"):
        raise CliError(f"--scenario {args.scenario!r}: known scenarios are {', '.join(SCENARIOS)}, regions")
    if args.preset_file is not None:
        try:
            preset = load_preset(args.preset_file)
        except ValueError as exc:
            raise CliError(f"--preset-file {exc}") from None
    elif args.preset in PRESETS:
        preset = PRESETS[args.preset]
    else:
        raise CliError(f"--preset {args.preset!r}: known presets are {', '.join(PRESETS)}")
    if args.scenario == "regions":
        refuse_given(args, SIM_DEFAULTS, "not read by --scenario regions")
        refuse_given(args, ("users", "trace"), "not read by --scenario regions (users arrive at --arrivals-per-min)")
        return cmd_bench_sim_regions(args, preset)
    refuse_given(args, SIM_REGIONS_DEFAULTS, f"read only by --scenario regions, not {args.scenario}")
    fill_defaults(args, SIM_DEFAULTS)
    if args.time_scale is None:
        args.time_scale = 1.0
    policies = policy_names("symphony,recompute,sticky" if args.policies is None else args.policies)
    users = None
    if args.users is not None:
        try:
            users = tuple(int(u) for u in args.users.split(",") if u.strip())
        except ValueError:
            raise CliError(f"--users {args.users!r}: expected comma-separated whole numbers") from None
        if not users or min(users) < 1:
            raise CliError(f"--users {args.users!r}: expected positive user counts")
    check_human_timing(args)
    named = args.workload if args.workload in WORKLOADS else None
    if args.workload is not None and named is None:
        args.workload = Path(args.workload)
    if named is not None and args.scenario != "users":
        raise CliError(f"--workload {named}: a named workload is for --scenario users; give a file")
    if not args.tpot_bound > 1:
        raise CliError(f"--tpot-bound {args.tpot_bound}: expected a factor above 1")
    if args.scenario == "users" and "recompute" not in policies:
        raise CliError("--scenario users: --policies must include recompute, the baseline of every ratio")
    trace = None
    conversations: list[Any] = []
    if args.scenario == "trace":
        if args.workload is None:
            raise CliError("--scenario trace needs --workload: a Mooncake trace (.jsonl) or Azure's (.csv)")
        workload = workload_file(args)
        trace = _trace(workload, args.time_scale)
    elif named == "mooncake":
        workload = args.trace or MOONCAKE_SAMPLE
        if workload.suffix == ".csv":
            raise CliError(f"--trace {workload}: the mooncake workload needs a Mooncake trace (.jsonl, with hash ids)")
        trace = _trace(workload, 1.0, flag="--trace")  # replayed closed loop: --time-scale scales think time
    elif named == "agentic":
        workload = Path("agentic")
    else:
        if named == "sharegpt":
            args.workload = None
        workload, conversations = load_conversations(args, min_turns=2, max_turns=8)
    try:
        agent = AgentShape(
            prefix_tokens=args.agent_prefix_tokens,
            steps=args.agent_steps,
            output_tokens=args.agent_output_tokens,
            tool_tokens=args.agent_tool_tokens,
            tool_s=args.agent_tool_s,
        )
    except ValueError as exc:
        raise CliError(f"--agent-*: {exc}") from None
    run_sim_bench(
        out=args.out,
        scenario=args.scenario,
        workload=workload,
        conversations=conversations,
        preset=preset,
        trace=trace,
        nodes=args.nodes,
        users=users,
        policies=policies,
        users_workload_name=named or "sharegpt",
        agent=agent,
        max_users=args.max_users,
        refine=args.refine,
        tpot_bound=args.tpot_bound,
        prefix_caching=not args.no_prefix_cache,
        duration_s=args.duration,
        miss_rate=args.miss_rate,
        time_scale=args.time_scale,
        seed=args.seed,
        plot=args.plot,
    )
    return 0


def _trace(path: Path, time_scale: float, flag: str = "--workload") -> list[Any]:
    from eval.traces import load_azure, load_mooncake

    loader = load_azure if path.suffix == ".csv" else load_mooncake
    try:
        requests = loader(path, time_scale=time_scale)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CliError(f"{flag} {exc}") from None
    if not requests:
        raise CliError(f"{flag} {path}: no request in the trace")
    return requests


def cmd_bench_resume(args: argparse.Namespace) -> int:
    from eval.bench_resume import run_resume_bench

    config = load_from_args(args, engine_overrides(args))
    if args.context_tokens % config.engine.block_size:
        raise CliError(
            f"--context-tokens {args.context_tokens}: must be a multiple of engine.block_size "
            f"({config.engine.block_size}), so the whole history is loadable"
        )
    return run_resume_bench(
        config,
        out=args.out,
        context_tokens=args.context_tokens,
        trials=args.trials,
        gap_s=args.gap_ms / 1000.0,
        conversations=args.conversations,
        plot=args.plot,
    )


def cmd_bench_tiers(args: argparse.Namespace) -> int:
    # Before torch loads its OpenMP runtime, which reads this once: by default the team that ran the
    # memcpy bound spins on the other core for milliseconds after it, and the store's copy lanes that
    # the bench times next get one core out of two (docs/benchmarks.md#bench-tiers). An
    # OMP_WAIT_POLICY already set is kept.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from eval.bench_tiers import run_tiers_bench

    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise CliError(f"--device {args.device!r}: expected cpu or cuda[:N]")
    if args.work_dir is not None and not args.work_dir.is_dir():
        raise CliError(f"--work-dir {args.work_dir}: not a directory")
    run_tiers_bench(
        out=args.out, tokens=args.tokens, trials=args.trials, device=args.device, work_dir=args.work_dir, plot=args.plot
    )
    return 0
