"""Fault-injection stand-ins for the scheduler's integration tests: a gRPC node manager whose
status the test sets, and an OpenAI-like engine that can stream, stall or break on request.

The real node manager and real vLLM engines are exercised end to end in tests/e2e.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web

from symphony.rpc import kv_pb2, kv_pb2_grpc, node_pb2, node_pb2_grpc
from tests.helpers import free_port


class FakeKVStore(kv_pb2_grpc.KVStoreServicer):
    """Records the prefetches the scheduler asks for; each ends in `final_state` once `release` is set
    (set from the start unless a test holds it)."""

    def __init__(self) -> None:
        self.prefetches: list[kv_pb2.PrefetchRequest] = []
        self.final_state = kv_pb2.PREFETCH_STATE_DONE
        self.final_pages = (0, 0)  # a finished prefetch's (pages_in_target, pages_from_peer)
        self.joins = False
        self.running_jobs: dict[tuple[str, int], str] = {}
        self.release = asyncio.Event()
        self.release.set()
        # WatchBlocks: None answers UNIMPLEMENTED (a node manager without block events); else a
        # snapshot of these blocks in `blocks_tier`, then a heartbeat every HEARTBEAT_S.
        self.blocks: list[bytes] | None = None
        self.blocks_tier = kv_pb2.TIER_DRAM
        self.fingerprint = b""
        self.watch_requests: list[tuple[str, int]] = []

    HEARTBEAT_S = 0.2

    async def WatchBlocks(self, request, context):
        if self.blocks is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no block events here")
        self.watch_requests.append((request.epoch, request.after_seq))
        stored = kv_pb2.BlockEvent(kind=kv_pb2.BLOCK_EVENT_STORED, tier=self.blocks_tier, block_keys=self.blocks)
        batch = kv_pb2.BlockEventBatch(model_fingerprint=self.fingerprint, epoch="boot", seq=1, events=[stored])
        batch.snapshot_begin = batch.snapshot_end = True
        yield batch
        while True:
            await asyncio.sleep(self.HEARTBEAT_S)  # the node's cadence, not a wait for the test
            yield kv_pb2.BlockEventBatch(model_fingerprint=self.fingerprint, epoch="boot", seq=1)

    async def Prefetch(self, request, context):
        self.prefetches.append(request)
        if request.engine_cache_salt and request.target_tier != kv_pb2.TIER_HBM:
            # As the real node refuses it (KVStoreService.Prefetch): a fake that took it let every
            # DRAM pull the scheduler sent with a salt pass here and fail on live nodes.
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "engine_cache_salt goes with target_tier TIER_HBM")
        # As the node's queue: a request for a session whose job of the same target is still running
        # joins it (gets its id) when `joins` is set.
        key = (request.session.session_id, request.target_tier)
        job = self.running_jobs.setdefault(key, str(len(self.prefetches))) if self.joins else str(len(self.prefetches))
        return kv_pb2.PrefetchStatus(prefetch_id=job, state=kv_pb2.PREFETCH_STATE_QUEUED)

    async def GetPrefetch(self, request, context):
        try:
            await asyncio.wait_for(self.release.wait(), request.wait_ms / 1000)
        except TimeoutError:
            return kv_pb2.PrefetchStatus(prefetch_id=request.prefetch_id, state=kv_pb2.PREFETCH_STATE_RUNNING)
        in_target, from_peer = self.final_pages
        return kv_pb2.PrefetchStatus(
            prefetch_id=request.prefetch_id,
            state=self.final_state,
            pages_in_target=in_target,
            pages_from_peer=from_peer,
        )


class FakeNodeManager(node_pb2_grpc.NodeManagerServicer):
    def __init__(self, status: node_pb2.NodeStatus) -> None:
        self.status = status
        self.port = free_port()
        self.server: grpc.aio.Server | None = None
        self.kv = FakeKVStore()
        self.kv.fingerprint = status.model_fingerprint

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def Health(self, request, context):
        return node_pb2.HealthResponse(serving=True, engine_state=self.status.engine_state)

    async def Status(self, request, context):
        return self.status

    async def start(self) -> None:
        self.server = grpc.aio.server()
        node_pb2_grpc.add_NodeManagerServicer_to_server(self, self.server)
        kv_pb2_grpc.add_KVStoreServicer_to_server(self.kv, self.server)
        self.server.add_insecure_port(self.address)
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)
            self.server = None


def ready_status(
    node_id: str,
    engine_url: str,
    model: str = "m",
    running: int = 0,
    waiting: int = 0,
    fingerprint: bytes | None = None,
    secret_check: bytes = b"",
) -> node_pb2.NodeStatus:
    """A ready node's status; its model fingerprint defaults to one per model name; `secret_check`:
    the cluster secret it reports (symphony.tenancy.secret_check; empty: none)."""
    return node_pb2.NodeStatus(
        node_id=node_id,
        engine_state=node_pb2.ENGINE_STATE_READY,
        engine_url=engine_url,
        served_model=model,
        max_model_len=4096,
        block_size=32,
        num_requests_running=running,
        num_requests_waiting=waiting,
        model_fingerprint=fingerprint or hashlib.sha256(model.encode()).digest(),
        secret_check=secret_check,
    )


def sse(content: str) -> bytes:
    chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": content}}]}
    return f"data: {json.dumps(chunk)}\n\n".encode()


@dataclass
class FakeEngine:
    """Behaviour per request is picked by the prompt's first message content:
    "stall": stream one chunk then wait (to test disconnects), "linger": a whole stream, `[DONE]`
    included, whose end comes only once the caller hangs up, "break": stream two chunks then drop the
    connection, "bad": answer 400 like vLLM's validation,
    "unkeyed": 401 like an engine refusing the key, "slow": a plain answer only after 10 s (or
    until the caller hangs up, or `slow_done` is set), "prefill": a stream whose first chunk waits for `prefill_done`,
    anything else: a normal answer."""

    port: int = field(default_factory=free_port)
    requests: list[dict[str, object]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    prefill_done: asyncio.Event = field(default_factory=asyncio.Event)
    slow_done: asyncio.Event = field(default_factory=asyncio.Event)
    tokenize_requests: list[dict[str, Any]] = field(default_factory=list)
    tokenize_headers: list[dict[str, str]] = field(default_factory=list)
    tokenize_with: Callable[[dict[str, Any]], list[int]] | None = None
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        behaviour = body["messages"][0]["content"] if body.get("messages") else ""
        if behaviour == "bad":
            return web.json_response(
                {
                    "error": {
                        "message": "temperature must be >= 0",
                        "type": "BadRequestError",
                        "param": "temperature",
                        "code": 400,
                    }
                },
                status=400,
            )
        if behaviour == "unkeyed":  # as node_manager.engine_auth refuses a key it does not know
            return web.json_response({"error": {"code": "engine_key_required"}}, status=401)
        if behaviour == "slow" and not body.get("stream"):
            for _ in range(500):
                if request.transport is None or request.transport.is_closing():
                    self.disconnected.set()
                    break
                if self.slow_done.is_set():
                    break
                await asyncio.sleep(0.02)
        if not body.get("stream"):
            return web.json_response(
                {
                    "object": "chat.completion",
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}
                    ],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                }
            )
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        if behaviour == "break":
            await response.write(sse("a") + sse("b"))
            assert request.transport is not None
            request.transport.abort()
            return response
        if behaviour == "prefill":
            await asyncio.wait_for(self.prefill_done.wait(), 30)
        if behaviour == "stall":
            await response.write(sse("first"))
            try:
                for _ in range(600):
                    await asyncio.sleep(0.05)
                    await response.write(b": keep-alive\n\n")
            except (ConnectionResetError, asyncio.CancelledError):
                self.disconnected.set()
                raise
            return response
        for word in ("one", "two", "three"):
            await response.write(sse(word))
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {
                "prompt_tokens": 7,
                "completion_tokens": 3,
                "total_tokens": 10,
                "prompt_tokens_details": {"cached_tokens": 4},
            }
            chunk = {"object": "chat.completion.chunk", "choices": [], "usage": usage}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        if behaviour == "linger":
            try:
                for _ in range(600):
                    await asyncio.sleep(0.05)
                    await response.write(b"")
                    if request.transport is None or request.transport.is_closing():
                        break
            except (ConnectionResetError, asyncio.CancelledError):
                self.disconnected.set()
                raise
            self.disconnected.set()
            return response
        await response.write_eof()
        return response

    async def _tokenize(self, request: web.Request) -> web.Response:
        """/tokenize and /detokenize: records the body in `tokenize_requests` and answers as vLLM
        would, with the ids of `tokenize_with` (the scheduler's tokenizer check then passes) or
        made-up ones."""
        body = await request.json()
        self.tokenize_requests.append(body)
        self.tokenize_headers.append(dict(request.headers))
        if request.path == "/detokenize":
            return web.json_response({"prompt": "engine text"})
        ids = self.tokenize_with(body) if self.tokenize_with is not None else [7, 8, 9]
        return web.json_response({"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": None})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._chat)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._tokenize)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
