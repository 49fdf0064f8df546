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
writes of the turn before it on this 2-core machine, which measures that race, not the path.

Isolation: vLLM's prefix cache is keyed by token content and `cache_salt`, Symphony's tiers by
tenant. Every (trial, path) is its own tenant and salt, and every resumed turn except
engine_cache's uses a salt its history never had, so it can only get the history from Symphony.
Histories are token ids (MT-bench text, tokenized once) so a turn's prompt is exactly the history
plus the follow-up: no re-tokenization at the seam.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

import grpc
import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from eval.match_latency import match_latency
from eval.plots import plot_resume
from eval.ports import free_port_run
from eval.process_cpu import wait_until_quiet
from eval.results import write_result
from eval.stats import histogram_quantile, percentile
from symphony.config import SymphonyConfig
from symphony.launcher import Cluster
from symphony.models import ModelError, ModelInfo, context_window, fetch_default_model, resolve_model
from symphony.rpc import kv_pb2, kv_pb2_grpc

PATHS = ("recompute", "engine_cache", "dram", "ssd_on_demand", "ssd_prefetched", "remote_prefetched")
MTBENCH = Path(__file__).resolve().parent / "data" / "mtbench" / "mt_bench_question.jsonl"
FOLLOW_UP_TOKENS = 48  # the new user message of the resumed turn
OUTPUT_TOKENS = 8
SAVE_WAIT_S = 120.0
PREFETCH_WAIT_MS = 120_000
# Targets at 2,048 tokens (issue 4), as ratios to engine_cache's median TTFT.
TARGETS = {"dram": 1.15, "ssd_prefetched": 1.15, "remote_prefetched": 1.2, "ssd_on_demand": 2.0}
RECOMPUTE_SANITY = 5.0
MATCH_CALLS = 2_000  # a p99 from its 20th largest
MATCH_P99_TARGET_MS = 1.0


@dataclasses.dataclass
class Node:
    engine: openai.OpenAI
    kv: kv_pb2_grpc.KVStoreStub
    grpc_address: str
    metrics_url: str
    ssd_dir: Path
    kv_socket: Path  # the node-local channel the engine's connector asks


@dataclasses.dataclass
class Turn:
    ttft_ms: float
    text: str
    prompt_tokens: int
    cached_tokens: int
    tokens: list[str] = dataclasses.field(default_factory=list)  # "token_id:N", with `logprobs` asked for
    logprobs: list[float] = dataclasses.field(default_factory=list)  # of each chosen token


def mtbench_turns() -> list[list[str]]:
    """Each MT-bench question's user turns, in file order."""
    return [json.loads(line)["turns"] for line in MTBENCH.read_text().splitlines()]


def _corpus_ids(base_url: str, model: str) -> list[int]:
    """MT-bench questions, tokenized once: the material every history is cut from."""
    text = "\n\n".join(" ".join(turns) for turns in mtbench_turns())
    reply = httpx.post(base_url + "/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False},
                       timeout=60)
    reply.raise_for_status()
    return list(reply.json()["tokens"])


def _slice(corpus: list[int], start: int, length: int) -> list[int]:
    return [corpus[(start + i) % len(corpus)] for i in range(length)]


def _turn(node: Node, model: str, prompt: list[int], tenant: str, salt: str, max_tokens: int,
          logprobs: bool = False) -> Turn:
    started = time.perf_counter()
    extra: dict[str, Any] = {"kv_transfer_params": {"tenant": tenant, "session_id": "conversation"},
                             "cache_salt": salt, "ignore_eos": True}
    if logprobs:
        extra["return_tokens_as_token_ids"] = True  # ids, not strings two tokens could share
    stream = node.engine.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, logprobs=1 if logprobs else None, extra_body=extra)
    ttft = None
    text: list[str] = []
    tokens: list[str] = []
    token_logprobs: list[float] = []
    usage = None
    for chunk in stream:
        if chunk.choices:
            if ttft is None:
                ttft = (time.perf_counter() - started) * 1000.0
            choice = chunk.choices[0]
            text.append(choice.text)
            if choice.logprobs is not None:
                tokens.extend(choice.logprobs.tokens or [])
                token_logprobs.extend(choice.logprobs.token_logprobs or [])
        if chunk.usage is not None:
            usage = chunk.usage
    if ttft is None or usage is None:
        raise RuntimeError("the engine streamed no token or no usage")
    details = usage.prompt_tokens_details
    return Turn(ttft, "".join(text), usage.prompt_tokens, (details.cached_tokens or 0) if details else 0,
                tokens, token_logprobs)


def _ref(tenant: str) -> kv_pb2.SessionRef:
    return kv_pb2.SessionRef(tenant=tenant, session_id="conversation")


def _wait_saved(node: Node, tenant: str, tokens: int, block_size: int) -> None:
    """Until the node's tiers hold the first `tokens` of the session: its full blocks, and the
    partial last block the connector saves in the step after the turn finished."""
    blocks, tail = divmod(tokens, block_size)
    deadline = time.monotonic() + SAVE_WAIT_S
    while time.monotonic() < deadline:
        status = node.kv.GetSessionStatus(kv_pb2.SessionStatusRequest(session=_ref(tenant)), timeout=10)
        if status.loadable_prefix_blocks > blocks or (status.loadable_prefix_blocks == blocks
                                                       and status.loadable_tail_tokens >= tail):
            return
        time.sleep(0.02)
    raise RuntimeError(f"the history of {tenant} was not saved within {SAVE_WAIT_S:.0f} s")


def _drop_page_cache(directory: Path) -> None:
    """So that an SSD read is a disk read, not a page-cache hit."""
    for path in directory.rglob("*"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # a directory, or a segment evicted meanwhile
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _prefetch(node: Node, tenant: str, next_salt: str, source_peer: str = "") -> kv_pb2.PrefetchStatus:
    """What an advisory does: a top-tier prefetch, ending in the engine's prefix cache under the
    salt the next turn carries."""
    status = node.kv.Prefetch(kv_pb2.PrefetchRequest(session=_ref(tenant), target_tier=kv_pb2.TIER_HBM,
                                                     deadline_ms=5_000, source_peer=source_peer,
                                                     engine_cache_salt=next_salt, wait_ms=PREFETCH_WAIT_MS),
                              timeout=PREFETCH_WAIT_MS / 1000 + 10)
    if status.state != kv_pb2.PREFETCH_STATE_DONE:
        raise RuntimeError(f"prefetch of {tenant} ended {kv_pb2.PrefetchState.Name(status.state)}: {status.error}")
    return status


def _layer_wait_buckets(node: Node) -> dict[float, float]:
    text = httpx.get(node.metrics_url, timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "symphony_connector_layer_wait_seconds":
            return {float(s.labels["le"]): s.value for s in family.samples if s.name.endswith("_bucket")}
    return {}


class Histories(Protocol):
    """Where a trial's conversation comes from: its history, and the resumed turn's prompt (the
    history, then the new message)."""

    def history(self, trial: int) -> list[int]: ...

    def prompt(self, trial: int) -> list[int]: ...


class CorpusHistories:
    """Histories of one length cut from the MT-bench corpus, each followed by a message cut from
    elsewhere in it: the timing trials, where only the length matters."""

    def __init__(self, corpus: list[int], context_tokens: int) -> None:
        self.corpus = corpus
        self.context_tokens = context_tokens

    def history(self, trial: int) -> list[int]:
        return _slice(self.corpus, trial * 7919, self.context_tokens)

    def prompt(self, trial: int) -> list[int]:
        return [*self.history(trial), *_slice(self.corpus, trial * 7919 + self.context_tokens + 1000,
                                                FOLLOW_UP_TOKENS)]


class ResumeRunner:
    """Sends a trial's resumed turn along one path, after putting its history where the path says."""

    def __init__(self, nodes: list[Node], model: str, histories: Histories, block_size: int, gap_s: float,
                 output_tokens: int = OUTPUT_TOKENS, logprobs: bool = False) -> None:
        self.nodes = nodes
        self.gap_s = gap_s
        self.model = model
        self.histories = histories
        self.block_size = block_size
        self.output_tokens = output_tokens
        self.logprobs = logprobs
        self.run_id = uuid.uuid4().hex[:8]
        self.ssd_wait_windows: list[tuple[dict[float, float], dict[float, float]]] = []
        # Per prefetched path, the history tokens each prefetch left in the engine's prefix cache
        # (0: the warm-up was skipped or failed, and the turn loaded from the tiers instead).
        self.engine_cached_tokens: dict[str, list[int]] = {}

    def _resumed(self, node: Node, prompt: list[int], tenant: str, salt: str) -> Turn:
        return _turn(node, self.model, prompt, tenant, salt, self.output_tokens, self.logprobs)

    def resumed_turn(self, trial: int, path: str) -> Turn:
        tenant = salt = f"resume-{self.run_id}-{trial}-{path}"
        history = self.histories.history(trial)
        prompt = self.histories.prompt(trial)
        home, other = self.nodes
        if path == "recompute":
            return self._resumed(home, prompt, tenant, salt)
        built_on = other if path == "remote_prefetched" else home
        _turn(built_on, self.model, history, tenant, salt, 1)  # the turn that leaves the history behind
        gap_ends = time.monotonic() + self.gap_s
        # Every path but recompute waits for the history's partial last block too: vLLM's own cache
        # holds whole blocks only, so its hit is completed by that block from the node's tiers, as
        # every Symphony path's is, and all of them hand vLLM the same bytes.
        _wait_saved(built_on, tenant, len(history), self.block_size)
        if path == "engine_cache":
            _sleep_until(gap_ends)
            return self._resumed(home, prompt, tenant, salt)
        if path in ("ssd_on_demand", "ssd_prefetched"):
            home.kv.DemoteSession(kv_pb2.DemoteRequest(session=_ref(tenant), tier=kv_pb2.TIER_DRAM), timeout=60)
            _drop_page_cache(home.ssd_dir)
        if path in ("ssd_prefetched", "remote_prefetched"):
            status = _prefetch(home, tenant, salt + "-resumed",
                               source_peer=other.grpc_address if path == "remote_prefetched" else "")
            self.engine_cached_tokens.setdefault(path, []).append(status.engine_cached_tokens)
        _sleep_until(gap_ends)  # the think time between turns; the moves above happened within it
        if path == "ssd_on_demand":
            before = _layer_wait_buckets(home)
            turn = self._resumed(home, prompt, tenant, salt + "-resumed")
            self.ssd_wait_windows.append((before, _await_wait_report(home, before)))
            return turn
        return self._resumed(home, prompt, tenant, salt + "-resumed")


def _sleep_until(deadline: float) -> None:
    time.sleep(max(0.0, deadline - time.monotonic()))


def _await_wait_report(node: Node, before: dict[float, float], timeout_s: float = 10.0) -> dict[float, float]:
    """The worker reports a step's layer waits just after the step: wait for that report."""
    deadline = time.monotonic() + timeout_s
    after = _layer_wait_buckets(node)
    inf = float("inf")
    while after.get(inf, 0.0) <= before.get(inf, 0.0) and time.monotonic() < deadline:
        time.sleep(0.01)
        after = _layer_wait_buckets(node)
    return after


def measure(nodes: list[Node], base_url: str, model: str, context_tokens: int, trials: int, block_size: int,
            gap_s: float = 1.0, seed: int = 11) -> dict[str, Any]:
    corpus = _corpus_ids(base_url, model)
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
    result: dict[str, Any] = {"context_tokens": context_tokens, "trials": trials, "gap_s": gap_s,
                              "follow_up_tokens": FOLLOW_UP_TOKENS, "output_tokens": OUTPUT_TOKENS}
    result["ttft_ms"] = {path: statistics.median(t.ttft_ms for t in turns[path]) for path in PATHS}
    result["ttft_ms_all"] = {path: [round(t.ttft_ms, 2) for t in turns[path]] for path in PATHS}
    result["prefill_tokens_computed"] = {path: statistics.median(t.prompt_tokens - t.cached_tokens
                                                                 for t in turns[path]) for path in PATHS}
    result["prefetch_engine_cached_tokens"] = {path: statistics.median(counts)
                                               for path, counts in bench.engine_cached_tokens.items()}
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
    targets = {f"{path}_le_{bound}x_engine_cache": result["ratio_to_engine_cache"][path] <= bound
               for path, bound in TARGETS.items()}
    targets[f"recompute_ge_{RECOMPUTE_SANITY:g}x_engine_cache"] = (
        result["ratio_to_engine_cache"]["recompute"] >= RECOMPUTE_SANITY)
    targets["outputs_identical"] = outputs_identical
    targets[f"match_p99_le_{MATCH_P99_TARGET_MS:g}ms"] = result["match_ms_p99"] <= MATCH_P99_TARGET_MS
    result["targets"] = targets
    return result


def _bench_config(config: SymphonyConfig, context_tokens: int, home: Path, window: int | None) -> SymphonyConfig:
    """Two nodes on free ports, a private home (its SSD tier starts empty), room for the context
    (within the model's window, which the caller checked the turn fits)."""
    max_model_len = max(config.engine.max_model_len, context_tokens + FOLLOW_UP_TOKENS + OUTPUT_TOKENS)
    return dataclasses.replace(
        config,
        home=str(home),
        cluster=dataclasses.replace(config.cluster, nodes=2),
        scheduler=dataclasses.replace(config.scheduler, port=free_port_run(1), node_addresses=[]),
        node=dataclasses.replace(config.node, grpc_port_base=free_port_run(2), engine_port_base=free_port_run(2)),
        kv=dataclasses.replace(config.kv, metrics_port_base=free_port_run(2), ssd_dir="", data_port_base=0),
        engine=dataclasses.replace(config.engine, kv_connector=True,
                                   max_model_len=min(max_model_len, window) if window else max_model_len),
    )


async def _with_private_cluster(config: SymphonyConfig, model: ModelInfo, window: int | None, home: Path,
                                context_tokens: int, trials: int, gap_s: float, conversations: int) -> dict[str, Any]:
    config = _bench_config(config, context_tokens, home, window)
    cluster = Cluster(config, model, sys.stderr)
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
            nodes.append(Node(openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                                             timeout=600),
                               kv_pb2_grpc.KVStoreStub(channel), config.node_grpc_address(i),
                               f"http://{config.node.host}:{config.kv_metrics_port(i)}/metrics",
                               config.kv_ssd_dir(i), config.kv_socket_path(i)))
        base_url = f"http://{config.node.host}:{config.engine_port(0)}"
        result = await asyncio.to_thread(measure, nodes, base_url, model.served_name, context_tokens, trials,
                                         config.engine.block_size, gap_s)
        if conversations:
            from eval.resume_correctness import check_resume_correctness

            result["correctness"] = await asyncio.to_thread(check_resume_correctness, nodes, base_url,
                                                            model.served_name, conversations,
                                                            config.engine.block_size, gap_s)
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
        print(f"{path:<20}{result['ttft_ms'][path]:>14.1f}{result['ratio_to_engine_cache'][path]:>10.2f}"
              f"{result['prefill_tokens_computed'][path]:>13.0f}")
    print(f"outputs identical: {result['outputs_identical']}   ssd_on_demand layer wait p50 "
          f"{result['layer_wait_ms_p50']:.2f} ms, p99 {result['layer_wait_ms_p99']:.2f} ms   "
          f"match p50 {result['match_ms_p50']:.3f} ms, p99 {result['match_ms_p99']:.3f} ms (CPU time p99 "
          f"{result['match_cpu_ms_p99']:.3f} ms, steal {result['match_probe_steal_frac']:.0%}; right after the trials "
          f"p99 {result['match_after_trials_ms_p99']:.3f} ms, CPU time p99 "
          f"{result['match_after_trials_cpu_ms_p99']:.3f} ms); registration send "
          f"p50 {result['registration_send_ms_p50']:.3f} ms, p99 {result['registration_send_ms_p99']:.3f} ms")
    if "correctness" in result:
        check = result["correctness"]
        print(f"correctness over {check['conversations']} MT-bench two-turn conversations: Symphony's paths vs "
              f"vLLM's own cache hit "
              f"{'identical' if check['identical'] else 'MISMATCHED ' + str(check['differing_paths'])}, "
              f"max logprob gap {check['max_logprob_gap']:.2e} (tolerance {check['logprob_tolerance']:g}); "
              f"vLLM's cache hit vs recompute: {len(check['engine_cache_vs_recompute_mismatched'])} parted, "
              f"max logprob gap {check['engine_cache_vs_recompute_max_logprob_gap']:.2e}")
    for name, ok in result["targets"].items():
        print(f"  target {name}: {'met' if ok else 'NOT met'}")


def run_resume_bench(config: SymphonyConfig, *, out: Path, context_tokens: int, trials: int, gap_s: float = 1.0,
                     conversations: int = 0, plot: Path | None = None) -> int:
    if not config.engine.model:
        fetch_default_model(config.home_path, progress=lambda m: print(m, file=sys.stderr))
    model = resolve_model(config.engine.model, config.engine.served_model_name, config.home_path)
    window, block = context_window(model.path), config.engine.block_size
    if window is not None and context_tokens + FOLLOW_UP_TOKENS + OUTPUT_TOKENS > window:
        # The engines would refuse a max_model_len past the model's window and restart forever.
        raise ModelError(f"--context-tokens {context_tokens}: the resumed turn adds {FOLLOW_UP_TOKENS} + "
                         f"{OUTPUT_TOKENS} tokens, past {model.path.name}'s {window}-token context window; use "
                         f"at most {(window - FOLLOW_UP_TOKENS - OUTPUT_TOKENS) // block * block}")
    home = config.home_path / "bench" / f"resume-{uuid.uuid4().hex[:8]}"
    try:
        result = asyncio.run(_with_private_cluster(config, model, window, home, context_tokens, trials, gap_s,
                                                   conversations))
    except BaseException:
        print(f"the benchmark cluster's logs are kept in {home / 'logs'}", file=sys.stderr)
        raise
    shutil.rmtree(home, ignore_errors=True)  # its SSD tier holds every trial's history
    write_result(result, out, table=_print_table, plot=plot, plotter=plot_resume)
    return 0
