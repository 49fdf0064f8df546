"""`symphony bench proxy`: what the scheduler hop adds to time-to-first-token.

Rounds of `concurrency` streaming chats sent at once to one engine, either all straight to it or all
through the scheduler in front of it, in ABBA order (direct, via, via, direct, ...). After a warm-up
every prompt is in the engine's prefix cache, so TTFT is short and the hop is not buried under
prefill. Both paths are never mixed within a round: requests racing for the same engine step would
turn a hop into a missed step, which measures the race, not the hop.

The engine's step time swings from round to round far more than a local HTTP hop costs
(docs/benchmarks.md#bench-proxy). The overhead is therefore the median, over adjacent round pairs,
of (via round median - direct round median), reported with a bootstrap 95% interval; more rounds
narrow it. Each prompt is a question after about `prompt_tokens` tokens of context, so the
scheduler parses, validates and routes requests of a realistic size.

Then the scheduler's own CPU per request is measured apart, against a node that answers instantly
(`eval.scheduler_cpu`): on the live engine, the scheduler's CPU would be mixed with the engine's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import openai
from tqdm import tqdm

from eval.plots import plot_proxy
from eval.ports import private_cluster_config
from eval.results import write_result
from eval.scheduler_cpu import CpuSettings, measure_scheduler_cpu
from eval.stats import percentile
from symphony.config import SymphonyConfig
from symphony.config_secrets import with_cluster_secret
from symphony.kv_transfer import SESSION_PARAM, TENANT_PARAM, params_key, sign_params
from symphony.launcher import LocalCluster
from symphony.models import default_model_dir, fetch_default_model, resolve_model
from symphony.tenancy import DEFAULT_TENANT, engine_key

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "What is 12 times 12?",
    "Translate 'good morning' into Spanish.",
    "Which planet is known as the red planet?",
    "Suggest a name for a pet goldfish.",
    "What is the boiling point of water in Celsius?",
    "Write a haiku about autumn.",
    "Who wrote Romeo and Juliet?",
    "What does CPU stand for?",
    "List two uses of a paperclip.",
    "What is the largest ocean on Earth?",
    "Describe the color blue in one sentence.",
    "What is the opposite of cold?",
]

TARGET_OVERHEAD_MS_P50 = 3.0
TARGET_P99_RATIO = 1.10
TARGET_SCHEDULER_CPU_MS = 0.3
CONTEXT_SENTENCE = (
    "Background for the question that follows: a cluster of model servers keeps each conversation's "
    "attention cache in memory tiers and moves it between machines ahead of the next request. "
)


async def _ttft_ms(
    client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int, session: str, signing: bytes | None
) -> float:
    """`signing`: for a request straight to the engine, the key of the kv_transfer_params the scheduler
    would send with it (`symphony.kv_transfer`): the engine's connector then does the same work on
    both paths."""
    started = time.perf_counter()
    params = {TENANT_PARAM: DEFAULT_TENANT, SESSION_PARAM: session}
    extra = None if signing is None else {"kv_transfer_params": sign_params(params, model, signing, time.time())}
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        extra_headers={"X-Session-ID": session},
        extra_body=extra,
    )
    ttft = None
    async for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = (time.perf_counter() - started) * 1000.0
    if ttft is None:
        raise RuntimeError(f"no token streamed for prompt {prompt!r}")
    return ttft


async def _round(
    client: openai.AsyncOpenAI, model: str, prompts: list[str], max_tokens: int, tag: str, signing: bytes | None
) -> list[float]:
    return list(
        await asyncio.gather(
            *(_ttft_ms(client, model, p, max_tokens, f"bench-{tag}-{i}", signing) for i, p in enumerate(prompts))
        )
    )


def _bootstrap_median_ci(values: list[float], resamples: int = 2000, seed: int = 7) -> tuple[float, float]:
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def proxy_prompts(concurrency: int, prompt_tokens: int) -> list[str]:
    """One prompt per stream: about `prompt_tokens` tokens of context (its own per stream, so no
    stream's prefix-cache hit comes from another's), then a short question."""
    repeats = max(0, round(prompt_tokens / 40))  # CONTEXT_SENTENCE is about 40 tokens
    prompts = []
    for i in range(concurrency):
        question = PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" (#{i})")
        prompts.append((f"[{i}] " + CONTEXT_SENTENCE * repeats if repeats else "") + question)
    return prompts


async def measure(
    scheduler_url: str,
    engine_url: str,
    model: str,
    concurrency: int,
    rounds: int,
    max_tokens: int,
    prompt_tokens: int,
    secret: str,
) -> dict[str, Any]:
    """`secret`: the cluster's, which the scheduler signs the engine's kv_transfer_params with, and
    which the engine's key is derived from."""
    prompts = proxy_prompts(concurrency, prompt_tokens)
    signing: dict[str, bytes | None] = {"direct": params_key(secret.encode()), "via_scheduler": None}
    clients = {
        "direct": openai.AsyncOpenAI(
            base_url=engine_url.rstrip("/") + "/v1", api_key=engine_key(secret.encode()), max_retries=0
        ),
        "via_scheduler": openai.AsyncOpenAI(base_url=scheduler_url.rstrip("/") + "/v1", api_key="bench", max_retries=0),
    }
    samples: dict[str, list[list[float]]] = {"direct": [], "via_scheduler": []}
    try:
        for path, client in clients.items():  # warm-up: fills the prefix cache, opens connections
            await _round(client, model, prompts, max_tokens, f"warm-{path}", signing[path])
        with tqdm(total=2 * rounds, desc="proxy bench rounds", unit="round", file=sys.stderr) as bar:
            for r in range(rounds):
                order = ["direct", "via_scheduler"] if r % 2 == 0 else ["via_scheduler", "direct"]
                for path in order:
                    samples[path].append(
                        await _round(clients[path], model, prompts, max_tokens, f"{path}-{r}", signing[path])
                    )
                    bar.update(1)
    finally:
        for client in clients.values():
            await client.close()

    direct = [x for rnd in samples["direct"] for x in rnd]
    via = [x for rnd in samples["via_scheduler"] for x in rnd]
    # Round r of each path ran back to back, so their difference cancels the slow drift of the machine.
    per_pair = [
        statistics.median(v) - statistics.median(d)
        for d, v in zip(samples["direct"], samples["via_scheduler"], strict=True)
    ]
    low, high = _bootstrap_median_ci(per_pair)
    result = {
        "direct_ttft_ms_p50": percentile(direct, 50),
        "direct_ttft_ms_p99": percentile(direct, 99),
        "via_scheduler_ttft_ms_p50": percentile(via, 50),
        "via_scheduler_ttft_ms_p99": percentile(via, 99),
        "overhead_ms_p50": statistics.median(per_pair),
        "per_pair_overhead_ms": per_pair,
        "overhead_ms_p50_ci95": [low, high],
        "pooled_p50_difference_ms": percentile(via, 50) - percentile(direct, 50),
        "p99_ratio": percentile(via, 99) / percentile(direct, 99),
        "samples_per_path": len(direct),
        "model": model,
        "concurrency": concurrency,
        "prompt_tokens": prompt_tokens,
        "rounds_per_path": rounds,
        "max_tokens": max_tokens,
        "definitions": {
            "ttft": "client-side time from sending the request to the first streamed content token",
            "overhead_ms_p50": "median over adjacent round pairs of (via-scheduler round median TTFT - direct "
            "round median TTFT); ci95 is a bootstrap interval of that median",
        },
        "raw_ms": samples,
    }
    result["targets"] = {
        "overhead_ms_p50<=3": result["overhead_ms_p50"] <= TARGET_OVERHEAD_MS_P50,
        "via_p99<=1.10*direct_p99": result["p99_ratio"] <= TARGET_P99_RATIO,
    }
    return result


async def _with_private_cluster(config: SymphonyConfig, **kwargs: Any) -> dict[str, Any]:
    """Start a 1-node cluster of its own (so the scheduler fronts exactly the engine measured): its
    own home and ports, beside any cluster already running."""
    if not config.engine.model:
        fetch_default_model(config.home_path, progress=lambda m: print(m, file=sys.stderr))
    model = resolve_model(config.engine.model, config.engine.served_model_name, config.home_path)
    home = config.home_path / "bench" / f"proxy-{uuid.uuid4().hex[:8]}"
    private = private_cluster_config(config, home, 1)
    config = dataclasses.replace(
        private, engine=dataclasses.replace(config.engine, model=str(model.path), served_model_name=model.served_name)
    )
    cluster = LocalCluster(config, model, sys.stderr)
    cluster.spawn()
    try:
        if not await cluster.wait_ready(asyncio.Event()):
            raise RuntimeError("the benchmark cluster did not become ready")
        engine_url = f"http://{config.node.host}:{config.engine_port(0)}"
        result = await measure(
            config.scheduler_url, engine_url, model.served_name, **kwargs, secret=config.cluster.secret
        )
    except BaseException:
        await cluster.shutdown()
        print(f"the benchmark cluster's logs are kept in {home / 'logs'}", file=sys.stderr)
        raise
    await cluster.shutdown()
    shutil.rmtree(home, ignore_errors=True)
    return result


def _tokenizer_dir(config: SymphonyConfig) -> Path:
    return Path(config.engine.model).expanduser() if config.engine.model else default_model_dir(config.home_path)


def _scheduler_env(config: SymphonyConfig, model: str) -> dict[str, str]:
    """The benchmark's scheduler settings that matter to its CPU, for the no-op nodes' scheduler: its
    policy, and the model's tokenizer for `model`, the name the no-op nodes serve."""
    return {
        "SYMPHONY_SCHEDULER_POLICY": config.scheduler.policy,
        "SYMPHONY_SCHEDULER_TOKENIZER": "",
        "SYMPHONY_SCHEDULER_TOKENIZERS": json.dumps([f"{model}={_tokenizer_dir(config)}"]),
    }


def _print_table(result: dict[str, Any]) -> None:
    if "overhead_ms_p50" in result:
        print(f"{'path':<15}{'TTFT p50 ms':>14}{'TTFT p99 ms':>14}")
        for label, key in (("direct", "direct"), ("via scheduler", "via_scheduler")):
            print(f"{label:<15}{result[key + '_ttft_ms_p50']:>14.1f}{result[key + '_ttft_ms_p99']:>14.1f}")
        low, high = result["overhead_ms_p50_ci95"]
        print(
            f"overhead p50: {result['overhead_ms_p50']:.2f} ms (95% CI {low:.2f} .. {high:.2f})   "
            f"p99 ratio: {result['p99_ratio']:.3f}"
        )
    if "scheduler_cpu_ms_per_request" in result:
        shared = result["scheduler_cpu"]["settings"]["shared_tokens"]
        print(
            f"scheduler CPU per request (no-op engine{f', {shared} tokens shared' if shared else ''}): "
            f"{result['scheduler_cpu_ms_per_request']:.3f} ms   "
            f"no-op TTFT p50: {result['scheduler_cpu']['noop_ttft_ms_p50']:.2f} ms"
        )
    for name, ok in result["targets"].items():
        print(f"  target {name}: {'met' if ok else 'NOT met'}")


def run_proxy_bench(
    config: SymphonyConfig,
    *,
    out: Path,
    concurrency: int,
    rounds: int,
    max_tokens: int,
    prompt_tokens: int,
    cpu_requests: int,
    scheduler_url: str | None,
    engine_url: str | None,
    plot: Path | None = None,
    cpu_only: bool = False,
    cpu_shared_tokens: int = 0,
) -> int:
    """The live rounds (unless `cpu_only`), then the scheduler's CPU part (unless `cpu_requests` is 0)."""
    kwargs = {"concurrency": concurrency, "rounds": rounds, "max_tokens": max_tokens, "prompt_tokens": prompt_tokens}
    if cpu_only:
        # The name the scheduler serves the tokenizer's model under (scheduler.tokenizer_load).
        result: dict[str, Any] = {"model": config.engine.served_model_name or _tokenizer_dir(config).name}
        result["targets"] = {}
    elif scheduler_url:
        assert engine_url, "the CLI requires --engine-url with --scheduler-url"
        import httpx

        model = httpx.get(scheduler_url.rstrip("/") + "/v1/models", timeout=5).json()["data"][0]["id"]
        secret = with_cluster_secret(config).cluster.secret  # a deployment on this host: its home's
        result = asyncio.run(measure(scheduler_url, engine_url, model, **kwargs, secret=secret))
    else:
        result = asyncio.run(_with_private_cluster(config, **kwargs))
    if cpu_requests:
        settings = CpuSettings(
            concurrency=concurrency, prompt_tokens=prompt_tokens, shared_tokens=cpu_shared_tokens, requests=cpu_requests
        )
        model = result.get("model", "noop-model")
        cpu = asyncio.run(measure_scheduler_cpu(settings, model, _scheduler_env(config, model)))
        result["scheduler_cpu"] = cpu
        result["scheduler_cpu_ms_per_request"] = cpu["scheduler_cpu_ms_per_request"]
        result["targets"][f"scheduler_cpu_ms_per_request<={TARGET_SCHEDULER_CPU_MS}"] = (
            cpu["scheduler_cpu_ms_per_request"] <= TARGET_SCHEDULER_CPU_MS
        )
    write_result(result, out, table=_print_table, plot=plot if "raw_ms" in result else None, plotter=plot_proxy)
    return 0
