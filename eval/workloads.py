"""Multi-turn chat workloads with human timing: ShareGPT conversations replayed turn by turn, with a
user who reads each answer, then types the next message, and whose typing start is the advisory.

Timing model (seeded, so every policy of a run sees the same users): each user reads at a speed
drawn once from N(184, 29) words per minute (IReST) and types at N(52, 12) words per minute (Dhakal
et al. 2018); a turn's think time is the answer's reading time, then the next message's typing
time. The advisory fires when typing starts (its lead is the typing time), except for a configured
share of turns where it is missed. `time_scale` compresses the human times so a small cluster sees
many turns in a short run (0.05: a minute of thinking becomes 3 s). It compresses the advisories'
leads too (10 s of typing becomes 0.5 s); `typing_time_scale`, when set, scales the typing alone,
so that only the idle time (reading the answer) is compressed and the leads stay human-scale
(`typing_time_scale=1`: typing at human speed).

Any file in ShareGPT's format works: JSON lines (or a JSON list) of {"id", "conversations": [{"from":
"human"|"gpt"|"system", "value"}]}.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SHAREGPT_SAMPLE = Path(__file__).resolve().parent / "data" / "sharegpt" / "sharegpt_multiturn_sample.jsonl"
TOKENS_PER_WORD = 1.3  # English text in LLaMA-family tokenizers


@dataclass(frozen=True, slots=True)
class Turn:
    message: str  # what the user sends
    answer_words: int  # the original answer's length, which bounds the replayed one


@dataclass(frozen=True, slots=True)
class Conversation:
    conversation_id: str
    turns: tuple[Turn, ...]


def load_sharegpt(
    path: Path, *, min_turns: int = 2, max_turns: int = 8, max_message_words: int = 400, limit: int | None = None
) -> list[Conversation]:
    """Conversations with at least `min_turns` user turns, cut to `max_turns`; leading assistant
    messages (shared excerpts that start mid-conversation) and system messages are skipped, long
    messages cut to `max_message_words`. Raises ValueError naming the file when it is not ShareGPT."""
    text = Path(path).read_text()
    try:
        records = (
            json.loads(text)
            if text.lstrip().startswith("[")
            else [json.loads(line) for line in text.splitlines() if line.strip()]
        )
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON or JSON lines ({exc})") from None
    conversations = []
    for index, record in enumerate(records):
        if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
            raise ValueError(f"{path}: record {index} has no 'conversations' list")
        turns = list(_turns(record["conversations"], max_message_words))[:max_turns]
        if len(turns) >= min_turns:
            conversations.append(Conversation(str(record.get("id", index)), tuple(turns)))
        if limit is not None and len(conversations) >= limit:
            break
    return conversations


def _turns(messages: list[dict[str, str]], max_words: int) -> Iterator[Turn]:
    pending: str | None = None
    for message in messages:
        role, value = message.get("from"), str(message.get("value", ""))
        if role == "human" and value.strip():  # an empty message (they occur) is no turn
            if pending is not None:
                yield Turn(pending, 0)  # two user messages in a row: the first had no answer
            pending = " ".join(value.split()[:max_words])
        elif role == "gpt" and pending is not None:
            yield Turn(pending, len(value.split()))
            pending = None
    if pending is not None:
        yield Turn(pending, 0)


@dataclass(frozen=True, slots=True)
class HumanTiming:
    reading_wpm: tuple[float, float] = (184.0, 29.0)  # mean, standard deviation
    typing_wpm: tuple[float, float] = (52.0, 12.0)
    time_scale: float = 1.0
    advisory_miss_rate: float = 0.0
    typing_time_scale: float | None = None  # typing's own scale; None: time_scale

    def user(self, seed: int, pace: float = 1.0) -> UserTiming:
        """One user's timing, drawn from `seed`; `pace` multiplies both of their times (a heavy
        user of a skewed workload reads and types faster: pace < 1)."""
        rng = random.Random(seed)
        reading = max(60.0, rng.gauss(*self.reading_wpm))
        typing = max(15.0, rng.gauss(*self.typing_wpm))
        typing_scale = self.time_scale if self.typing_time_scale is None else self.typing_time_scale
        return UserTiming(
            reading, typing, self.time_scale * pace, self.advisory_miss_rate, rng, typing_scale=typing_scale * pace
        )


class UserTiming:
    """One user's speeds; seconds, already scaled (reading by `time_scale`, typing by `typing_scale`,
    which is `time_scale` unless given)."""

    def __init__(
        self,
        reading_wpm: float,
        typing_wpm: float,
        time_scale: float,
        miss_rate: float,
        rng: random.Random,
        *,
        typing_scale: float | None = None,
    ) -> None:
        self.reading_wpm = reading_wpm
        self.typing_wpm = typing_wpm
        self.time_scale = time_scale
        self.typing_scale = time_scale if typing_scale is None else typing_scale
        self.miss_rate = miss_rate
        self._rng = rng

    def reading_s(self, words: int) -> float:
        """The idle time before typing starts: reading an answer of `words` words."""
        return words / self.reading_wpm * 60.0 * self.time_scale

    def typing_s(self, words: int) -> float:
        """Typing a message of `words` words: the advisory's lead."""
        return words / self.typing_wpm * 60.0 * self.typing_scale

    def advises(self) -> bool:
        """Whether this turn's typing start reaches the scheduler as an advisory."""
        return self._rng.random() >= self.miss_rate


def answer_tokens(turn: Turn, cap: int, floor: int = 16) -> int:
    """max_tokens for a replayed answer: the original's length in tokens, at least `floor` (a missing
    answer still gets one worth reading) and never above `cap`."""
    return min(cap, max(floor, round(turn.answer_words * TOKENS_PER_WORD)))


@dataclass(frozen=True, slots=True)
class UserPlan:
    """What one simulated user of the live load generator replays: `sessions` in turn (cycled when
    the run outlasts them), each a conversation whose turns go out in order, at `pace` times the
    human timing (both the reading and the typing)."""

    sessions: tuple[Conversation, ...]
    pace: float = 1.0
    heavy: bool = False  # a heavy user of a skewed workload (eval.skewed)
