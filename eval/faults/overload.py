"""Scenario 6, overload and fairness: open-loop load past capacity gets quick refusals (503 with
Retry-After) rather than latency collapse, and a tenant flooding requests and advisories leaves
another tenant's latency near its value alone.

Three phases through the scheduler replicas, every request a greedy chat of one of a few
MT-bench questions (so one recompute reference per distinct prompt checks every answer):
1. **capacity**: `workers` closed-loop clients of the flooding tenant, as many as the engines run
   at once, for `capacity_s` and until CAPACITY_ROUNDS answers per client came; the capacity is the
   answers per second that ended in the phase's second half, and their p99 latency the saturated
   latency (the time in a full engine).
2. **quiet alone**: the quiet tenant sends open-loop (Poisson) at `QUIET_SHARE` of the capacity,
   one-token answers (their latency is their time to first token); its p95.
3. **flood**: the flooding tenant sends open-loop at `factor` x the capacity, each request after
   an advisory of its own session, while the quiet tenant sends as in phase 2.
   - The flood's answers must not collapse: their p99 within `scheduler.max_queue_wait_s` plus
     twice the saturated p99.
   - The surplus is refused: `503 overloaded` (admission) or `429 queue_full`.
   - The goodput holds: the flood's answers that ended during the flood, after its first
     `max_queue_wait_s` (the queue filling), at least GOODPUT_SHARE of the capacity less the
     quiet tenant's answers in the same span (the engines' time those take is not the flood's to
     have; each counted as a whole answer, though it is one token: a stricter bar).
   - The quiet tenant's p95 is compared with phase 2's (the issue's target: within 1.5x).

Pacing uses the event loop's clock (open loop: a request's send never waits for another's answer).
Each loop draws its arrivals and questions from its own generator, seeded from `seed`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import openai

from eval.faults.chats import ChatLoad, reference
from eval.faults.checker import Answer, RequestOutcome, percentile
from eval.resume_runner import mtbench_turns

# The flood's answer lengths, one drawn per request. Of one length, requests started together end
# together: a CPU engine's batch of 8 freed its slots all at once, 9 s apart, and every request
# held back waited for the next such burst (the quiet tenant's p95 with it: 14 s, `c381c45`).
FLOOD_TOKENS = (4, 8, 12, 16)
QUIET_TOKENS = (1,)  # the answer is the first token: the latency is the time to it
QUIET_SHARE = 0.05  # of the capacity, the quiet tenant's rate (at least QUIET_MIN_RPS)
QUIET_MIN_RPS = 0.5
QUESTIONS = 8  # distinct prompts
# The capacity phase lasts until this many answers per client came: its second half must be past
# the first round's ramp (every client starting at once). With one round, a phase of 15 s and
# answers of 4-16 tokens taking 10-24 s, few answers ended in it (0.66 a second measured for a
# cluster serving 2).
CAPACITY_ROUNDS = 3
FAIRNESS_BOUND = 1.5  # the quiet tenant's p95 with the flood, over its p95 alone (the issue's)
GOODPUT_SHARE = 0.8  # answers per second under the flood, of the capacity
REFUSALS = ("503:overloaded", "429:queue_full", "429:tenant_queue_full")  # the surplus, refused

Advise = Callable[[str, str], Awaitable[int]]  # (tenant, session) -> the advisory's HTTP status (0: none)


@dataclass(frozen=True)
class OverloadPlan:
    capacity_s: float
    quiet_s: float
    flood_s: float
    workers: int  # closed-loop clients that saturate the cluster
    longest_s: float  # the capacity phase's, when its answers are slow to come
    factor: float = 2.0  # the flood's rate, of the capacity
    seed: int = 0


@functools.cache
def _questions() -> tuple[str, ...]:
    return tuple(turns[0] for turns in mtbench_turns())[:QUESTIONS]


def messages_of(index: int) -> list[dict[str, str]]:
    questions = _questions()
    return [{"role": "user", "content": questions[index % len(questions)]}]


class OverloadLoad:
    """Sends the phases' requests (through `load.send`, the failover clients) and advisories."""

    def __init__(self, load: ChatLoad, advise: Advise, seed: int) -> None:
        self.load = load
        self.advise = advise
        self.seed = seed
        self.loops = 0  # each loop's generator: seeded from (seed, its number)
        self.advisories: Counter[int] = Counter()

    def _rng(self) -> random.Random:
        self.loops += 1
        return random.Random(f"{self.seed}-{self.loops}")

    async def _one(self, tenant: str, question: int, tokens: int, advised: bool) -> RequestOutcome:
        session = f"{self.load.scenario}-{tenant}-{uuid.uuid4().hex[:10]}"
        if advised:
            self.advisories[await self.advise(tenant, session)] += 1
        return await self.load.send(tenant, session, messages_of(question), tokens)

    async def closed_loop(
        self, tenant: str, workers: int, duration_s: float, tokens: Sequence[int], longest_s: float
    ) -> tuple[list[RequestOutcome], float]:
        """`workers` clients, each sending its next request when its last ended, for `duration_s`
        and until CAPACITY_ROUNDS answers per client ended (engines that take longer than the
        phase to answer a few full batches still get measured full), at most `longest_s`. Returns once every one
        has ended, with the phase's end: when the last request was sent (monotonic)."""
        started = time.monotonic()
        outcomes: list[RequestOutcome] = []
        rng = self._rng()
        ended = started

        def going_on() -> bool:
            elapsed = time.monotonic() - started
            answered = sum(1 for o in outcomes if o.kind == "ok")
            return elapsed < duration_s or (answered < CAPACITY_ROUNDS * workers and elapsed < longest_s)

        async def worker() -> None:
            nonlocal ended
            while going_on():
                ended = time.monotonic()
                question, length = rng.randrange(QUESTIONS), rng.choice(tokens)
                outcomes.append(await self._one(tenant, question, length, False))

        await asyncio.gather(*(worker() for _ in range(workers)))
        return outcomes, ended

    async def open_loop(
        self, tenant: str, rate_per_s: float, duration_s: float, tokens: Sequence[int], advised: bool = False
    ) -> list[RequestOutcome]:
        """Poisson arrivals at `rate_per_s` for `duration_s`; returns once every one has ended."""
        loop, rng = asyncio.get_running_loop(), self._rng()
        start = loop.time()
        at = start
        sent: list[asyncio.Task[RequestOutcome]] = []
        while (at := at + rng.expovariate(rate_per_s)) < start + duration_s:
            await asyncio.sleep(max(0.0, at - loop.time()))
            question, length = rng.randrange(QUESTIONS), rng.choice(tokens)
            sent.append(asyncio.create_task(self._one(tenant, question, length, advised)))
        return list(await asyncio.gather(*sent))


async def distinct_references(
    engines: Sequence[openai.AsyncOpenAI], model: str, outcomes: Sequence[RequestOutcome]
) -> list[Answer | None]:
    """Each answered outcome's recompute reference, computed once per distinct prompt and answer
    length asked for (greedy: the same for every request that asks the same)."""

    def key(o: RequestOutcome) -> tuple[str, int] | None:
        return (json.dumps(o.messages, sort_keys=True), o.max_tokens) if o.answer is not None else None

    wanted = {k: o.messages for o in outcomes if (k := key(o)) is not None}
    found: dict[tuple[str, int], Answer] = {}
    for n, (k, messages) in enumerate(sorted(wanted.items())):
        try:
            found[k] = await reference(engines[n % len(engines)], model, messages, max(1, k[1]))
        except openai.APIError:
            continue  # no reference: its outcomes count as unchecked
    return [found.get(k) if (k := key(o)) is not None else None for o in outcomes]


def _latencies(outcomes: Sequence[RequestOutcome]) -> list[float]:
    return [o.elapsed_s for o in outcomes if o.kind == "ok"]


def capacity_of(outcomes: Sequence[RequestOutcome], start_s: float, end_s: float) -> tuple[float, float | None]:
    """Answers per second that ended in the second half of the phase [start_s, end_s] (its
    clients' deadline: those that ended after it, draining, do not count), and their p99 (s)."""
    middle = (start_s + end_s) / 2
    ended = [o for o in outcomes if o.kind == "ok" and middle <= o.started_s + o.elapsed_s <= end_s]
    rate = len(ended) / (end_s - middle) if end_s > middle else 0.0
    return rate, percentile([o.elapsed_s for o in ended], 99)


def overload_summary(
    capacity: Sequence[RequestOutcome],
    capacity_window: tuple[float, float],
    quiet_alone: Sequence[RequestOutcome],
    flood: Sequence[RequestOutcome],
    quiet_flooded: Sequence[RequestOutcome],
    flood_window: tuple[float, float],
    max_queue_wait_s: float,
    offered_rps: float,
) -> dict[str, Any]:
    """The scenario's figures (every latency in seconds) and the inputs of its targets; each
    window is (start, deadline) on the outcomes' clock."""
    capacity_rps, saturated_p99 = capacity_of(capacity, *capacity_window)
    accepted = _latencies(flood)
    refused = [o for o in flood if o.kind in REFUSALS]
    # The goodput's span: the flood once its queue filled (admission's bound), to its deadline.
    counted_from = flood_window[0] + min(max_queue_wait_s, (flood_window[1] - flood_window[0]) / 2)

    def served(outcomes: Sequence[RequestOutcome]) -> int:
        return sum(
            1 for o in outcomes if o.kind == "ok" and counted_from <= o.started_s + o.elapsed_s <= flood_window[1]
        )

    span_s = flood_window[1] - counted_from
    alone_p95 = percentile(_latencies(quiet_alone), 95)
    flooded_p95 = percentile(_latencies(quiet_flooded), 95)
    bound = max_queue_wait_s + 2 * saturated_p99 if saturated_p99 is not None else None
    return {
        "capacity_rps": round(capacity_rps, 2),
        "saturated_p99_s": saturated_p99,
        "offered_rps": round(offered_rps, 2),
        "flood_requests": len(flood),
        "flood_accepted": len(accepted),
        "flood_refused": len(refused),
        "flood_refused_by_kind": dict(Counter(o.kind for o in refused)),
        "flood_errors_by_kind": dict(Counter(o.kind for o in flood if o.kind != "ok" and o.kind not in REFUSALS)),
        "flood_refused_p99_s": percentile([o.elapsed_s for o in refused], 99),
        "flood_accepted_p50_s": percentile(accepted, 50),
        "flood_accepted_p99_s": percentile(accepted, 99),
        "flood_accepted_p99_bound_s": bound,
        "goodput_rps": round(served(flood) / span_s, 2),
        "quiet_goodput_rps": round(served(quiet_flooded) / span_s, 2),
        "quiet_alone_requests": len(quiet_alone),
        "quiet_alone_p95_s": alone_p95,
        "quiet_flooded_requests": len(quiet_flooded),
        "quiet_flooded_errors": sum(1 for o in quiet_flooded if o.kind != "ok"),
        "quiet_flooded_p95_s": flooded_p95,
        "quiet_p95_ratio": round(flooded_p95 / alone_p95, 3) if alone_p95 and flooded_p95 is not None else None,
        "max_queue_wait_s": max_queue_wait_s,
    }


def overload_targets(report: dict[str, Any]) -> dict[str, bool]:
    """Scenario 6's targets: the surplus refused, the answers' latency bounded, the goodput kept,
    and the quiet tenant's p95 within FAIRNESS_BOUND of its value alone (served, every request)."""
    p99, bound = report["flood_accepted_p99_s"], report["flood_accepted_p99_bound_s"]
    ratio = report["quiet_p95_ratio"]
    return {
        "overload_surplus_refused": report["flood_refused"] > 0,
        "overload_accepted_p99_bounded": p99 is not None and bound is not None and p99 <= bound,
        "overload_goodput_ge_0.8_capacity": report["goodput_rps"]
        >= GOODPUT_SHARE * (report["capacity_rps"] - report["quiet_goodput_rps"])
        > 0,
        "overload_quiet_p95_within_1.5x": ratio is not None
        and ratio <= FAIRNESS_BOUND
        and report["quiet_flooded_errors"] == 0,
    }


async def run_overload(
    load: ChatLoad, advise: Advise, plan: OverloadPlan, quiet: str, flooder: str, max_queue_wait_s: float
) -> tuple[list[RequestOutcome], dict[str, Any]]:
    """The three phases (module docstring); every outcome, and the summary."""
    sender = OverloadLoad(load, advise, plan.seed)
    started = time.monotonic()
    capacity, ended = await sender.closed_loop(flooder, plan.workers, plan.capacity_s, FLOOD_TOKENS, plan.longest_s)
    window = (started, ended)
    capacity_rps, _ = capacity_of(capacity, *window)
    if capacity_rps <= 0:
        raise RuntimeError(f"no answer ended in the capacity phase's second half ({len(capacity)} requests)")
    quiet_rps = max(QUIET_MIN_RPS, QUIET_SHARE * capacity_rps)
    alone = await sender.open_loop(quiet, quiet_rps, plan.quiet_s, QUIET_TOKENS)
    flood_started = time.monotonic()
    offered = plan.factor * capacity_rps
    flood, flooded = await asyncio.gather(
        sender.open_loop(flooder, offered, plan.flood_s, FLOOD_TOKENS, advised=True),
        sender.open_loop(quiet, quiet_rps, plan.flood_s, QUIET_TOKENS),
    )
    summary = overload_summary(
        capacity,
        window,
        alone,
        flood,
        flooded,
        (flood_started, flood_started + plan.flood_s),
        max_queue_wait_s,
        offered,
    )
    summary.update({"workers": plan.workers, "quiet_rps": round(quiet_rps, 2), "advisories": dict(sender.advisories)})
    return [*capacity, *alone, *flood, *flooded], summary
