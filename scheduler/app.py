"""HTTP surface of the scheduler (FastAPI): OpenAI-compatible inference, advisories, health, metrics."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

# Starlette's StreamingResponse loads anyio's asyncio backend on first use (~0.3 s on this machine);
# importing it here moves that cost from the first user's TTFT to start-up.
import anyio._backends._asyncio  # noqa: F401
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from scheduler.advisories import AdvisoryTable
from scheduler.cluster import Cluster, NodeView
from scheduler.dispatch import Dispatcher
from scheduler.errors import ApiError, api_error_handler, http_error_handler
from scheduler.metrics import SchedulerMetrics
from scheduler.routing import make_policy
from scheduler.validation import validate_advisory, validate_inference
from symphony.config import SymphonyConfig

SESSION_HEADER = "x-session-id"
DEFAULT_TENANT = "default"  # tenants from API keys arrive with the security work (issue 5)


class SchedulerState:
    """Everything one scheduler instance owns; built from config, started and stopped by the app."""

    def __init__(self, config: SymphonyConfig) -> None:
        self.config = config
        sc = config.scheduler
        self.metrics = SchedulerMetrics()
        self.cluster = Cluster(config.scheduler_node_addresses(), poll_interval_s=sc.poll_interval_ms / 1000,
                               down_after_s=sc.node_down_after_ms / 1000, on_update=self.export_node)
        self.advisories = AdvisoryTable(sc.max_advisories, sc.advisory_ttl_s)
        self.dispatcher = Dispatcher(self.cluster, make_policy(sc.policy), self.advisories, self.metrics, sc)

    def export_node(self, node: NodeView) -> None:
        now = time.monotonic()
        m = self.metrics
        m.node_up.labels(node.node_id).set(1 if node.available(now, self.cluster.down_after_s) else 0)
        m.node_load.labels(node.node_id).set(node.running + node.waiting)
        m.node_inflight.labels(node.node_id).set(node.inflight)
        m.node_kv_usage.labels(node.node_id).set(node.kv_usage)
        m.node_engine_restarts.labels(node.node_id).set(node.engine_restarts)

    async def start(self) -> None:
        await self.dispatcher.start()
        await self.cluster.start()

    async def stop(self) -> None:
        await self.cluster.stop()
        await self.dispatcher.stop()


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes exceeds the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(config: SymphonyConfig, state: SchedulerState | None = None) -> FastAPI:
    state = state or SchedulerState(config)
    sc = config.scheduler

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="Symphony scheduler", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.symphony = state
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)

    async def inference(endpoint: str, request: Request) -> Response:
        received_at = time.perf_counter()
        try:
            raw = await _read_body(request, sc.max_body_bytes)
            parsed = validate_inference(endpoint, raw, request.headers.get(SESSION_HEADER),
                                        state.cluster.served_models(), sc.max_session_id_len)
            return await state.dispatcher.dispatch(parsed, DEFAULT_TENANT, received_at)
        except ApiError as exc:
            state.metrics.requests.labels(endpoint, str(exc.status)).inc()
            raise

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await inference("chat", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await inference("completions", request)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        data = [{"id": name, "object": "model", "owned_by": "symphony", "max_model_len": max_len}
                for name, max_len in sorted(state.cluster.served_models().items())]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/advisories", status_code=202)
    async def advisories(request: Request) -> JSONResponse:
        raw = await _read_body(request, sc.max_body_bytes)
        parsed = validate_advisory(raw, request.headers.get(SESSION_HEADER), state.cluster.served_models(),
                                   sc.max_session_id_len, sc.max_expected_arrival_ms)
        return JSONResponse(state.dispatcher.advise(parsed, DEFAULT_TENANT), status_code=202)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        nodes = state.cluster.describe()
        ready = sum(1 for n in nodes.values() if n["state"] == "ready")
        body = {"status": "ready" if ready else "not_ready", "ready_nodes": ready, "nodes": nodes,
                "models": sorted(state.cluster.served_models())}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        for node in state.cluster.nodes:
            state.export_node(node)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
