"""The tenant of the HTTP/1.x bytes on a link connection (`symphony.link_tenants`), read with h11.

Two sans-IO h11 connections read the two directions: one in the server's role reads the
requests, one in the client's role reads the responses. Each is told what the other side did
(the request's method and `Connection: close` for the client, a bodyless response for the
server), so both keep h11's framing and keep-alive state without a byte being written anywhere.

Whose bytes: a request's, from the first byte of its head to the last of its body, are the
tenant of its `Authorization` header (`http_tenant_of`); a response's are its request's.
Attribution is by segment (h11 reports events, not offsets): a segment whose owner is not known
yet (a head still arriving) is held; a segment that carries bytes of two requests of different
owners, which only pipelining produces (the project's clients never pipeline), is UNATTRIBUTED,
as are responses nobody asked for. Bounded: a head of at most `MAX_HEAD_BYTES`, at most
`MAX_OUTSTANDING` requests awaiting their responses; a protocol switch (101, CONNECT) or an h11
protocol error raises, and the link stops attributing the connection.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import h11

from symphony.link_tenants import UNATTRIBUTED, Credit

MAX_HEAD_BYTES = 16 * 1024
MAX_OUTSTANDING = 8
_NO_EVENT = (h11.NEED_DATA, h11.PAUSED)


class Http1Attributor:
    def __init__(self, tenant_of: Callable[[str | None], str]) -> None:
        self._tenant_of = tenant_of
        self._requests = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self._responses = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        self._receiving: str | None = None  # the owner of the request whose body is arriving
        self._answering: deque[str] = deque()  # owners of requests not yet answered, oldest first
        self._held = {"forward": 0, "reverse": 0}

    def feed(self, direction: str, data: bytes) -> list[Credit]:
        self._held[direction] += len(data)
        if direction == "forward":
            owners = {self._receiving} if self._receiving is not None else set()
            self._requests.receive_data(data)
            owners |= self._read_requests()
            if self._requests.their_state is h11.DONE and self._requests.trailing_data[0]:
                owners.add(UNATTRIBUTED)  # the next request's bytes, pipelined behind this one's
            return self._settle("forward", owners)
        credits: list[Credit] = []
        owners = {self._answering[0] if self._answering else UNATTRIBUTED}
        self._responses.receive_data(data)
        while (event := self._responses.next_event()) not in _NO_EVENT:
            if isinstance(event, h11.ConnectionClosed):
                break
            if isinstance(event, h11.InformationalResponse) and event.status_code == 101:
                raise ValueError("the connection switched protocols")
            if not isinstance(event, h11.EndOfMessage):
                continue
            self._answering.popleft()
            closing = self._responses.their_state is h11.MUST_CLOSE
            self._requests.send(h11.Response(status_code=200, headers=_framing(closing, request=False)))
            self._requests.send(h11.EndOfMessage())
            credits += self._next_cycle()
            if self._responses.trailing_data[0]:
                owners.add(self._answering[0] if self._answering else UNATTRIBUTED)
        return credits + self._settle("reverse", owners)

    def close(self) -> list[Credit]:
        return []  # what is still held is the link's to call UNATTRIBUTED

    def _read_requests(self) -> set[str]:
        """The owners of the requests whose heads the bytes received so far complete."""
        owners = set()
        while (event := self._requests.next_event()) not in _NO_EVENT:
            if isinstance(event, h11.ConnectionClosed):
                break
            if isinstance(event, h11.Request):
                if event.method == b"CONNECT":
                    raise ValueError("CONNECT tunnels are not read")
                if len(self._answering) >= MAX_OUTSTANDING:
                    raise ValueError(f"more than {MAX_OUTSTANDING} requests awaiting answers")
                authorization = next((v for k, v in event.headers if k == b"authorization"), None)
                owner = self._tenant_of(None if authorization is None else authorization.decode("latin-1"))
                self._receiving = owner
                self._answering.append(owner)
                owners.add(owner)
                closing = any(k == b"connection" and b"close" in v.lower() for k, v in event.headers)
                mirror = h11.Request(method=event.method, target=event.target, headers=_framing(closing, request=True))
                self._responses.send(mirror)
                self._responses.send(h11.EndOfMessage())
            elif isinstance(event, h11.EndOfMessage):
                self._receiving = None
        return owners

    def _next_cycle(self) -> list[Credit]:
        """Once both sides are done with a request and its response, the next request; returns
        credits for request bytes held that it owns."""
        states = (self._requests.our_state, self._requests.their_state)
        if states != (h11.DONE, h11.DONE) or self._responses.their_state is not h11.DONE:
            return []
        self._requests.start_next_cycle()
        self._responses.start_next_cycle()
        owners = self._read_requests()
        return self._settle("forward", owners) if owners else []

    def _settle(self, direction: str, owners: set[str]) -> list[Credit]:
        """Credit what `direction` holds to its one owner (UNATTRIBUTED for several; nothing
        for none yet)."""
        held = self._held[direction]
        if not owners or not held:
            return []
        self._held[direction] = 0
        owner = owners.pop() if len(owners) == 1 else UNATTRIBUTED
        return [(direction, owner, held)]


def _framing(closing: bool, request: bool) -> list[tuple[str, str]]:
    """The headers of a bodyless mirror message, keeping (or not) the connection alive."""
    headers = [("host", "link"), ("content-length", "0")] if request else [("content-length", "0")]
    return [*headers, ("connection", "close")] if closing else headers
