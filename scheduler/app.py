"""HTTP surface of the scheduler: OpenAI-compatible inference and advisories (scheduler.hot_path),
vLLM's other endpoints (models, health, version, tokenize: scheduler.engine_api), readiness and
metrics (FastAPI)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator

# Starlette loads anyio's asyncio backend lazily, on first use of its task groups or thread pool;
# importing it here keeps that cost out of the first request's latency
# (docs/design-notes.md#scheduler-http-path).
import anyio._backends._asyncio  # noqa: F401
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp

from scheduler.admin import admin_routes
from scheduler.engine_api import engine_routes
from scheduler.errors import ApiError, http_error_handler, validation_error_handler
from scheduler.hot_path import HotPath
from scheduler.openapi import openapi_document
from scheduler.region_summary import region_summary
from scheduler.state import SchedulerState
from symphony.config import SymphonyConfig


def create_app(config: SymphonyConfig, state: SchedulerState | None = None) -> ASGIApp:
    """The scheduler's ASGI app: the POST endpoints in scheduler.hot_path, the rest in FastAPI."""
    state = state or SchedulerState(config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="Symphony scheduler", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)

    async def api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return JSONResponse(exc.body(), status_code=exc.status)

    app.add_exception_handler(ApiError, api_error)
    app.openapi = lambda: openapi_document(app)  # type: ignore[method-assign]  # the hot path's paths too
    app.include_router(admin_routes(state))
    app.include_router(engine_routes(state))

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        """Readiness: the status and the count of ready nodes for anyone (a load balancer's probe);
        the details (nodes, costs, the index) for the admin or internal token once keys are set."""
        nodes = state.cluster.describe()
        ready = sum(1 for n in nodes.values() if n["state"] == "ready")
        status = 200 if ready else 503
        body: dict[str, object] = {"status": "ready" if ready else "not_ready", "ready_nodes": ready}
        if not state.auth.observer(request.headers.get("Authorization")):
            return JSONResponse(body, status_code=status)
        body |= {
            "nodes": nodes,
            "models": sorted(state.cluster.served_models()),
            "cost_profile": state.cost_profile.describe(),
            # Node pairs whose pulls the scheduler timed; `priced`: the policy prices moves by them.
            "observed_links": [dataclasses.asdict(link) for link in state.dispatcher.links.describe()],
            # Per served model: "ready", "loading" or "none" (requests then route on session hints).
            "tokenizers": {model: state.tokens.status(model) for model in sorted(state.cluster.served_models())},
        }
        if state.kv_watch is not None and state.kv_index is not None:
            for node_id, detail in state.kv_watch.describe().items():
                if node_id in nodes:
                    nodes[node_id]["kv_index"] = detail
            body["kv_index"] = {
                "blocks": state.kv_index.blocks,
                "max_blocks": state.kv_index.table.max_blocks,
                "bytes": state.kv_index.approx_bytes(),
                "evictions": state.kv_index.evictions,
            }
        if (coordination := state.describe_coordination()) is not None:
            body["coordination"] = coordination
        return JSONResponse(body, status_code=status)

    @app.get("/summary")
    async def summary(request: Request, since: int = 0, epoch: str = "") -> JSONResponse:
        """This region's load and costs, and the sessions it holds KV of (changes since `since` of
        the feed `epoch`), as the global layer of a multi-region cluster reads them."""
        state.auth.check_observer(request.headers.get("Authorization"))
        if since < 0 or len(epoch) > 64:
            raise ApiError(400, "since must be >= 0 and epoch at most 64 characters", param="since")
        return JSONResponse(region_summary(state, since, epoch))

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state.auth.check_observer(request.headers.get("Authorization"))
        state.export_gauges()
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return HotPath(app, state)
