"""Greedy multi-turn chats through the scheduler replicas while faults happen, and the recompute
reference each answer is checked against.

Each session is a conversation of MT-bench questions, one tenant's, sent through the SDK's
failover (`client_sdk.failover.Replicas`) to whichever replica answers; each turn carries the
answers the cluster gave before, so its KV history lives on the nodes' tiers between turns. A turn
asks for the top-2 logprobs of every answer token: the checker needs them on the reference side
to tell a near tie from wrong KV.

The reference of a turn is its very messages sent straight to an engine (with the engine key),
under a cache salt used once, with no `kv_transfer_params`: the engine computes the whole prompt
and Symphony's connector keeps the call off the tiers.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import openai

from client_sdk.failover import Replicas, unsent
from eval.faults.checker import Answer, RequestOutcome, well_formed_error
from eval.resume_runner import mtbench_turns

ANSWER_TOKENS = 12
THINK_S = 0.3  # between a session's turns
TURNS_KEPT = 4  # a session starts over after this many turns, so prompts stay short on a CPU engine


@dataclass(frozen=True)
class Tenant:
    name: str
    api_key: str


def answer_of(choice: Any) -> Answer:
    """The tokens of a chat choice and, per position, the margin between its best two candidates."""
    tokens, margins = [], []
    for entry in (choice.logprobs.content if choice.logprobs is not None else None) or []:
        tokens.append(entry.token)
        top = sorted((t.logprob for t in entry.top_logprobs or []), reverse=True)
        margins.append(top[0] - top[1] if len(top) >= 2 else math.inf)
    return Answer(tuple(tokens), tuple(margins))


def _kind_of_status(exc: openai.APIStatusError) -> str:
    body = exc.body if isinstance(exc.body, dict) and "error" in exc.body else {"error": exc.body}
    if not well_formed_error(exc.status_code, body):
        return "malformed"
    error = body["error"]
    assert isinstance(error, dict)  # well_formed_error checked it
    return f"{exc.status_code}:{error.get('code') or error.get('type')}"


class ChatLoad:
    """`sessions` concurrent conversations, spread over `tenants`, until `stop()`. Every request
    ends as a `RequestOutcome` in `outcomes`, whatever happened to it."""

    def __init__(
        self,
        urls: Sequence[str],
        tenants: Sequence[Tenant],
        model: str,
        sessions: int,
        *,
        scenario: str,
        timeout_s: float,
    ) -> None:
        self.model = model
        self.scenario = scenario
        self.timeout_s = timeout_s
        self.clients = {
            t.name: Replicas(
                [
                    openai.AsyncOpenAI(
                        base_url=u.rstrip("/") + "/v1", api_key=t.api_key, max_retries=0, timeout=timeout_s
                    )
                    for u in urls
                ],
                rounds=3,
            )
            for t in tenants
        }
        self.tenants = list(tenants)
        self.sessions = sessions
        self.outcomes: list[RequestOutcome] = []
        self._questions = [turns[0] for turns in mtbench_turns()]
        self._stop = asyncio.Event()
        self._answered = asyncio.Event()  # set at each outcome appended
        self._tasks: list[asyncio.Task[None]] = []
        self.origin_s: float | None = None  # monotonic, at the first start

    def start(self) -> None:
        """Start the sessions (again, after `stop`: new conversations)."""
        if self.origin_s is None:
            self.origin_s = time.monotonic()
        self._stop.clear()
        for i in range(self.sessions):
            self._tasks.append(asyncio.create_task(self._session(i)))

    async def stop(self) -> None:
        """Let every session finish its turn in flight, then end."""
        self._stop.set()
        await asyncio.gather(*self._tasks)
        self._tasks.clear()

    def turns_done(self) -> int:
        return sum(1 for o in self.outcomes if o.kind == "ok")

    async def wait_turns(self, count: int, timeout_s: float) -> bool:
        """Wait until `count` turns were answered in all; False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        while self.turns_done() < count:
            self._answered.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._answered.wait(), remaining)
        return True

    async def first_turn(self, tenant: str, session: str, number: int) -> None:
        """A new conversation's first turn (question `number`, modulo how many there are), sent
        and kept in `outcomes` like the sessions' turns, to be checked the same way."""
        messages = [{"role": "user", "content": self._questions[number % len(self._questions)]}]
        self.outcomes.append(await self.send(tenant, session, messages, ANSWER_TOKENS))
        self._answered.set()

    async def send(self, tenant: str, session: str, messages: list[dict[str, str]], max_tokens: int) -> RequestOutcome:
        """One turn through the replicas; never raises for what the cluster answered."""
        started = time.monotonic()
        status, kind, answer, node, detail = 0, "ok", None, "", ""
        try:
            raw = await self.clients[tenant].acall(
                lambda c: c.chat.completions.with_raw_response.create(
                    model=self.model,
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=max_tokens,
                    temperature=0,
                    logprobs=True,
                    top_logprobs=2,
                    extra_headers={"X-Session-ID": session},
                )
            )
            status, node = raw.status_code, raw.headers.get("x-symphony-node", "")
            answer = answer_of(raw.parse().choices[0])
        except openai.APIStatusError as exc:
            status, kind, detail = exc.status_code, _kind_of_status(exc), str(exc)
        except openai.APITimeoutError as exc:
            kind, detail = "timeout", repr(exc.__cause__)
        except openai.APIConnectionError as exc:
            # "connect": no replica took it (every round); "broken": one took it, then the connection broke.
            kind, detail = ("connect" if unsent(exc) else "broken"), repr(exc.__cause__)
        except (ValueError, KeyError, IndexError, AttributeError) as exc:  # a 2xx whose body is no chat answer
            kind, detail = "malformed", repr(exc)
        return RequestOutcome(
            self.scenario,
            tenant,
            session,
            started,
            time.monotonic() - started,
            status,
            kind,
            list(messages),
            answer,
            node,
            detail[:200],
            max_tokens,
        )

    async def _session(self, index: int) -> None:
        tenant = self.tenants[index % len(self.tenants)].name
        generation = 0
        while not self._stop.is_set():
            session = f"{self.scenario}-{index}-{generation}-{uuid.uuid4().hex[:6]}"
            messages: list[dict[str, str]] = []
            for turn in range(TURNS_KEPT):
                if self._stop.is_set():
                    return
                question = self._questions[(index * 7 + generation * 3 + turn) % len(self._questions)]
                messages = [*messages, {"role": "user", "content": question}]
                outcome = await self.send(tenant, session, messages, ANSWER_TOKENS)
                self.outcomes.append(outcome)
                self._answered.set()
                if outcome.answer is None:
                    break  # the history is unknown past a failed turn: start a new conversation
                messages.append({"role": "assistant", "content": "".join(outcome.answer.tokens)})
                await asyncio.sleep(THINK_S)
            generation += 1

    async def close(self) -> None:
        for replicas in self.clients.values():
            for client in replicas.clients:
                await client.close()


async def reference(engine: openai.AsyncOpenAI, model: str, messages: list[dict[str, str]], max_tokens: int) -> Answer:
    """The recompute reference of a turn: `engine` is an engine's own client (its key)."""
    reply = await engine.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"cache_salt": f"reference-{uuid.uuid4().hex}"},
    )
    return answer_of(reply.choices[0])


async def references(
    engines: Sequence[openai.AsyncOpenAI], model: str, outcomes: Sequence[RequestOutcome]
) -> list[Answer | None]:
    """A reference per answered outcome (None for the others), spread over `engines`."""
    found: list[Answer | None] = [None] * len(outcomes)
    answered = [i for i, o in enumerate(outcomes) if o.answer is not None]
    lanes = max(1, len(engines))

    async def lane(k: int) -> None:
        for i in answered[k::lanes]:
            with contextlib.suppress(openai.APIError):  # no reference: counted as unchecked
                found[i] = await reference(engines[k], model, outcomes[i].messages, ANSWER_TOKENS)

    await asyncio.gather(*(lane(k) for k in range(lanes)))
    return found
