"""One region's entry to the global layer: an HTTP server that takes the OpenAI API and advisories,
picks a region for each request (global_layer.policies) and relays it to that region's scheduler,
the answer streamed back as it comes.

Contracts:
- The client's region is `X-Client-Region` when given (a region of the topology, else 400), else
  the entry's own.
- The tenant comes from the API key as the schedulers resolve it (symphony.tenancy); an unknown key
  is refused here (401), since residency needs the tenant before anything crosses a region.
- A tenant's request goes only to a region its residency rule allows. When none of those is up,
  the client gets 503 `no_allowed_region` naming them; the refusal is logged and counted.
- Failover: a region that cannot be reached (connection refused or reset, no answer within the
  connect timeout), that answers 503 because it has no engine, or that sends no summary for
  ABANDON_AFTER_DOWN x `regions.region_down_after_ms` while the request waits for its answer's
  status line (a blackholed link, a hung scheduler), is marked unreachable and the next region in
  the policy's order is tried, so no client sees an error for a request whose answer had not
  started. An abandoned request may still run in the region it left (nothing reaches it to say
  otherwise), so it can run twice; a non-streaming one waits for its status line until its whole
  answer is ready, and is exposed for that long (counted in `/regions` as `abandoned`). Once an answer's
  status line has been relayed, an error ends the stream (the client sees a cut-off answer, as
  from a one-region scheduler).
- Bounded: request bodies by `scheduler.max_body_bytes`, upstream connections by the pool, reads
  by `scheduler.request_timeout_s` between bytes; a client must send each request whole within
  `scheduler.request_read_timeout_s` (global_layer.read_deadline, counted in `/regions`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import PayloadEncodingError
from aiohttp.web_protocol import RequestPayloadError
from multidict import CIMultiDict

from global_layer.advised import AdvisedRegions
from global_layer.policies import rank_regions
from global_layer.probe import RegionProbe
from global_layer.request_content import request_content
from global_layer.residency_admin import SharedTopology, add_residency_routes
from global_layer.views import RegionPolicy, RegionRequest
from symphony.api_errors import error_body
from symphony.config import SymphonyConfig
from symphony.logs import get_logger
from symphony.region_links import region_address
from symphony.region_load import KV_SOURCE_HEADER, format_kv_source, session_digest
from symphony.regions import RegionTopology
from symphony.tenancy import DEFAULT_TENANT, TenantKeys, bearer, internal_headers, observer_refusal

log = get_logger(__name__)

CLIENT_REGION_HEADER = "X-Client-Region"
SESSION_HEADER = "X-Session-ID"  # as the schedulers read it (else the body's session_id)
# A request waiting on a region silent for this many times `regions.region_down_after_ms` is sent
# to the next region (twice the time that stops new requests: a summary delayed by a busy link,
# or a loaded host, does not abandon running work).
ABANDON_AFTER_DOWN = 2.0
REGION_HEADER = "X-Symphony-Region"  # on every answer: the region that served it
# A scheduler's 503 codes that mean "no engine here": the next region is tried.
FAILOVER_CODES = frozenset({"no_engine_ready", "no_engine_available", "engine_unreachable"})
_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)
# Request headers not passed on: the body is forwarded decoded, and asks for no interim answer.
_NOT_FORWARDED = frozenset(("content-encoding", "expect"))
# Below the schedulers' keep-alive (scheduler.keep_alive_s, over 5 s) with room to spare, as
# scheduler.dispatch keeps its engine connections below theirs.
UPSTREAM_KEEPALIVE_S = 4.0
_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/advisories": "advisories"}
FORWARDED_PATHS = tuple(_ENDPOINTS)
MAX_ERROR_BODY_BYTES = 64 * 1024  # a failover-able error answer read to find its code


class RegionRefused(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def response(self) -> web.Response:
        body = error_body(self.status, self.message, param=self.param, code=self.code)
        return web.json_response(body, status=self.status)


class Entry:
    """The entry of region `region`; `probes` are its views of every region (its own included)."""

    def __init__(
        self,
        config: SymphonyConfig,
        topology: RegionTopology,
        region: str,
        policy: RegionPolicy,
        shared: SharedTopology | None = None,
    ) -> None:
        self.config = config
        # The topology and residency rules of every entry of this process (the admin API replaces
        # them); `topology` reads the current one.
        self.shared = shared if shared is not None else SharedTopology(topology)
        self.region = region
        self.policy = policy
        self.keys = TenantKeys(config.scheduler.api_keys)
        s = config.scheduler
        # Requests and probes have pools of their own: a full request pool never starves the
        # probes (a region would read as down). Idle connections are dropped before the schedulers'
        # keep-alive ends them, so a reused one is never one the scheduler just closed (which
        # would read as the region being unreachable). `connect` bounds the wait for a pooled
        # connection too.
        self.session = _session(s.max_inflight_requests, s.connect_timeout_s, s.request_timeout_s)
        self.probe_session = _session(len(topology.names), s.connect_timeout_s, s.request_timeout_s)
        r = config.regions
        self.probes = {
            name: RegionProbe(
                name,
                self.base_url(name),
                self.probe_session,
                interval_s=r.probe_interval_ms / 1000,
                down_after_s=r.region_down_after_ms / 1000,
                headers=internal_headers(config.cluster.secret),
            )
            for name in topology.names
        }
        self.served: Counter[str] = Counter()  # requests answered, by serving region
        self.failovers: Counter[str] = Counter()  # requests moved on, by the region that failed them
        self.abandoned: Counter[str] = Counter()  # of them, left waiting on a region gone silent
        self.refusals: Counter[str] = Counter()  # by reason (code)
        self.read_timeouts = 0  # connections closed for not sending a whole request in time
        # Advisories a region took with a copy of another region's to pull, by that region.
        self.moves: Counter[str] = Counter()
        # Sessions whose advisory moves their KV to a region: their next request follows it there.
        self.advised = AdvisedRegions(s.max_advisories, s.advisory_ttl_s)

    @property
    def topology(self) -> RegionTopology:
        return self.shared.current

    def base_url(self, region: str) -> str:
        host, port = region_address(self.config, self.topology, self.region, region)
        return f"http://{host}:{port}"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.scheduler.max_body_bytes)
        for path in FORWARDED_PATHS:
            app.router.add_post(path, self.forward)
        app.router.add_get("/v1/models", self.forward)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/regions", self.describe_handler)
        add_residency_routes(app, self.config, self.shared)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: web.Application) -> None:
        for probe in self.probes.values():
            probe.start()

    async def _stop(self, _: web.Application) -> None:
        for probe in self.probes.values():
            await probe.stop()
        await self.session.close()
        await self.probe_session.close()

    async def healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "region": self.region})

    def describe(self) -> dict[str, Any]:
        regions = {}
        for name, probe in self.probes.items():
            view = probe.view()
            regions[name] = {
                "up": view.up,
                "rtt_ms": self.topology.rtt_ms(self.region, name),
                "load": view.load.to_json() if view.load else None,
                "served": self.served[name],
                "failovers": self.failovers[name],
                "abandoned": self.abandoned[name],
                "kv_moves_in": self.moves[name],
                "sessions_known": len(probe.held),  # sessions its feed says it holds KV of
                "probe_errors": probe.probe_errors,
                "last_error": probe.last_error,
            }
        return {
            "entry": self.region,
            "policy": self.policy.name,
            "regions": regions,
            "refusals": dict(self.refusals),
            "read_timeouts": self.read_timeouts,
        }

    def count_read_timeout(self) -> None:
        self.read_timeouts += 1

    async def describe_handler(self, request: web.Request) -> web.Response:
        s = self.config.scheduler
        refusal = observer_refusal(
            s.api_keys, s.admin_token, self.config.cluster.secret.encode(), request.headers.get("Authorization")
        )
        if refusal is not None:  # the regions' loads and links: for the admin or internal token
            status, message, code = refusal
            return web.json_response(error_body(status, message, code=code), status=status)
        return web.json_response(self.describe())

    def _tenant(self, request: web.Request) -> str:
        if self.keys.open:
            return DEFAULT_TENANT
        token = bearer(request.headers.get("Authorization"))
        if token is None:
            raise RegionRefused(401, "missing API key: send it as 'Authorization: Bearer <key>'", "invalid_api_key")
        tenant = self.keys.tenant(token)
        if tenant is None:
            raise RegionRefused(401, "unknown API key", "invalid_api_key")
        return tenant

    def _client_region(self, request: web.Request) -> str:
        named = request.headers.get(CLIENT_REGION_HEADER)
        if named is None:
            return self.region
        if named not in self.topology.names:
            raise RegionRefused(
                400,
                f"{CLIENT_REGION_HEADER} {named!r} is not a region of this cluster "
                f"(regions: {', '.join(self.topology.names)})",
                "unknown_region",
                param=CLIENT_REGION_HEADER,
            )
        return named

    def _ranked(self, request: RegionRequest) -> list[str]:
        views = [probe.view() for probe in self.probes.values()]
        ranking = rank_regions(self.policy, request, views, self.topology)
        if ranking.regions:
            advised = self.advised.peek(request.session) if request.session and not request.advisory else None
            if advised in ranking.regions:  # its KV is being moved there for it
                return [advised, *(r for r in ranking.regions if r != advised)]
            return ranking.regions
        allowed = self.topology.allowed_regions(request.tenant)
        if ranking.forbidden_up:
            self.refusals["no_allowed_region"] += 1
            log.warning(
                "residency refused a request: no allowed region is up",
                tenant=request.tenant,
                allowed=",".join(allowed),
                up=",".join(ranking.forbidden_up),
            )
            raise RegionRefused(
                503,
                f"no region tenant {request.tenant!r} may use is available (allowed: {', '.join(allowed)}; "
                f"up but outside its residency: {', '.join(ranking.forbidden_up)}); retry shortly",
                "no_allowed_region",
            )
        self.refusals["no_region_available"] += 1
        raise RegionRefused(503, "no region is available; retry shortly", "no_region_available")

    def _region_request(self, request: web.Request, body: bytes) -> RegionRequest:
        tenant, client_region = self._tenant(request), self._client_region(request)
        session = request.headers.get(SESSION_HEADER)
        if not self.policy.needs_body:
            return RegionRequest(tenant, client_region, session_digest(tenant, session) if session else None)
        endpoint = _ENDPOINTS.get(request.path, "")
        parsed = request_content(body, endpoint)
        session = session or parsed.session_id
        digest = session_digest(tenant, session) if session else None
        held, holders = {}, {}
        for name, probe in self.probes.items():
            if digest and (tokens := probe.held.tokens(digest)):
                held[name], holders[name] = tokens, probe.held.holder(digest)
        advisory = endpoint == "advisories"
        return RegionRequest(tenant, client_region, digest, parsed.text, parsed.tokens, held, holders, advisory)

    async def forward(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.read() if request.can_read_body else b""
            region_request = self._region_request(request, body)
            ranked = self._ranked(region_request)
        except RegionRefused as refused:
            return refused.response()
        except web.HTTPRequestEntityTooLarge:
            limit = self.config.scheduler.max_body_bytes
            return RegionRefused(413, f"request body larger than {limit} bytes", "body_too_large").response()
        except (RequestPayloadError, PayloadEncodingError) as exc:  # a broken chunked or compressed body
            return RegionRefused(400, f"the request body could not be read: {exc}", "invalid_body").response()
        # The body was decoded on the way in: it goes on as it is now.
        headers = CIMultiDict(
            (k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP | _NOT_FORWARDED
        )
        headers.popall(KV_SOURCE_HEADER, None)  # the entry's to say, never a client's
        last: RegionRefused | None = None
        inference = request.path in ("/v1/chat/completions", "/v1/completions")
        for region in ranked:
            if not self.topology.allowed(region_request.tenant, region):
                continue  # a rule changed since the ranking (the admin API): the new one holds
            url = self.base_url(region) + request.path_qs
            sent, moving = self._with_move(headers, region_request, region)
            if moving and region_request.session:
                # Bound before the advisory goes: a request that comes while it is on its way
                # follows it too. Undone below unless the region takes the advisory.
                self.advised.put(region_request.session, region)
            try:
                upstream = await self._answer_while_up(region, request.method, url, body, sent)
            except aiohttp.SocketTimeoutError:
                # Connected, but no answer in scheduler.request_timeout_s: the region may have run
                # it, so it is not sent again elsewhere.
                waited = self.config.scheduler.request_timeout_s
                return RegionRefused(
                    504, f"region {region} did not answer in {waited:g} s", "region_timeout"
                ).response()
            except (aiohttp.ClientConnectionError, aiohttp.ClientResponseError, TimeoutError) as exc:
                if moving and region_request.session:
                    self.advised.drop(region_request.session)
                self._failed(region, f"{type(exc).__name__}: {exc}")
                continue
            took = upstream.status < 400
            if moving and region_request.session:
                if took:
                    self.moves[region] += 1
                else:
                    self.advised.drop(region_request.session)
            if took and inference and region_request.session:
                self.advised.drop(region_request.session)  # served: the next turn is ranked afresh
            try:
                if upstream.status != 503:
                    if took:
                        self.policy.observe(region_request, region)
                    return await self._relay(request, upstream, region)
                try:
                    raw = await _read_error(upstream)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    self._failed(region, f"503 cut off: {type(exc).__name__}: {exc}")
                    continue
                code = _error_code(raw) if raw is not None else None
                if raw is None or code not in FAILOVER_CODES:
                    return await self._relay(request, upstream, region, first=raw or b"")
                self._failed(region, f"503 {code}")
                last = RegionRefused(503, f"region {region} has no engine available; retry shortly", code)
            finally:
                upstream.release()
        if last is not None:
            return last.response()
        self.refusals["no_region_reachable"] += 1
        tried = ", ".join(ranked)
        return RegionRefused(
            503, f"no region could be reached (tried {tried}); retry shortly", "no_region_reachable"
        ).response()

    async def _answer_while_up(
        self, region: str, method: str, url: str, body: bytes, headers: CIMultiDict[str]
    ) -> aiohttp.ClientResponse:
        """The region's answer (its status line and headers), unless the region's probe gets no
        summary for ABANDON_AFTER_DOWN x its down time first: then the request is abandoned
        (nothing of it has reached the client) and TimeoutError says so. Silence alone decides:
        another request's failure, or a summary with no ready node, does not abandon this one.
        Polled every probe interval."""
        probe = self.probes[region]
        sent = self.session.request(method, url, data=body, headers=headers, allow_redirects=False)
        call = asyncio.ensure_future(sent)
        try:
            while not call.done():
                await asyncio.wait({call}, timeout=probe.interval_s)
                if not call.done() and probe.silent_for() > ABANDON_AFTER_DOWN * probe.down_after_s:
                    self.abandoned[region] += 1
                    raise TimeoutError(f"region {region} sent no summary for {probe.silent_for():.1f} s")
            return call.result()
        finally:
            if not call.done():
                call.cancel()
                await asyncio.wait({call})  # aiohttp closes the connection of a cancelled request
                if not call.cancelled() and call.exception() is None:
                    call.result().release()  # answered as it was being abandoned

    def _with_move(
        self, headers: CIMultiDict[str], request: RegionRequest, region: str
    ) -> tuple[CIMultiDict[str], bool]:
        """An advisory's headers for `region`, naming the other region's copy to pull first when
        the policy moves it (symphony.region_load.KV_SOURCE_HEADER); and whether they do."""
        if not (request.advisory and self.policy.moves_kv):
            return headers, False
        views = [probe.view() for probe in self.probes.values()]
        allowed = [v for v in views if v.up and self.topology.allowed(request.tenant, v.name)]
        source = self.policy.move_source(request, region, allowed, self.topology)
        if source is None:
            return headers, False
        with_move = headers.copy()
        with_move[KV_SOURCE_HEADER] = format_kv_source(*source)
        return with_move, True

    def _failed(self, region: str, why: str) -> None:
        self.failovers[region] += 1
        self.probes[region].mark_unreachable(why)
        log.info("region unreachable; trying the next", entry=self.region, region=region, error=why)

    def _answer_headers(self, upstream: aiohttp.ClientResponse, region: str) -> CIMultiDict[str]:
        headers = CIMultiDict((k, v) for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP)
        headers[REGION_HEADER] = region
        return headers

    async def _relay(
        self, request: web.Request, upstream: aiohttp.ClientResponse, region: str, first: bytes = b""
    ) -> web.StreamResponse:
        """Relay the answer (`first`: what was already read of its body). Once the status line is
        out, an upstream error cuts the client's connection, so a broken answer never reads as a
        complete one; a client that left ends the relay (and so the upstream request)."""
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        response.headers.extend(self._answer_headers(upstream, region))
        if upstream.content_length is not None:
            response.content_length = upstream.content_length
        self.served[region] += 1
        try:
            await response.prepare(request)
            if first:
                await response.write(first)
        except ConnectionError:
            return response  # the client left
        while True:
            try:
                chunk = await upstream.content.readany()
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.warning("region's answer broke off", entry=self.region, region=region, error=str(exc))
                if request.transport is not None:
                    request.transport.abort()
                return response
            if not chunk:
                break
            try:
                await response.write(chunk)
            except ConnectionError:
                return response  # the client left: releasing the upstream ends its request
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response


def _session(limit: int, connect_s: float, read_s: float) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=limit, keepalive_timeout=UPSTREAM_KEEPALIVE_S)
    timeout = aiohttp.ClientTimeout(connect=connect_s, sock_connect=connect_s, sock_read=read_s)
    # No Accept-Encoding of its own: bodies pass through as the client asked for them.
    return aiohttp.ClientSession(
        connector=connector, timeout=timeout, auto_decompress=False, skip_auto_headers=("Accept-Encoding",)
    )


async def _read_error(upstream: aiohttp.ClientResponse) -> bytes | None:
    """A 503's whole body, to find its code; None when it is longer than MAX_ERROR_BODY_BYTES (no
    error of a scheduler is: it is relayed as it is)."""
    if upstream.content_length is not None and upstream.content_length > MAX_ERROR_BODY_BYTES:
        return None
    raw = b""
    while len(raw) <= MAX_ERROR_BODY_BYTES:
        chunk = await upstream.content.readany()
        if not chunk:
            return raw
        raw += chunk
    return None


def _error_code(raw: bytes) -> str | None:
    """The OpenAI-style error code of an error answer's body (None when it has none)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None
