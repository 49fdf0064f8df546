"""The `users` scenario's parts (`symphony bench sim --scenario users`): its workloads, the per-turn
work ratio they allow, and the search for the most users each policy serves within a TPOT bound.

At equal TPOT, the users two policies serve tend to the inverse ratio of their engine work per turn
(a bound on mean TPOT caps the work per second a node takes, whoever routes it). A workload puts a
ceiling on that ratio between recomputing every turn's prompt and resuming the session's KV:
`work_ratio_bound`, computed from the workload alone.

The search: every policy runs at the starting user counts; the TPOT bound is `TPOT_BOUND` (1.15) x the
baseline's mean TPOT at the fewest. A policy still within the bound at its most users runs again at
twice as many, until its TPOT crosses the bound or `max_users` is reached; then `refine` bisections
narrow the crossing, and its limit is where its TPOT crosses the bound, interpolated linearly between
the two points that bracket the first crossing. A policy that never crossed has only a lower bound.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from eval.sim.engine import EngineModel
from eval.sim.tool_agents import AgentShape, agent_users
from eval.sim.trace_users import trace_users
from eval.sim.turns import Script
from eval.sim.workload import sharegpt_users
from eval.traces import TraceRequest
from eval.workloads import Conversation, HumanTiming

TPOT_BOUND = 1.15
Row = dict[str, Any]
Points = dict[str, dict[int, Row]]  # policy -> users -> that run's summary


WORKLOADS = ("sharegpt", "mooncake", "agentic")
# Where each workload's search starts: light enough that the baseline's TPOT there is its unloaded one.
START_USERS = {"sharegpt": (64, 128, 256, 512, 1024), "mooncake": (32, 64, 128, 256), "agentic": (4, 8, 16, 32)}
# Simulated seconds per point: Mooncake's whole hour, as its turns are few and its prefills large
# (a run of 600 s moved its ratio by 0.6 from one length to another).
DURATION_S = {"sharegpt": 600.0, "mooncake": 3600.0, "agentic": 600.0}


@dataclass(frozen=True, slots=True)
class UsersWorkload:
    name: str
    scripts: Callable[[int], list[Script]]  # users -> their scripts (seeded: the same for every policy)
    details: dict[str, Any]  # what the result records about it


def users_workload(
    name: str,
    timing: HumanTiming,
    *,
    conversations: Sequence[Conversation] = (),
    trace: Sequence[TraceRequest] = (),
    agent: AgentShape | None = None,
    seed: int = 0,
) -> UsersWorkload:
    """`name`'s users: ShareGPT `conversations` with human timing, a Mooncake `trace`'s sessions,
    or tool-calling agents of `agent`'s shape."""
    if name == "sharegpt":
        if not conversations:
            raise ValueError("the sharegpt workload needs conversations")
        return UsersWorkload(
            name,
            lambda users: sharegpt_users(conversations, users, timing, seed=seed),
            {"conversations": len(conversations)},
        )
    if name == "mooncake":
        if not trace:
            raise ValueError("the mooncake workload needs a trace's requests")
        return UsersWorkload(
            name, lambda users: trace_users(trace, users, timing, seed=seed), {"trace_requests": len(trace)}
        )
    if name == "agentic":
        shape = agent or AgentShape()
        miss = timing.advisory_miss_rate
        return UsersWorkload(
            name,
            lambda users: agent_users(shape, users, miss_rate=miss, seed=seed),
            {"agent": dataclasses.asdict(shape), "final_context_tokens": shape.final_context_tokens()},
        )
    raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")


def chain(script: Script) -> Iterator[Script]:
    """A user's scripts in the order they run (a script, then its `after`, ...)."""
    current: Script | None = script
    while current is not None:
        yield current
        current = current.after


@dataclass(frozen=True, slots=True)
class TurnSize:
    arrival_ms: float  # on a cluster that answers at once: the user's think times only
    prompt_tokens: int
    held_tokens: int  # of the prompt, what the session's KV holds when the turn comes
    output_tokens: int


def turn_sizes(script: Script, step_ms: float = 0.0) -> Iterator[TurnSize]:
    """A user's turns (`script` and those after it), as the simulator plays them: a turn resumes the
    last turn's prompt and answer but the answer's last token (never fed back), or what
    `Step.history_tokens` keeps of them. Arrivals take each answer to stream at `step_ms` a token."""
    now_ms = script.start_ms
    for part in chain(script):
        prompt = held = last_output = 0
        for index, step in enumerate(part.steps):
            if index == 0:
                prompt, held = step.new_tokens, 0
                if part is not script:
                    now_ms += step.think_ms
            else:
                history = prompt + last_output
                kv = history - 1
                if step.history_tokens is not None:
                    history = min(history, step.history_tokens)
                    kv = min(kv, history)
                prompt, held = history + step.new_tokens, kv
                now_ms += step.think_ms
            yield TurnSize(now_ms, prompt, held, step.output_tokens)
            last_output = step.output_tokens
            now_ms += step.output_tokens * step_ms


def work_ratio_bound(scripts: Sequence[Script], engine: EngineModel, until_ms: float) -> float:
    """Engine work per turn recomputing every prompt over resuming the session's KV
    (`EngineModel.turn_work_ms`), summed over the turns the workload's users send within `until_ms`
    (on a cluster that answers at its unloaded pace): the ceiling the workload puts on the users
    ratio between recompute with nothing cached and a policy that resumes every turn on its KV."""
    recompute = resume = 0.0
    for script in scripts:
        for turn in turn_sizes(script, engine.step_ms):
            if turn.arrival_ms > until_ms:
                break
            prompt = turn.prompt_tokens
            recompute += engine.turn_work_ms(prompt, prompt, turn.output_tokens)
            resume += engine.turn_work_ms(prompt, prompt - min(turn.held_tokens, prompt - 1), turn.output_tokens)
    if not resume:
        raise ValueError("the workload sends no turn in that time")
    return recompute / resume


def _beyond(row: Row, bound_ms: float) -> bool:
    """Past the bound; a run in which no answer of two tokens or more finished counts as past it."""
    return row["tpot_ms_mean"] is None or row["tpot_ms_mean"] > bound_ms


def crossing(rows: dict[int, Row], bound_ms: float) -> tuple[int | None, int] | None:
    """(the last user count within the bound before the first beyond it, that first one); None if
    every point is within it. The first element is None when even the fewest users were beyond it."""
    within: int | None = None
    for users in sorted(rows):
        if _beyond(rows[users], bound_ms):
            return within, users
        within = users
    return None


@dataclass(slots=True)
class Limit:
    users: float | None  # where TPOT crosses the bound (interpolated); without a crossing, the most run
    crossed: bool
    bracket: tuple[int | None, int] | None = None  # the points run either side of the crossing

    def as_dict(self) -> dict[str, Any]:
        return {"users": self.users, "crossed": self.crossed, "bracket": list(self.bracket) if self.bracket else None}


def limit(rows: dict[int, Row], bound_ms: float) -> Limit:
    found = crossing(rows, bound_ms)
    if found is None:
        return Limit(float(max(rows)), crossed=False)
    low, high = found
    if low is None:
        return Limit(None, crossed=True, bracket=found)
    tpot_low, tpot_high = rows[low]["tpot_ms_mean"], rows[high]["tpot_ms_mean"]
    if tpot_high is None or tpot_high <= tpot_low:
        return Limit(float(low), crossed=True, bracket=found)
    users = low + (bound_ms - tpot_low) * (high - low) / (tpot_high - tpot_low)
    return Limit(users, crossed=True, bracket=found)


@dataclass(slots=True)
class Search:
    points: Points
    bound_ms: float | None
    limits: dict[str, Limit] = field(default_factory=dict)

    def ratio(self, policy: str, baseline: str) -> float | None:
        """`policy`'s limit over the baseline's (None unless the baseline crossed the bound with a
        point within it; a lower bound when `policy` never crossed)."""
        ours, base = self.limits[policy], self.limits[baseline]
        if not base.crossed or not base.users or ours.users is None:
            return None
        return ours.users / base.users


def search_users(
    run: Callable[[str, int], Row],
    policies: Sequence[str],
    start: Sequence[int],
    *,
    baseline: str = "recompute",
    max_users: int = 65_536,
    refine: int = 2,
    tpot_bound: float = TPOT_BOUND,
) -> Search:
    """Run `run(policy, users)` at the starting counts, then as the module says; every point is
    measured once. The bound comes from the baseline's TPOT at the fewest users."""
    if baseline not in policies:
        raise ValueError(f"the baseline {baseline!r} must be among the policies")
    points: Points = {policy: {} for policy in policies}

    def measure(policy: str, users: int) -> None:
        if users not in points[policy]:
            points[policy][users] = run(policy, users)

    for users in sorted(set(start)):
        for policy in policies:
            measure(policy, users)
    reference = points[baseline][min(start)]["tpot_ms_mean"]
    if reference is None:
        return Search(points, None, {p: limit(points[p], float("inf")) for p in policies})
    bound_ms = tpot_bound * reference
    for policy in policies:
        rows = points[policy]
        while crossing(rows, bound_ms) is None and max(rows) * 2 <= max_users:
            measure(policy, max(rows) * 2)
        for _ in range(refine):
            found = crossing(rows, bound_ms)
            if found is None or found[0] is None or found[1] - found[0] <= 1:
                break
            measure(policy, (found[0] + found[1]) // 2)
    return Search(points, bound_ms, {policy: limit(points[policy], bound_ms) for policy in policies})
