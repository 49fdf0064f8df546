"""A deadline on reading each HTTP request at the global layer's entries, against clients that hold
connections open by sending slowly (slowloris), as `scheduler.read_deadline` gives the schedulers.
aiohttp times out only idle keep-alive connections, not one that never finishes its headers or body.

`ReadDeadlines(seconds)` keeps one timer per connection, armed when the connection opens and again
when each answer has been sent. When it fires, the connection is closed unless a request's headers
and whole body are in (it is being served, however long that takes: waiting for a region, streaming
its answer). A client still sending its request gets nothing back; a handler reading its body sees
the client gone. A connection idle that long after its last answer is closed too.

Use both parts: `protocol_factory` for the server (arms each new connection) and `middleware` in the
application (follows each request on it). State: one timer and one request per open connection, on
the event loop only; a closed connection's entry goes when its timer fires.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from symphony.logs import get_logger

log = get_logger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ReadDeadlines:
    def __init__(self, seconds: float, on_timeout: Callable[[], None] | None = None) -> None:
        if seconds <= 0:
            raise ValueError("seconds must be positive")
        self.seconds = seconds
        self._on_timeout = on_timeout  # told of each connection closed (a count)
        self._timers: dict[RequestHandler, asyncio.TimerHandle] = {}
        self._serving: dict[RequestHandler, web.Request] = {}

    def protocol_factory(self, server: web.Server) -> Callable[[], RequestHandler]:
        """`server`'s protocol factory (what `loop.create_server` takes), arming each connection."""

        def connection() -> RequestHandler:
            protocol = server()
            self._arm(protocol)
            return protocol

        return connection

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        protocol = request.protocol
        self._serving[protocol] = request
        try:
            return await handler(request)
        finally:
            self._serving.pop(protocol, None)
            self._arm(protocol)  # for the next request on this connection (or its idling)

    def _arm(self, protocol: RequestHandler) -> None:
        if (timer := self._timers.pop(protocol, None)) is not None:
            timer.cancel()
        loop = asyncio.get_running_loop()
        self._timers[protocol] = loop.call_later(self.seconds, self._expired, protocol)

    def _expired(self, protocol: RequestHandler) -> None:
        self._timers.pop(protocol, None)
        request = self._serving.get(protocol)
        if request is not None and (not request.can_read_body or request.content.is_eof()):
            return  # its request is in whole: being served; re-armed when its answer is sent
        transport = protocol.transport
        if transport is None or transport.is_closing():
            return
        if self._on_timeout is not None:
            self._on_timeout()
        log.info("closed a connection that did not send its request in time", seconds=self.seconds)
        transport.close()
