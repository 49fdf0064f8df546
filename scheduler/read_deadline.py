"""A deadline on reading each HTTP request, against clients that hold connections open by sending
slowly (slowloris). uvicorn times out idle keep-alive connections between requests, but not a
connection that never finishes its first request line, its headers or its body.

`read_deadline_protocol(seconds)` is uvicorn's httptools protocol with one timer per request: armed
when the connection opens and when each request's first byte arrives, disarmed once the request
is whole (headers and body). If it fires the connection is closed: a client still sending
headers gets nothing (there is no request to answer), and an application reading a body sees the
client disconnect (`hot_path.read_body`: 400, which the closed connection never carries). Only
reading is timed: a request whose body is in, waiting in a queue or streaming its answer, is not;
nor is a request pipelined behind another's answer (uvicorn reads it only once that ends).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from symphony.logs import get_logger

log = get_logger(__name__)


class ReadDeadlineProtocol(HttpToolsProtocol):
    read_timeout_s = 30.0  # set per server by `read_deadline_protocol`
    on_timeout: Callable[[], None] | None = None  # told of each connection closed (a metric)

    _read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.cycle is None or self.cycle.response_complete:
            self._arm()
        # else a request pipelined behind one still answering: uvicorn stops reading until that
        # answer ends, so its own reading cannot be timed from here (left untimed).

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.on_timeout is not None:
            self.on_timeout()
        log.info("closed a connection that did not send its request in time", client=self.client)
        self.transport.close()


def read_deadline_protocol(seconds: float, on_timeout: Callable[[], None] | None = None) -> type[ReadDeadlineProtocol]:
    """The protocol class (uvicorn.Config's `http`) with a deadline of `seconds` per request."""
    timed = {"read_timeout_s": seconds, "on_timeout": staticmethod(on_timeout) if on_timeout else None}
    return type("ReadDeadlineProtocol", (ReadDeadlineProtocol,), timed)
