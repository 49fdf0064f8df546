"""Simulated users from ShareGPT conversations and human timing (`eval.workloads`, the same model the
live load generator uses): each user replays conversations back to back, reading every answer and
typing every message, with a typing-start advisory unless it is missed."""

from __future__ import annotations

import random
from collections.abc import Sequence

from eval.sim.turns import Script, Step
from eval.workloads import TOKENS_PER_WORD, Conversation, HumanTiming, UserTiming, answer_tokens
from symphony.priority import Priority


def _words(text: str) -> int:
    return len(text.split())


def conversation_script(
    conversation: Conversation,
    session: str,
    user: UserTiming,
    start_ms: float,
    max_answer_tokens: int,
    after: Script | None,
    priority: Priority,
) -> Script:
    steps = []
    previous_answer_words = 0
    for turn in conversation.turns:
        words = _words(turn.message)
        typing_ms = user.typing_s(words) * 1000
        think_ms = user.reading_s(previous_answer_words) * 1000 + typing_ms
        output = answer_tokens(turn, max_answer_tokens)
        steps.append(Step(max(1, round(words * TOKENS_PER_WORD)), output, think_ms, typing_ms, user.advises()))
        previous_answer_words = round(output / TOKENS_PER_WORD)
    return Script(session, start_ms, tuple(steps), priority=priority, after=after)


def sharegpt_users(
    conversations: Sequence[Conversation],
    users: int,
    timing: HumanTiming,
    *,
    conversations_per_user: int = 4,
    max_answer_tokens: int = 512,
    stagger_ms: float = 60_000,
    seed: int = 0,
    high_share: float = 0.0,
) -> list[Script]:
    """One script chain per user: `conversations_per_user` conversations (taken in turn from
    `conversations`), the first starting at a random time within `stagger_ms`; `high_share` of the
    users (chosen at random) are high priority, the rest normal."""
    if not conversations:
        raise ValueError("no conversations to replay")
    if not 0 <= high_share <= 1:
        raise ValueError(f"high_share {high_share} is not a share in [0, 1]")
    rng = random.Random(seed)
    high = set(random.Random(seed + 1).sample(range(users), round(high_share * users)))
    scripts = []
    for u in range(users):
        user = timing.user(seed * 1_000_003 + u)
        start_ms = rng.uniform(0, stagger_ms)
        chain: Script | None = None
        for k in reversed(range(conversations_per_user)):
            conversation = conversations[(u * conversations_per_user + k) % len(conversations)]
            chain = conversation_script(
                conversation,
                f"u{u}-c{k}",
                user,
                start_ms,
                max_answer_tokens,
                chain,
                Priority.HIGH if u in high else Priority.NORMAL,
            )
        assert chain is not None
        scripts.append(chain)
    return scripts
