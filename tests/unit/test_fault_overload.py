"""Scenario 6's figures and targets (eval.faults.overload), on hand-made outcomes; its open loop,
on a fake sender."""

from __future__ import annotations

import asyncio

from eval.faults.checker import Answer, RequestOutcome
from eval.faults.overload import (
    OverloadLoad,
    capacity_of,
    distinct_references,
    messages_of,
    overload_summary,
    overload_targets,
)


def outcome(started: float, elapsed: float, status: int = 200, tenant: str = "t") -> RequestOutcome:
    kind = "ok" if status == 200 else f"{status}:overloaded"
    answer = Answer(("a",), (1.0,)) if status == 200 else None
    return RequestOutcome("overload", tenant, "s", started, elapsed, status, kind, messages_of(0), answer)


def test_the_capacity_is_the_answers_ended_in_the_phase_s_second_half() -> None:
    # 10 s phase: answers ending at 1..10 s; 6 of them end in [5, 10] s (5, 6, ..., 10).
    outcomes = [outcome(t - 1.0, 1.0) for t in range(1, 11)] + [outcome(2.0, 0.01, 503)]
    rate, p99 = capacity_of(outcomes, 0.0, 10.0)
    assert rate == 6 / 5 and p99 == 1.0


def test_the_summary_and_targets_judge_collapse_refusals_goodput_and_fairness() -> None:
    capacity = [outcome(t + 0.5, 1.0) for t in range(20)]  # 10 answers end in [10, 20]: 1 a second
    alone = [outcome(0.0, 0.1), outcome(0.0, 0.2)]
    flood = [outcome(30.0 + t, 2.0) for t in range(16)] + [outcome(31.0, 0.01, 503)]
    flooded = [outcome(30.0, 0.25), outcome(31.0, 0.2), outcome(45.0, 0.2)]
    report = overload_summary(capacity, (0.0, 20.0), alone, flood, flooded, (30.0, 50.0), 10.0, 2.0)
    assert report["capacity_rps"] == 1.0 and report["saturated_p99_s"] == 1.0
    assert report["flood_accepted_p99_bound_s"] == 12.0  # 10 s of queue + twice 1 s
    assert report["flood_refused"] == 1 and report["flood_refused_by_kind"] == {"503:overloaded": 1}
    # Answers ending in [40, 50] s: 8 of the flood's and 1 of the quiet tenant's (its share).
    assert report["goodput_rps"] == 0.8 and report["quiet_goodput_rps"] == 0.1
    assert report["quiet_p95_ratio"] == 1.25
    assert all(overload_targets(report).values()), overload_targets(report)

    # Every one accepted and waiting 40 s, or timed out in the queue: collapse. None ended during
    # the flood (no goodput), and a queue timeout is no refusal of the surplus.
    collapsed = [outcome(30.0 + t, 40.0) for t in range(16)] + [outcome(31.0, 60.0, 503)]
    collapsed[-1].kind = "503:queue_timeout"
    unfair = [outcome(30.0, 0.5), outcome(31.0, 0.2)]
    report = overload_summary(capacity, (0.0, 20.0), alone, collapsed, unfair, (30.0, 50.0), 10.0, 2.0)
    assert report["flood_errors_by_kind"] == {"503:queue_timeout": 1} and report["goodput_rps"] == 0.0
    missed = {name for name, held in overload_targets(report).items() if not held}
    assert missed == set(overload_targets(report))  # every target


def test_references_are_computed_once_per_distinct_prompt_and_length() -> None:
    asked: list[tuple[str, int]] = []

    class Completions:
        async def create(self, **kwargs: object) -> object:
            messages = kwargs["messages"]
            assert isinstance(messages, list) and isinstance(kwargs["max_tokens"], int)
            asked.append((messages[0]["content"], kwargs["max_tokens"]))
            token = type("T", (), {"token": "a", "logprob": 0.0, "top_logprobs": []})
            logprobs = type("L", (), {"content": [token] * kwargs["max_tokens"]})
            return type("R", (), {"choices": [type("C", (), {"logprobs": logprobs})]})

    engine = type("E", (), {"chat": type("Chat", (), {"completions": Completions()})})
    outcomes = [outcome(0.0, 1.0), outcome(1.0, 1.0), outcome(2.0, 0.1, 503)]
    refs = asyncio.run(distinct_references([engine], "m", outcomes))  # type: ignore[list-item]
    assert len(asked) == 1 and refs[0] is refs[1] and refs[0] is not None and refs[2] is None


async def test_the_open_loop_sends_poisson_arrivals_without_waiting_for_answers() -> None:
    sent: list[float] = []
    lengths: set[int] = set()
    gate = asyncio.Event()

    class Load:
        scenario = "overload"

        async def send(self, tenant: str, session: str, messages: object, tokens: int) -> RequestOutcome:
            sent.append(asyncio.get_running_loop().time())
            lengths.add(tokens)
            if len(sent) >= 40:
                gate.set()
            await gate.wait()  # no answer before 40 were sent: a closed loop would never get there
            return outcome(0.0, 0.0, tenant=tenant)

    async def advise(tenant: str, session: str) -> int:
        return 202

    sender = OverloadLoad(Load(), advise, seed=1)  # type: ignore[arg-type]
    outcomes = await asyncio.wait_for(sender.open_loop("t", 200.0, 0.5, (4, 8), advised=True), 10.0)
    assert 50 <= len(outcomes) <= 150  # about 100 at 200 a second for 0.5 s
    assert lengths == {4, 8}  # one answer length drawn per request
    assert sender.advisories == {202: len(outcomes)}
