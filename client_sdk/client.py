"""SymphonyClient / AsyncSymphonyClient: the official `openai` client plus Symphony's session and
advisory conventions.

Every chat call carries the session id in `X-Session-ID`, so the scheduler can route the turn to
where the session's KV is (or was just prefetched). Advisories tell the scheduler a request is
coming, so it picks the node now and moves the session's KV there first:

- `typing(session)`: for a chat frontend to call on every keystroke; it sends one "typing"
  advisory per session per `debounce_s`, the rest cost nothing.
- `predecessor(session, expected_arrival_ms)`: for an agent framework, a context manager (or
  decorator) around the step whose output feeds the session's next request, sent on entry.

The API key (`api_key` or $SYMPHONY_API_KEY) names the tenant. Errors are the `openai` package's
exceptions (BadRequestError, AuthenticationError, ...), for advisories too.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import openai
from openai.types.chat import ChatCompletionMessageParam

from client_sdk.failover import DEFAULT_URL, Replicas, replica_urls

__all__ = ["DEFAULT_URL", "AdminClient", "Advisory", "AsyncAdminClient", "AsyncSymphonyClient", "SymphonyClient"]

Client = TypeVar("Client")
# One scheduler URL, several separated by commas, or a list of them (replicas: client_sdk.failover).
BaseUrl = str | Sequence[str] | None

SESSION_HEADER = "X-Session-ID"


@dataclass(frozen=True, slots=True)
class Advisory:
    """The scheduler's answer to an advisory: where the session's next request will run."""

    session_id: str
    kind: str
    node: str | None  # None under a policy that ignores advisories
    expected_arrival_ms: int | None
    expires_in_ms: int


def _message_params(messages: Iterable[dict[str, Any]]) -> list[ChatCompletionMessageParam]:
    """Plain message dicts as openai's typed params; openai and the scheduler check their content."""
    return cast("list[ChatCompletionMessageParam]", list(messages))


def _api_root(base_url: str) -> str:
    root = base_url.rstrip("/")
    return root if root.endswith("/v1") else root + "/v1"


def _replicas(
    factory: Callable[..., Client],
    base_url: BaseUrl,
    api_key: str | None,
    timeout: float,
    max_retries: int,
    root: Callable[[str], str] = lambda url: url,
) -> Replicas[Client]:
    """One `factory` client (openai.OpenAI or AsyncOpenAI) per replica URL (client_sdk.failover)."""
    urls = replica_urls(base_url)
    # The local cluster needs no key; the openai client insists on one being set.
    key = api_key or os.environ.get("SYMPHONY_API_KEY") or "symphony-local"
    several = len(urls) > 1
    clients = [
        factory(base_url=root(_api_root(url)), api_key=key, timeout=timeout, max_retries=0 if several else max_retries)
        for url in urls
    ]
    return Replicas(clients, max_retries + 1 if several else 1)


def _admin_root(api_root: str) -> str:
    return api_root.removesuffix("/v1") + "/admin/v1"


def _session_headers(kwargs: dict[str, Any], session_id: str) -> dict[str, str]:
    return {**(kwargs.pop("extra_headers", None) or {}), SESSION_HEADER: session_id}


def _advisory_body(session_id: str, kind: str, expected_arrival_ms: int | None, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {"session_id": session_id, "kind": kind, "model": model}
    if expected_arrival_ms is not None:
        body["expected_arrival_ms"] = expected_arrival_ms
    return body


def _advisory(reply: Any) -> Advisory:
    return Advisory(
        reply["session_id"], reply["kind"], reply["node"], reply.get("expected_arrival_ms"), reply["expires_in_ms"]
    )


DEBOUNCE_S = 2.0  # one typing advisory per session per this long
MAX_DEBOUNCED_SESSIONS = 10_000


class _Debounce:
    """Which sessions sent a typing advisory recently; bounded (oldest forgotten first)."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._sent: OrderedDict[str, float] = OrderedDict()

    def due(self, session_id: str) -> bool:
        """True (and remembered) when the session's last advisory is older than the window."""
        now = self._clock()
        last = self._sent.get(session_id)
        if last is not None and now - last < self.window_s:
            return False
        self._sent[session_id] = now
        self._sent.move_to_end(session_id)
        while len(self._sent) > MAX_DEBOUNCED_SESSIONS:
            self._sent.popitem(last=False)
        return True

    def forget(self, session_id: str) -> None:
        """The session's request went out (or its advisory failed): its next keystroke advises again."""
        self._sent.pop(session_id, None)


class SymphonyClient:
    """Synchronous client. `model` defaults to the cluster's first served model."""

    def __init__(
        self,
        base_url: BaseUrl = None,
        *,
        api_key: str | None = None,
        model: str | None = None,
        timeout: float = 600.0,
        max_retries: int = 2,
        debounce_s: float = DEBOUNCE_S,
    ) -> None:
        self.replicas = _replicas(openai.OpenAI, base_url, api_key, timeout, max_retries)
        self._model = model
        self._typing = _Debounce(debounce_s)

    @property
    def openai(self) -> openai.OpenAI:
        """The `openai` client of the replica that answered last (the first, before any call)."""
        return self.replicas.current

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = self.replicas.call(lambda c: c.models.list()).data[0].id
        return self._model

    def chat(self, session_id: str, messages: Iterable[dict[str, Any]], *, stream: bool = False, **kwargs: Any) -> Any:
        """`chat.completions.create` for one turn of `session_id`; kwargs pass through to openai."""
        kwargs.setdefault("model", self.model)
        headers = _session_headers(kwargs, session_id)
        self._typing.forget(session_id)
        params = _message_params(messages)
        return self.replicas.call(
            lambda c: c.chat.completions.create(messages=params, stream=stream, extra_headers=headers, **kwargs)
        )

    def complete(self, session_id: str, prompt: str, **kwargs: Any) -> Any:
        kwargs.setdefault("model", self.model)
        headers = _session_headers(kwargs, session_id)
        self._typing.forget(session_id)
        return self.replicas.call(lambda c: c.completions.create(prompt=prompt, extra_headers=headers, **kwargs))

    def advise(self, session_id: str, kind: str, *, expected_arrival_ms: int | None = None) -> Advisory:
        body = _advisory_body(session_id, kind, expected_arrival_ms, self.model)
        reply = self.replicas.call(lambda c: c.post("/advisories", cast_to=object, body=body))
        return _advisory(reply)

    def typing_started(self, session_id: str) -> Advisory:
        """The user began typing the next turn of `session_id`."""
        return self.advise(session_id, "typing")

    def typing(self, session_id: str) -> Advisory | None:
        """A keystroke in `session_id`'s input: the first one sends a typing advisory, the ones that
        follow within `debounce_s` (or until the turn is sent with `chat`) send nothing (None)."""
        if not self._typing.due(session_id):
            return None
        try:
            return self.advise(session_id, "typing")
        except BaseException:
            self._typing.forget(session_id)  # not sent: the next keystroke tries again
            raise

    @contextlib.contextmanager
    def predecessor(self, session_id: str, expected_arrival_ms: int) -> Iterator[Advisory]:
        """Around an agent step whose output becomes `session_id`'s next request in at least
        `expected_arrival_ms`: the hint goes out on entry, so the session's KV moves while the step
        runs. Also a decorator: `@client.predecessor("reviewer", 1800)`."""
        yield self.advise(session_id, "predecessor", expected_arrival_ms=expected_arrival_ms)

    def close(self) -> None:
        for client in self.replicas.clients:
            client.close()

    def __enter__(self) -> SymphonyClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class AsyncSymphonyClient:
    """The same as SymphonyClient, with coroutine methods."""

    def __init__(
        self,
        base_url: BaseUrl = None,
        *,
        api_key: str | None = None,
        model: str | None = None,
        timeout: float = 600.0,
        max_retries: int = 2,
        debounce_s: float = DEBOUNCE_S,
    ) -> None:
        self.replicas = _replicas(openai.AsyncOpenAI, base_url, api_key, timeout, max_retries)
        self._model = model
        self._typing = _Debounce(debounce_s)

    @property
    def openai(self) -> openai.AsyncOpenAI:
        """The `openai` client of the replica that answered last (the first, before any call)."""
        return self.replicas.current

    async def model(self) -> str:
        if self._model is None:
            self._model = (await self.replicas.acall(lambda c: c.models.list())).data[0].id
        return self._model

    async def chat(
        self, session_id: str, messages: Iterable[dict[str, Any]], *, stream: bool = False, **kwargs: Any
    ) -> Any:
        kwargs.setdefault("model", await self.model())
        headers = _session_headers(kwargs, session_id)
        self._typing.forget(session_id)
        params = _message_params(messages)
        return await self.replicas.acall(
            lambda c: c.chat.completions.create(messages=params, stream=stream, extra_headers=headers, **kwargs)
        )

    async def complete(self, session_id: str, prompt: str, **kwargs: Any) -> Any:
        kwargs.setdefault("model", await self.model())
        headers = _session_headers(kwargs, session_id)
        self._typing.forget(session_id)
        return await self.replicas.acall(lambda c: c.completions.create(prompt=prompt, extra_headers=headers, **kwargs))

    async def advise(self, session_id: str, kind: str, *, expected_arrival_ms: int | None = None) -> Advisory:
        body = _advisory_body(session_id, kind, expected_arrival_ms, await self.model())
        reply = await self.replicas.acall(lambda c: c.post("/advisories", cast_to=object, body=body))
        return _advisory(reply)

    async def typing_started(self, session_id: str) -> Advisory:
        return await self.advise(session_id, "typing")

    async def typing(self, session_id: str) -> Advisory | None:
        """As `SymphonyClient.typing`."""
        if not self._typing.due(session_id):
            return None
        try:
            return await self.advise(session_id, "typing")
        except BaseException:
            self._typing.forget(session_id)  # not sent: the next keystroke tries again
            raise

    @contextlib.asynccontextmanager
    async def predecessor(self, session_id: str, expected_arrival_ms: int) -> AsyncIterator[Advisory]:
        """As `SymphonyClient.predecessor` (`async with`, or a decorator of a coroutine function)."""
        yield await self.advise(session_id, "predecessor", expected_arrival_ms=expected_arrival_ms)

    async def close(self) -> None:
        for client in self.replicas.clients:
            await client.close()

    async def __aenter__(self) -> AsyncSymphonyClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()


class AdminClient:
    """The admin API (`scheduler.admin_token`): priority tiers per tenant or session, residency
    rules, tenants' quotas."""

    def __init__(self, base_url: BaseUrl = None, *, token: str | None = None, timeout: float = 30.0) -> None:
        token = token or os.environ.get("SYMPHONY_ADMIN_TOKEN")
        self.replicas = _replicas(openai.OpenAI, base_url, token, timeout, 0, _admin_root)

    def _put(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return cast("dict[str, Any]", self.replicas.call(lambda c: c.put(path, cast_to=object, body=body)))

    def _get(self, path: str) -> dict[str, Any]:
        return cast("dict[str, Any]", self.replicas.call(lambda c: c.get(path, cast_to=object)))

    def set_priority(self, tenant: str, priority: str, *, session_id: str | None = None) -> dict[str, Any]:
        """priority: "high", "normal" or "low"; for the whole tenant, or one of its sessions."""
        return self._put("/priorities", {"tenant": tenant, "session_id": session_id, "priority": priority})

    def priorities(self) -> dict[str, Any]:
        return self._get("/priorities")

    def set_residency(self, tenant: str, regions: list[str] | None) -> dict[str, Any]:
        """The only regions `tenant`'s requests and KV may enter (None: any), at this one process
        (a regional scheduler or the global layer; `symphony admin residency` sets every one)."""
        return self._put("/residency", {"tenant": tenant, "regions": regions})

    def residency(self) -> dict[str, Any]:
        return self._get("/residency")

    def set_quotas(self, tenant: str, limits: dict[str, float] | None) -> dict[str, Any]:
        """Change a tenant's quotas at this scheduler (`requests_per_s`, `max_inflight`, `weight`,
        ...: the keys given; None: back to `[quotas]`' defaults). The scheduler keeps the change
        across a restart (a 503 `state_not_saved` says it could not); with etcd, every replica
        takes it."""
        return self._put("/quotas", {"tenant": tenant, "limits": limits})

    def quotas(self) -> dict[str, Any]:
        return self._get("/quotas")

    def close(self) -> None:
        for client in self.replicas.clients:
            client.close()


class AsyncAdminClient:
    """As AdminClient, with coroutine methods."""

    def __init__(self, base_url: BaseUrl = None, *, token: str | None = None, timeout: float = 30.0) -> None:
        token = token or os.environ.get("SYMPHONY_ADMIN_TOKEN")
        self.replicas = _replicas(openai.AsyncOpenAI, base_url, token, timeout, 0, _admin_root)

    async def _put(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return cast("dict[str, Any]", await self.replicas.acall(lambda c: c.put(path, cast_to=object, body=body)))

    async def _get(self, path: str) -> dict[str, Any]:
        return cast("dict[str, Any]", await self.replicas.acall(lambda c: c.get(path, cast_to=object)))

    async def set_priority(self, tenant: str, priority: str, *, session_id: str | None = None) -> dict[str, Any]:
        return await self._put("/priorities", {"tenant": tenant, "session_id": session_id, "priority": priority})

    async def priorities(self) -> dict[str, Any]:
        return await self._get("/priorities")

    async def set_quotas(self, tenant: str, limits: dict[str, float] | None) -> dict[str, Any]:
        return await self._put("/quotas", {"tenant": tenant, "limits": limits})

    async def quotas(self) -> dict[str, Any]:
        return await self._get("/quotas")

    async def close(self) -> None:
        for client in self.replicas.clients:
            await client.close()
