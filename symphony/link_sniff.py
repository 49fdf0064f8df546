"""Which reader a link connection gets (`symphony.link_tenants`): told from its first bytes."""

from __future__ import annotations

import re
from collections.abc import Callable

from symphony.link_grpc import GrpcAttributor
from symphony.link_http1 import Http1Attributor
from symphony.link_tenants import Attributor, Credit, Unattributed

_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HTTP1_REQUEST_LINE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+ ")


class Sniff:
    """The attributor of a connection whose protocol is told from its first forward bytes: the
    HTTP/2 preface (gRPC over h2c), an HTTP/1.x request line, or anything else (UNATTRIBUTED).
    Reverse bytes before that are held."""

    def __init__(self, http_tenant: Callable[[str | None], str]) -> None:
        self._http_tenant = http_tenant
        self._head = b""
        self._held_reverse: list[bytes] = []
        self._inner: Attributor | None = None

    def feed(self, direction: str, data: bytes) -> list[Credit]:
        if self._inner is not None:
            return self._inner.feed(direction, data)
        if direction == "reverse":
            self._held_reverse.append(data)
            return []
        self._head += data
        inner = self._choose(ended=not data)
        if inner is None:
            return []
        self._inner = inner
        credits = inner.feed("forward", self._head)
        for segment in self._held_reverse:
            credits += inner.feed("reverse", segment)
        if not data:
            credits += inner.feed("forward", b"")
        self._head, self._held_reverse = b"", []
        return credits

    def _choose(self, ended: bool) -> Attributor | None:
        head = self._head
        if len(head) < len(_H2_PREFACE) and _H2_PREFACE.startswith(head) and not ended:
            return None  # could still be the preface
        if head.startswith(_H2_PREFACE):
            return GrpcAttributor()
        if _HTTP1_REQUEST_LINE.match(head):
            return Http1Attributor(self._http_tenant)
        if len(head) < 32 and b" " not in head and not ended:
            return None  # a method name still arriving
        return Unattributed()

    def close(self) -> list[Credit]:
        return self._inner.close() if self._inner is not None else []
