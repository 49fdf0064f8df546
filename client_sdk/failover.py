"""Failover between scheduler replicas, for the SDK's clients.

A client given several scheduler URLs (a list, or `$SYMPHONY_URL` with commas) keeps one `openai`
client per replica and sends each call to the replica that answered last, so that a session's
advisories and turns keep going to one replica while it is up. A call that cannot connect to it
(refused, or no connection within the timeout) goes to the next replica, in order, before any
error reaches the caller.

Contracts:
- Only a call that never reached a replica is sent again. An answer of any status (a 4xx, a 429,
  a 503) is that replica's and is raised as it is; so is a call that was sent and then got no
  answer (the connection broke or the read timed out: the replica may be computing it, and a
  second would compute it again), and a stream that broke after it started.
- With one URL, nothing changes: the `openai` client retries on its own (`max_retries`). With
  several, each replica's client does not retry; instead up to `max_retries + 1` rounds go over
  all replicas, 0.5 s, 1 s, ... apart, and the last round's error is raised.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

import openai

DEFAULT_URL = "http://127.0.0.1:8000"
ROUND_BACKOFF_S = 0.5  # the wait after the first round that reached no replica; doubles each round

Client = TypeVar("Client")
Result = TypeVar("Result")


def replica_urls(base_url: str | Sequence[str] | None) -> list[str]:
    """The scheduler URLs a client was given: `base_url` (one, several separated by commas, or a
    list), else `$SYMPHONY_URL` (the same forms), else the local cluster's. ValueError when it
    names none."""
    given: str | Sequence[str] = base_url or os.environ.get("SYMPHONY_URL") or DEFAULT_URL
    parts = given.split(",") if isinstance(given, str) else list(given)
    urls = [url.strip() for url in parts if url.strip()]
    if not urls:
        raise ValueError("no scheduler URL given (base_url or $SYMPHONY_URL)")
    return urls


_NOT_CONNECTED = ("ConnectError", "ConnectTimeout")


def unsent(exc: openai.APIConnectionError) -> bool:
    """Whether the call never reached the replica: no connection could be made to it. Read from
    the transport error openai chains (its HTTP package's ConnectError or ConnectTimeout: httpx,
    or httpx2 in later openai releases, hence by name)."""
    cause = exc.__cause__
    return cause is not None and any(
        cls.__name__ in _NOT_CONNECTED and cls.__module__.startswith("httpx") for cls in type(cause).__mro__
    )


class Replicas(Generic[Client]):
    def __init__(self, clients: Sequence[Client], rounds: int) -> None:
        if not clients:
            raise ValueError("at least one replica")
        self.clients = list(clients)
        self.rounds = max(1, rounds)
        self.index = 0  # the replica that answered last (or is tried first)

    @property
    def current(self) -> Client:
        return self.clients[self.index]

    def _order(self) -> list[int]:
        n = len(self.clients)
        return [(self.index + i) % n for i in range(n)]

    def call(self, send: Callable[[Client], Result]) -> Result:
        """`send` to the replicas in turn until one answers (see the module's contracts)."""
        failure: openai.APIConnectionError | None = None
        for attempt in range(self.rounds):
            if attempt:
                time.sleep(ROUND_BACKOFF_S * 2 ** (attempt - 1))
            for i in self._order():
                try:
                    result = send(self.clients[i])
                except openai.APIConnectionError as exc:
                    if not unsent(exc):
                        raise
                    failure = exc
                    continue
                self.index = i
                return result
        assert failure is not None
        raise failure

    async def acall(self, send: Callable[[Client], Awaitable[Result]]) -> Result:
        """`call`, for coroutines."""
        failure: openai.APIConnectionError | None = None
        for attempt in range(self.rounds):
            if attempt:
                await asyncio.sleep(ROUND_BACKOFF_S * 2 ** (attempt - 1))
            for i in self._order():
                try:
                    result = await send(self.clients[i])
                except openai.APIConnectionError as exc:
                    if not unsent(exc):
                        raise
                    failure = exc
                    continue
                self.index = i
                return result
        assert failure is not None
        raise failure
