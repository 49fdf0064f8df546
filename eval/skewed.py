"""A skewed chat workload: a few heavy users among many light ones, so that placing a session once
and keeping it there (sticky routing) can pile the heavy sessions onto one node.

From the same ShareGPT conversations as the plain replay (user u takes conversations u, u + U,
u + 2U, ... of U users), a seeded draw makes `heavy_share` of the users heavy:

- a heavy user's sessions are long: conversations chained back to back into one session until its
  estimated history (messages at `TOKENS_PER_WORD`, answers at their replayed length) would pass
  `heavy_history_tokens`, which keeps them inside SmolLM2's 8,192-token context;
- a heavy user is fast: their reading and typing take `heavy_pace` times a light user's, so they send
  about 1/heavy_pace as many turns per second;
- a light user's sessions are short: each conversation cut to `light_turns` turns, at human pace.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from eval.workloads import TOKENS_PER_WORD, Conversation, Turn, UserPlan, answer_tokens

TEMPLATE_TOKENS_PER_TURN = 10  # chat-template tokens around a message and its answer (estimate)


@dataclass(frozen=True, slots=True)
class SkewSettings:
    heavy_share: float = 0.25  # of the users, at least one
    heavy_pace: float = 0.25  # a heavy user's reading and typing time over a light user's
    heavy_history_tokens: int = 4096  # a heavy session's estimated history stays within this
    light_turns: int = 2  # a light session's turns at most

    def __post_init__(self) -> None:
        if not 0 < self.heavy_share <= 1:
            raise ValueError(f"heavy_share {self.heavy_share} is not a share in (0, 1]")
        if not 0 < self.heavy_pace <= 1:
            raise ValueError(f"heavy_pace {self.heavy_pace} must be in (0, 1] (1: as slow as a light user)")
        if self.heavy_history_tokens < 1 or self.light_turns < 1:
            raise ValueError("heavy_history_tokens and light_turns must be positive")


def turn_tokens(turn: Turn, max_answer_tokens: int) -> int:
    """A turn's estimated share of a history: its message, its replayed answer, the template."""
    return (
        round(len(turn.message.split()) * TOKENS_PER_WORD)
        + answer_tokens(turn, max_answer_tokens)
        + TEMPLATE_TOKENS_PER_TURN
    )


def chain(conversations: Sequence[Conversation], budget_tokens: int, max_answer_tokens: int) -> list[Conversation]:
    """The conversations' turns, in order, regrouped into sessions whose estimated history stays
    within `budget_tokens` (a turn alone over the budget is a session of its own)."""
    sessions: list[Conversation] = []
    turns: list[Turn] = []
    tokens = 0
    for conversation in conversations:
        for turn in conversation.turns:
            cost = turn_tokens(turn, max_answer_tokens)
            if turns and tokens + cost > budget_tokens:
                sessions.append(Conversation(f"chain{len(sessions)}", tuple(turns)))
                turns, tokens = [], 0
            turns.append(turn)
            tokens += cost
    if turns:
        sessions.append(Conversation(f"chain{len(sessions)}", tuple(turns)))
    return sessions


def skewed_plans(
    conversations: Sequence[Conversation],
    users: int,
    settings: SkewSettings,
    *,
    max_answer_tokens: int,
    seed: int,
) -> list[UserPlan]:
    """One plan per user; which users are heavy is drawn from `seed`."""
    if not conversations:
        raise ValueError("no conversations to replay")
    heavy = set(random.Random(seed).sample(range(users), max(1, round(settings.heavy_share * users))))
    plans = []
    for user in range(users):
        own = [conversations[i % len(conversations)] for i in range(user, max(user + 1, len(conversations)), users)]
        if user in heavy:
            sessions = chain(own, settings.heavy_history_tokens, max_answer_tokens)
            plans.append(UserPlan(tuple(sessions), settings.heavy_pace, heavy=True))
        else:
            cut = [Conversation(c.conversation_id, c.turns[: settings.light_turns]) for c in own]
            plans.append(UserPlan(tuple(cut)))
    return plans
