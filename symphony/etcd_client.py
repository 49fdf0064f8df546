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
import json
from collections.abc import Iterator
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


@dataclass(frozen=True)
class WatchEvent:
    key: bytes
    value: bytes | None  # None: the key was deleted (or its lease ended)
    previous: bytes | None  # its value before the change (None: it did not exist)
    mod_revision: int


def _watch_events(line: str) -> list[WatchEvent]:
    """The events of one message of a watch stream. EtcdError for an error, a cancelled watch or a
    compacted start revision."""
    if not line.strip():
        return []
    try:
        message = json.loads(line)
    except ValueError:
        raise EtcdError(f"a watch message is not JSON: {line[:120]!r}") from None
    if not isinstance(message, dict) or "error" in message:
        raise EtcdError(f"watch failed: {str(message)[:200]}")
    result = message.get("result", {})
    if result.get("canceled") or int(result.get("compact_revision", 0) or 0):
        reason = result.get("cancel_reason", "")
        raise EtcdError(f"watch cancelled (compacted to {result.get('compact_revision')}): {reason}")
    events = []
    for event in result.get("events", []):
        kv, previous = event.get("kv", {}), event.get("prev_kv")
        deleted = event.get("type") == "DELETE"
        events.append(
            WatchEvent(
                _unb64(kv.get("key")),
                None if deleted else _unb64(kv.get("value")),
                _unb64(previous.get("value")) if previous else None,
                int(kv.get("mod_revision", 0)),
            )
        )
    return events


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
        self._watch_next = 0  # the endpoint the next watch starts at (a watch's own thread's)

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
                # A 5xx (no leader during an election, a member restarting) is etcd not serving
                # yet, as much as no answer: callers wait for it as for an endpoint down.
                kind = EtcdUnavailable if reply.status_code >= 500 else EtcdError
                raise kind(f"{endpoint}{path}: {reply.status_code} {message}")
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

    def snapshot(self, prefix: bytes, max_entries: int, page: int = MAX_RANGE) -> tuple[list[Entry], int]:
        """Every entry under `prefix`, read page by page at one revision (a consistent view
        however many pages), and that revision: a watch from revision + 1 misses nothing after
        it. EtcdError past `max_entries` (the table it holds is bounded below that)."""
        body: dict[str, Any] = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)), "limit": page}
        entries: list[Entry] = []
        revision = 0
        while True:
            answer = self._call("/v3/kv/range", body)
            revision = revision or int(answer["header"]["revision"])
            entries += [
                Entry(_unb64(kv["key"]), _unb64(kv.get("value")), int(kv["mod_revision"]), int(kv.get("lease", 0)))
                for kv in answer.get("kvs", [])
            ]
            if len(entries) > max_entries:
                raise EtcdError(f"more than {max_entries} entries under {prefix!r}")
            if not answer.get("more") or not entries:
                return entries, revision
            body.update(key=_b64(entries[-1].key + b"\0"), revision=str(revision))

    def watch(self, prefix: bytes, start_revision: int, idle_timeout_s: float) -> Iterator[WatchEvent]:
        """The changes under `prefix` from `start_revision` on, as they come. A stream begins with
        etcd's confirmation of the watch; once it has, the watch ends (returns) after
        `idle_timeout_s` without a message or when it breaks, and the caller watches again from
        the revision after the last event it got, at the same endpoint. An endpoint that fails
        before its stream begins (refused, closed, nothing within `idle_timeout_s`: a hung or
        cut-off etcd) is passed for the next, where the next watch starts too. EtcdError when the
        revision was compacted (read a snapshot again) or the watch is refused; EtcdUnavailable
        when no endpoint began a stream."""
        create = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)), "prev_kv": True}
        create["start_revision"] = str(start_revision)
        timeout = httpx.Timeout(self.timeout_s, read=idle_timeout_s)
        failures = []
        count, first = len(self.endpoints), self._watch_next
        for step in range(count):
            index = (first + step) % count
            endpoint = self.endpoints[index]
            began = False
            try:
                with self._http.stream(
                    "POST", endpoint + "/v3/watch", json={"create_request": create}, timeout=timeout
                ) as reply:
                    if reply.status_code != 200:
                        raise EtcdError(f"{endpoint}/v3/watch: {reply.status_code}")
                    for line in reply.iter_lines():
                        if not began:
                            began = True
                            self._watch_next = index  # a working endpoint: the next watch starts here
                        yield from _watch_events(line)
                if began:
                    return
                failures.append(f"{endpoint}: closed before the watch began")
            except httpx.TransportError as exc:
                if began:
                    return  # idle, or broken after it began: the caller resumes where it is
                failures.append(f"{endpoint}: {type(exc).__name__}")
            self._watch_next = (index + 1) % count
        raise EtcdUnavailable(f"no etcd endpoint began a watch: {'; '.join(failures)}")

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

    def delete_key(self, key: bytes) -> int:
        """Delete `key`; the store's revision after (the delete's own when the key existed)."""
        return int(self._call("/v3/kv/deleterange", {"key": _b64(key)})["header"]["revision"])

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
