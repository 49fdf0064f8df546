"""The scheduler's POST endpoints as plain ASGI, ahead of FastAPI.

The inference and advisory endpoints skip FastAPI/Starlette's middleware and routing stack, whose
per-request CPU is paid in series in a burst and so lands in TTFT
(docs/design-notes.md#scheduler-http-path); FastAPI keeps the GET endpoints (models, health,
metrics), where it costs nothing that matters.
"""

from __future__ import annotations

import asyncio
import time

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scheduler.errors import ApiError, error_response, rate_limited_error, tenant_inflight_error
from scheduler.relay import UpstreamRelay
from scheduler.state import SchedulerState
from scheduler.validation import validate_advisory, validate_inference
from symphony.logs import get_logger
from symphony.region_load import KV_SOURCE_HEADER, parse_kv_source
from symphony.regions import node_index
from symphony.tenant_quotas import QuotaKind

log = get_logger(__name__)

INFERENCE_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
ADVISORY_PATH = "/v1/advisories"
SESSION_HEADER = b"x-session-id"
AUTHORIZATION_HEADER = b"authorization"
KV_SOURCE = KV_SOURCE_HEADER.lower().encode()


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes exceeds the {limit}-byte limit")
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ApiError(400, "the client disconnected while sending the request")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the {limit}-byte limit")
        chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks)


class HotPath:
    """Routes POST /v1/chat/completions, /v1/completions and /v1/advisories; the rest goes to `app`."""

    def __init__(self, app: ASGIApp, state: SchedulerState) -> None:
        self.app = app
        self.state = state
        self._limits = state.config.scheduler
        self._salt_key = state.config.cluster.secret.encode()  # keys the tenants' engine cache salts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            endpoint = INFERENCE_PATHS.get(path)
            if endpoint is not None or path == ADVISORY_PATH:
                await self._guarded(endpoint or "advisories", scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _guarded(self, endpoint: str, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            if scope["method"] != "POST":
                raise ApiError(405, "method not allowed for this endpoint")
            if endpoint == "advisories":
                await self._advisory(scope, receive, tracking_send)
            else:
                await self._inference(endpoint, scope, receive, tracking_send)
        except ApiError as exc:
            if endpoint != "advisories":
                self.state.metrics.count_request(endpoint, exc.status)
            if not started:
                await error_response(exc.status, exc.message, param=exc.param, code=exc.code, headers=exc.headers)(
                    scope, receive, send
                )
        except Exception:
            # Never a bare traceback to the client; the log keeps it for us.
            log.exception("unhandled error", endpoint=endpoint)
            if endpoint != "advisories":
                self.state.metrics.count_request(endpoint, 500)
            if not started:
                await error_response(500, "internal error in the scheduler; see its log")(scope, receive, send)

    async def _inference(self, endpoint: str, scope: Scope, receive: Receive, send: Send) -> None:
        received_at = time.perf_counter()
        tenant = self.state.auth.tenant(header(scope, AUTHORIZATION_HEADER))
        self._take_quota("requests", tenant)
        raw = await read_body(scope, receive, self._limits.max_body_bytes)
        parsed = validate_inference(
            endpoint,
            raw,
            header(scope, SESSION_HEADER),
            self.state.cluster.served_models(),
            self._limits.max_session_id_len,
            self._salt_key,
        )
        # If the client hangs up at any point (waiting for a plain answer, or mid-stream), cancel
        # this exchange: the engine connection closes and vLLM aborts the generation. One watcher
        # for the whole exchange, and the only reader of `receive` once the body is in.
        exchange = asyncio.current_task()
        assert exchange is not None
        client_gone = False

        async def cancel_on_disconnect() -> None:
            nonlocal client_gone
            while (await receive())["type"] != "http.disconnect":
                pass
            client_gone = True
            exchange.cancel()

        quotas = self.state.quotas
        if not quotas.enter(tenant):  # counted until its answer ends, streamed or whole
            self.state.metrics.quota_refused.labels(tenant, "inflight").inc()
            raise tenant_inflight_error(tenant, quotas.limits(tenant).max_inflight)
        watcher = asyncio.ensure_future(cancel_on_disconnect())
        response = None
        try:
            response = await self.state.dispatcher.dispatch(parsed, tenant, received_at)
            await response(scope, receive, send)
        except ApiError as exc:
            if exc.code == "tenant_queue_full":
                self.state.metrics.quota_refused.labels(tenant, "queued").inc()
            raise
        except asyncio.CancelledError:
            if not client_gone:
                raise
            exchange.uncancel()
            if not (isinstance(response, UpstreamRelay) and response.counted):  # a stream it read to its end
                self.state.metrics.count_request(endpoint, 499)  # nginx's "client closed request"
        finally:
            watcher.cancel()
            quotas.leave(tenant)

    def _take_quota(self, kind: QuotaKind, tenant: str) -> None:
        """One of the tenant's `kind` tokens, else 429 with Retry-After."""
        retry_after_s = self.state.quotas.take(kind, tenant, time.monotonic())
        if retry_after_s > 0:
            self.state.metrics.quota_refused.labels(tenant, f"{kind}_rate").inc()
            raise rate_limited_error(tenant, kind, retry_after_s)

    def _kv_source(self, value: str | None, tenant: str) -> tuple[str, int] | None:
        """The other region's copy the global layer names (KV_SOURCE_HEADER), checked: a node this
        scheduler reaches through its links, in a region the tenant's data may be in."""
        if value is None:
            return None
        try:
            node, tokens = parse_kv_source(value)
        except ValueError as exc:
            raise ApiError(400, str(exc), param=KV_SOURCE_HEADER) from None
        remote = self.state.dispatcher.remote_nodes
        topology = self.state.topology
        index = node_index(node) if node in remote else None
        if topology is None or index is None:
            raise ApiError(400, f"{KV_SOURCE_HEADER}: {node!r} is no node of another region", param=KV_SOURCE_HEADER)
        if not topology.allowed(tenant, topology.region_of_node(index)):
            raise ApiError(
                403, f"{KV_SOURCE_HEADER}: tenant {tenant!r} has no data in {node}'s region", code="residency"
            )
        return node, tokens

    async def _advisory(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        tenant = self.state.auth.tenant(header(scope, AUTHORIZATION_HEADER))
        self._take_quota("advisories", tenant)
        raw = await read_body(scope, receive, self._limits.max_body_bytes)
        parsed = validate_advisory(
            raw,
            header(scope, SESSION_HEADER),
            self.state.cluster.served_models(),
            self._limits.max_session_id_len,
            self._limits.max_expected_arrival_ms,
        )
        remote = self._kv_source(header(scope, KV_SOURCE), tenant)
        reply = JSONResponse(self.state.dispatcher.advise(parsed, tenant, remote), status_code=202)
        await reply(scope, receive, send)
        # From the request's headers to the answer handed to the server: the scheduler's own part of
        # an advisory's round trip (the client also sees the network and its event loop's delays).
        self.state.metrics.advisory_latency.observe(time.perf_counter() - started)
