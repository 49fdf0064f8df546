"""The guard in front of a node's vLLM engine (`node_manager.engine_auth`): every path but a
liveness check needs the cluster's engine key, including those vLLM's own `--api-key` leaves open."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import httpx
import pytest

from node_manager.engine_auth import ENGINE_KEY_ENV, EngineKeyGuard
from symphony.tenancy import engine_headers, engine_key

SECRET = "s" * 32
KEY = engine_key(SECRET.encode())


async def _inner(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
    """What vLLM would answer: 200 and the path, for HTTP; an accepted WebSocket."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.accept"})
        return
    body = scope["path"].encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def guarded(monkeypatch: pytest.MonkeyPatch) -> httpx.AsyncClient:
    monkeypatch.setenv(ENGINE_KEY_ENV, KEY)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=EngineKeyGuard(_inner)), base_url="http://engine")


# vLLM's --api-key guards /v1 only: /invocations (SageMaker's chat and completions), /tokenize,
# /pooling, /metrics and the dev endpoints would be open to a direct caller.
PATHS = ["/v1/chat/completions", "/v1/completions", "/invocations", "/tokenize", "/pooling", "/metrics", "/version"]
PATHS += ["/reset_prefix_cache", "/health/", "/v1/models"]


@pytest.mark.parametrize("path", PATHS)
async def test_every_path_needs_the_key(guarded: httpx.AsyncClient, path: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY}):
        refused = await guarded.post(path, json={}, headers=headers)
        assert refused.status_code == 401, (path, headers)
        assert refused.json()["error"]["code"] == "engine_key_required"
        assert refused.headers["www-authenticate"] == "Bearer"
    allowed = await guarded.post(path, json={}, headers=engine_headers(SECRET))
    assert (allowed.status_code, allowed.text) == (200, path)
    lower = await guarded.get(path, headers={"authorization": f"bearer {KEY}"})  # scheme and name: any case
    assert lower.status_code == 200


async def test_a_liveness_check_stays_open_and_only_that(guarded: httpx.AsyncClient) -> None:
    for path in ("/health", "/ping"):
        assert (await guarded.get(path)).status_code == 200
        assert (await guarded.head(path)).status_code == 200
        assert (await guarded.post(path)).status_code == 401  # /ping's POST is SageMaker's: guarded


async def test_a_key_from_another_secret_is_refused(guarded: httpx.AsyncClient) -> None:
    other = engine_headers("t" * 32)
    assert other and (await guarded.post("/v1/completions", json={}, headers=other)).status_code == 401


async def test_a_websocket_without_the_key_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENGINE_KEY_ENV, KEY)
    guard = EngineKeyGuard(_inner)
    sent: list[MutableMapping[str, Any]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    async def receive() -> MutableMapping[str, Any]:
        return {"type": "websocket.connect"}

    scope = {"type": "websocket", "path": "/v1/realtime", "headers": []}
    await guard(scope, receive, send)
    assert sent == [{"type": "websocket.close", "code": 1008}]
    sent.clear()
    await guard({**scope, "headers": [(b"authorization", f"Bearer {KEY}".encode())]}, receive, send)
    assert sent == [{"type": "websocket.accept"}]


def test_an_engine_without_its_key_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENGINE_KEY_ENV, raising=False)
    with pytest.raises(RuntimeError, match=ENGINE_KEY_ENV):
        EngineKeyGuard(_inner)


def test_the_key_comes_from_the_secret_and_says_nothing_of_it() -> None:
    assert engine_key(b"") == "" and engine_headers("") == {}
    assert len(KEY) == 48 and SECRET not in KEY
    assert engine_key(SECRET.encode()) == KEY != engine_key(b"t" * 32)
