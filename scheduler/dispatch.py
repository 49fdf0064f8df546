"""Dispatch: pick a node (pending advisory first, else the routing policy) and relay to its engine.

The scheduler is on the token path only as a byte relay: request bodies go out as received (after
validation) and streamed chunks are passed through unparsed, which keeps the added TTFT to the cost
of one local HTTP hop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from scheduler.advisories import AdvisoryTable, SessionKey
from scheduler.cluster import Cluster, NodeView
from scheduler.errors import ApiError, error_response, sse_error_event
from scheduler.metrics import SchedulerMetrics
from scheduler.routing import RouteRequest, RoutingPolicy
from scheduler.validation import AdvisoryRequest, InferenceRequest
from symphony.config import SchedulerConfig
from symphony.logs import get_logger

log = get_logger("scheduler.dispatch")

ENGINE_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
NODE_HEADER = "X-Symphony-Node"
ROUTE_HEADER = "X-Symphony-Route"
# Errors raised before the engine sent a status line: the request did not start, so another node
# may take it. A read timeout is not among them: the engine may still be working on it.
_NOT_STARTED = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError, aiohttp.ServerDisconnectedError,
                aiohttp.ClientOSError)
# After a failed connect, keep a node out of rotation this long (or until a later poll says ready).
_UNREACHABLE_HOLD_S = 1.0


class RelayResponse(StreamingResponse):
    """Streams an engine's event stream to the client, chunk for chunk.

    Starlette's StreamingResponse opens an anyio task group per response to notice disconnects; at
    16 concurrent streams that was a visible part of the scheduler's per-request CPU. Here one plain
    asyncio task waits for the disconnect and closes the upstream, which ends the relay loop.
    """

    def __init__(self, upstream: aiohttp.ClientResponse, chunks: AsyncIterator[bytes], media_type: str,
                 headers: dict[str, str], release: Callable[[], None]) -> None:
        super().__init__(chunks, status_code=200, media_type=media_type, headers=headers)
        self._upstream = upstream
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def close_upstream_on_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self._upstream.close()

        watcher = asyncio.ensure_future(close_upstream_on_disconnect())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            # A relay that never started has not run its own cleanup; both calls are no-ops otherwise
            # (close() after release() leaves the pooled connection alone).
            self._upstream.close()
            self._release()


@dataclass(frozen=True, slots=True)
class Route:
    node: NodeView
    reason: str


class Dispatcher:
    def __init__(self, cluster: Cluster, policy: RoutingPolicy, advisories: AdvisoryTable,
                 metrics: SchedulerMetrics, config: SchedulerConfig) -> None:
        self.cluster = cluster
        self.policy = policy
        self.advisories = advisories
        self.metrics = metrics
        self.config = config
        self.inflight_total = 0
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # aiohttp rather than httpx: httpx's pool walks every connection per request, which cost
        # ~2 ms of CPU per request at 16 concurrent streams and showed up directly in TTFT.
        # Idle connections are dropped before uvicorn's 5 s keep-alive (vLLM's server) would close them
        # under us, which would turn a reused connection into a spurious "engine unreachable".
        connector = aiohttp.TCPConnector(limit=self.config.max_inflight_requests + 16, keepalive_timeout=4.0)
        timeout = aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout_s,
                                        sock_read=self.config.request_timeout_s)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False)

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- routing --------------------------------------------------------------------------------
    def _route(self, model: str, tenant: str, session_id: str | None, exclude: set[str],
               advised_node: str | None) -> Route:
        nodes = [n for n in self.cluster.snapshot(model, self.advisories.pending_by_node) if n.node_id not in exclude]
        if advised_node is not None:
            if any(n.node_id == advised_node and n.available for n in nodes):
                self.metrics.advisory_followups.labels("honored").inc()
                return Route(self._node(advised_node), "advisory")
            self.metrics.advisory_followups.labels("rerouted").inc()
        decision = self.policy.choose(RouteRequest(tenant, session_id, model), nodes)
        if decision.node_id is None:
            states = ", ".join(f"{k}={v}" for k, v in self.cluster.states().items())
            raise ApiError(503, f"no engine is available to serve {model!r} ({states}); retry shortly",
                           code="no_engine_available")
        reason = decision.reason if advised_node is None else f"{decision.reason}_after_advisory"
        return Route(self._node(decision.node_id), reason)

    def _node(self, node_id: str) -> NodeView:
        node = self.cluster.by_id(node_id)
        assert node is not None, f"policy chose unknown node {node_id}"
        return node

    # -- advisories -----------------------------------------------------------------------------
    def advise(self, advisory: AdvisoryRequest, tenant: str) -> dict[str, object]:
        key: SessionKey = (tenant, advisory.session_id)
        # A newer advisory for the same session replaces the older one, so it must not count as load.
        previous = self.advisories.take(key)
        route = self._route(advisory.model, tenant, advisory.session_id, set(), None)
        if previous is not None and previous.node_id != route.node.node_id:
            log.debug("advisory moved session", session=advisory.session_id, old=previous.node_id,
                      new=route.node.node_id)
        entry = self.advisories.put(key, advisory.kind, route.node.node_id, advisory.expected_arrival_ms)
        self.metrics.advisories.labels(advisory.kind).inc()
        self.metrics.advisories_pending.set(len(self.advisories))
        return {
            "object": "advisory",
            "session_id": advisory.session_id,
            "kind": advisory.kind,
            "node": route.node.node_id,
            "expected_arrival_ms": advisory.expected_arrival_ms,
            "expires_in_ms": int((entry.expires_at - entry.created_at) * 1000),
        }

    # -- inference ------------------------------------------------------------------------------
    async def dispatch(self, request: InferenceRequest, tenant: str, received_at: float) -> Response:
        if self.inflight_total >= self.config.max_inflight_requests:
            raise ApiError(429, f"the scheduler has {self.inflight_total} requests in flight (limit "
                           f"{self.config.max_inflight_requests}); retry later", code="too_many_requests")
        advised_node = None
        if request.session_id is not None:
            advisory = self.advisories.take((tenant, request.session_id))
            self.metrics.advisories_pending.set(len(self.advisories))
            advised_node = advisory.node_id if advisory is not None else None
        tried: set[str] = set()
        last_error = ""
        for _attempt in range(2):  # the first node, then once elsewhere if it never started the request
            try:
                route = self._route(request.model, tenant, request.session_id, tried, advised_node)
            except ApiError:
                if not last_error:
                    raise
                break
            advised_node = None  # an advisory binds the first attempt only
            tried.add(route.node.node_id)
            try:
                return await self._send(route, request, received_at)
            except _NOT_STARTED as exc:
                last_error = f"{route.node.node_id}: {type(exc).__name__}: {exc}"
                log.warning("engine unreachable, re-routing", node=route.node.node_id,
                            error=str(exc) or type(exc).__name__)
                self.cluster.mark_engine_unreachable(route.node, _UNREACHABLE_HOLD_S)
                self.metrics.retries.labels(route.node.node_id).inc()
        raise ApiError(503, f"the engine could not be reached ({last_error}); retry shortly",
                       code="engine_unreachable")

    async def _send(self, route: Route, request: InferenceRequest, received_at: float) -> Response:
        assert self._session is not None, "Dispatcher.start() was not awaited"
        node = route.node
        headers = {"content-type": "application/json"}
        if request.session_id is not None:
            headers["x-session-id"] = request.session_id
        node.inflight += 1
        self.inflight_total += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                node.inflight -= 1
                self.inflight_total -= 1

        try:
            upstream = await self._session.post(node.engine_url + ENGINE_PATHS[request.endpoint],
                                                data=request.body, headers=headers)
        except BaseException:
            release()
            raise
        self.metrics.routed.labels(node.node_id, route.reason).inc()
        log.debug("dispatched", node=node.node_id, reason=route.reason, session=request.session_id,
                  status=upstream.status)
        reply_headers = {NODE_HEADER: node.node_id, ROUTE_HEADER: route.reason}
        content_type = upstream.headers.get("content-type", "application/json")
        if not request.stream or upstream.status != 200:
            try:
                payload = await upstream.read()
            except (TimeoutError, aiohttp.ClientError) as exc:
                status = 504 if isinstance(exc, TimeoutError) else 502
                self._count(request, status)
                return error_response(status, f"{node.node_id}'s engine did not deliver a response: "
                                      f"{type(exc).__name__}", code="engine_error", headers=reply_headers)
            finally:
                upstream.release()
                release()
            status = upstream.status
            if status >= 500:
                self._count(request, 502)
                detail = payload.decode(errors="replace")[:500]
                return error_response(502, f"{node.node_id}'s engine failed: {detail}", code="engine_error",
                                      headers=reply_headers)
            self._count(request, status)
            self.metrics.e2e.labels(request.endpoint, "false").observe(time.perf_counter() - received_at)
            return Response(payload, status_code=status, media_type=content_type, headers=reply_headers)

        self._count(request, 200)
        return RelayResponse(upstream, self._relay(upstream, request, node.node_id, received_at, release),
                             content_type, reply_headers, release)

    async def _relay(self, upstream: aiohttp.ClientResponse, request: InferenceRequest, node_id: str,
                     received_at: float, release: Callable[[], None]) -> AsyncIterator[bytes]:
        first, finished = True, False
        try:
            async for chunk in upstream.content.iter_any():
                if first:
                    first = False
                    self.metrics.ttft.labels(request.endpoint).observe(time.perf_counter() - received_at)
                yield chunk
            finished = True
        except (TimeoutError, aiohttp.ClientError) as exc:
            # The status line is already sent; tell the client inside the stream instead.
            log.warning("engine stream broke", node=node_id, error=type(exc).__name__)
            yield sse_error_event(502, f"the engine stream broke: {type(exc).__name__}", "engine_stream_broken")
        finally:
            if finished:
                upstream.release()  # keep the connection for the next request
            else:
                # The client left early (or the engine broke): dropping the connection makes vLLM
                # abort the generation instead of finishing it for nobody.
                upstream.close()
            release()
            self.metrics.e2e.labels(request.endpoint, "true").observe(time.perf_counter() - received_at)

    def _count(self, request: InferenceRequest, status: int) -> None:
        self.metrics.requests.labels(request.endpoint, str(status)).inc()
