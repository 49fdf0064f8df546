"""What the simulator's users send: turns (open loop, at their times) and scripted sessions (closed
loop, each turn after the last answer and the user's think time)."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.routing import Priority


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of the workload: its arrival, and an advisory ahead of it (None: no advisory)."""

    session: str
    arrival_ms: float
    prompt_tokens: int  # the whole prompt: the session's history plus the new message
    output_tokens: int
    advisory_ms: float | None = None
    tenant: str = "default"
    priority: Priority = Priority.NORMAL
    # Of the prompt, the leading tokens that continue the session's KV (None: as many as it holds);
    # a turn whose prompt drops part of the history reuses no more than what it kept.
    history_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Step:
    """One turn of a scripted (closed-loop) session: the user's think time starts when the previous
    answer is complete, so the turn's arrival depends on how fast the cluster answered."""

    new_tokens: int  # the message the user adds to the history
    output_tokens: int
    think_ms: float  # after the previous answer: reading it, then typing this message
    typing_ms: float  # the last part of think_ms: the advisory fires when typing starts
    advised: bool = True
    # How much of the session's context (its last prompt and answer) the prompt carries before
    # the new tokens: None, all of it; fewer, a prompt that dropped the rest (a recorded trace's).
    history_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Script:
    session: str
    start_ms: float  # the first turn's arrival
    steps: tuple[Step, ...]
    tenant: str = "default"
    priority: Priority = Priority.NORMAL
    # The same user's next conversation (a new session): its first turn arrives its first step's
    # think time after this one's last answer.
    after: Script | None = None
