"""A small client of etcd's v3 API through its JSON gateway (`/v3/kv/...`, `/v3/lease/...`),
for the scheduler's high availability: control state that every replica reads, and node
membership under leases.

Why the gateway: the `etcd3` package on PyPI is unmaintained and ships generated stubs that current
protobuf refuses; the gateway is etcd's own, served on the client port of every etcd since 3.4
(Debian's etcd-server is 3.4), and needs nothing but HTTP. Keys and values are bytes, base64 on the
wire.

Contracts: every call has a deadline (`timeout_s`, connect and read); a call goes to the endpoints
in order, the first that answers wins, and one that fails to connect or times out is tried no more
for that call. `EtcdUnavailable` when none answered, `EtcdError` for an answer that is an error.
A range returns at most `limit` entries (default MAX_RANGE). Thread-safe (httpx.Client is).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import httpx

MAX_RANGE = 10_000  # entries one range may return: every table kept in etcd is bounded below this


class EtcdError(RuntimeError):
    """etcd answered, with an error (a bad request, a lease that does not exist, ...)."""


class EtcdUnavailable(EtcdError):
    """No endpoint answered within the deadline."""


@dataclass(frozen=True)
class Entry:
    key: bytes
    value: bytes
    mod_revision: int
    lease: int = 0


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key starting with `prefix` (etcd's range_end for a prefix)."""
    end = bytearray(prefix)
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"  # every key


class EtcdClient:
    def __init__(self, endpoints: list[str], timeout_s: float = 2.0) -> None:
        if not endpoints:
            raise ValueError("etcd needs at least one endpoint")
        self.endpoints = [endpoint.rstrip("/") for endpoint in endpoints]
        self.timeout_s = timeout_s  # each endpoint's, per call
        self._http = httpx.Client(timeout=httpx.Timeout(timeout_s))

    def close(self) -> None:
        self._http.close()

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        failures = []
        for endpoint in self.endpoints:
            try:
                reply = self._http.post(endpoint + path, json=body)
            except httpx.HTTPError as exc:  # refused, reset, timed out: the next endpoint
                failures.append(f"{endpoint}: {type(exc).__name__}")
                continue
            try:
                answer = reply.json()
            except ValueError:
                raise EtcdError(f"{endpoint}{path} answered {reply.status_code} with no JSON") from None
            if reply.status_code != 200 or not isinstance(answer, dict) or "error" in answer:
                message = answer.get("message") or answer.get("error") if isinstance(answer, dict) else answer
                raise EtcdError(f"{endpoint}{path}: {reply.status_code} {message}")
            return answer
        raise EtcdUnavailable(f"no etcd endpoint answered {path}: {'; '.join(failures)}")

    def get(self, key: bytes) -> Entry | None:
        entries = self.range(key)
        return entries[0] if entries else None

    def range(self, key: bytes, range_end: bytes | None = None, limit: int = MAX_RANGE) -> list[Entry]:
        """The entries from `key` up to `range_end` (exclusive; None: `key` alone), key order."""
        body: dict[str, Any] = {"key": _b64(key), "limit": limit}
        if range_end is not None:
            body["range_end"] = _b64(range_end)
        answer = self._call("/v3/kv/range", body)
        return [
            Entry(_unb64(kv["key"]), _unb64(kv.get("value")), int(kv["mod_revision"]), int(kv.get("lease", 0)))
            for kv in answer.get("kvs", [])
        ]

    def get_prefix(self, prefix: bytes, limit: int = MAX_RANGE) -> list[Entry]:
        return self.range(prefix, prefix_end(prefix), limit)

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Store `value` under `key` (attached to `lease` when not 0); the new revision."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self._call("/v3/kv/put", body)["header"]["revision"])

    def put_if(self, key: bytes, value: bytes, mod_revision: int, lease: int = 0) -> bool:
        """Store `value` only if `key` was last written at `mod_revision` (0: only if it does not
        exist): a compare-and-swap. True if it was stored."""
        compare = {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        answer = self._call("/v3/kv/txn", {"compare": [compare], "success": [{"request_put": put}]})
        return bool(answer.get("succeeded", False))

    def delete(self, key: bytes, range_end: bytes | None = None) -> int:
        """Delete `key` (or the range up to `range_end`); how many keys went."""
        body: dict[str, Any] = {"key": _b64(key)}
        if range_end is not None:
            body["range_end"] = _b64(range_end)
        return int(self._call("/v3/kv/deleterange", body).get("deleted", 0))

    def grant(self, ttl_s: int) -> int:
        """A new lease of `ttl_s` seconds (etcd may raise a short TTL to its minimum); its id."""
        return int(self._call("/v3/lease/grant", {"TTL": ttl_s})["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew `lease`; its TTL now, 0 when it has expired (its keys are gone)."""
        answer = self._call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(answer.get("result", answer).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        """End `lease` now: its keys go with it."""
        self._call("/v3/lease/revoke", {"ID": str(lease)})
