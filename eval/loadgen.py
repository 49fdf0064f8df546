"""Live load generator: simulated users replaying multi-turn conversations against an
OpenAI-compatible endpoint (a Symphony scheduler, or any server: advisories can be off), with
human reading and typing time between turns and a typing advisory when each message is started.

Every request streams (with usage), so each record has its time to first token, time per output
token, end-to-end time, the node that served it (`x-symphony-node`), and how many of its prompt
tokens were computed rather than found in some cache (`usage.prompt_tokens_details.cached_tokens`).
"""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
from tqdm import tqdm

from eval.workloads import Conversation, HumanTiming, answer_tokens

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
    ) -> None:
        if not conversations:
            raise ValueError("no conversations to replay")
        self.model = model
        self.conversations = conversations
        self.timing = timing
        self.settings = settings
        self.session_prefix = session_prefix
        self.client = openai.AsyncOpenAI(
            base_url=base_url.rstrip("/") + "/v1", api_key=api_key, max_retries=0, timeout=settings.request_timeout_s
        )
        self.records: list[RequestRecord] = []
        self._started = 0.0

    async def run(self) -> list[RequestRecord]:
        self._started = time.monotonic()
        deadline = self._started + self.settings.duration_s
        with tqdm(desc="requests", unit="req", file=None) as progress:
            await asyncio.gather(*[self._user(u, deadline, progress) for u in range(self.settings.users)])
        await self.client.close()
        return self.records

    async def _user(self, user: int, deadline: float, progress: tqdm) -> None:
        timing = self.timing.user(self.settings.seed * 1_000 + user)
        await asyncio.sleep(user * 0.25 * self.timing.time_scale)  # users do not all start at the same instant
        index = user
        while time.monotonic() < deadline:
            conversation = self.conversations[index % len(self.conversations)]
            session = f"{self.session_prefix}-u{user}-c{index}"
            messages: list[dict[str, str]] = []
            previous_words = 0
            for number, turn in enumerate(conversation.turns):
                await asyncio.sleep(timing.reading_s(previous_words))
                if time.monotonic() >= deadline:
                    return
                advised = self.settings.advisories and timing.advises()
                typing_started = time.monotonic()
                advisory_ms = await self._advise(session) if advised else 0.0
                await asyncio.sleep(
                    max(0.0, timing.typing_s(len(turn.message.split())) - (time.monotonic() - typing_started))
                )
                messages.append({"role": "user", "content": turn.message})
                record = RequestRecord(
                    user,
                    session,
                    number,
                    time.monotonic() - self._started,
                    advised,
                    time.monotonic() - typing_started if advised else 0.0,
                    advisory_ms=advisory_ms,
                )
                answer = await self._request(record, messages, answer_tokens(turn, self.settings.max_answer_tokens))
                self.records.append(record)
                progress.update()
                if answer is None:
                    break  # the conversation cannot go on without its answer
                messages.append({"role": "assistant", "content": answer})
                previous_words = len(answer.split())
            index += self.settings.users

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
        started = time.monotonic()
        text: list[str] = []
        try:
            async with self.client.chat.completions.with_streaming_response.create(
                model=self.model,
                messages=messages,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers={SESSION_HEADER: record.session},
            ) as response:
                record.node = response.headers.get(NODE_HEADER, "")
                record.route = response.headers.get(ROUTE_HEADER, "")
                record.routed_ms = server_timing_ms(response.headers.get("server-timing", ""), "route")
                async for chunk in await response.parse():
                    if chunk.choices and chunk.choices[0].delta.content:
                        if not text:
                            record.ttft_s = time.monotonic() - started
                        text.append(chunk.choices[0].delta.content)
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
        if not text:
            record.ttft_s = record.e2e_s
        record.ok = True
        return "".join(text)


def write_records(records: list[RequestRecord], json_path: Path | None = None, csv_path: Path | None = None) -> None:
    rows: list[dict[str, Any]] = [{**dataclasses.asdict(r), "tpot_s": r.tpot_s} for r in records]
    if json_path is not None:
        json_path.write_text(json.dumps(rows, indent=1))
    if csv_path is not None and rows:
        with csv_path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
