"""Open-loop workloads of token-id prompts for the live cluster (`bench cluster --workload
shared-prefix`, `--trace FILE`): requests arrive at set times whatever the answers, and their
prompts share prefixes by construction, so how much of the reusable KV a policy reused can be
counted exactly (`existed_tokens`).

- `shared_prefix_requests`: `groups` shared prefixes (a system prompt or a RAG document each), each of
  a length drawn once in `prefix_tokens`; requests arrive as a Poisson process of `rate_per_s`, each
  for a group drawn uniformly, each the first turn of a session of its own: the group's prefix
  followed by a question of a length drawn in `question_tokens`. Sharing is across sessions, which a
  session table cannot see. Defaults fit SmolLM2 (8,192-token context) on 2 CPU nodes.
- `trace_requests`: a Mooncake trace (`eval.traces`) replayed live. Each hash id becomes a block of
  `block_tokens` seeded tokens (512 in the trace; fewer here, so prompts fit the model's context), so
  requests share exactly the prefix blocks their hash ids share; prompts past `max_prompt_tokens`
  are cut (the prefix is kept). The clock is scaled by `time_scale`, and a seeded share of the
  trace's sessions (`eval.traces.sessions_of`) is kept, chosen so that the replay's mean arrival rate
  is about `rate_per_s`; a conversation's turns keep their order and their (scaled) gaps.

Token ids are drawn from `eval.traces.TOKEN_ID_RANGE` (ordinary vocabulary entries of SmolLM2).
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from eval.traces import MOONCAKE_BLOCK_TOKENS, TOKEN_ID_RANGE, TraceRequest, mooncake_prompt, sessions_of


@dataclass(frozen=True, slots=True)
class OpenRequest:
    arrival_s: float  # since the run started
    session: str
    turn: int  # within its session
    prompt: tuple[int, ...]  # token ids
    max_tokens: int
    group: int = 0  # the shared prefix's group (0 for a trace)


def reusable_tokens(existing: int, prompt_tokens: int) -> int:
    """Of `existing` leading prompt tokens whose KV exists, what a cache could serve: never the
    prompt's last token (an engine always computes it, to sample from it). Token-exact, not in
    blocks: KV of a partial block that existed and was recomputed counts as a miss."""
    return max(0, min(existing, prompt_tokens - 1))


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the common prefix of `a` and `b`."""
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def existed_tokens(
    prompts: Sequence[Sequence[int]], sent_s: Sequence[float], ready_s: Sequence[float | None]
) -> list[int]:
    """Per request, the leading prompt tokens whose KV existed somewhere when it was sent: its longest
    common prefix with an earlier request whose prefill was done by then (`ready_s`: when that
    request's first token came; None for a request that failed, which leaves no KV), counted by
    `reusable_tokens`. Evictions are ignored on purpose: KV that existed and was dropped still
    counts, so cached/existed measures how much of the reusable KV the cluster kept and found.
    The longest common prefix with a set is with one of the query's neighbours in sorted order."""
    pending = [(ready, i) for i, ready in enumerate(ready_s) if ready is not None]
    heapq.heapify(pending)
    done: list[tuple[int, ...]] = []  # the prompts prefilled so far, sorted
    out = [0] * len(prompts)
    for i in sorted(range(len(prompts)), key=lambda i: sent_s[i]):
        while pending and pending[0][0] < sent_s[i]:  # strictly: a request never finds itself
            bisect.insort(done, tuple(prompts[heapq.heappop(pending)[1]]))
        query = tuple(prompts[i])
        at = bisect.bisect_left(done, query)
        shared = max((_common(query, done[j]) for j in (at - 1, at) if 0 <= j < len(done)), default=0)
        out[i] = reusable_tokens(shared, len(query))
    return out


def _tokens(rng: random.Random, count: int) -> tuple[int, ...]:
    return tuple(rng.randrange(*TOKEN_ID_RANGE) for _ in range(count))


@dataclass(frozen=True, slots=True)
class SharedPrefixSettings:
    groups: int = 16
    prefix_tokens: tuple[int, int] = (1500, 2000)  # a group's prefix length, drawn once per group
    question_tokens: tuple[int, int] = (100, 200)  # a request's own tokens after the prefix
    rate_per_s: float = 1.0  # Poisson arrivals, all groups together

    def __post_init__(self) -> None:
        for name, (low, high) in (("prefix_tokens", self.prefix_tokens), ("question_tokens", self.question_tokens)):
            if not 1 <= low <= high:
                raise ValueError(f"{name} {low}-{high}: expected 1 <= low <= high")
        if self.groups < 1 or not self.rate_per_s > 0:
            raise ValueError("groups and rate_per_s must be positive")


def shared_prefix_requests(
    settings: SharedPrefixSettings, *, duration_s: float, max_tokens: int, seed: int
) -> tuple[list[OpenRequest], dict[str, Any]]:
    """The requests arriving within `duration_s`, and a description (`prefix_tokens` per group, the
    request count and the realised `rate_per_s`)."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, rng.randint(*settings.prefix_tokens)) for _ in range(settings.groups)]
    requests: list[OpenRequest] = []
    arrival = rng.expovariate(settings.rate_per_s)
    while arrival < duration_s:
        group = rng.randrange(settings.groups)
        question = _tokens(rng, rng.randint(*settings.question_tokens))
        session = f"g{group}-q{len(requests)}"
        requests.append(OpenRequest(arrival, session, 0, prefixes[group] + question, max_tokens, group))
        arrival += rng.expovariate(settings.rate_per_s)
    info = {
        "groups": settings.groups,
        "prefix_tokens": [len(p) for p in prefixes],
        "question_tokens_range": list(settings.question_tokens),
        "rate_per_s_asked": settings.rate_per_s,
        "requests": len(requests),
        "rate_per_s": len(requests) / duration_s,
    }
    return requests, info


@dataclass(frozen=True, slots=True)
class TraceReplaySettings:
    block_tokens: int = 64  # tokens per hash id (the trace's blocks are 512)
    time_scale: float = 0.05  # the trace's clock, scaled (0.05: its hour becomes 3 minutes)
    rate_per_s: float = 1.0  # about this many arrivals per second, by sampling sessions
    max_prompt_tokens: int = 8192 - 64 - 1  # prompts cut to this many tokens

    def __post_init__(self) -> None:
        if self.block_tokens < 1 or self.max_prompt_tokens < 1:
            raise ValueError("block_tokens and max_prompt_tokens must be positive")
        if not self.time_scale > 0 or not self.rate_per_s > 0:
            raise ValueError("time_scale and rate_per_s must be positive")


def trace_requests(
    trace: Sequence[TraceRequest], settings: TraceReplaySettings, *, duration_s: float, max_tokens: int, seed: int
) -> tuple[list[OpenRequest], dict[str, Any]]:
    """The sampled sessions' requests arriving within `duration_s` (after scaling the clock), and a
    description (the kept share of sessions, the request count, the realised rate)."""
    if not trace:
        raise ValueError("the trace has no request")
    start = trace[0].arrival_ms
    span_s = max(1e-3, (trace[-1].arrival_ms - start) / 1000 * settings.time_scale)
    fraction = min(1.0, settings.rate_per_s * span_s / len(trace))
    names = sessions_of(list(trace))
    kept = {name for name in set(names) if random.Random(f"{seed}/{name}").random() < fraction}
    requests: list[OpenRequest] = []
    turns: dict[str, int] = {}
    cut = 0
    for name, request in zip(names, trace, strict=True):
        arrival_s = (request.arrival_ms - start) / 1000 * settings.time_scale
        if name not in kept or arrival_s >= duration_s:
            continue
        scaled = math.ceil(request.input_tokens * settings.block_tokens / MOONCAKE_BLOCK_TOKENS)
        prompt = mooncake_prompt(dataclasses.replace(request, input_tokens=scaled), settings.block_tokens)
        cut += len(prompt) > settings.max_prompt_tokens
        turn = turns.get(name, 0)
        turns[name] = turn + 1
        output = max(1, min(max_tokens, request.output_tokens))
        requests.append(OpenRequest(arrival_s, name, turn, tuple(prompt[: settings.max_prompt_tokens]), output))
    info = {
        "trace_requests": len(trace),
        "block_tokens": settings.block_tokens,
        "trace_time_scale": settings.time_scale,
        "sessions_fraction": fraction,
        "sessions": len(turns),
        "requests": len(requests),
        "prompts_cut": cut,
        "rate_per_s_asked": settings.rate_per_s,
        "rate_per_s": len(requests) / duration_s,
    }
    return requests, info
