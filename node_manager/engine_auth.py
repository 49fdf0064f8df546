"""The guard in front of a node's vLLM engine: every request but a liveness check needs the
cluster's engine key (`symphony.tenancy.engine_key`), which only the cluster's own processes hold.

vLLM's own `--api-key` guards only the paths under /v1, /v2, /inference and /cohere
(vllm/entrypoints/serve/middleware/authenticate.py): `/invocations` serves chat and completions
without it, and `/tokenize`, `/pooling`, `/metrics` and the dev endpoints are open. This guard is
loaded into the engine's API server with vLLM's `--middleware` option and covers every path, so a
direct call that skips the scheduler (and with it tenancy, quotas and signed KV params) is refused.

Contract: the engine's environment holds the key in `ENGINE_KEY_ENV`; the guard reads it once,
when Starlette first builds the middleware stack, and raises without one. It fails closed: the app
is then never built, so the engine answers nothing but errors (its /health included), never becomes
ready, and the node manager restarts it until it gives up. A node started with a key never serves
unguarded. It runs inside vLLM, so it imports only the standard
library and `symphony.tenancy` (which does too).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from symphony.tenancy import ENGINE_KEY_ENV

MIDDLEWARE = f"{__name__}.EngineKeyGuard"  # the value of vLLM's --middleware
# Open without the key: the node manager's readiness probe and load balancers' liveness checks.
OPEN_PATHS = frozenset({"/health", "/ping"})

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

_REFUSAL = json.dumps(
    {
        "error": {
            "message": "this engine serves its cluster only: send requests to the Symphony scheduler",
            "type": "authentication_error",
            "param": None,
            "code": "engine_key_required",
        }
    }
).encode()


class EngineKeyGuard:
    """Pure ASGI middleware: a request passes when its `Authorization: Bearer` token is the key
    (compared as sha256 digests in constant time), or when it is a GET or HEAD of an open path.
    Others get 401 with an OpenAI-style body; a WebSocket is closed (1008, policy violation)."""

    def __init__(self, app: App) -> None:
        key = os.environ.get(ENGINE_KEY_ENV, "")
        if not key:
            raise RuntimeError(f"{ENGINE_KEY_ENV} is not set: the engine refuses to serve unguarded")
        self._app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or self._allowed(scope):
            await self._app(scope, receive, send)
            return
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(_REFUSAL)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _REFUSAL})

    def _allowed(self, scope: Scope) -> bool:
        if scope.get("method") in ("GET", "HEAD") and scope.get("path") in OPEN_PATHS:
            return True
        token = b""
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                scheme, _, token = bytes(value).partition(b" ")
                if scheme.lower() != b"bearer":
                    token = b""
                break
        return hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self._digest)
