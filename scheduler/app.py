"""HTTP surface of the scheduler: OpenAI-compatible inference and advisories (scheduler.hot_path),
models, health and metrics (FastAPI)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

# Starlette loads anyio's asyncio backend lazily, on first use of its task groups or thread pool
# (~0.3 s on this machine); importing it here keeps that cost out of the first request's latency.
import anyio._backends._asyncio  # noqa: F401
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp

from scheduler.admin import admin_routes
from scheduler.advisories import AdvisoryTable
from scheduler.auth import Authenticator
from scheduler.cluster import Cluster
from scheduler.dispatch import Dispatcher
from scheduler.errors import ApiError, http_error_handler
from scheduler.hot_path import HotPath
from scheduler.metrics import SchedulerMetrics
from scheduler.policies import make_policy
from scheduler.priorities import PriorityTable
from scheduler.sessions import SessionTable
from symphony.config import SymphonyConfig


class SchedulerState:
    """Everything one scheduler instance owns; built from config, started and stopped by the app."""

    def __init__(self, config: SymphonyConfig) -> None:
        self.config = config
        sc = config.scheduler
        self.metrics = SchedulerMetrics()
        self.cluster = Cluster(config.scheduler_node_addresses(), poll_interval_s=sc.poll_interval_ms / 1000,
                               down_after_s=sc.node_down_after_ms / 1000)
        self.advisories = AdvisoryTable(sc.max_advisories, sc.advisory_ttl_s,
                                        on_drop=lambda reason: self.metrics.advisories_dropped.labels(reason).inc())
        self.auth = Authenticator(sc.api_keys, sc.admin_token)
        self.sessions = SessionTable(sc.max_sessions, sc.session_ttl_s)
        self.priorities = PriorityTable(sc.max_priority_settings)
        self.dispatcher = Dispatcher(self.cluster, make_policy(sc.policy, sc), self.advisories, self.metrics, sc,
                                     sessions=self.sessions, priorities=self.priorities)

    def export_gauges(self) -> None:
        """Refresh the gauges from live state; done when /metrics is scraped, not on every change."""
        now = time.monotonic()
        m = self.metrics
        self.advisories.purge(now)
        self.sessions.purge()
        m.advisories_pending.set(len(self.advisories))
        for node in self.cluster.nodes:
            if not node.reported:
                continue  # its id is not known yet; no series under a placeholder name
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

    async def api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return JSONResponse(exc.body(), status_code=exc.status)

    app.add_exception_handler(ApiError, api_error)
    app.include_router(admin_routes(state))

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        data = [{"id": name, "object": "model", "owned_by": "symphony", "max_model_len": max_len}
                for name, max_len in sorted(state.cluster.served_models().items())]
        return JSONResponse({"object": "list", "data": data})

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
        state.export_gauges()
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return HotPath(app, state)
