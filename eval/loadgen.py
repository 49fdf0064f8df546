"""Live load generators against an OpenAI-compatible endpoint (a Symphony scheduler, or any server:
advisories can be off).

- `LoadGenerator`: simulated users replaying multi-turn conversations (closed loop: a user's next
  turn waits for the answer), with human reading and typing time between turns and a typing
  advisory when each message is started; each user replays the conversations of its `UserPlan`.
- `OpenLoopGenerator`: token-id prompts sent at fixed arrival times whatever the answers
  (`eval.open_loop`: shared-prefix groups, a Mooncake trace), through `/v1/completions`.

Every request streams (with usage), so each record has its time to first token, time per output
token, end-to-end time, the node that served it (`x-symphony-node`), how many of its prompt tokens
were computed rather than found in some cache (`usage.prompt_tokens_details.cached_tokens`), and how
many of them had KV somewhere in the cluster when it was sent (`existed_tokens`: the prefix an
earlier request of the same run carried, once that request's prefill was done).
"""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
from tqdm import tqdm

from eval.open_loop import OpenRequest, existed_tokens, reusable_tokens
from eval.workloads import Conversation, HumanTiming, UserPlan, answer_tokens

SESSION_HEADER = "X-Session-ID"
NODE_HEADER = "x-symphony-node"
ROUTE_HEADER = "x-symphony-route"


def server_timing_ms(header: str, metric: str) -> float:
    """The `dur` of `metric` in a Server-Timing header ("route;dur=12.5, ..."); 0 when absent."""
    for entry in header.split(","):
        name, *params = (part.strip() for part in entry.split(";"))
        if name == metric:
            for param in params:
                key, _, value = param.partition("=")
                if key.strip() == "dur":
                    try:
                        return float(value)
                    except ValueError:
                        return 0.0
    return 0.0


@dataclass(slots=True)
class RequestRecord:
    user: int
    session: str
    turn: int
    sent_at_s: float  # since the run started
    advised: bool
    advisory_lead_s: float  # from the advisory to the request (0 without one)
    node: str = ""
    ok: bool = False
    error: str = ""
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    advisory_ms: float = 0.0  # the advisory's round trip as the client saw it (0 without one)
    route: str = ""  # why the scheduler chose the node (its X-Symphony-Route header)
    routed_ms: float = 0.0  # time in the scheduler before the request went out (Server-Timing "route")
    # Prompt tokens whose KV existed somewhere in the cluster when the request was sent (at most all
    # but the prompt's last token: what a cache could have served; eval.open_loop.reusable_tokens).
    existed_tokens: int = 0

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / max(1, self.output_tokens - 1)

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True, slots=True)
class LoadSettings:
    users: int
    duration_s: float
    max_answer_tokens: int = 64
    advisories: bool = True
    seed: int = 7
    request_timeout_s: float = 600.0


def openai_client(base_url: str, api_key: str, settings: LoadSettings, http_client: Any = None) -> openai.AsyncOpenAI:
    """The load generators' client: no retries (a failed request is a result), the run's timeout."""
    return openai.AsyncOpenAI(
        base_url=base_url.rstrip("/") + "/v1",
        api_key=api_key,
        max_retries=0,
        timeout=settings.request_timeout_s,
        http_client=http_client,
    )


class LoadGenerator:
    def __init__(
        self,
        base_url: str,
        model: str,
        conversations: list[Conversation],
        timing: HumanTiming,
        settings: LoadSettings,
        *,
        api_key: str = "symphony-local",
        session_prefix: str = "load",
        plans: list[UserPlan] | None = None,
        http_client: Any = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        """Without `plans`, user u replays conversations u, u + U, u + 2U, ... (U users) at human pace.
        `http_client`, `clock` and `sleep` are for tests (a fake transport, a virtual clock): the
        users' think time and the advisories' leads are measured on `clock`, TTFT on the real one."""
        if not conversations:
            raise ValueError("no conversations to replay")
        if plans is not None and (len(plans) != settings.users or not all(p.sessions for p in plans)):
            raise ValueError(f"need {settings.users} plans, each with a session")
        self.model = model
        self.conversations = conversations
        self.plans = plans
        self.timing = timing
        self.settings = settings
        self.session_prefix = session_prefix
        self.client = openai_client(base_url, api_key, settings, http_client)
        self._now = clock
        self._sleep = sleep
        self.records: list[RequestRecord] = []
        self._started = 0.0

    async def run(self) -> list[RequestRecord]:
        self._started = self._now()
        deadline = self._started + self.settings.duration_s
        with tqdm(desc="requests", unit="req", file=None) as progress:
            await asyncio.gather(*[self._user(u, deadline, progress) for u in range(self.settings.users)])
        await self.client.close()
        return self.records

    def _session(self, user: int, k: int) -> tuple[str, Conversation]:
        """The user's k-th session: its name and conversation."""
        if self.plans is None:
            index = user + k * self.settings.users
            return f"{self.session_prefix}-u{user}-c{index}", self.conversations[index % len(self.conversations)]
        sessions = self.plans[user].sessions
        return f"{self.session_prefix}-u{user}-c{k}", sessions[k % len(sessions)]

    async def _user(self, user: int, deadline: float, progress: tqdm) -> None:
        pace = 1.0 if self.plans is None else self.plans[user].pace
        timing = self.timing.user(self.settings.seed * 1_000 + user, pace)
        await self._sleep(user * 0.25 * self.timing.time_scale)  # users do not all start at the same instant
        k = 0
        while self._now() < deadline:
            session, conversation = self._session(user, k)
            messages: list[dict[str, str]] = []
            previous_words = 0
            history = 0  # tokens with KV after the previous turn: its prompt and all but its last answer token
            for number, turn in enumerate(conversation.turns):
                await self._sleep(timing.reading_s(previous_words))
                if self._now() >= deadline:
                    return
                advised = self.settings.advisories and timing.advises()
                typing_started = self._now()
                advisory_ms = await self._advise(session) if advised else 0.0
                await self._sleep(max(0.0, timing.typing_s(len(turn.message.split())) - (self._now() - typing_started)))
                messages.append({"role": "user", "content": turn.message})
                record = RequestRecord(
                    user,
                    session,
                    number,
                    self._now() - self._started,
                    advised,
                    self._now() - typing_started if advised else 0.0,
                    advisory_ms=advisory_ms,
                )
                answer = await self._request(record, messages, answer_tokens(turn, self.settings.max_answer_tokens))
                self.records.append(record)
                progress.update()
                if answer is None:
                    break  # the conversation cannot go on without its answer
                record.existed_tokens = reusable_tokens(history, record.prompt_tokens)
                history = record.prompt_tokens + record.output_tokens - 1
                messages.append({"role": "assistant", "content": answer})
                previous_words = len(answer.split())
            k += 1

    async def _advise(self, session: str) -> float:
        """Send the typing advisory; its round trip in ms (0 when refused: a hint, the turn goes on)."""
        started = time.perf_counter()
        try:
            await self.client.post(
                "/advisories", cast_to=object, body={"session_id": session, "kind": "typing", "model": self.model}
            )
        except openai.APIError:
            return 0.0
        return (time.perf_counter() - started) * 1000

    async def _request(self, record: RequestRecord, messages: list[dict[str, str]], max_tokens: int) -> str | None:
        opened = self.client.chat.completions.with_streaming_response.create(
            model=self.model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={SESSION_HEADER: record.session},
        )
        return await _stream(record, opened, lambda chunk: chunk.choices[0].delta.content or None)


async def _stream(record: RequestRecord, opened: Any, text_of: Callable[[Any], str | None]) -> str | None:
    """Read a streaming response (`opened`: an unentered `with_streaming_response.create(...)`) into
    `record`: the node and route headers, TTFT (the first chunk for which `text_of` is not None), the
    usage. The answer's text, or None when the request failed (`record.error` says why)."""
    started = time.monotonic()
    text: list[str] = []
    first = True
    try:
        async with opened as response:
            record.node = response.headers.get(NODE_HEADER, "")
            record.route = response.headers.get(ROUTE_HEADER, "")
            record.routed_ms = server_timing_ms(response.headers.get("server-timing", ""), "route")
            async for chunk in await response.parse():
                piece = text_of(chunk) if chunk.choices else None
                if piece is not None:
                    if first:
                        record.ttft_s = time.monotonic() - started
                        first = False
                    text.append(piece)
                if chunk.usage is not None:
                    record.prompt_tokens = chunk.usage.prompt_tokens
                    record.output_tokens = chunk.usage.completion_tokens
                    details = chunk.usage.prompt_tokens_details
                    record.cached_tokens = (details.cached_tokens or 0) if details else 0
    except (openai.APIError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
        record.e2e_s = time.monotonic() - started
        return None
    record.e2e_s = time.monotonic() - started
    if first:
        record.ttft_s = record.e2e_s
    record.ok = True
    return "".join(text)


class OpenLoopGenerator:
    """Sends each request at its arrival time (open loop: whether earlier ones were answered does
    not matter) through `/v1/completions` with its token ids, greedy and with `ignore_eos` so that
    every answer has its `max_tokens`; no advisories. `run` returns a record per request, in the
    requests' order, with `existed_tokens` filled in once all are done."""

    def __init__(
        self,
        base_url: str,
        model: str,
        requests: list[OpenRequest],
        settings: LoadSettings,
        *,
        api_key: str = "symphony-local",
        session_prefix: str = "open",
        http_client: Any = None,  # for tests: an httpx-style client on a fake transport
    ) -> None:
        self.model = model
        self.requests = requests
        self.settings = settings
        self.session_prefix = session_prefix
        self.client = openai_client(base_url, api_key, settings, http_client)

    async def run(self) -> list[RequestRecord]:
        started = time.monotonic()
        records = [
            RequestRecord(r.group, f"{self.session_prefix}-{r.session}", r.turn, r.arrival_s, False, 0.0)
            for r in self.requests
        ]
        with tqdm(total=len(records), desc="requests", unit="req", file=None) as progress:

            async def send(request: OpenRequest, record: RequestRecord) -> None:
                await asyncio.sleep(max(0.0, started + request.arrival_s - time.monotonic()))
                record.sent_at_s = time.monotonic() - started
                opened = self.client.completions.with_streaming_response.create(
                    model=self.model,
                    prompt=list(request.prompt),
                    max_tokens=request.max_tokens,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_headers={SESSION_HEADER: record.session},
                    extra_body={"ignore_eos": True},
                )
                await _stream(record, opened, lambda chunk: chunk.choices[0].text or "")
                progress.update()

            await asyncio.gather(*[send(r, rec) for r, rec in zip(self.requests, records, strict=True)])
        await self.client.close()
        existed = existed_tokens(
            [r.prompt for r in self.requests],
            [rec.sent_at_s for rec in records],
            [rec.sent_at_s + rec.ttft_s if rec.ok else None for rec in records],
        )
        for record, tokens in zip(records, existed, strict=True):
            record.existed_tokens = tokens
        return records


def write_records(records: list[RequestRecord], json_path: Path | None = None, csv_path: Path | None = None) -> None:
    rows: list[dict[str, Any]] = [{**dataclasses.asdict(r), "tpot_s": r.tpot_s} for r in records]
    if json_path is not None:
        json_path.write_text(json.dumps(rows, indent=1))
    if csv_path is not None and rows:
        with csv_path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
