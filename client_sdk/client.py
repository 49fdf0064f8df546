"""SymphonyClient / AsyncSymphonyClient: the official `openai` client plus Symphony's session and
advisory conventions.

Every chat call carries the session id in `X-Session-ID`, so the scheduler can route the turn to
where the session's KV is (or was just prefetched). `typing_started` tells the scheduler a user began
typing the next turn of a session: the scheduler picks the node now and the next request goes there.
Errors are the `openai` package's exceptions (BadRequestError, NotFoundError, ...), for advisories too.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import openai

DEFAULT_URL = "http://127.0.0.1:8000"
SESSION_HEADER = "X-Session-ID"


@dataclass(frozen=True, slots=True)
class Advisory:
    """The scheduler's answer to an advisory: where the session's next request will run."""

    session_id: str
    kind: str
    node: str
    expected_arrival_ms: int | None
    expires_in_ms: int


def _api_root(base_url: str) -> str:
    root = base_url.rstrip("/")
    return root if root.endswith("/v1") else root + "/v1"


def _openai_kwargs(base_url: str | None, api_key: str | None, timeout: float, max_retries: int) -> dict[str, Any]:
    url = base_url or os.environ.get("SYMPHONY_URL") or DEFAULT_URL
    # The local cluster needs no key; the openai client insists on one being set.
    key = api_key or os.environ.get("SYMPHONY_API_KEY") or "symphony-local"
    return {"base_url": _api_root(url), "api_key": key, "timeout": timeout, "max_retries": max_retries}


def _session_headers(kwargs: dict[str, Any], session_id: str) -> dict[str, str]:
    return {**(kwargs.pop("extra_headers", None) or {}), SESSION_HEADER: session_id}


def _advisory_body(session_id: str, kind: str, expected_arrival_ms: int | None, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {"session_id": session_id, "kind": kind, "model": model}
    if expected_arrival_ms is not None:
        body["expected_arrival_ms"] = expected_arrival_ms
    return body


def _advisory(reply: Any) -> Advisory:
    return Advisory(reply["session_id"], reply["kind"], reply["node"], reply.get("expected_arrival_ms"),
                    reply["expires_in_ms"])


class SymphonyClient:
    """Synchronous client. `model` defaults to the cluster's first served model."""

    def __init__(self, base_url: str | None = None, *, api_key: str | None = None, model: str | None = None,
                 timeout: float = 600.0, max_retries: int = 2) -> None:
        self.openai = openai.OpenAI(**_openai_kwargs(base_url, api_key, timeout, max_retries))
        self._model = model

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = self.openai.models.list().data[0].id
        return self._model

    def chat(self, session_id: str, messages: Iterable[dict[str, Any]], *, stream: bool = False,
             **kwargs: Any) -> Any:
        """`chat.completions.create` for one turn of `session_id`; kwargs pass through to openai."""
        kwargs.setdefault("model", self.model)
        headers = _session_headers(kwargs, session_id)
        return self.openai.chat.completions.create(messages=list(messages), stream=stream,  # type: ignore[call-overload]
                                                   extra_headers=headers, **kwargs)

    def complete(self, session_id: str, prompt: str, **kwargs: Any) -> Any:
        kwargs.setdefault("model", self.model)
        headers = _session_headers(kwargs, session_id)
        return self.openai.completions.create(prompt=prompt, extra_headers=headers, **kwargs)

    def advise(self, session_id: str, kind: str, *, expected_arrival_ms: int | None = None) -> Advisory:
        reply = self.openai.post("/advisories", cast_to=object,
                                 body=_advisory_body(session_id, kind, expected_arrival_ms, self.model))
        return _advisory(reply)

    def typing_started(self, session_id: str) -> Advisory:
        """The user began typing the next turn of `session_id`."""
        return self.advise(session_id, "typing")

    def close(self) -> None:
        self.openai.close()

    def __enter__(self) -> SymphonyClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class AsyncSymphonyClient:
    """The same as SymphonyClient, with coroutine methods."""

    def __init__(self, base_url: str | None = None, *, api_key: str | None = None, model: str | None = None,
                 timeout: float = 600.0, max_retries: int = 2) -> None:
        self.openai = openai.AsyncOpenAI(**_openai_kwargs(base_url, api_key, timeout, max_retries))
        self._model = model

    async def model(self) -> str:
        if self._model is None:
            self._model = (await self.openai.models.list()).data[0].id
        return self._model

    async def chat(self, session_id: str, messages: Iterable[dict[str, Any]], *, stream: bool = False,
                   **kwargs: Any) -> Any:
        kwargs.setdefault("model", await self.model())
        headers = _session_headers(kwargs, session_id)
        return await self.openai.chat.completions.create(messages=list(messages), stream=stream,  # type: ignore[call-overload]
                                                         extra_headers=headers, **kwargs)

    async def complete(self, session_id: str, prompt: str, **kwargs: Any) -> Any:
        kwargs.setdefault("model", await self.model())
        headers = _session_headers(kwargs, session_id)
        return await self.openai.completions.create(prompt=prompt, extra_headers=headers, **kwargs)

    async def advise(self, session_id: str, kind: str, *, expected_arrival_ms: int | None = None) -> Advisory:
        reply = await self.openai.post("/advisories", cast_to=object,
                                       body=_advisory_body(session_id, kind, expected_arrival_ms, await self.model()))
        return _advisory(reply)

    async def typing_started(self, session_id: str) -> Advisory:
        return await self.advise(session_id, "typing")

    async def close(self) -> None:
        await self.openai.close()

    async def __aenter__(self) -> AsyncSymphonyClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()
