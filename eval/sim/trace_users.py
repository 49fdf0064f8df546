"""Simulated users from a recorded conversation trace (Mooncake's: `eval.traces`): each user replays
the trace's sessions, one after another, closed loop.

A session is a prefix group (`eval.traces.sessions_of`): a request continues the session whose last
prompt's hash blocks lead its own. Its turns keep their recorded lengths; how much of a turn's
prompt continues the session's KV comes from the hash ids, 512-token blocks:

- when the prompt repeats every whole block of the last one and is at least that prompt plus its
  answer long, it is that history plus new tokens (a chat's next turn: Mooncake's typical case);
- otherwise it carries only the blocks it shares with the last prompt (`Step.history_tokens`), and
  the rest of the prompt is new.

Prefix blocks shared between different sessions (a common system prompt) are not modelled: the
simulator keeps KV per session. Think time before a turn is the trace's own gap between that
session's turns (scaled by `time_scale`); a session's first turn comes after a gap drawn from those.
The typing advisory's lead is the new tokens' typing time at the user's speed, within the think time.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Sequence

from eval.sim.turns import Script, Step
from eval.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest, sessions_of
from eval.workloads import TOKENS_PER_WORD, HumanTiming, UserTiming

MAX_SESSIONS_PER_USER = 16  # more than any user finishes in a run of the default length


def shared_blocks(earlier: TraceRequest, later: TraceRequest) -> int:
    """Leading hash blocks the two prompts share."""
    count = 0
    for a, b in zip(earlier.hash_ids, later.hash_ids, strict=False):
        if a != b:
            break
        count += 1
    return count


def trace_sessions(requests: Sequence[TraceRequest]) -> list[list[TraceRequest]]:
    """The trace's sessions (prefix groups), each in arrival order, in order of their first request."""
    by_session: dict[str, list[TraceRequest]] = {}
    for name, request in zip(sessions_of(list(requests)), requests, strict=True):
        by_session.setdefault(name, []).append(request)
    return list(by_session.values())


def _steps(session: Sequence[TraceRequest], user: UserTiming, time_scale: float, first_think_ms: float) -> list[Step]:
    steps = []
    for index, turn in enumerate(session):
        history: int | None = None
        if index:
            last = session[index - 1]
            blocks = shared_blocks(last, turn)
            continues = blocks >= last.input_tokens // MOONCAKE_BLOCK_TOKENS
            if continues and turn.input_tokens >= last.input_tokens + last.output_tokens:
                history = None  # the whole last prompt and its answer, then the new message
                new = turn.input_tokens - last.input_tokens - last.output_tokens
            else:
                history = min(blocks * MOONCAKE_BLOCK_TOKENS, last.input_tokens)
                new = turn.input_tokens - history
            think_ms = (turn.arrival_ms - last.arrival_ms) * time_scale
        else:
            new, think_ms = turn.input_tokens, first_think_ms
        new = max(1, new)
        typing_ms = min(think_ms, user.typing_s(math.ceil(new / TOKENS_PER_WORD)) * 1000)
        steps.append(Step(new, turn.output_tokens, think_ms, typing_ms, user.advises(), history))
    return steps


def trace_users(
    requests: Sequence[TraceRequest],
    users: int,
    timing: HumanTiming,
    *,
    stagger_ms: float = 60_000,
    seed: int = 0,
) -> list[Script]:
    """One script chain per user: the sessions, shuffled (seeded), dealt to the users in turn, at
    most `MAX_SESSIONS_PER_USER` each; each user's first starting at a random time within
    `stagger_ms`. Shuffled, so that the sessions a run reaches are a sample of the whole trace (its
    first ones continue sessions begun before it, and share less)."""
    sessions = [s for s in trace_sessions(requests) if s]
    if not sessions:
        raise ValueError("no requests to replay")
    gaps = [b.arrival_ms - a.arrival_ms for s in sessions for a, b in itertools.pairwise(s)]
    typical_gap_ms = statistics.median(gaps) if gaps else 60_000.0
    rng = random.Random(seed)
    rng.shuffle(sessions)
    scripts = []
    for u in range(users):
        user = timing.user(seed * 1_000_003 + u)
        start_ms = rng.uniform(0, stagger_ms)
        mine = sessions[u % len(sessions) :: users][:MAX_SESSIONS_PER_USER] or [sessions[u % len(sessions)]]
        chain: Script | None = None
        for k in reversed(range(len(mine))):
            first_think_ms = (rng.choice(gaps) if gaps else typical_gap_ms) * timing.time_scale
            steps = _steps(mine[k], user, timing.time_scale, first_think_ms)
            chain = Script(f"u{u}-s{k}", start_ms, tuple(steps), after=chain)
        assert chain is not None
        scripts.append(chain)
    return scripts
