"""The paths of a resumed turn and the runner that drives one trial along each, for
`symphony bench resume` (`eval.bench_resume`) and its correctness check (`eval.resume_correctness`).
What each path means is in `eval.bench_resume`'s docstring."""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from symphony.kv_transfer import SESSION_PARAM, TENANT_PARAM, sign_params
from symphony.rpc import kv_pb2, kv_pb2_grpc

PATHS = ("recompute", "engine_cache", "dram", "ssd_on_demand", "ssd_prefetched", "remote_prefetched")
MTBENCH = Path(__file__).resolve().parent / "data" / "mtbench" / "mt_bench_question.jsonl"
FOLLOW_UP_TOKENS = 48  # the new user message of the resumed turn
OUTPUT_TOKENS = 8
SAVE_WAIT_S = 120.0
PREFETCH_WAIT_MS = 120_000


@dataclasses.dataclass
class Node:
    engine: openai.OpenAI
    kv: kv_pb2_grpc.KVStoreStub
    grpc_address: str
    metrics_url: str
    ssd_dir: Path
    kv_socket: Path  # the node-local channel the engine's connector asks
    params_key: bytes  # signs the kv_transfer_params the engine's connector trusts (`symphony.kv_transfer`)

    @property
    def engine_headers(self) -> dict[str, str]:
        """What a call to the engine outside `engine` sends: the key `engine` was made with."""
        return {"Authorization": f"Bearer {self.engine.api_key}"}


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


def corpus_ids(base_url: str, model: str, headers: dict[str, str]) -> list[int]:
    """MT-bench questions, tokenized once by the engine at `base_url` (`headers`: its key): the
    material every history is cut from."""
    text = "\n\n".join(" ".join(turns) for turns in mtbench_turns())
    reply = httpx.post(
        base_url + "/tokenize",
        json={"model": model, "prompt": text, "add_special_tokens": False},
        timeout=60,
        headers=headers,
    )
    reply.raise_for_status()
    return list(reply.json()["tokens"])


def _slice(corpus: list[int], start: int, length: int) -> list[int]:
    return [corpus[(start + i) % len(corpus)] for i in range(length)]


def _turn(
    node: Node, model: str, prompt: list[int], tenant: str, salt: str, max_tokens: int, logprobs: bool = False
) -> Turn:
    started = time.perf_counter()
    extra: dict[str, Any] = {
        "kv_transfer_params": sign_params(
            {TENANT_PARAM: tenant, SESSION_PARAM: "conversation"}, model, node.params_key, time.time()
        ),
        "cache_salt": salt,
        "ignore_eos": True,
    }
    if logprobs:
        extra["return_tokens_as_token_ids"] = True  # ids, not strings two tokens could share
    stream = node.engine.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=1 if logprobs else None,
        extra_body=extra,
    )
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
    return Turn(
        ttft, "".join(text), usage.prompt_tokens, (details.cached_tokens or 0) if details else 0, tokens, token_logprobs
    )


def _ref(tenant: str) -> kv_pb2.SessionRef:
    return kv_pb2.SessionRef(tenant=tenant, session_id="conversation")


def _wait_saved(node: Node, tenant: str, tokens: int, block_size: int) -> None:
    """Until the node's tiers hold the first `tokens` of the session: its full blocks, and the
    partial last block the connector saves in the step after the turn finished."""
    blocks, tail = divmod(tokens, block_size)
    deadline = time.monotonic() + SAVE_WAIT_S
    while time.monotonic() < deadline:
        status = node.kv.GetSessionStatus(kv_pb2.SessionStatusRequest(session=_ref(tenant)), timeout=10)
        if status.loadable_prefix_blocks > blocks or (
            status.loadable_prefix_blocks == blocks and status.loadable_tail_tokens >= tail
        ):
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
    status = node.kv.Prefetch(
        kv_pb2.PrefetchRequest(
            session=_ref(tenant),
            target_tier=kv_pb2.TIER_HBM,
            deadline_ms=5_000,
            source_peer=source_peer,
            engine_cache_salt=next_salt,
            wait_ms=PREFETCH_WAIT_MS,
        ),
        timeout=PREFETCH_WAIT_MS / 1000 + 10,
    )
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
        return [*self.history(trial), *_slice(self.corpus, trial * 7919 + self.context_tokens + 1000, FOLLOW_UP_TOKENS)]


class ResumeRunner:
    """Sends a trial's resumed turn along one path, after putting its history where the path says."""

    def __init__(
        self,
        nodes: list[Node],
        model: str,
        histories: Histories,
        block_size: int,
        gap_s: float,
        output_tokens: int = OUTPUT_TOKENS,
        logprobs: bool = False,
    ) -> None:
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
            status = _prefetch(
                home, tenant, salt + "-resumed", source_peer=other.grpc_address if path == "remote_prefetched" else ""
            )
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
