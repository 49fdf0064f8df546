"""A deadline on reading each HTTP request at the global layer's entries, against clients that hold
connections open by sending slowly (slowloris), as `scheduler.read_deadline` gives the schedulers.
aiohttp times out only idle keep-alive connections, not one that never finishes its headers or body.

`ReadDeadlines(seconds)` times each request on a connection: from the connection's opening for its
first, from its first bytes for each later one. When the time is up, the connection is closed unless
the request's headers and whole body are in (it is then served, however long that takes: waiting for
a region, streaming its answer). A client still sending its request gets nothing back; a handler
reading its body sees the client gone. A connection idle between requests is aiohttp's to time out
(`keepalive_timeout`), and a request pipelined behind another's answer is left untimed (aiohttp reads
it only once that answer ends).

Use both parts: `protocol_factory` for the server (each connection's aiohttp protocol behind a thin
wrapper that sees its bytes arrive) and `middleware` in the application (marks the request being
served). Only the protocol interface of asyncio and aiohttp's public request API are relied on,
except one read of the handler's queue of parsed requests (see `_Connection.expired`). State: one
wrapper per open connection, dropped when it closes; everything on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from symphony.logs import get_logger

log = get_logger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _complete(request: web.Request) -> bool:
    return not request.can_read_body or request.content.is_eof()


class _Connection(asyncio.Protocol):
    """One connection: aiohttp's protocol (`inner`), every callback passed on, plus its deadline."""

    def __init__(self, inner: RequestHandler, deadlines: ReadDeadlines) -> None:
        self.inner = inner
        self.deadlines = deadlines
        self.timer: asyncio.TimerHandle | None = None
        self.serving: web.Request | None = None  # the request its handler runs, if any
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.deadlines.open[self.inner] = self
        self.inner.connection_made(transport)
        self.arm()  # the first request: from the connection's opening

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        self.deadlines.open.pop(self.inner, None)
        self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.timer is None and self.serving is None:
            self.arm()  # a new request's first bytes
        self.inner.data_received(data)

    def eof_received(self) -> None:
        self.inner.eof_received()  # aiohttp's closes the transport (it returns nothing: falsy)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def arm(self) -> None:
        self.disarm()
        self.timer = asyncio.get_running_loop().call_later(self.deadlines.seconds, self.expired)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def expired(self) -> None:
        self.timer = None
        if self.serving is not None and _complete(self.serving):
            return  # in whole, being served
        # Parsed whole but not yet handed to the handler (a loop turn or two): it will be served.
        # aiohttp's queue of (message, payload), read only; absent in another version, nothing is.
        queued: Any = getattr(self.inner, "_messages", ())
        if self.serving is None and any(payload.is_eof() for _, payload in queued):
            return
        if self.transport is None or self.transport.is_closing():
            return
        self.deadlines.timed_out()
        self.transport.close()


class ReadDeadlines:
    def __init__(self, seconds: float, on_timeout: Callable[[], None] | None = None) -> None:
        if seconds <= 0:
            raise ValueError("seconds must be positive")
        self.seconds = seconds
        self._on_timeout = on_timeout  # told of each connection closed (a count)
        self.open: dict[RequestHandler, _Connection] = {}  # by aiohttp's protocol, while connected

    def protocol_factory(self, server: web.Server) -> Callable[[], asyncio.Protocol]:
        """`server`'s protocol factory (what `loop.create_server` takes), each connection timed."""
        return lambda: _Connection(server(), self)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        connection = self.open.get(request.protocol)
        if connection is None:  # not served through `protocol_factory` (or already gone)
            return await handler(request)
        connection.serving = request
        if _complete(request):
            connection.disarm()
        try:
            return await handler(request)
        finally:
            connection.serving = None
            connection.disarm()  # the next request is timed from its first bytes

    def timed_out(self) -> None:
        if self._on_timeout is not None:
            self._on_timeout()
        log.info("closed a connection that did not send its request in time", seconds=self.seconds)
