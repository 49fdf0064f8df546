"""Whose bytes cross a WAN link: per-tenant byte counters for `WanLink`, read passively from the
traffic itself, so a residency rule can be checked against what really went over each link and
not against what the senders say they sent.

A listener is given an attributor factory; each connection gets its own attributor, fed every
segment the relay reads, in each direction, before the far side sees it (so an answer is only
ever parsed after the request it answers). The attributor never changes or delays the bytes: it
only says, by `Credit`s, whose they were.

Labels: a tenant's name; `NONE` (bytes that name no tenant: protocol preambles, connection
control, requests without a key, RPCs whose request has no session); `UNKNOWN_KEY` (a bearer
token that is no tenant's key); `UNATTRIBUTED` (bytes that could not be read: another protocol, a
parse error, a bound exceeded, a connection cut before its bytes were placed); `OTHER` (tenants
past `MAX_LABELS` on one listener); and `PENDING`, bytes read whose owner is not known yet (a
request's head before its last byte). For each direction of each listener, at every instant, the
labels sum to the bytes the link read: nothing is counted twice or dropped.

Bounds: `MAX_PENDING_BYTES` per direction of a connection, `MAX_LABELS` per listener; past the
first, the connection's bytes are `UNATTRIBUTED` from then on (counted in `sniff_errors`); an
attributor that raises is treated the same way. The protocol is told from the first bytes of the
connection (`symphony.link_sniff.Sniff`): an HTTP/2 preface is gRPC (`symphony.link_grpc`), an
HTTP/1.x request line is HTTP (`symphony.link_http1`), anything else is `UNATTRIBUTED`. One event loop; not
thread-safe.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from symphony.tenancy import DEFAULT_TENANT, TenantKeys, bearer, tenant_name_error

log = logging.getLogger(__name__)

NONE = "none"
UNKNOWN_KEY = "unknown_key"
UNATTRIBUTED = "unattributed"
OTHER = "other"
PENDING = "pending"
RESERVED = frozenset({NONE, UNKNOWN_KEY, UNATTRIBUTED, OTHER, PENDING})  # never a tenant's label
UNRESOLVED = frozenset({UNATTRIBUTED, OTHER, PENDING})  # bytes that may be any tenant's
MAX_LABELS = 256  # tenants per listener, per direction (the reserved labels besides)
MAX_PENDING_BYTES = 256 * 1024  # per direction of one connection

# (direction, label, bytes): that many of the bytes fed so far in that direction were the label's
Credit = tuple[str, str, int]


class Attributor(Protocol):
    """One connection's reader. `feed` gets each segment of `direction` ("forward": from the
    connecting side; "reverse": back; b"": that direction ended) and returns credits for bytes
    fed so far, in either direction, whose owner it now knows; bytes not yet credited it holds.
    `close` returns credits for everything it still holds, at the connection's end."""

    def feed(self, direction: str, data: bytes) -> list[Credit]: ...

    def close(self) -> list[Credit]: ...


class Unattributed:
    """A connection nothing can be read from: every byte is UNATTRIBUTED."""

    def feed(self, direction: str, data: bytes) -> list[Credit]:
        return [(direction, UNATTRIBUTED, len(data))] if data else []

    def close(self) -> list[Credit]:
        return []


class TenantTally:
    """One listener's bytes by label, per direction, bounded at MAX_LABELS labels."""

    def __init__(self, directions: Iterable[str]) -> None:
        self.labels: dict[str, dict[str, int]] = {d: {} for d in directions}
        self.pending: dict[str, int] = dict.fromkeys(self.labels, 0)
        self.sniff_errors = 0

    def credit(self, direction: str, label: str, n: int) -> None:
        counts = self.labels[direction]
        if label not in counts and label not in RESERVED and len(counts.keys() - RESERVED) >= MAX_LABELS:
            label = OTHER
        counts[label] = counts.get(label, 0) + n

    def snapshot(self, direction: str) -> dict[str, int]:
        """The direction's counts, with PENDING when some bytes are not placed yet."""
        out = dict(self.labels[direction])
        if self.pending[direction]:
            out[PENDING] = self.pending[direction]
        return out


class ConnectionTally:
    """Feeds one connection's attributor and books its credits on the listener's tally, holding
    the attributor to its bounds: one that raises, or holds more than MAX_PENDING_BYTES of one
    direction, is replaced by `Unattributed` and what it held is booked UNATTRIBUTED."""

    def __init__(self, attributor: Attributor, tally: TenantTally, name: str = "") -> None:
        self.attributor = attributor
        self.tally = tally
        self.name = name
        self.held = dict.fromkeys(tally.labels, 0)  # this connection's share of tally.pending

    def feed(self, direction: str, data: bytes) -> None:
        self.held[direction] += len(data)
        self.tally.pending[direction] += len(data)
        try:
            self._book(self.attributor.feed(direction, data))
        except Exception as exc:  # a parser's failure on hostile or unexpected bytes
            self._give_up(f"{type(exc).__name__}: {exc}")
            return
        if max(self.held.values()) > MAX_PENDING_BYTES:
            self._give_up(f"more than {MAX_PENDING_BYTES} bytes without an owner")

    def close(self) -> None:
        """At the connection's end: what is still held is UNATTRIBUTED."""
        try:
            self._book(self.attributor.close())
        except Exception as exc:
            self._give_up(f"{type(exc).__name__}: {exc}")
        self._release_held()

    def _book(self, credits: list[Credit]) -> None:
        for direction, label, n in credits:
            if not 0 <= n <= self.held[direction]:
                raise RuntimeError(f"attributor credited {n} {direction} bytes of {self.held[direction]} held")
            self.held[direction] -= n
            self.tally.pending[direction] -= n
            self.tally.credit(direction, label, n)

    def _release_held(self) -> None:
        for d, n in self.held.items():
            if n:
                self.held[d] = 0
                self.tally.pending[d] -= n
                self.tally.credit(d, UNATTRIBUTED, n)

    def _give_up(self, why: str) -> None:
        self.tally.sniff_errors += 1
        log.debug("link %s: bytes no longer attributed (%s)", self.name, why)
        self._release_held()
        self.attributor = Unattributed()


def http_tenant_of(keys: TenantKeys, cluster_tokens: Iterable[str] = ()) -> Callable[[str | None], str]:
    """The label of an HTTP request by its `Authorization` header, as the entry and the scheduler
    decide its tenant (`TenantKeys`): without keys configured every request is DEFAULT_TENANT's.
    `cluster_tokens` (the internal and admin tokens) are the cluster's own control traffic, a
    region's summaries among them: NONE, no tenant's."""
    own = [token.encode() for token in cluster_tokens if token]

    def tenant_of(authorization: str | None) -> str:
        if keys.open:
            return DEFAULT_TENANT
        token = bearer(authorization)
        if token is None:
            return NONE
        given = token.encode("utf-8", "surrogateescape")
        if any([hmac.compare_digest(given, mine) for mine in own]):  # each compared: no early exit
            return NONE
        tenant = keys.tenant(token)
        return UNKNOWN_KEY if tenant is None else _tenant_label(tenant)

    return tenant_of


def grpc_tenant_label(tenant: str) -> str:
    """The label of an RPC by its request's `SessionRef.tenant`: NONE when empty, UNATTRIBUTED
    when the peer sent something no tenant could be named."""
    return _tenant_label(tenant) if tenant else NONE


def _tenant_label(tenant: str) -> str:
    """A tenant's own label; UNATTRIBUTED for a name that is no tenant's or is a reserved label
    (so a tenant called "none" or "pending" can neither hide its bytes nor break the sums)."""
    return UNATTRIBUTED if tenant in RESERVED or tenant_name_error(tenant) else tenant


def residency_crossings(
    links: list[dict[str, Any]],
    residency: Mapping[str, frozenset[str]],
    field: str = "tenant_bytes",
    unresolved: bool = True,
) -> dict[str, int]:
    """Per restricted tenant, the bytes that may be its on links touching a region it is not
    allowed in (`GET /links`'s pairs; `field`: "tenant_bytes", or "tenant_kv_bytes" for the KV
    pulls): its own, plus every byte that could not be placed (UNRESOLVED), which may be anyone's.
    So 0 means none of its bytes crossed, as far as the links could read them all. Bytes that name
    no tenant (NONE: preambles, probes, connection control) are not counted. Every restricted
    tenant is present. `unresolved=False`: the tenant's own bytes only."""
    crossed = dict.fromkeys(residency, 0)
    for link in links:
        regions = set(link["pair"].split("~"))
        counts = link.get(field, {})
        lanes = counts.values() if field == "tenant_bytes" else [counts]
        for tenant, allowed in residency.items():
            if regions <= allowed:
                continue
            counted = {tenant, *UNRESOLVED} if unresolved else {tenant}
            crossed[tenant] += sum(n for lane in lanes for label, n in lane.items() if label in counted)
    return crossed
