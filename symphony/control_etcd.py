"""The control state in etcd (cluster.etcd_endpoints): one key per tenant and one per session tier,
so that the replicas of a scheduler share what the admin API changed, each writing only the entry
it changed (the last write of an entry wins, as for two admins on one scheduler).

Layout, under `<etcd_prefix>/control/<scope>/` (scope: "scheduler", or "scheduler-<region>": the
replicas of a region's scheduler share theirs):
- `tenant/<tenant>` -> `TenantEntry` JSON: its tier, its quota change, its residency rule change;
- `session/<digest>` -> `SessionPriority` JSON, the digest of tenant and session id
  (symphony.region_load.session_digest: a session id may hold any character).
An entry back to the configuration (tier normal, nothing changed) is a deleted key.

Failure modes: an entry that is not valid JSON of its kind raises `ControlStateError` at load (the
scheduler does not start: a residency rule quietly dropped would let a tenant's data leave its
regions) and is skipped, logged, when it arrives by a watch. A write that fails raises OSError,
as a file's would.
"""

from __future__ import annotations

import errno
import time
from typing import Literal, TypeVar

import pydantic

from symphony.control_state import (
    Changed,
    ControlDocument,
    ControlStateError,
    QuotaChange,
    RuleChange,
    SessionPriority,
)
from symphony.etcd_client import EtcdClient, EtcdError, EtcdUnavailable, WatchEvent
from symphony.region_load import session_digest

Model = TypeVar("Model", bound=pydantic.BaseModel)
LOAD_RETRY_S = 0.5  # between reads of a load waiting for etcd


class TenantEntry(pydantic.BaseModel, extra="forbid"):
    priority: Literal["low", "high"] | None = None
    quota: QuotaChange | None = None
    residency: RuleChange | None = None

    def empty(self) -> bool:
        return self.priority is None and self.quota is None and self.residency is None


def control_scope(region: str) -> str:
    return f"scheduler-{region}" if region else "scheduler"


class EtcdControlStore:
    def __init__(self, client: EtcdClient, prefix: str, scope: str, max_entries: int, wait_s: float = 30.0) -> None:
        self.client = client
        self.wait_s = wait_s  # how long `load` waits for etcd to answer
        self.prefix = f"{prefix.rstrip('/')}/control/{scope}/".encode()
        self.where = f"etcd {self.prefix.decode()}"
        self.max_entries = max_entries  # tenants and session tiers: a snapshot past it is refused
        self.revision = 0  # of the last load: a watch from revision + 1 misses nothing
        self.values: dict[bytes, bytes] = {}  # key -> value at that load

    def tenant_key(self, tenant: str) -> bytes:
        return self.prefix + b"tenant/" + tenant.encode()

    def session_key(self, tenant: str, session_id: str) -> bytes:
        return self.prefix + b"session/" + session_digest(tenant, session_id).encode()

    def load(self) -> ControlDocument:
        """The stored entries as one document. etcd out of reach is waited for, `wait_s` at most
        (a scheduler restarted while etcd is briefly away starts once it is back), then
        ControlStateError."""
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                entries, self.revision = self.client.snapshot(self.prefix, self.max_entries)
                break
            except EtcdUnavailable as exc:
                if time.monotonic() >= deadline:
                    raise ControlStateError(f"{self.where}: {exc} (waited {self.wait_s:g} s)") from None
                time.sleep(LOAD_RETRY_S)
            except EtcdError as exc:
                raise ControlStateError(f"{self.where}: {exc}") from None
        self.values = {entry.key: entry.value for entry in entries}
        document = ControlDocument()
        for key, value in self.values.items():
            try:
                changed, entry = self.decode(key, value)
            except ValueError as exc:
                raise ControlStateError(f"etcd {key.decode(errors='replace')}: {exc}") from None
            add_entry(document, changed, entry)
        return document

    def decode(self, key: bytes, value: bytes | None) -> tuple[Changed, TenantEntry | SessionPriority | None]:
        """The change an entry names, and the entry (None: deleted; only a session's tenant and id
        are then unknown, so `value` must be the deleted entry's last value). ValueError for a key
        or value that is not one of this layout's."""
        name = key[len(self.prefix) :]
        if name.startswith(b"tenant/") and key.startswith(self.prefix):
            tenant = name[len(b"tenant/") :].decode()
            return Changed(tenant), None if value is None else _valid(TenantEntry, value)
        if name.startswith(b"session/") and key.startswith(self.prefix) and value is not None:
            session = _valid(SessionPriority, value)
            return Changed(session.tenant, session.session_id), session
        raise ValueError("not a control entry")

    def decode_event(self, event: WatchEvent) -> tuple[Changed, TenantEntry | SessionPriority | None]:
        if event.value is None and b"/session/" in event.key:
            if event.previous is None:
                raise ValueError("a deleted session entry without its last value")
            changed, _ = self.decode(event.key, event.previous)
            return changed, None
        return self.decode(event.key, event.value)

    def key_of(self, changed: Changed) -> bytes:
        if changed.session_id is None:
            return self.tenant_key(changed.tenant)
        return self.session_key(changed.tenant, changed.session_id)

    def save(self, document: ControlDocument, changed: Changed) -> int:
        """Write the entry `changed` names, as `document` has it (delete it when it is back to the
        configuration's); the revision it was written at. OSError (EIO) when etcd fails."""
        value: bytes | None
        if changed.session_id is None:
            entry = TenantEntry(
                priority=document.tenant_priorities.get(changed.tenant),
                quota=document.quotas.get(changed.tenant),
                residency=document.residency.get(changed.tenant),
            )
            value = None if entry.empty() else entry.model_dump_json().encode()
        else:
            session = next(
                (
                    s
                    for s in document.session_priorities
                    if s.tenant == changed.tenant and s.session_id == changed.session_id
                ),
                None,
            )
            value = None if session is None else session.model_dump_json().encode()
        key = self.key_of(changed)
        try:
            return self.client.delete_key(key) if value is None else self.client.put(key, value)
        except EtcdError as exc:
            raise OSError(errno.EIO, f"etcd: {exc}") from None


def add_entry(document: ControlDocument, changed: Changed, entry: TenantEntry | SessionPriority | None) -> None:
    """Put one stored entry in `document` (built entry by entry from a snapshot)."""
    if isinstance(entry, SessionPriority):
        document.session_priorities.append(entry)
    elif isinstance(entry, TenantEntry):
        if entry.priority is not None:
            document.tenant_priorities[changed.tenant] = entry.priority
        if entry.quota is not None:
            document.quotas[changed.tenant] = entry.quota
        if entry.residency is not None:
            document.residency[changed.tenant] = entry.residency


def _valid(model: type[Model], value: bytes) -> Model:
    try:
        return model.model_validate_json(value)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the entry"
        raise ValueError(f"{where}: {first['msg']}") from None
