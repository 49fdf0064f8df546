"""Cluster membership in etcd (`symphony.etcd_client`): each node manager keeps one key under a
lease it renews; a node that stops renewing (killed, stopped, cut off) leaves when its lease
expires, and schedulers list the members that remain.

Layout: `<prefix>/nodes/<node_id>` -> a `Member` as JSON. One lease per registration.

Contracts:
- `Registration.start` registers before it returns (EtcdError if etcd cannot be reached), then
  renews every third of the TTL on a thread of its own; `begin` does the same but leaves a first
  registration that failed to that thread. A renewal that finds the lease gone (it
  expired while the node was stopped or cut off) registers again under a new lease; renewals that
  fail are counted and retried at the same pace, never raised.
- `Registration.stop` revokes the lease: the member leaves at once, not a TTL later.
- `members` lists at most etcd_client.MAX_RANGE members, in node-id order, skipping (and counting)
  values that are not a valid `Member`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pydantic

from symphony.etcd_client import EtcdClient, EtcdError
from symphony.logs import get_logger

log = get_logger(__name__)

MIN_TTL_S = 2  # etcd raises shorter leases to its own minimum; below this renewals would race it


class Member(pydantic.BaseModel, extra="forbid", frozen=True):
    node_id: str = pydantic.Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")
    address: str = pydantic.Field(min_length=1, max_length=256)  # its node manager's gRPC host:port
    region: str = ""  # "" in a single-region cluster


def members_prefix(prefix: str) -> bytes:
    return prefix.rstrip("/").encode() + b"/nodes/"


@dataclass
class Registration:
    client: EtcdClient
    prefix: str  # the cluster's key prefix, e.g. "/symphony"
    member: Member
    ttl_s: int = 5
    lease: int = 0
    registrations: int = 0  # times it (re)registered
    failed_renewals: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        if self.ttl_s < MIN_TTL_S:
            raise ValueError(f"a membership lease needs at least {MIN_TTL_S} s, got {self.ttl_s}")

    @property
    def key(self) -> bytes:
        return members_prefix(self.prefix) + self.member.node_id.encode()

    def start(self) -> None:
        self._register()
        self._start_renewing()

    def begin(self) -> None:
        """`start`, but etcd out of reach is no error: the renewal thread registers once it answers
        (a node manager serves whether or not etcd is up yet)."""
        try:
            self._register()
        except EtcdError as exc:
            self.failed_renewals += 1
            log.warning("membership: not registered yet, retrying", node=self.member.node_id, error=str(exc))
        self._start_renewing()

    def _start_renewing(self) -> None:
        self._thread = threading.Thread(target=self._renew, name=f"membership-{self.member.node_id}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            # A renewal in flight (a keepalive, or a registration: a grant then a put) ends within
            # the client's deadline per endpoint and call.
            self._thread.join(timeout=2 * self.client.timeout_s * len(self.client.endpoints) + 1)
        if self.lease:
            try:
                self.client.revoke(self.lease)
            except EtcdError as exc:  # it leaves when the lease expires instead
                log.warning("membership lease not revoked", node=self.member.node_id, error=str(exc))
            self.lease = 0

    def _register(self) -> None:
        lease = self.client.grant(self.ttl_s)
        self.client.put(self.key, self.member.model_dump_json().encode(), lease=lease)
        self.lease = lease
        self.registrations += 1
        log.info("node registered", node=self.member.node_id, lease=lease)

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if self.lease and self.client.keepalive(self.lease) > 0:
                    continue
                log.warning("membership lease lost: registering again", node=self.member.node_id)
                self._register()
            except EtcdError as exc:
                self.failed_renewals += 1
                log.warning("membership renewal failed", node=self.member.node_id, error=str(exc))
            except RuntimeError:  # its client was closed under it: the node is stopping
                if self._stop.is_set():
                    return
                raise


def members(client: EtcdClient, prefix: str) -> list[Member]:
    found = []
    for entry in client.get_prefix(members_prefix(prefix)):
        try:
            found.append(Member.model_validate_json(entry.value))
        except pydantic.ValidationError:
            log.warning("membership entry ignored: not a member", key=entry.key.decode(errors="replace"))
    return found
