"""`symphony bench calibrate` and `symphony bench validate`: the simulator against the live engine.

calibrate: on a private local 2-node cluster (the engines as `symphony up` runs them, one core each
here), the engines are probed directly through their OpenAI-compatible completions endpoints,
with prompts of random token ids (no cache holds them) and `ignore_eos` (answers of exact length):

- prefill: one request at a time, prompts of several lengths, `max_tokens=1`: time to first token;
- decode: 1 to 8 requests started together, short and long prompts, 48 output tokens: their time
  per output token once decoding;

on one engine alone (the engine model's costs) and on each engine beside busy neighbours (the
others decoding a steady background load: the model's neighbour slowdown), in interleaved rounds.

`eval.sim.calibration` fits the engine model to those samples; with the engine's KV capacity (from its
`vllm:cache_config_info` metric) and SmolLM2's KV geometry over the measured peer link, that is the
`local` preset, written as a JSON file the simulator reads (`bench sim --preset-file`). The same fit,
with tier loads and node-to-node links measured by `eval.calibrate_costs`, is the scheduler's cost
profile (`scheduler.cost_profile`), written where `scheduler.cost_profile` says.

validate: the same cluster then serves a ShareGPT replay through one policy (`bench cluster`'s load
generator: human timing, advisories); the simulator replays the very requests the live run sent
(open loop: each at the time it was sent, with its measured prompt and answer lengths) on two
engines of the calibrated preset, routed by the same policy object. Mean TTFT, mean TPOT and output
throughput are compared; `sim_vs_live_error` is the largest relative error of the three.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import shutil
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from eval.bench_cluster import bench_cluster_config, measure_policies, on_private_cluster
from eval.calibrate_costs import build_profile, check_queue, measure_links, measure_tier_loads, tier_costs
from eval.loadgen import LoadSettings, RequestRecord
from eval.results import write_result
from eval.sim.calibration import DecodeSample, PrefillSample, fit_engine, fit_slowdown, load_preset, save_preset
from eval.sim.cluster import ClusterSim, LinkModel, SimResult
from eval.sim.presets import Preset, sim_policy
from eval.sim.scenarios import summarize
from eval.sim.turns import Turn
from eval.workloads import Conversation, HumanTiming
from scheduler.cost_profile import CostProfile, problems, to_dict, to_json
from symphony.config import SymphonyConfig
from symphony.kv_geometry import geometry_from_model_dir, smollm2_geometry
from symphony.kv_transfer import TENANT_PARAM, params_key, sign_params
from symphony.models import ModelInfo, fetch_default_model, resolve_model
from symphony.tenancy import engine_key


@dataclass(frozen=True, slots=True)
class ProbePlan:
    prefill_tokens: tuple[int, ...] = (64, 256, 512, 1024)
    decode_points: tuple[tuple[int, int], ...] = (  # (requests together, prompt tokens each)
        (1, 32),
        (2, 32),
        (4, 32),
        (8, 32),
        (1, 512),
        (1, 1024),
        (4, 256),
    )
    rounds: int = 3  # each round probes alone, then beside busy neighbours (see `calibrate`)
    output_tokens: int = 48


FULL_PLAN = ProbePlan()
TOKEN_ID_RANGE = (1_000, 40_000)  # ordinary vocabulary entries of SmolLM2 (49,152), no special tokens
CALIBRATION_TENANT = "calibrate"  # the probes' tenant: their KV is nobody's
# Node-to-node KV moves in the local preset: of the order of a `bench tiers` peer pull on one host
# (docs/benchmarks.md#bench-calibrate-and-bench-validate).
LOCAL_LINK_GBPS = 1.0
LOCAL_LINK_RTT_MS = 0.2
VALIDATION_BOUND = 0.2  # the bar: within 20% of the live cluster
MAX_NUM_SEQS = 128  # vLLM CPU's default max_num_seqs for its OpenAI server (GPUs: 256), which `symphony up` keeps
BACKGROUND_REQUESTS = 2  # a neighbour's decoding while an engine is probed beside it
# Short enough that a neighbour finishes its batch soon after it is told to stop: an aborted stream
# keeps its engine busy into the next alone probe (docs/benchmarks.md#bench-calibrate-and-bench-validate).
BACKGROUND_TOKENS = 64


@dataclass(frozen=True, slots=True)
class _Streamed:
    first_ms: float  # from the send to the first token
    last_ms: float  # to the last one
    tokens: int


async def _stream(client: openai.AsyncOpenAI, model: str, prompt: list[int], max_tokens: int, key: bytes) -> _Streamed:
    """Send one completion and time its stream. Tokens are counted from each chunk's logprobs: a
    chunk can carry several tokens when the server falls behind the engine. Its params are signed
    under `key`, as the scheduler's are: the connector does the work of a routed request."""
    params = sign_params({TENANT_PARAM: CALIBRATION_TENANT}, model, key, time.time())
    started = time.perf_counter()
    first = last = 0.0
    tokens = 0
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        logprobs=1,
        extra_body={"ignore_eos": True, "kv_transfer_params": params},
    )
    async for chunk in stream:
        if not chunk.choices or chunk.choices[0].logprobs is None:
            continue
        count = len(chunk.choices[0].logprobs.tokens or [])
        if not count:
            continue
        last = (time.perf_counter() - started) * 1000
        first = first or last
        tokens += count
    if tokens < max_tokens:
        raise RuntimeError(f"the engine streamed {tokens} tokens where {max_tokens} were asked for")
    return _Streamed(first, last, tokens)


class _EngineProbe:
    """One engine's OpenAI client and its own stream of random prompts."""

    def __init__(self, base_url: str, model: str, seed: int, signing: bytes, key: str) -> None:
        self.base_url = base_url
        self.model = model
        self.signing = signing
        self._rng = random.Random(seed)
        self.client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=key, timeout=600.0, max_retries=0)

    def prompt(self, tokens: int) -> list[int]:
        return [self._rng.randrange(*TOKEN_ID_RANGE) for _ in range(tokens)]

    async def stream(self, tokens: int, max_tokens: int) -> _Streamed:
        """One probe, timed from its own send. The engine's server closes a keep-alive connection
        idle for 5 s; a probe sent on one as it closes fails with a read error before the server
        sees it, so a probe whose connection fails is sent again, once, on a fresh prompt and a
        fresh clock."""
        try:
            return await _stream(self.client, self.model, self.prompt(tokens), max_tokens, self.signing)
        except openai.APIConnectionError as exc:
            print(f"calibrate {self.base_url}: probe connection failed ({exc}); sending it again", file=sys.stderr)
            return await _stream(self.client, self.model, self.prompt(tokens), max_tokens, self.signing)

    async def warm(self, plan: ProbePlan) -> None:
        """Run each probe's prompt length and the largest batch once, unmeasured: an engine's first
        probes of a new shape pay one-time allocations and kernel choices
        (docs/benchmarks.md#bench-calibrate-and-bench-validate)."""
        for tokens in plan.prefill_tokens:
            await self.stream(tokens, 1)
        await asyncio.gather(*[self.stream(32, 2) for _ in range(max(batch for batch, _ in plan.decode_points))])

    async def prefill(self, plan: ProbePlan) -> list[PrefillSample]:
        samples = []
        for tokens in plan.prefill_tokens:
            first = (await self.stream(tokens, 1)).first_ms
            samples.append(PrefillSample(tokens, first))
            print(f"calibrate {self.base_url}: prefill {tokens} tokens: {first:.0f} ms", file=sys.stderr)
        return samples

    async def decode(self, plan: ProbePlan) -> list[DecodeSample]:
        samples = []
        for batch, tokens in plan.decode_points:
            runs = await asyncio.gather(*[self.stream(tokens, plan.output_tokens) for _ in range(batch)])
            # Started together, prefilled in the first step or two, then decoding side by side.
            tpot = statistics.fmean((r.last_ms - r.first_ms) / (r.tokens - 1) for r in runs)
            samples.append(DecodeSample(batch, batch * (tokens + plan.output_tokens // 2), tpot))
            print(
                f"calibrate {self.base_url}: decode {batch} x {tokens} tokens: {tpot:.1f} ms per token", file=sys.stderr
            )
        return samples

    async def background_decode(self, stop: asyncio.Event) -> None:
        """Keep BACKGROUND_REQUESTS requests decoding until `stop` is set, then let them finish: the
        engine is idle when this returns."""
        while not stop.is_set():
            await asyncio.gather(*[self.stream(32, BACKGROUND_TOKENS) for _ in range(BACKGROUND_REQUESTS)])

    async def close(self) -> None:
        await self.client.close()


async def engine_capacity(base_url: str, key: str) -> tuple[int, int]:
    """(KV blocks, block size) from the engine's `vllm:cache_config_info` metric (`key`: its key)."""
    async with httpx.AsyncClient(timeout=10.0, headers={"Authorization": f"Bearer {key}"}) as http:
        text = (await http.get(base_url + "/metrics")).text
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1 : line.index("}")].split(","))
            values = {key: value.strip('"') for key, value in labels.items()}
            return int(values["num_gpu_blocks"]), int(values["block_size"])
    raise RuntimeError(f"{base_url}/metrics has no vllm:cache_config_info")


async def calibrate(
    config: SymphonyConfig, served_model: str, plan: ProbePlan = FULL_PLAN
) -> tuple[Preset, dict[str, Any]]:
    """Probe the engines of the running cluster `config` describes, on a host whose engines share
    cores and memory bandwidth (this one), in two conditions:

    - alone: the first engine while the others idle. Its costs are the engine model's.
    - beside busy neighbours, as a loaded cluster runs them: each engine's prefill and decode
      probes while the others decode a steady background load. How much slower these ran than
      the model predicts is its `neighbour_slowdown`, which the simulator applies to a step in
      proportion to the other engines busy when it starts.

    Both conditions are needed: a live cluster's engines are busy together only part of the time.
    The slowdown is a ratio of two conditions measured minutes apart on a shared, drifting host, so
    the conditions take turns, round by round, and the drift falls on both; and the neighbours'
    load is the same steady background for every busy probe
    (docs/benchmarks.md#bench-calibrate-and-bench-validate)."""
    urls = [f"http://{config.node.host}:{config.engine_port(i)}" for i in range(config.cluster.nodes)]
    signing = params_key(config.cluster.secret.encode())
    key = engine_key(config.cluster.secret.encode())
    engines = [_EngineProbe(url, served_model, seed=i, signing=signing, key=key) for i, url in enumerate(urls)]
    prefill_alone: list[PrefillSample] = []
    decode_alone: list[DecodeSample] = []
    prefill_busy: list[PrefillSample] = []
    decode_busy: list[DecodeSample] = []
    try:
        for engine in engines:
            await engine.warm(plan)
        beside_neighbours = engines if len(engines) > 1 else []
        for _ in range(plan.rounds):
            prefill_alone += await engines[0].prefill(plan)
            decode_alone += await engines[0].decode(plan)
            for engine in beside_neighbours:
                stop = asyncio.Event()
                neighbours = [
                    asyncio.create_task(other.background_decode(stop)) for other in engines if other is not engine
                ]
                try:
                    prefill_busy += await engine.prefill(plan)
                    decode_busy += await engine.decode(plan)
                finally:
                    stop.set()
                    await asyncio.gather(*neighbours)
    finally:
        for engine in engines:
            await engine.close()
    kv_blocks, block_size = await engine_capacity(urls[0], key)
    fit = fit_engine(prefill_alone, decode_alone, kv_blocks=kv_blocks, block_size=block_size, max_batch=MAX_NUM_SEQS)
    model = dataclasses.replace(fit.model, neighbour_slowdown=fit_slowdown(fit.model, prefill_busy, decode_busy))
    geometry = smollm2_geometry()
    link = LinkModel(int(geometry.bytes_per_token()), LOCAL_LINK_GBPS, LOCAL_LINK_RTT_MS)
    samples_taken = len(prefill_alone) + len(decode_alone) + len(prefill_busy) + len(decode_busy)
    preset = Preset(
        "local",
        model,
        link,
        f"symphony bench calibrate, {time.strftime('%Y-%m-%d')}: {served_model} on this host's "
        f"vLLM CPU engine ({samples_taken} samples, alone and beside busy neighbours)",
    )
    samples = {
        "prefill_samples": [dataclasses.asdict(s) for s in prefill_alone],
        "decode_samples": [dataclasses.asdict(s) for s in decode_alone],
        "prefill_samples_beside_busy": [dataclasses.asdict(s) for s in prefill_busy],
        "decode_samples_beside_busy": [dataclasses.asdict(s) for s in decode_busy],
        "fit_r2": {"prefill": fit.prefill_r2, "decode": fit.decode_r2},
    }
    return preset, samples


def _private_config(config: SymphonyConfig) -> tuple[SymphonyConfig, ModelInfo, Path]:
    if not config.engine.model:
        fetch_default_model(config.home_path, progress=lambda m: print(m, file=sys.stderr))
    model = resolve_model(config.engine.model, config.engine.served_model_name, config.home_path)
    home = config.home_path / "bench" / f"calibrate-{uuid.uuid4().hex[:8]}"
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # the engines' /reset_prefix_cache, before a policy's run
    return bench_cluster_config(config, home, model), model, home


def run_calibrate_bench(config: SymphonyConfig, *, out: Path, preset_out: Path, profile_out: Path) -> int:
    """Calibrate the engine model (the simulator's preset) and measure the cost profile (the
    scheduler's, `eval.calibrate_costs`): tier loads first, with no cluster running, then the
    engines, the links between the nodes and the check of the policy's queue term."""
    private, model, home = _private_config(config)
    geometry = geometry_from_model_dir(model.path, config.engine.block_size, config.engine.dtype)
    kv_bytes_per_token = int(geometry.bytes_per_token())
    tier_rates = measure_tier_loads(geometry, config.kv.device, config.kv_ssd_dir(0).parent)
    tiers = tier_costs(kv_bytes_per_token, tier_rates)
    costs: dict[str, Any] = {}

    async def work() -> tuple[Preset, dict[str, Any]]:
        preset, samples = await calibrate(private, model.served_name)
        links, costs["link_samples"] = await measure_links(private)
        source = f"symphony bench calibrate, {time.strftime('%Y-%m-%d')}: {model.served_name}, {len(links)} links"
        profile = build_profile(
            preset.engine, kv_bytes_per_token=kv_bytes_per_token, tiers=tiers, links=links, model=model.served_name,
            source=source,
        )  # fmt: skip
        costs["profile"] = profile
        url, key = f"http://{private.node.host}:{private.engine_port(0)}", engine_key(private.cluster.secret.encode())
        costs["queue_check"] = await check_queue(profile, url, model.served_name, key)
        return preset, samples

    try:
        preset, samples = asyncio.run(on_private_cluster(private, model, work))
    except BaseException:
        print(f"the benchmark cluster's logs are kept in {home / 'logs'}", file=sys.stderr)
        raise
    shutil.rmtree(home, ignore_errors=True)
    save_preset(preset_out, preset, samples)
    profile: CostProfile = costs["profile"]
    found = problems(profile)
    if found:  # written anyway, for a look: the scheduler refuses it and says why
        print(f"the measured cost profile is implausible: {'; '.join(found)}", file=sys.stderr)
    profile_out.parent.mkdir(parents=True, exist_ok=True)
    profile_out.write_text(to_json(profile))
    result = {
        "preset_file": str(preset_out),
        "engine": dataclasses.asdict(preset.engine),
        **samples,
        "profile_file": str(profile_out),
        "cost_profile": to_dict(profile),
        "cost_profile_problems": found,
        "tier_rates": tier_rates,
        "link_samples": costs["link_samples"],
        "queue_check": costs["queue_check"],
    }
    write_result(result, out, table=_print_calibration)
    return 0


def _print_calibration(result: dict[str, Any]) -> None:
    engine = result["engine"]
    print(
        f"step {engine['step_ms']:.2f} ms + prefill {engine['prefill_ms_per_token']:.3f} ms/token + decode "
        f"{engine['decode_ms_per_seq']:.3f} ms/request + {engine['decode_ms_per_kilotoken']:.3f} ms/1k context; "
        f"request overhead {engine['request_overhead_ms']:.1f} ms; beside busy neighbours "
        f"+{engine['neighbour_slowdown']:.0%}; {engine['kv_blocks']} KV blocks of "
        f"{engine['block_size']}; fit R2 prefill {result['fit_r2']['prefill']:.3f}, "
        f"decode {result['fit_r2']['decode']:.3f}"
    )
    print(f"preset written to {result['preset_file']}")
    profile = result["cost_profile"]
    tiers, links = profile["tier_load_ms_per_token"], profile["links"]
    print(
        f"cost profile: load us/token hbm {tiers['hbm'] * 1000:.2f}, dram {tiers['dram'] * 1000:.2f}, ssd "
        f"{tiers['ssd'] * 1000:.2f}; links "
        + ", ".join(f"{k['source']}->{k['target']} {k['rtt_ms']:.2f} ms {k['bandwidth_gbps']:.2f} GB/s" for k in links)
    )
    for check in result["queue_check"]:
        print(
            f"  queue check {check['kind']} x{check['requests']}: measured {check['measured_ttft_ms']:.0f} ms, "
            f"estimated {check['estimated_ttft_ms']:.0f} ms ({check['relative_error']:+.0%})"
        )
    print(f"cost profile written to {result['profile_file']}")


# ---- validate -------------------------------------------------------------------------------------


def replay_turns(records: list[RequestRecord]) -> list[Turn]:
    """The live run's completed requests as open-loop turns: sent when they were sent, advised as
    they were, with the prompt and answer lengths the engine reported."""
    turns = []
    for r in records:
        if not r.ok:
            continue
        advisory = (r.sent_at_s - r.advisory_lead_s) * 1000 if r.advised else None
        turns.append(Turn(r.session, r.sent_at_s * 1000, r.prompt_tokens, max(1, r.output_tokens), advisory))
    return turns


def live_figures(records: list[RequestRecord]) -> dict[str, float]:
    ok = [r for r in records if r.ok]
    span = max(r.sent_at_s + r.e2e_s for r in ok) - min(r.sent_at_s for r in ok)
    return {
        "ttft_ms_mean": statistics.fmean(r.ttft_s * 1000 for r in ok),
        "tpot_ms_mean": statistics.fmean(r.tpot_s * 1000 for r in ok if r.output_tokens > 1),
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / span,
        "requests": len(ok),
    }


def sim_figures(result: SimResult) -> dict[str, float]:
    """The simulator's summary of the replay, its throughput over the same span `live_figures`
    takes: from the first request to the last answer."""
    done = [r for r in result.requests if r.finished_ms is not None]
    span = max(r.finished_ms for r in done) - min(r.arrival_ms for r in done)  # type: ignore[type-var]
    summary = summarize(result, span)
    return {
        "ttft_ms_mean": summary["ttft_ms_mean"],
        "tpot_ms_mean": summary["tpot_ms_mean"],
        "output_tokens_per_s": summary["output_tokens_per_s"],
        "requests": summary["completed"],
    }


def compare(live: dict[str, float], simulated: dict[str, float]) -> dict[str, float]:
    """Relative error of each figure, simulated against live."""
    return {
        key: abs(simulated[key] - live[key]) / live[key]
        for key in ("ttft_ms_mean", "tpot_ms_mean", "output_tokens_per_s")
    }


def simulate_replay(preset: Preset, policy: str, node_ids: list[str], turns: list[Turn]) -> SimResult:
    engines = dict.fromkeys(node_ids, preset.engine)
    return ClusterSim(sim_policy(policy, preset), engines, preset.link).run(turns=turns)


def run_validate_bench(
    config: SymphonyConfig,
    *,
    out: Path,
    policy: str,
    users: int,
    duration_s: float,
    time_scale: float,
    max_answer_tokens: int,
    workload: Path,
    conversations: list[Conversation],
    preset_file: Path | None,
    preset_out: Path,
    records_dir: Path | None = None,
) -> int:
    private, model, home = _private_config(config)
    settings = LoadSettings(users=users, duration_s=duration_s, max_answer_tokens=max_answer_tokens)
    timing = HumanTiming(time_scale=time_scale)
    records: dict[str, list[RequestRecord]] = {}
    calibration: dict[str, Any] = {}
    if records_dir is not None:
        records_dir.mkdir(parents=True, exist_ok=True)

    async def work() -> dict[str, Any]:
        if preset_file is None:
            preset, samples = await calibrate(private, model.served_name)
            save_preset(preset_out, preset, samples)
            calibration.update(samples, preset_file=str(preset_out))
        return await measure_policies(
            private,
            model.served_name,
            home,
            [policy],
            settings,
            timing,
            conversations,
            records_dir,
            records_by_policy=records,
        )

    try:
        summaries = asyncio.run(on_private_cluster(private, model, work))
    except BaseException:
        print(f"the benchmark cluster's logs are kept in {home / 'logs'}", file=sys.stderr)
        raise
    shutil.rmtree(home, ignore_errors=True)
    preset = load_preset(preset_file or preset_out)
    live_records = records[policy]
    if not any(r.ok for r in live_records):
        raise RuntimeError("the live run completed no request; nothing to validate against")
    node_ids = [private.node_id(i) for i in range(private.cluster.nodes)]
    simulated = sim_figures(simulate_replay(preset, policy, node_ids, replay_turns(live_records)))
    live = live_figures(live_records)
    errors = compare(live, simulated)
    result: dict[str, Any] = {
        "policy": policy,
        "users": users,
        "duration_s": duration_s,
        "time_scale": time_scale,
        "max_answer_tokens": max_answer_tokens,
        "workload": str(workload),
        "preset": dataclasses.asdict(preset.engine),
        "live": live,
        "simulated": simulated,
        "relative_error": errors,
        "sim_vs_live_error": max(errors.values()),
        "live_summary": summaries[policy],
        "calibration": calibration,
    }
    result["targets"] = {f"sim_vs_live_error_le_{VALIDATION_BOUND:g}": result["sim_vs_live_error"] <= VALIDATION_BOUND}
    write_result(result, out, table=_print_validation)
    return 0


def _print_validation(result: dict[str, Any]) -> None:
    print(
        f"policy {result['policy']}, {result['users']} users, {result['duration_s']:.0f} s, "
        f"{result['live']['requests']} requests"
    )
    print(f"{'':<22}{'live':>12}{'simulated':>12}{'error':>9}")
    for key, error in result["relative_error"].items():
        print(f"{key:<22}{result['live'][key]:>12.1f}{result['simulated'][key]:>12.1f}{error:>9.1%}")
    for name, ok in result["targets"].items():
        print(f"  target {name}: {'met' if ok else 'NOT met'}")
