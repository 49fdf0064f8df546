"""Dispatch: pick a node (pending advisory first, else the routing policy, which may hold a request
back until a node has room) and relay to its engine; advisories route ahead and move KV there.

The scheduler is on the token path only as a byte relay: request bodies go out as received (after
validation) and streamed chunks are passed through unparsed, which keeps the added TTFT to the cost
of one local HTTP hop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import aiohttp
from fastapi.responses import Response

from scheduler.admission import SlotRate
from scheduler.advisories import AdvisoryTable, advisory_reply
from scheduler.cost_profile import DEFAULT_PROFILE, CostProfile
from scheduler.decisions import PullRule, Routing, advisory_choice, advisory_move, rooms
from scheduler.errors import ApiError, error_response, no_engine_error, too_many_inflight_error
from scheduler.kv_locator import RequestLocator
from scheduler.metrics import SchedulerMetrics
from scheduler.node_monitor import NodeMonitor, NodeView
from scheduler.policies.symphony import SymphonyPolicy
from scheduler.prefetcher import LatestMoves, MoveState, Prefetch, Prefetcher
from scheduler.priorities import PriorityTable
from scheduler.pull_costs import ObservedLinks
from scheduler.push_queue import PushQueue
from scheduler.relay import BufferedRelay, Exchange, StreamRelay, UpstreamRelay
from scheduler.routing import (
    NOTHING_HELD,
    HeldPrefix,
    NodeSnapshot,
    RouteRequest,
    RoutingPolicy,
    move_sources,
    prefill_work,
)
from scheduler.sessions import SessionKey, SessionTable
from scheduler.validation import AdvisoryRequest, InferenceRequest
from symphony.config import SchedulerConfig
from symphony.logs import get_logger
from symphony.tenant_quotas import TenantQuotas

log = get_logger(__name__)

ENGINE_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
NODE_HEADER = "X-Symphony-Node"
ROUTE_HEADER = "X-Symphony-Route"
SERVER_TIMING_HEADER = "Server-Timing"
# Errors raised before the engine sent a status line: the request did not start, so another node
# may take it. A read timeout is not among them: the engine may still be working on it.
# (ClientOSError covers refused connections; ServerDisconnectedError a connection the engine dropped
# before answering.)
_NOT_STARTED = (aiohttp.ClientOSError, aiohttp.ConnectionTimeoutError, aiohttp.ServerDisconnectedError)
Source = tuple[str, int] | None  # a node holding a session's KV, and how many tokens of it
# After a failed connect, keep a node out of rotation this long.
_UNREACHABLE_HOLD_S = 1.0


@dataclass(frozen=True, slots=True)
class Route:
    node: NodeView
    reason: str


class Dispatcher:
    def __init__(
        self,
        cluster: NodeMonitor,
        policy: RoutingPolicy,
        advisories: AdvisoryTable,
        metrics: SchedulerMetrics,
        config: SchedulerConfig,
        *,
        sessions: SessionTable | None = None,
        priorities: PriorityTable | None = None,
        locator: RequestLocator | None = None,
        profile: CostProfile = DEFAULT_PROFILE,
        remote_nodes: Mapping[str, str] | None = None,
        quotas: TenantQuotas | None = None,
        salt_key: bytes = b"",  # the cluster's secret (the warm-ups' cache salts)
    ) -> None:
        self.cluster = cluster
        self.locator = locator  # prices requests by content for policies that locate KV
        self.policy = policy
        self.profile = profile  # the cluster's measured costs (what an advisory's move is worth)
        self.advisories = advisories
        self.metrics = metrics
        self.config = config
        # Given or new (not `or`: an empty table is falsy).
        self.sessions = sessions if sessions is not None else SessionTable(config.max_sessions, config.session_ttl_s)
        self.priorities = priorities if priorities is not None else PriorityTable(config.max_priority_settings)
        self.queue = PushQueue(  # tenants' turns and shares, admission
            config.max_queued_requests,
            quotas,
            config.queue_wait_bound_s,
            config.queue_timeout_s,
            metrics,
        )
        self.pulls = PullRule(config.route_pull_wait_ms, config.route_pull_min_tokens)
        self.links = ObservedLinks(profile)  # pulls' observed times correct the profile's links
        self.remote_nodes = dict(remote_nodes or {})  # other regions' nodes, through the WAN links
        self.prefetcher = Prefetcher(
            cluster.kv_stub, self._address_of, metrics, config.max_prefetches, self._moved, self._pulled, salt_key
        )
        self.prefetches = LatestMoves(config.max_advisories)
        self.inflight_total = 0
        # Requests that reached an engine and ended: how fast slots free up (admission; its finish
        # rate: region_summary). Loop only.
        self.slots = SlotRate()
        self._session: aiohttp.ClientSession | None = None
        cluster.on_status = self.wake_queued

    async def start(self) -> None:
        # aiohttp rather than httpx: httpx's pool walks every connection per request, a CPU cost
        # that lands in TTFT (docs/design-notes.md#scheduler-http-path).
        # Idle connections are dropped before uvicorn's 5 s keep-alive (vLLM's server) would close them
        # under us, which would turn a reused connection into a spurious "engine unreachable".
        connector = aiohttp.TCPConnector(limit=self.config.max_inflight_requests + 16, keepalive_timeout=4.0)
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.config.connect_timeout_s, sock_read=self.config.request_timeout_s
        )
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False)

    async def stop(self) -> None:
        await self.prefetcher.stop()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _moved(self, key: SessionKey, node_id: str, history_tokens: int, source: str) -> None:
        fingerprint = self.cluster.fingerprint(node_id)
        if fingerprint is not None:  # a session moved in from another region enters the table
            self.sessions.moved(key, node_id, history_tokens, fingerprint, create=source in self.remote_nodes)

    def _pulled(self, source: str, node_id: str, tokens: int, ms: float) -> None:
        """A pull into `node_id`'s DRAM took `ms`: moves over that link are priced by what they take
        (not one from another region: the global layer prices the WAN, from its links)."""
        if source not in self.remote_nodes and (profile := self.links.observe(source, node_id, tokens, ms)):
            self.profile = profile
            if isinstance(self.policy, SymphonyPolicy):  # the one policy that prices moves
                self.policy.profile = profile

    def _same_model_copies(self, kv_tokens: Mapping[str, int], node_id: str) -> dict[str, int]:
        """The copies in `kv_tokens` that `node_id` may load or pull: those on nodes serving the same
        model fingerprint as it (the nodes refuse any other, this keeps the scheduler from asking)."""
        target = self.cluster.fingerprint(node_id)
        if target is None:
            return {}
        return {n: t for n, t in kv_tokens.items() if self.cluster.fingerprint(n) == target}

    # -- routing --------------------------------------------------------------------------------
    def _route_request(
        self,
        model: str,
        tenant: str,
        session_id: str | None,
        history_tokens: int,
        text: Callable[[], str] | None = None,
    ) -> RouteRequest:
        """What the policy sees of a request: its session's KV whereabouts (on nodes that can serve)
        and priority tier from the scheduler's tables."""
        kv_tokens: dict[str, int] = {}
        if session_id is not None:
            entry = self.sessions.get((tenant, session_id))
            if entry is not None:
                history_tokens = max(history_tokens, entry.history_tokens)
                # Only copies that are still the model they were computed by: a node restarted with
                # another model (or dtype) holds none of this session's KV for its new model.
                kv_tokens = {
                    n: t for n, t in entry.kv_tokens.items() if self.cluster.fingerprint(n) == entry.fingerprint
                }
        routing_text = text() if text is not None and self.policy.traits.needs_routing_text else ""
        return RouteRequest(
            tenant, session_id, model, self.priorities.of(tenant, session_id), history_tokens, kv_tokens, routing_text
        )

    def _snapshot(self, model: str, exclude: set[str]) -> list[NodeSnapshot]:
        self.advisories.purge()  # expired announcements must not count as load
        return [
            n
            for n in self.cluster.snapshot(model, self.advisories.pending_by_node, self.sessions.high_sessions)
            if n.node_id not in exclude
        ]

    async def _route(
        self, request: RouteRequest, exclude: set[str], advised_node: str | None, wait_until: float, retry: bool
    ) -> Route:
        """The node for `request` (`Routing.attempt`). When the policy holds it back (selective
        pushing), it waits for room until `wait_until`; a `retry` (admitted before) at the head."""
        routing = Routing(request, advised_node)
        requeued = retry
        while True:
            if not requeued and self.queue.ahead_of(request.priority):
                # Held requests of this tier or above go first (scheduler.held_queue): a newcomer
                # must not take the node that frees up for them.
                await self._wait_for_room(request, wait_until, requeued)
                requeued = True
            placement = routing.attempt(self.policy, self._snapshot(request.model, exclude))
            if placement.followup is not None:
                self.metrics.advisory_followups.labels(placement.followup).inc()
            if placement.node_id is not None:
                return Route(self._node(placement.node_id), placement.reason)
            if not placement.queue:
                raise no_engine_error(request.model, self.cluster.states())
            await self._wait_for_room(request, wait_until, requeued)
            requeued = True

    async def _wait_for_room(self, request: RouteRequest, wait_until: float, requeued: bool) -> None:
        slots_per_s = self.slots.per_s(time.monotonic() * 1000, self.inflight_total, len(self.queue))
        await self.queue.wait_for_room(request.priority, request.tenant, wait_until, requeued, slots_per_s)

    def wake_queued(self) -> None:
        """Room may have opened (a status arrived, a request ended): let as many queued requests try
        again as there are nodes with nothing waiting."""
        if not len(self.queue):
            return
        now = time.monotonic()
        self.queue.wake_for(rooms(n.snapshot(now, self.cluster.down_after_s) for n in self.cluster.nodes))

    def _node(self, node_id: str | None) -> NodeView:
        node = self.cluster.by_id(node_id) if node_id is not None else None
        assert node is not None, f"policy chose unknown node {node_id}"
        return node

    # -- advisories -----------------------------------------------------------------------------
    def _address_of(self, node_id: str) -> str | None:
        return self.cluster.address_of(node_id) or self.remote_nodes.get(node_id)

    def advise(self, advisory: AdvisoryRequest, tenant: str, remote: Source = None) -> dict[str, object]:
        """Route the session's next request to a node now and move its KV there (`remote`: another
        region's node holding more of it, and how much, as the global layer names it)."""
        key: SessionKey = (tenant, advisory.session_id)
        # A newer advisory for the same session replaces the older one, so it must not count as load.
        previous = self.advisories.take(key)
        lead_ms = advisory.expected_arrival_ms
        lead_ms = self.config.typing_lead_ms if lead_ms is None else lead_ms  # when its request is likely
        request = replace(self._route_request(advisory.model, tenant, advisory.session_id, 0), lead_ms=lead_ms)
        if not self.policy.traits.prefetch_on_advisory:
            # A baseline without advisories: accepted (clients need not know the policy), no effect.
            self.metrics.advisories.labels(advisory.kind, "ignored").inc()
            return advisory_reply(advisory, None, self.config.advisory_ttl_s * 1000)
        decision = advisory_choice(self.policy, request, self._snapshot(request.model, set()))
        if decision.node_id is None:
            raise no_engine_error(request.model, self.cluster.states())
        node_id = self._node(decision.node_id).node_id
        if previous is not None and previous.node_id != node_id:
            log.debug("advisory moved session", session=advisory.session_id, old=previous.node_id, new=node_id)
        entry = self.advisories.put(key, advisory.kind, node_id, advisory.expected_arrival_ms)
        self.metrics.advisories.labels(advisory.kind, "routed").inc()
        self._prefetch(key, request, node_id, lead_ms, remote)
        return advisory_reply(advisory, node_id, (entry.expires_at - entry.created_at) * 1000)

    def _prefetch(
        self, key: SessionKey, request: RouteRequest, node_id: str, deadline_ms: int, remote: Source = None
    ) -> bool:
        """Move the session's KV to `node_id` before its request: from the node's own tiers, or
        pulled from the node holding the most of it. A session no node holds (a first turn) has
        nothing to move: the advisory only pre-assigned its node; nor has one whose last prompt the
        node's engine caches, and KV the request would load at its arrival faster than a warm-up
        pass costs the engine stays where it is (`advisory_move`). True when a move is under way."""
        copies = self._same_model_copies(request.kv_tokens, node_id)
        sources = move_sources(copies, node_id, remote, self._node(node_id).block_size, self._reachable)
        source = sources.source  # another region's node when its copy is longer: pulled over the WAN
        history = source[1] if source is not None else copies.get(node_id, 0)
        current = self.prefetches.get(key)
        if current is not None and current.node_id == node_id and current.state == MoveState.PENDING:
            return True  # a repeated advisory (a user still typing): the move is already under way
        if self.prefetches.fresh(key, node_id, history, time.monotonic()):
            self.metrics.prefetches.labels("unchanged").inc()  # there moments ago
            return True
        if current is not None and current.state == MoveState.PENDING:
            self.prefetcher.cancel(current)  # the session was re-advised elsewhere
        if self.locator is not None and self.locator.kv.in_engine(key, node_id):
            # A move would bring the engine nothing and cost it a warm-up pass: recorded as ready.
            self.metrics.prefetches.labels(MoveState.IN_ENGINE).inc()
            now = time.monotonic()
            prefetch: Prefetch | None = Prefetch(key, node_id, history, now, finished_at=now, state=MoveState.IN_ENGINE)
        elif not history:
            return False
        else:
            locator = self.locator if source is None else None  # else pulled from a peer into DRAM
            held = locator.kv.held_for_move(key, node_id, history) if locator is not None else None
            move = advisory_move(self.profile, held or HeldPrefix(dram=history), source is not None)
            if move == "loads_on_arrival":  # cheaper than a warm-up pass on the engine
                self.metrics.prefetches.labels(move).inc()
                self.prefetches.pop(key, None)  # no earlier move counts for its request
                return False
            peer = source[0] if source is not None else ""
            near = (sources.near, sources.near_blocks) if sources.near else None
            prefetch = self.prefetcher.start(key, node_id, peer, deadline_ms, request.priority, history, move, 0, near)
        if prefetch is None:
            return False
        if remote and source is remote and prefetch.state == MoveState.PENDING:  # a pull from another region
            self.metrics.prefetches.labels("from_region").inc()
        self.prefetches.record(prefetch)
        return prefetch.state == MoveState.PENDING

    def promote(self, tenant: str, session_id: str | None) -> int:
        """A session (or a whole tenant) just set to high priority: the KV of each of its sessions the
        scheduler knows goes to the top tier of the session's node at once. Returns how many moves
        started (at most `max_prefetches` follow at once; the rest move on their next advisory)."""
        keys = [(tenant, session_id)] if session_id is not None else self.sessions.of_tenant(tenant)
        started = 0
        for key in keys:
            entry = self.sessions.get(key)
            if entry is None or entry.last_node is None or self.cluster.by_id(entry.last_node) is None:
                continue
            request = self._route_request(entry.model, tenant, key[1], 0)
            if request.priority == "high" and self._prefetch(key, request, entry.last_node, 0):
                started += 1
        return started

    def _reachable(self, node_id: str) -> bool:
        node = self.cluster.by_id(node_id)
        return node is not None and time.monotonic() - node.last_status_at <= self.cluster.down_after_s

    # -- inference ------------------------------------------------------------------------------
    async def dispatch(self, request: InferenceRequest, tenant: str, received_at: float) -> UpstreamRelay | Response:
        self._check_inflight()
        key = (tenant, request.session_id) if request.session_id is not None else None
        advised_node = None
        if key is not None:
            advisory = self.advisories.take(key)
            if advisory is not None:
                advised_node = advisory.node_id
                self._count_kv_ready(key, advisory.kind)
        route_request = self._route_request(
            request.model, tenant, request.session_id, request.history_tokens, request.routing_text
        )
        if self.locator is not None and self.policy.traits.locates_kv:
            route_request = await self.locator.locate(route_request, request.body)
        body = request.engine_body(tenant, self.policy.traits.uses_tiers)
        wait_until = time.monotonic() + self.config.queue_timeout_s
        tried: set[str] = set()
        last_error = ""
        for attempt in range(2):  # the first node, then once elsewhere if it never started the request
            try:
                route = await self._route(route_request, tried, advised_node, wait_until, attempt > 0)
            except ApiError:
                if not last_error:
                    raise
                break
            with route.node.reserving():  # its room taken until `_send` counts it (no await between)
                await self._pull_for_request(key, route_request, route.node.node_id)
            advised_node = None  # an advisory binds the first attempt only
            tried.add(route.node.node_id)
            # Recorded as the request goes out, not when a plain answer comes back: the session's
            # next advisory or a concurrent turn must see where its KV is being built.
            self.policy.observe(route_request, route.node.node_id)
            # Checked again as it goes out, not only on arrival: requests that waited in the push
            # queue count too, and the connection pool (sized to this limit) must never make a
            # request wait for a connection: that wait ends as a connect timeout, read as
            # "engine unreachable".
            self._check_inflight()
            undo_served = None
            if key is not None:
                undo_served = self.sessions.served(
                    key,
                    route.node.node_id,
                    route_request.history_tokens,
                    fingerprint=route.node.model_fingerprint,
                    model=request.model,
                    high=route_request.priority == "high",
                )
            try:
                reply = await self._send(route, request, body, received_at, route_request)
            except _NOT_STARTED as exc:
                if undo_served is not None:
                    undo_served()  # the node never took the turn: it holds none of its KV
                last_error = f"{route.node.node_id}: {type(exc).__name__}: {exc}"
                log.warning(
                    "engine unreachable, re-routing", node=route.node.node_id, error=str(exc) or type(exc).__name__
                )
                self.cluster.mark_engine_unreachable(route.node, _UNREACHABLE_HOLD_S)
                self.metrics.retries.labels(route.node.node_id).inc()
                continue
            self.metrics.priority_requests.labels(route_request.priority).inc()
            return reply
        raise ApiError(503, f"the engine could not be reached ({last_error}); retry shortly", code="engine_unreachable")

    async def _pull_for_request(self, key: SessionKey | None, request: RouteRequest, node_id: str) -> None:
        """Wait for the pull `self.pulls` plans for a request routed to `node_id` (from a reachable node
        of the same model): of the session's own history, or of another session's copy of its shared
        prefix (`RouteRequest.prefix_donor`), whichever brings more; the node joins a running pull of
        the same session (`PeerPuller.pull`). A failed or late pull costs only the wait: the engine
        recomputes what did not arrive, far dearer than pulling it (docs/design-notes.md#route-pull)."""
        own = shared = None
        if key is not None:
            copies = self._same_model_copies(request.kv_tokens, node_id)
            own = self.pulls.plan(self.policy.traits, copies, node_id, self._reachable)
        donor = request.prefix_donor
        if donor is not None:
            copies = self._same_model_copies(request.prefix_copies, node_id)
            # What the node holds of the prompt already, by content: a pull must bring more than that.
            copies[node_id] = max(copies.get(node_id, 0), request.holdings().get(node_id, NOTHING_HELD).total)
            shared = self.pulls.plan(self.policy.traits, copies, node_id, self._reachable)
        if shared is not None and (own is None or shared.tokens > own.tokens):
            # Only the shared prefix: the donor's own history may go on far past it.
            blocks = shared.tokens // max(1, self._node(node_id).block_size)
            pulled = await self.prefetcher.pull((request.tenant, str(donor)), node_id, shared, request.priority, blocks)
            self.metrics.prefix_pulls.labels(pulled).inc()
            if pulled == "failed" and self.locator is not None:
                self.locator.kv.donor_failed(str(donor))  # the next request of the prefix names itself
        elif own is not None and key is not None:
            pulled = await self.prefetcher.pull(key, node_id, own, request.priority)
            self.metrics.route_pulls.labels(pulled).inc()

    def _check_inflight(self) -> None:
        if self.inflight_total >= self.config.max_inflight_requests:
            raise too_many_inflight_error(self.inflight_total, self.config.max_inflight_requests)

    def _count_kv_ready(self, key: SessionKey, kind: str) -> None:
        """Was the KV an advisory moved for this request in the node's top tier when it arrived?"""
        prefetch = self.prefetches.pop(key, None)
        if prefetch is not None:
            self.metrics.advised_requests.labels(kind, "yes" if prefetch.ready else "no").inc()

    async def _send(
        self, route: Route, request: InferenceRequest, body: bytes, received_at: float, routed: RouteRequest
    ) -> UpstreamRelay | Response:
        """Open the exchange with the engine; raises a _NOT_STARTED error if it never began."""
        assert self._session is not None, "Dispatcher.start() was not awaited"
        node = route.node
        headers = {"content-type": "application/json", **self.cluster.engine_headers}
        if request.session_id is not None:
            headers["x-session-id"] = request.session_id
        node.inflight += 1
        self.inflight_total += 1
        released, sent_ms = False, time.monotonic() * 1000
        # Its prefill's size counts as the node's until its first token (what requests routed next
        # wait behind). A plain answer arrives whole: it counts until the engine's gauges do.
        prefilling, priority = True, routed.priority
        work = prefill_work(routed, node.node_id, self.policy.traits.prefetch_on_advisory)
        node.prefilling += 1
        node.prefilling_work += work

        def first_token() -> None:
            nonlocal prefilling
            if prefilling:
                prefilling = False
                node.prefilling -= 1
                node.prefilling_work -= work

        def release(reached_engine: bool = True) -> None:
            nonlocal released
            if not released:
                released = True
                first_token()  # ended (or failed) before its first token: no longer prefilling
                forget()
                node.inflight -= 1
                self.inflight_total -= 1
                if reached_engine:  # one that never did freed no engine's slot
                    now_ms = time.monotonic() * 1000
                    self.slots.ended(now_ms, now_ms - sent_ms)
                self.wake_queued()

        forget = (lambda: None) if request.stream else node.count_until_gauged(time.monotonic(), first_token)
        # Server-Timing (W3C): the time this request spent here before going out (routing, the push
        # queue, a pull of its KV), so a client can tell it apart from the engine's.
        routed_ms = (time.perf_counter() - received_at) * 1000
        reply_headers = {
            NODE_HEADER: node.node_id,
            ROUTE_HEADER: route.reason,
            SERVER_TIMING_HEADER: f"route;dur={routed_ms:.1f}",
        }
        try:
            upstream = await self._session.post(
                node.engine_url + ENGINE_PATHS[request.endpoint], data=body, headers=headers
            )
        except _NOT_STARTED:
            release(reached_engine=False)
            raise
        except (TimeoutError, aiohttp.ClientError) as exc:
            # The engine took the request but sent no status line in time (a plain request's
            # headers come only when generation ends): not safe to send elsewhere.
            release()
            status = 504 if isinstance(exc, TimeoutError) else 502
            self.metrics.count_request(request.endpoint, status)
            return error_response(
                status,
                f"{node.node_id}'s engine did not answer: {type(exc).__name__}",
                code="engine_timeout" if status == 504 else "engine_error",
                headers=reply_headers,
            )
        except BaseException:
            release()
            raise
        self.metrics.routed.labels(node.node_id, route.reason).inc()
        log.debug(
            "dispatched", node=node.node_id, reason=route.reason, session=request.session_id, status=upstream.status
        )
        exchange = Exchange(request.endpoint, priority, node.node_id, received_at, reply_headers, release, first_token)
        if request.stream and upstream.status == 200:
            return StreamRelay(upstream, exchange, self.metrics)
        return BufferedRelay(upstream, exchange, self.metrics)
