"""Relaying an engine's answer to the client: buffered for plain requests, chunk for chunk for streams.

Both kinds own the engine response from the moment its status line arrived and, however the
exchange ends (done, engine error, or cancelled because the client left; see scheduler.hot_path),
close the engine connection unless it finished cleanly and release the in-flight slot. Closing it
early is what makes vLLM abort a generation nobody will read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from scheduler.errors import error_response, sse_error_event
from scheduler.metrics import SchedulerMetrics
from symphony.logs import get_logger

log = get_logger(__name__)

SSE_DONE = b"data: [DONE]\n\n"  # the last event of an OpenAI-style stream


@dataclass(frozen=True, slots=True)
class Exchange:
    """What a relay needs to know about the request it answers."""

    endpoint: str  # "chat" | "completions", the metrics label
    priority: str  # the request's priority tier, a metrics label
    node_id: str
    received_at: float  # perf_counter() when the request arrived
    headers: dict[str, str]  # added to the client response (node, route)
    release: Callable[[], None]  # frees the in-flight slot; idempotent
    first_token: Callable[[], None] = lambda: None  # the first chunk of a stream went out; idempotent


class UpstreamRelay:
    """An ASGI response built around an engine response whose status line has arrived."""

    def __init__(self, upstream: aiohttp.ClientResponse, exchange: Exchange, metrics: SchedulerMetrics) -> None:
        self.upstream = upstream
        self.exchange = exchange
        self.metrics = metrics
        self.counted = False  # the exchange's outcome is in the metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.respond(scope, receive, send)
        finally:
            # close() after a normal release() leaves the pooled connection alone.
            self.upstream.close()
            self.exchange.release()

    async def respond(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError

    def count(self, status: int, stream: bool) -> None:
        self.counted = True
        self.metrics.count_request(self.exchange.endpoint, status)
        self.metrics.e2e.labels(self.exchange.endpoint, "true" if stream else "false").observe(
            time.perf_counter() - self.exchange.received_at
        )


class BufferedRelay(UpstreamRelay):
    """A plain (non-streamed) answer, or any error status: read it whole, then pass it on."""

    async def respond(self, scope: Scope, receive: Receive, send: Send) -> None:
        node = self.exchange.node_id
        try:
            payload = await self.upstream.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            status = 504 if isinstance(exc, TimeoutError) else 502
            self.count(status, stream=False)
            answer: Response = error_response(
                status,
                f"{node}'s engine did not deliver a response: {type(exc).__name__}",
                code="engine_error",
                headers=self.exchange.headers,
            )
        else:
            self.upstream.release()  # keep the connection for the next request
            # An engine's 401 is the cluster's fault, not the client's: it refused this scheduler's
            # engine key (a node started under another cluster secret; node_manager.engine_auth).
            if self.upstream.status >= 500 or self.upstream.status == 401:
                self.count(502, stream=False)
                detail = payload.decode(errors="replace")[:500]
                answer = error_response(
                    502, f"{node}'s engine failed: {detail}", code="engine_error", headers=self.exchange.headers
                )
            else:
                self.count(self.upstream.status, stream=False)
                answer = Response(
                    payload,
                    status_code=self.upstream.status,
                    headers=self.exchange.headers,
                    media_type=self.upstream.headers.get("content-type", "application/json"),
                )
        await answer(scope, receive, send)


class StreamRelay(UpstreamRelay):
    """A streamed answer (status 200): each chunk goes out as it arrives, unparsed."""

    async def respond(self, scope: Scope, receive: Receive, send: Send) -> None:
        media_type = self.upstream.headers.get("content-type", "text/event-stream")
        headers = [(b"content-type", media_type.encode("latin-1"))]
        headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.exchange.headers.items()]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        first, status, tail = True, 200, b""
        try:
            async for chunk in self.upstream.content.iter_any():
                if first:
                    first = False
                    self.exchange.first_token()
                    self.metrics.ttft.labels(self.exchange.endpoint, self.exchange.priority).observe(
                        time.perf_counter() - self.exchange.received_at
                    )
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                tail = (tail + chunk)[-len(SSE_DONE) :]
            self.upstream.release()  # keep the connection for the next request
        except asyncio.CancelledError:
            # The client left (scheduler.hot_path). After the stream's last event it had its whole
            # answer: a client may close on `[DONE]` (GuideLLM does) before the engine's end of
            # stream gets here. Served, not a 499.
            if tail == SSE_DONE:
                self.count(200, stream=True)
            raise
        except (TimeoutError, aiohttp.ClientError) as exc:
            # The status line is already sent; tell the client inside the stream instead.
            status = 502
            log.warning("engine stream broke", node=self.exchange.node_id, error=type(exc).__name__)
            await send(
                {
                    "type": "http.response.body",
                    "more_body": True,
                    "body": sse_error_event(
                        502, f"the engine stream broke: {type(exc).__name__}", "engine_stream_broken"
                    ),
                }
            )
        self.count(status, stream=True)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
