"""The tenant of the HTTP/1.x bytes on a link connection (`symphony.link_tenants`), read with h11.

Two sans-IO h11 connections read the two directions: one in the server's role reads the
requests, one in the client's role reads the responses. Each is told what the other side did
(the request's method and `Connection: close` for the client, a bodyless response for the
server), so both keep h11's framing and keep-alive state without a byte being written anywhere.

Whose bytes: a request's, from the first byte of its head to the last of its body, are the
tenant of its `Authorization` header (`http_tenant_of`); a response's are its request's. A
request without a key that has a body is UNATTRIBUTED rather than NONE (its body may be anyone's
prompt). Attribution is by segment (h11 reports events, not offsets): a segment whose owner is
not known yet (a head still arriving) is held; a response whose request never came is
UNATTRIBUTED. One request is read at a time, as the project's clients send them: a request sent
before the previous one's response ended (pipelining), a protocol switch (101, CONNECT) or an h11
protocol error raises, and the link stops attributing the connection. A head is at most
`MAX_HEAD_BYTES`.
"""

from __future__ import annotations

from collections.abc import Callable

import h11

from symphony.link_tenants import NONE, UNATTRIBUTED, Credit

MAX_HEAD_BYTES = 16 * 1024
_NO_EVENT = (h11.NEED_DATA, h11.PAUSED)


class Http1Attributor:
    def __init__(self, tenant_of: Callable[[str | None], str]) -> None:
        self._tenant_of = tenant_of
        self._requests = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self._responses = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        self._receiving: str | None = None  # the owner of the request whose body is arriving
        self._answering: str | None = None  # the owner of the request whose response is due
        self._server_closed = False  # the server ended its side: no response will come
        self._held = {"forward": 0, "reverse": 0}

    def feed(self, direction: str, data: bytes) -> list[Credit]:
        self._held[direction] += len(data)
        if direction == "forward":
            if data and self._requests.their_state is h11.DONE:
                raise ValueError("a request sent before the previous one was answered (pipelining)")
            owners = {self._receiving} if self._receiving is not None else set()
            self._requests.receive_data(data)
            owners |= self._read_requests()
            owners |= self._next_cycle()  # a response that ended before its request's body did
            if self._requests.their_state is h11.DONE and self._requests.next_event() is h11.PAUSED:
                # h11 pauses in DONE only with bytes past the request: the next one, pipelined
                raise ValueError("a request sent before the previous one was answered (pipelining)")
            return self._settle("forward", owners)
        credits: list[Credit] = []
        owners = {self._answering if self._answering is not None else UNATTRIBUTED}
        self._responses.receive_data(data)
        while (event := self._responses.next_event()) not in _NO_EVENT:
            if isinstance(event, h11.ConnectionClosed):
                self._server_closed = True
                break
            if isinstance(event, h11.InformationalResponse) and event.status_code == 101:
                raise ValueError("the connection switched protocols")
            if not isinstance(event, h11.EndOfMessage):
                continue
            self._answering = None
            closing = self._responses.their_state is h11.MUST_CLOSE
            self._requests.send(h11.Response(status_code=200, headers=_framing(closing, request=False)))
            self._requests.send(h11.EndOfMessage())
            next_owners = self._next_cycle()
            if next_owners:
                credits += self._settle("forward", next_owners)
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
                owner = self._owner(event)
                self._receiving = owner
                owners.add(owner)
                if self._server_closed:
                    continue  # sent as the server closed: it is the owner's, and no answer comes
                self._answering = owner
                closing = any(k == b"connection" and b"close" in v.lower() for k, v in event.headers)
                mirror = h11.Request(method=event.method, target=event.target, headers=_framing(closing, request=True))
                self._responses.send(mirror)
                self._responses.send(h11.EndOfMessage())
            elif isinstance(event, h11.EndOfMessage):
                self._receiving = None
        return owners

    def _owner(self, request: h11.Request) -> str:
        authorization = next((v for k, v in request.headers if k == b"authorization"), None)
        owner = self._tenant_of(None if authorization is None else authorization.decode("latin-1"))
        with_body = any(
            (k == b"content-length" and v.strip() != b"0") or k == b"transfer-encoding" for k, v in request.headers
        )
        return UNATTRIBUTED if owner == NONE and with_body else owner

    def _next_cycle(self) -> set[str]:
        """Once both sides are done with a request and its response, the next request's owners
        (of the bytes already received)."""
        if (self._requests.our_state, self._requests.their_state) != (h11.DONE, h11.DONE):
            return set()
        if self._responses.their_state is not h11.DONE:
            return set()
        self._requests.start_next_cycle()
        self._responses.start_next_cycle()
        return self._read_requests()

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
