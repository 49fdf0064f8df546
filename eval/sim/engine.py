"""One simulated engine: continuous batching over a paged KV cache, in steps (vLLM v1's shape).

Pure state and arithmetic, no clock of its own: the cluster loop (`eval.sim.cluster`) calls `step`
when the engine is idle and work is waiting, and schedules the step's end. Each step

- admits waiting requests in arrival order while the batch has room and the KV cache has the blocks
  for their whole prompt plus one (a request that never fits is refused, as vLLM refuses it);
- prefills every newly admitted request's uncached tokens and decodes one token for every request
  already running; a prefilled request's first token comes out at the end of the step that
  prefilled it;
- grows each running request by a block when its context crosses a block boundary, preempting the
  most recently admitted request when no block is free: vLLM's recompute preemption (its blocks
  freed, back to the queue's front; readmitted, it prefills its prompt and its output so far again,
  and keeps generating). As in vLLM, a step that preempted admits nothing while others still run.

Step time is linear in what the step does: `step_ms + prefill_ms_per_token x prefilled tokens +
decode_ms_per_seq x decoding requests + decode_ms_per_kilotoken x their context / 1000`, plus
`prefill_ms_per_token_kilotoken` x the prefilled tokens' positions / 1000 (prefill attention), less
the part of `step_ms` the prefill hides (`prefill_overlap_ms`, at most its per-token cost). The
constants are an `EngineModel`; presets and their calibration live apart from this mechanism. On a
shared host the cluster loop stretches a step by `neighbour_slowdown` times the share of the other
engines busy when it starts.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scheduler.routing import NO_WORK, PrefillWork


@dataclass(frozen=True, slots=True)
class EngineModel:
    step_ms: float  # fixed cost of one engine step (scheduling, launch)
    prefill_ms_per_token: float
    decode_ms_per_seq: float
    decode_ms_per_kilotoken: float  # attention over the running requests' context
    kv_blocks: int
    block_size: int = 32
    max_batch: int = 256
    # Per request, outside the engine's steps (HTTP, tokenizing, streaming the answer back): the
    # request reaches the engine this long after it arrives. Measured by `bench calibrate` for the
    # local CPU engine; 0 in the GPU presets, whose figures cover only the engine.
    request_overhead_ms: float = 0.0
    # Prefill attention, which grows with context: a prefilled token at position j costs this much
    # more per 1,000 tokens of j (so an N-token prompt adds N^2 / 2000 of it). Fitted by `bench
    # calibrate` for the CPU engine (docs/benchmarks.md#bench-calibrate-and-bench-validate).
    prefill_ms_per_token_kilotoken: float = 0.0
    # Engines that share one host's cores and memory bandwidth (the local CPU cluster) slow each
    # other down: a step that starts while the host's other engines are stepping takes this much
    # longer per busy neighbour share (0.3: 30% longer beside fully busy neighbours). Measured by
    # `bench calibrate`; 0 for engines on GPUs of their own.
    neighbour_slowdown: float = 0.0
    # How much of `step_ms` a step's prefill can hide: on a GPU `step_ms` is mostly reading the
    # weights, which the prefill's matrix multiplies overlap. A step that prefills N tokens takes
    # min(this, prefill_ms_per_token x N) off `step_ms`. Fitted to a measured profile in the A100
    # preset (`eval.sim.vidur_profile`); 0 where nothing overlaps (the CPU engine `bench calibrate` fits).
    prefill_overlap_ms: float = 0.0

    # The step price's parts, shared by the engine's steps, calibration's fit and the scenarios'
    # work per turn (numbers or numpy arrays).
    def prefill_ms(self, computed: Any, context: Any) -> Any:
        """Prefilling the last `computed` tokens of a `context`-token prompt: per token, plus the
        attention of each over the positions before it (mean position `context - computed / 2`)."""
        return (
            self.prefill_ms_per_token * computed
            + self.prefill_ms_per_token_kilotoken * computed * (context - computed / 2) / 1000
        )

    def prefill_overlap(self, tokens: Any) -> Any:
        """What a step that prefills `tokens` tokens in all takes off its fixed cost (`prefill_overlap_ms`)."""
        return np.minimum(self.prefill_overlap_ms, self.prefill_ms_per_token * np.asarray(tokens))

    def decode_ms(self, requests: Any, context_tokens: Any) -> Any:
        """One decode token each for `requests` requests holding `context_tokens` in all."""
        return self.decode_ms_per_seq * requests + self.decode_ms_per_kilotoken * context_tokens / 1000

    def turn_work_ms(self, prompt_tokens: float, computed_tokens: float, output_tokens: float) -> float:
        """The engine time one turn adds to the steps it shares, beyond their fixed cost: its last
        `computed_tokens` prompt tokens prefilled with their attention, and for each output token its
        place in a decode step (over its mean context). `prefill_overlap_ms` is not taken off: a step
        hides it once, and in the busy steps where turns' work adds up their prefills hide all of it."""
        mean_context = prompt_tokens + output_tokens / 2
        return float(self.prefill_ms(computed_tokens, prompt_tokens) + output_tokens * self.decode_ms(1, mean_context))


@dataclass(slots=True, eq=False)  # requests are told apart by identity, never by value
class SimRequest:
    request_id: int
    session: str
    arrival_ms: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0  # of the prompt, found in this engine's KV when admitted (not prefilled)
    node_id: str = ""
    first_token_ms: float | None = None
    finished_ms: float | None = None
    generated: int = 0
    preemptions: int = 0
    prefilled_tokens: int = 0  # prompt tokens this request had computed (over all its admissions)
    blocks: int = 0  # KV blocks it holds now: at least one exactly while it runs
    priority_rank: int = 1  # scheduler.routing.PRIORITY_RANK: low 0, normal 1, high 2
    sent_ms: float | None = None  # when the scheduler sent it to its node (None: not yet)

    @property
    def context(self) -> int:
        return self.prompt_tokens + self.generated

    @property
    def ttft_ms(self) -> float:
        assert self.first_token_ms is not None
        return self.first_token_ms - self.arrival_ms

    @property
    def tpot_ms(self) -> float:
        """Mean time per output token after the first (0 for a one-token answer)."""
        assert self.first_token_ms is not None and self.finished_ms is not None
        return (self.finished_ms - self.first_token_ms) / max(self.generated - 1, 1)


@dataclass(slots=True)
class StepPlan:
    """What one step does and what comes out of it at its end."""

    duration_ms: float
    first_tokens: list[SimRequest] = field(default_factory=list)  # prefilled now: first token at the end
    decoded: list[SimRequest] = field(default_factory=list)  # one more token each at the end
    refused: list[SimRequest] = field(default_factory=list)  # prompt larger than the whole cache


class SimEngine:
    def __init__(self, node_id: str, model: EngineModel, priority_scheduling: bool = False) -> None:
        self.node_id = node_id
        self.model = model
        # vLLM's `--scheduling-policy priority`: the waiting queue by priority (FIFO within one), and
        # the lowest-priority, latest-admitted request preempted first. Otherwise FCFS.
        self.priority_scheduling = priority_scheduling
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []  # in admission order
        self.free_blocks = model.kv_blocks
        self.busy_until_ms = 0.0
        self.busy_ms = 0.0  # time spent in steps (load balance)
        self.preemptions = 0
        # Kept as requests come and go (routing reads them at every decision): the requests here
        # without their first token, and their prefills' size. Exact: a request's context and
        # cached tokens do not change between `add` and its first token, and the work's sums are of
        # integers and half-integers far below 2**53.
        self._prefilling = 0
        self._prefilling_work = NO_WORK

    @property
    def kv_usage(self) -> float:
        return 1 - self.free_blocks / self.model.kv_blocks

    @property
    def prefilling(self) -> int:
        """Requests here without their first token (queued or in prefill): what the scheduler counts
        of its streams (`NodeSnapshot.prefilling`)."""
        return self._prefilling

    @property
    def prefilling_work(self) -> PrefillWork:
        """The size of those requests' prefills (what the scheduler estimates of its streams,
        `NodeSnapshot.prefilling_work`): the tokens each computes, as `step` will compute them."""
        return self._prefilling_work

    @staticmethod
    def _prefill_of(request: SimRequest) -> PrefillWork:
        computed = request.context - min(request.cached_tokens, request.context - 1)
        return PrefillWork(computed, computed * (request.context - computed / 2))

    def _started(self, request: SimRequest) -> None:
        """`request`, counted in `prefilling` since `add`, no longer is (first token, or refused)."""
        self._prefilling -= 1
        self._prefilling_work -= self._prefill_of(request)

    def add(self, request: SimRequest) -> None:
        """Queue `request`, which has no first token yet; its context and `cached_tokens` stay as
        they are until it has one."""
        request.node_id = self.node_id
        self._prefilling += 1
        self._prefilling_work += self._prefill_of(request)
        if not self.priority_scheduling:
            self.waiting.append(request)
            return
        for index, queued in enumerate(self.waiting):
            if queued.priority_rank < request.priority_rank:
                self.waiting.insert(index, request)
                return
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.model.block_size)

    def step(self) -> StepPlan:
        """Plan the next step; `finish_step` applies its outcome when it ends."""
        m = self.model
        plan = StepPlan(0.0)
        decoding = list(self.running)
        preempted = self._grow(decoding)
        decoding = [r for r in decoding if r.blocks]  # preempted ones left the batch (hold no blocks)
        prefill_ms = 0.0
        prefill_tokens = 0
        # A step that preempted admits nothing (vLLM), unless nothing is left running: then the
        # preempted request itself must be readmitted, or the engine would stall.
        while self.waiting and len(self.running) < m.max_batch and (not preempted or not self.running):
            request = self.waiting[0]
            need = self._blocks_for(request.context + 1)
            if need > m.kv_blocks:
                plan.refused.append(self.waiting.popleft())
                if request.first_token_ms is None:
                    self._started(request)
                continue
            if need > self.free_blocks:
                break  # FIFO: nothing behind it jumps ahead
            self.waiting.popleft()
            self.free_blocks -= need
            request.blocks = need
            # At least the last token is computed (vLLM always runs it to get the next token's logits).
            computed = request.context - min(request.cached_tokens, request.context - 1)
            request.prefilled_tokens += computed
            prefill_tokens += computed
            prefill_ms += m.prefill_ms(computed, request.context)
            self.running.append(request)
            plan.first_tokens.append(request)
        plan.decoded = decoding
        context = sum(r.context for r in decoding)
        if prefill_tokens:
            prefill_ms -= float(m.prefill_overlap(prefill_tokens))
        plan.duration_ms = m.step_ms + prefill_ms + m.decode_ms(len(decoding), context)
        return plan

    def _grow(self, decoding: list[SimRequest]) -> bool:
        """Each decoding request that needs another block for its next token gets one, preempting
        the newest running request while none is free. True if it preempted any."""
        preempted = False
        block_size = self.model.block_size
        for request in decoding:
            if not request.blocks:  # preempted by an earlier one's growth
                continue
            # Its next token, at position `context`, needs a block beyond those it holds.
            while request.prompt_tokens + request.generated >= request.blocks * block_size:
                if self.free_blocks:
                    self.free_blocks -= 1
                    request.blocks += 1
                    continue
                victim = self._victim()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
        return preempted

    def _victim(self) -> SimRequest:
        if not self.priority_scheduling:
            return self.running[-1]  # the most recently admitted
        lowest = min(r.priority_rank for r in self.running)
        return next(r for r in reversed(self.running) if r.priority_rank == lowest)

    def _preempt(self, request: SimRequest) -> None:
        self.running.remove(request)
        self.free_blocks += request.blocks
        request.blocks = 0
        request.preemptions += 1
        self.preemptions += 1
        # Back to the front of the queue (of its priority's part of it, under priority scheduling).
        at = 0
        if self.priority_scheduling:
            at = next(
                (i for i, queued in enumerate(self.waiting) if queued.priority_rank <= request.priority_rank),
                len(self.waiting),
            )
        self.waiting.insert(at, request)

    def finish_step(self, plan: StepPlan, now_ms: float) -> list[SimRequest]:
        """Apply a step that ended at `now_ms`; returns the requests that finished in it."""
        self.busy_ms += plan.duration_ms
        finished = []
        for request in [*plan.decoded, *plan.first_tokens]:
            if not request.blocks:  # preempted since the step was planned
                continue
            if request.first_token_ms is None:
                self._started(request)
                request.first_token_ms = now_ms
            request.generated += 1
            if request.generated >= request.output_tokens:
                request.finished_ms = now_ms
                self.free_blocks += request.blocks
                request.blocks = 0
                finished.append(request)
        if finished:  # every request running holds a block; these hold none now
            self.running = [r for r in self.running if r.blocks]
        return finished
