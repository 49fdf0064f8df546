"""A node that answers instantly, to measure what the scheduler itself costs per request.

`bench proxy`'s CPU part puts a real `symphony scheduler` process in front of this node: a gRPC
node manager whose Status always reports a ready engine, and an OpenAI-compatible engine that
streams its answer at once without computing anything. Whatever CPU the scheduler process spends
is then its own work per request (parsing, validation, tokenization, routing, relaying), not time
spent waiting on a model. The engine checks nothing beyond what the relay needs; its usage figures
count words, not tokens.

The node serves no KV RPCs (gRPC answers UNIMPLEMENTED itself, with no handler run or logged): a
scheduler that asks for a prefetch or a block stream sees a node that offers none, as it would a
node of an older release.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import grpc
from aiohttp import web

from symphony.rpc import node_pb2, node_pb2_grpc

_DONE = b"data: [DONE]\n\n"


def _chunk(body: dict[str, Any], model: str) -> bytes:
    return f"data: {json.dumps(body | {'model': model})}\n\n".encode()


class NoopEngine:
    """Streams `max_tokens` one-word chunks (at most 64) as soon as a request arrives."""

    def __init__(self, host: str, port: int, model: str) -> None:
        self.host, self.port, self.model = host, port, model
        self.requests = 0  # answered so far
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests += 1
        words = max(1, min(int(body.get("max_tokens") or 1), 64))
        chat = request.path.endswith("/chat/completions")
        usage = {"prompt_tokens": 1, "completion_tokens": words, "total_tokens": 1 + words}
        if not body.get("stream"):
            choice = {"index": 0, "finish_reason": "length"}
            if chat:
                choice["message"] = {"role": "assistant", "content": " ".join(["hi"] * words)}
            else:
                choice["text"] = " ".join(["hi"] * words)
            return web.json_response(
                {"object": "chat.completion" if chat else "text_completion", "choices": [choice], "usage": usage}
            )
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        kind = "chat.completion.chunk" if chat else "text_completion"
        delta = ({"delta": {"content": "hi "}} if chat else {"text": "hi "}) | {"index": 0}
        payload = b"".join(_chunk({"object": kind, "choices": [delta]}, self.model) for _ in range(words))
        if (body.get("stream_options") or {}).get("include_usage"):
            payload += _chunk({"object": kind, "choices": [], "usage": usage}, self.model)
        await response.write(payload + _DONE)
        await response.write_eof()
        return response

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's `/tokenize` and `/detokenize` in shape: a token per word, the words back."""
        body = await request.json()
        if request.path == "/detokenize":
            return web.json_response({"prompt": " ".join("hi" for _ in body.get("tokens") or [])})
        words = str(body.get("prompt") or body.get("messages") or "").split()
        return web.json_response({"count": len(words), "max_model_len": 32768, "tokens": [1] * len(words)})

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._answer)
        app.router.add_post("/v1/completions", self._answer)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._tokenize)
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


class _ReadyNodeManager(node_pb2_grpc.NodeManagerServicer):
    def __init__(self, status: node_pb2.NodeStatus) -> None:
        self.status = status

    async def Health(self, request: node_pb2.HealthRequest, context: Any) -> node_pb2.HealthResponse:
        return node_pb2.HealthResponse(serving=True, engine_state=node_pb2.ENGINE_STATE_READY)

    async def Status(self, request: node_pb2.StatusRequest, context: Any) -> node_pb2.NodeStatus:
        return self.status


class NoopNode:
    """The engine and its always-ready node manager, on the given ports of `host`."""

    def __init__(
        self, host: str, grpc_port: int, engine_port: int, model: str, block_size: int = 32, node_id: str = "noop-0"
    ) -> None:
        self.engine = NoopEngine(host, engine_port, model)
        self.address = f"{host}:{grpc_port}"
        status = node_pb2.NodeStatus(
            node_id=node_id,
            engine_state=node_pb2.ENGINE_STATE_READY,
            engine_url=self.engine.url,
            served_model=model,
            max_model_len=32768,
            block_size=block_size,
            model_fingerprint=hashlib.sha256(b"noop-node\0" + model.encode()).digest(),
        )
        self._manager = _ReadyNodeManager(status)
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        await self.engine.start()
        self._server = grpc.aio.server()
        node_pb2_grpc.add_NodeManagerServicer_to_server(self._manager, self._server)
        self._server.add_insecure_port(self.address)
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None
        await self.engine.stop()
