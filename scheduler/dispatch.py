"""Dispatch: pick a node (pending advisory first, else the routing policy) and relay to its engine.

The scheduler is on the token path only as a byte relay: request bodies go out as received (after
validation) and streamed chunks are passed through unparsed, which keeps the added TTFT to the cost
of one local HTTP hop.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
from fastapi.responses import Response

from scheduler.advisories import AdvisoryTable, SessionKey
from scheduler.cluster import Cluster, NodeView
from scheduler.errors import ApiError, error_response
from scheduler.metrics import SchedulerMetrics
from scheduler.relay import BufferedRelay, Exchange, StreamRelay, UpstreamRelay
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
# (ClientOSError covers refused connections; ServerDisconnectedError a connection the engine dropped
# before answering.)
_NOT_STARTED = (aiohttp.ClientOSError, aiohttp.ConnectionTimeoutError, aiohttp.ServerDisconnectedError)
# After a failed connect, keep a node out of rotation this long.
_UNREACHABLE_HOLD_S = 1.0


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
        self.advisories.purge()  # expired announcements must not count as load
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
        return {
            "object": "advisory",
            "session_id": advisory.session_id,
            "kind": advisory.kind,
            "node": route.node.node_id,
            "expected_arrival_ms": advisory.expected_arrival_ms,
            "expires_in_ms": int((entry.expires_at - entry.created_at) * 1000),
        }

    # -- inference ------------------------------------------------------------------------------
    async def dispatch(self, request: InferenceRequest, tenant: str, received_at: float
                       ) -> UpstreamRelay | Response:
        if self.inflight_total >= self.config.max_inflight_requests:
            raise ApiError(429, f"the scheduler has {self.inflight_total} requests in flight (limit "
                           f"{self.config.max_inflight_requests}); retry later", code="too_many_requests")
        advised_node = None
        if request.session_id is not None:
            advisory = self.advisories.take((tenant, request.session_id))
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

    async def _send(self, route: Route, request: InferenceRequest, received_at: float) -> UpstreamRelay | Response:
        """Open the exchange with the engine; raises a _NOT_STARTED error if it never began."""
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

        reply_headers = {NODE_HEADER: node.node_id, ROUTE_HEADER: route.reason}
        try:
            upstream = await self._session.post(node.engine_url + ENGINE_PATHS[request.endpoint],
                                                data=request.body, headers=headers)
        except _NOT_STARTED:
            release()
            raise
        except (TimeoutError, aiohttp.ClientError) as exc:
            # The engine took the request but sent no status line in time (a plain request's
            # headers come only when generation ends): not safe to send elsewhere.
            release()
            status = 504 if isinstance(exc, TimeoutError) else 502
            self.metrics.count_request(request.endpoint, status)
            return error_response(status, f"{node.node_id}'s engine did not answer: {type(exc).__name__}",
                                  code="engine_timeout" if status == 504 else "engine_error", headers=reply_headers)
        except BaseException:
            release()
            raise
        self.metrics.routed.labels(node.node_id, route.reason).inc()
        log.debug("dispatched", node=node.node_id, reason=route.reason, session=request.session_id,
                  status=upstream.status)
        exchange = Exchange(request.endpoint, node.node_id, received_at, reply_headers, release)
        if request.stream and upstream.status == 200:
            return StreamRelay(upstream, exchange, self.metrics)
        return BufferedRelay(upstream, exchange, self.metrics)

