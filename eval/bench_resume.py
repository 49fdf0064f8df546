"""`symphony bench resume`: time to first token of a resumed turn, by where its history's KV is.

One run starts a private 2-node cluster (real vLLM engines with Symphony's connector). Each trial
builds a conversation history of `context_tokens` tokens and sends its next turn along every path,
in an order shuffled per trial, so the drift of this shared machine falls on all paths alike:

- recompute: nothing holds the history; the engine prefills all of it.
- engine_cache: vLLM's own prefix cache holds it (the turn that built it just ran there), whole
  blocks only; the partial last block comes from Symphony's DRAM, as on every Symphony path.
- dram: only Symphony's DRAM tier holds it; the connector loads it layer by layer.
- ssd_on_demand: only SSD holds it (DRAM copies demoted, page cache dropped); no advisory, so it
  is read layer by layer when the request arrives.
- ssd_prefetched: as ssd_on_demand, but an advisory's top-tier prefetch moved it first: up from
  SSD, then into the engine's own prefix cache (a one-token warm-up under the next turn's salt).
- remote_prefetched: the history was built on the other node; the prefetch pulled it across first,
  then into the engine the same way.

Between the turn that leaves the history and the resumed turn, every path waits the same gap
(`gap_s`, 1 s by default): a user reading and typing, during which the advisory's prefetch runs
and the nodes' write-behind to SSD drains. With no gap the resumed turn would race the background
writes of the turn before it on a small host, which measures that race, not the path
(docs/benchmarks.md#bench-resume).

Isolation: vLLM's prefix cache is keyed by token content and `cache_salt`, Symphony's tiers by
tenant. Every (trial, path) is its own tenant and salt, and every resumed turn except
engine_cache's uses a salt its history never had, so it can only get the history from Symphony.
Histories are token ids (MT-bench text, tokenized once) so a turn's prompt is exactly the history
plus the follow-up: no re-tokenization at the seam.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import shutil
import statistics
import sys
import uuid
from pathlib import Path
from typing import Any

import grpc
import openai
from tqdm import tqdm

from eval.match_latency import match_latency
from eval.plots import plot_resume
from eval.ports import private_cluster_config
from eval.process_cpu import wait_until_quiet
from eval.results import write_result
from eval.resume_correctness import check_resume_correctness
from eval.resume_runner import (
    FOLLOW_UP_TOKENS,
    OUTPUT_TOKENS,
    PATHS,
    CorpusHistories,
    Node,
    ResumeRunner,
    Turn,
    corpus_ids,
)
from eval.stats import histogram_quantile, percentile
from symphony.config import SymphonyConfig
from symphony.kv_transfer import params_key
from symphony.launcher import LocalCluster
from symphony.models import ModelError, ModelInfo, context_window, fetch_default_model, resolve_model
from symphony.rpc import kv_pb2_grpc
from symphony.tenancy import engine_key

# Targets at 2,048 tokens (issue 4), as ratios to engine_cache's median TTFT.
TARGETS = {"dram": 1.15, "ssd_prefetched": 1.15, "remote_prefetched": 1.2, "ssd_on_demand": 2.0}
RECOMPUTE_SANITY = 5.0
MATCH_CALLS = 2_000  # a p99 from its 20th largest
MATCH_P99_TARGET_MS = 1.0


def measure(
    nodes: list[Node],
    base_url: str,
    model: str,
    context_tokens: int,
    trials: int,
    block_size: int,
    gap_s: float = 1.0,
    seed: int = 11,
) -> dict[str, Any]:
    corpus = corpus_ids(base_url, model, nodes[0].engine_headers)
    bench = ResumeRunner(nodes, model, CorpusHistories(corpus, context_tokens), block_size, gap_s)
    rng = random.Random(seed)
    for path in PATHS:  # warm-up, unrecorded: first-use costs (allocator, page faults, connections)
        bench.resumed_turn(-1, path)
    turns: dict[str, list[Turn]] = {path: [] for path in PATHS}
    differing: set[str] = set()  # paths whose output differed from engine_cache's in some trial
    with tqdm(total=trials * len(PATHS), desc=f"resume {context_tokens} tokens", file=sys.stderr) as bar:
        for trial in range(trials):
            order = list(PATHS)
            rng.shuffle(order)
            for path in order:
                turn = bench.resumed_turn(trial, path)
                turns[path].append(turn)
                bar.update()
            differing.update(path for path in PATHS if turns[path][-1].text != turns["engine_cache"][-1].text)
    result: dict[str, Any] = {
        "context_tokens": context_tokens,
        "trials": trials,
        "gap_s": gap_s,
        "follow_up_tokens": FOLLOW_UP_TOKENS,
        "output_tokens": OUTPUT_TOKENS,
    }
    result["ttft_ms"] = {path: statistics.median(t.ttft_ms for t in turns[path]) for path in PATHS}
    result["ttft_ms_all"] = {path: [round(t.ttft_ms, 2) for t in turns[path]] for path in PATHS}
    result["prefill_tokens_computed"] = {
        path: statistics.median(t.prompt_tokens - t.cached_tokens for t in turns[path]) for path in PATHS
    }
    result["prefetch_engine_cached_tokens"] = {
        path: statistics.median(counts) for path, counts in bench.engine_cached_tokens.items()
    }
    outputs_identical = not differing  # every path's output equal to engine_cache's, in every trial
    result["outputs_identical"] = outputs_identical
    result["outputs_differing_from_engine_cache"] = sorted(differing)
    dram_tenant = f"resume-{bench.run_id}-0-dram"
    # The lookup's latency on a quiet node (the target), and right after the last trial, while the
    # engines' workers still busy-poll the host's cores and the node writes the turn behind it: the
    # same lookups then wait for a core (their CPU time stays the same), shown beside it.
    busy = match_latency(nodes[0].kv_socket, dram_tenant, bench.histories.prompt(0), MATCH_CALLS)
    result["match_quiet_wait_s"] = wait_until_quiet()
    probe = match_latency(nodes[0].kv_socket, dram_tenant, bench.histories.prompt(0), MATCH_CALLS)
    result["match_after_trials_ms_p50"] = percentile(busy.match_ms, 50)
    result["match_after_trials_ms_p99"] = percentile(busy.match_ms, 99)
    result["match_after_trials_cpu_ms_p99"] = percentile(busy.match_cpu_ms, 99)
    result["match_ms_p50"] = percentile(probe.match_ms, 50)
    result["match_ms_p99"] = percentile(probe.match_ms, 99)
    # The same matches in CPU time, and what the host took meanwhile (see eval.match_latency).
    result["match_cpu_ms_p50"] = percentile(probe.match_cpu_ms, 50)
    result["match_cpu_ms_p99"] = percentile(probe.match_cpu_ms, 99)
    result["match_probe_steal_frac"] = probe.steal_frac
    # Once per scheduler step (all the step's new requests in one write), measured one request per step.
    result["registration_send_ms_p50"] = percentile(probe.send_ms, 50)
    result["registration_send_ms_p99"] = percentile(probe.send_ms, 99)
    before = {b: sum(w[0].get(b, 0.0) for w in bench.ssd_wait_windows) for b in bench.ssd_wait_windows[0][1]}
    after = {b: sum(w[1].get(b, 0.0) for w in bench.ssd_wait_windows) for b in bench.ssd_wait_windows[0][1]}
    result["layer_wait_ms_p50"] = histogram_quantile(before, after, 0.5) * 1000.0
    result["layer_wait_ms_p99"] = histogram_quantile(before, after, 0.99) * 1000.0
    engine = result["ttft_ms"]["engine_cache"]
    result["ratio_to_engine_cache"] = {path: result["ttft_ms"][path] / engine for path in PATHS}
    targets = {
        f"{path}_le_{bound}x_engine_cache": result["ratio_to_engine_cache"][path] <= bound
        for path, bound in TARGETS.items()
    }
    targets[f"recompute_ge_{RECOMPUTE_SANITY:g}x_engine_cache"] = (
        result["ratio_to_engine_cache"]["recompute"] >= RECOMPUTE_SANITY
    )
    targets["outputs_identical"] = outputs_identical
    targets[f"match_p99_le_{MATCH_P99_TARGET_MS:g}ms"] = result["match_ms_p99"] <= MATCH_P99_TARGET_MS
    result["targets"] = targets
    return result


def _bench_config(config: SymphonyConfig, context_tokens: int, home: Path, window: int | None) -> SymphonyConfig:
    """Two nodes on free ports, a private home (its SSD tier starts empty), room for the context
    (within the model's window, which the caller checked the turn fits)."""
    max_model_len = max(config.engine.max_model_len, context_tokens + FOLLOW_UP_TOKENS + OUTPUT_TOKENS)
    private = private_cluster_config(config, home, 2)
    return dataclasses.replace(
        private,
        engine=dataclasses.replace(
            config.engine, kv_connector=True, max_model_len=min(max_model_len, window) if window else max_model_len
        ),
    )


async def _with_private_cluster(
    config: SymphonyConfig,
    model: ModelInfo,
    window: int | None,
    home: Path,
    context_tokens: int,
    trials: int,
    gap_s: float,
    conversations: int,
) -> dict[str, Any]:
    config = _bench_config(config, context_tokens, home, window)
    cluster = LocalCluster(config, model, sys.stderr)
    cluster.spawn()
    channels = []
    try:
        if not await cluster.wait_ready(asyncio.Event()):
            raise RuntimeError("the benchmark cluster did not become ready")
        nodes = []
        for i in range(2):
            channel = grpc.insecure_channel(config.node_grpc_address(i))
            channels.append(channel)
            base_url = f"http://{config.node.host}:{config.engine_port(i)}"
            nodes.append(
                Node(
                    openai.OpenAI(
                        base_url=base_url + "/v1",
                        api_key=engine_key(config.cluster.secret.encode()),
                        max_retries=0,
                        timeout=600,
                    ),
                    kv_pb2_grpc.KVStoreStub(channel),
                    config.node_grpc_address(i),
                    f"http://{config.node.host}:{config.kv_metrics_port(i)}/metrics",
                    config.kv_ssd_dir(i),
                    config.kv_socket_path(i),
                    params_key(cluster.config.cluster.secret.encode()),
                )
            )
        base_url = f"http://{config.node.host}:{config.engine_port(0)}"
        result = await asyncio.to_thread(
            measure, nodes, base_url, model.served_name, context_tokens, trials, config.engine.block_size, gap_s
        )
        if conversations:
            result["correctness"] = await asyncio.to_thread(
                check_resume_correctness,
                nodes,
                base_url,
                model.served_name,
                conversations,
                config.engine.block_size,
                gap_s,
            )
            result["targets"]["correctness_identical"] = result["correctness"]["identical"]
            result["targets"]["correctness_identical_to_recompute"] = result["correctness"]["identical_to_recompute"]
        return result
    finally:
        for channel in channels:
            channel.close()
        await cluster.shutdown()


def _print_table(result: dict[str, Any]) -> None:
    print(f"resumed turn after {result['context_tokens']} tokens of history, {result['trials']} trials")
    print(f"{'path':<20}{'TTFT p50 ms':>14}{'x engine':>10}{'prefill tok':>13}")
    for path in PATHS:
        print(
            f"{path:<20}{result['ttft_ms'][path]:>14.1f}{result['ratio_to_engine_cache'][path]:>10.2f}"
            f"{result['prefill_tokens_computed'][path]:>13.0f}"
        )
    print(
        f"outputs identical: {result['outputs_identical']}   ssd_on_demand layer wait p50 "
        f"{result['layer_wait_ms_p50']:.2f} ms, p99 {result['layer_wait_ms_p99']:.2f} ms   "
        f"match p50 {result['match_ms_p50']:.3f} ms, p99 {result['match_ms_p99']:.3f} ms (CPU time p99 "
        f"{result['match_cpu_ms_p99']:.3f} ms, steal {result['match_probe_steal_frac']:.0%}; right after the trials "
        f"p99 {result['match_after_trials_ms_p99']:.3f} ms, CPU time p99 "
        f"{result['match_after_trials_cpu_ms_p99']:.3f} ms); registration send "
        f"p50 {result['registration_send_ms_p50']:.3f} ms, p99 {result['registration_send_ms_p99']:.3f} ms"
    )
    if "correctness" in result:
        check = result["correctness"]
        print(
            f"correctness over {check['conversations']} MT-bench two-turn conversations: Symphony's paths vs "
            f"vLLM's own cache hit "
            f"{'identical' if check['identical'] else 'MISMATCHED ' + str(check['differing_paths'])}, "
            f"max logprob gap {check['max_logprob_gap']:.2e} (tolerance {check['logprob_tolerance']:g}); "
            f"vLLM's cache hit vs recompute: {len(check['engine_cache_vs_recompute_mismatched'])} parted, "
            f"max logprob gap {check['engine_cache_vs_recompute_max_logprob_gap']:.2e}"
        )
    for name, ok in result["targets"].items():
        print(f"  target {name}: {'met' if ok else 'NOT met'}")


def run_resume_bench(
    config: SymphonyConfig,
    *,
    out: Path,
    context_tokens: int,
    trials: int,
    gap_s: float = 1.0,
    conversations: int = 0,
    plot: Path | None = None,
) -> int:
    if not config.engine.model:
        fetch_default_model(config.home_path, progress=lambda m: print(m, file=sys.stderr))
    model = resolve_model(config.engine.model, config.engine.served_model_name, config.home_path)
    window, block = context_window(model.path), config.engine.block_size
    if window is not None and context_tokens + FOLLOW_UP_TOKENS + OUTPUT_TOKENS > window:
        # The engines would refuse a max_model_len past the model's window and restart forever.
        raise ModelError(
            f"--context-tokens {context_tokens}: the resumed turn adds {FOLLOW_UP_TOKENS} + "
            f"{OUTPUT_TOKENS} tokens, past {model.path.name}'s {window}-token context window; use "
            f"at most {(window - FOLLOW_UP_TOKENS - OUTPUT_TOKENS) // block * block}"
        )
    home = config.home_path / "bench" / f"resume-{uuid.uuid4().hex[:8]}"
    try:
        result = asyncio.run(
            _with_private_cluster(config, model, window, home, context_tokens, trials, gap_s, conversations)
        )
    except BaseException:
        print(f"the benchmark cluster's logs are kept in {home / 'logs'}", file=sys.stderr)
        raise
    shutil.rmtree(home, ignore_errors=True)  # its SSD tier holds every trial's history
    write_result(result, out, table=_print_table, plot=plot, plotter=plot_resume)
    return 0
