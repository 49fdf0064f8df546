"""The scheduler's session table: where each session's last turn ran and which nodes' tiers hold
its KV (as far as the scheduler saw: turns it sent there, prefetches it asked for). Bounded by
size (least recently used first) and by age (an entry unused for `ttl_s` is dropped): routers that
keep every session forever are how index memory grows without bound (dynamo #10774).

What it knows is a hint, never a promise: a node may have evicted a session since. A wrong hint
costs a recompute of what the node lacks, never a wrong answer (the connector loads only what the
node's tiers really hold).

An entry records the model its copies are KV of (the served name and the fingerprint of the node
that computed the last turn): every copy in `kv_tokens` is KV of that fingerprint. A turn served
under another model (a client that switched models in one session) starts the entry's copies over,
so a session's KV is never offered to a node of another model as its history."""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

SessionKey = tuple[str, str]  # (tenant, session id): sessions never collide across tenants


@dataclass(slots=True)
class SessionEntry:
    last_node: str | None = None
    kv_tokens: dict[str, int] = field(default_factory=dict)  # node id -> history tokens its tiers hold
    model: str = ""  # the served model name of the last turn
    fingerprint: bytes = b""  # the model fingerprint every copy in kv_tokens is KV of
    history_tokens: int = 0
    used_at: float = 0.0
    high: bool = False  # its last turn ran at high priority


class SessionTable:
    def __init__(
        self,
        max_sessions: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[SessionKey, int, str], None] | None = None,
    ) -> None:
        if max_sessions <= 0 or ttl_s <= 0:
            raise ValueError("max_sessions and ttl_s must be positive")
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._clock = clock
        # Told a session's best copy (tokens, 0: none left; and the node holding it) whenever it
        # may have changed: the region's feed to the global layer (scheduler.region_feed).
        self._on_change = on_change
        self._entries: OrderedDict[SessionKey, SessionEntry] = OrderedDict()
        self.high_sessions: Counter[str] = Counter()  # high-priority sessions whose last turn ran on each node

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: SessionKey) -> SessionEntry | None:
        entry = self._entries.get(key)
        if entry is not None and self._clock() - entry.used_at > self.ttl_s:
            self._drop(key)
            return None
        return entry

    def served(
        self,
        key: SessionKey,
        node_id: str,
        history_tokens: int,
        *,
        fingerprint: bytes,
        model: str = "",
        high: bool = False,
    ) -> Callable[[], None]:
        """A turn of the session (its history plus what it adds) is being computed on `node_id`, which
        serves the model of `fingerprint`; the connector saves its KV there. Older copies elsewhere
        hold a shorter prefix of it (copies of another model are forgotten). Returns what undoes it,
        for a turn the node then never started."""
        entry = self._touch(key)
        before = (entry.last_node, entry.high, entry.history_tokens, entry.model)
        # What undo puts back of the copies: this node's count, or (a turn that switched models) the
        # fingerprint and copies of the model it left.
        switched = fingerprint != entry.fingerprint
        left_behind = (entry.fingerprint, dict(entry.kv_tokens))
        held_before = entry.kv_tokens.get(node_id)

        def undo() -> None:
            """Undoes may come in any order: each takes back only what is still this turn's. (Undoing a
            turn after undoing its predecessor brings the predecessor's hint back: a stale hint, which
            costs at most a recompute, as every hint here.)"""
            if self._entries.get(key) is not entry:
                return  # dropped or replaced since: nothing of this turn is left to undo
            if entry.last_node == node_id:  # no later turn went elsewhere since
                self._count_high(entry, -1)
                entry.last_node, entry.high, entry.history_tokens, entry.model = before
                self._count_high(entry, +1)
            if entry.fingerprint != fingerprint:
                return  # a later turn moved the session to another model: its copies are not this turn's
            if switched:
                entry.kv_tokens.pop(node_id, None)
                if not entry.kv_tokens:  # no later turn of this model: the model left behind is back
                    entry.fingerprint, entry.kv_tokens = left_behind[0], dict(left_behind[1])
            elif held_before is None:
                entry.kv_tokens.pop(node_id, None)
            else:
                entry.kv_tokens[node_id] = held_before
            self._changed(key, entry)

        self._count_high(entry, -1)
        if fingerprint != entry.fingerprint:
            entry.kv_tokens = {}  # another model's KV is no history of this turn's
            entry.fingerprint = fingerprint
        entry.model = model
        entry.last_node, entry.high = node_id, high
        self._count_high(entry, +1)
        entry.history_tokens = max(entry.history_tokens, history_tokens)
        entry.kv_tokens[node_id] = max(entry.kv_tokens.get(node_id, 0), history_tokens)
        self._changed(key, entry)
        return undo

    def moved(
        self, key: SessionKey, node_id: str, history_tokens: int, fingerprint: bytes, *, create: bool = False
    ) -> None:
        """A prefetch brought the `history_tokens` of the session it was asked to move (what was
        known when it started; a turn served elsewhere since is not part of it) to `node_id`, which
        serves the model of `fingerprint` (a move for a model the session has left counts for nothing;
        one of a session not in the table counts only with `create`: moved in from another region)."""
        entry = self._entries.get(key)
        if entry is None and create:
            entry = self._touch(key)
            entry.fingerprint, entry.history_tokens = fingerprint, history_tokens
        if entry is not None and entry.fingerprint == fingerprint:
            entry.kv_tokens[node_id] = max(entry.kv_tokens.get(node_id, 0), history_tokens)
            self._changed(key, entry)

    def of_tenant(self, tenant: str) -> list[SessionKey]:
        """The tenant's sessions, most recently used first (a scan of the bounded table: admin use)."""
        return [key for key in reversed(self._entries) if key[0] == tenant]

    def forget_node(self, node_id: str) -> None:
        """A node left the cluster (or lost its store): its copies no longer count."""
        for key, entry in self._entries.items():
            if entry.kv_tokens.pop(node_id, None) is not None:
                self._changed(key, entry)

    def purge(self) -> None:
        """Drop entries older than the TTL (oldest first; the table is kept in use order)."""
        now = self._clock()
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if now - entry.used_at <= self.ttl_s:
                return
            self._drop(key)

    def _touch(self, key: SessionKey) -> SessionEntry:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = SessionEntry()
        entry.used_at = self._clock()
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_sessions:
            self._drop(next(iter(self._entries)))
        return entry

    def _drop(self, key: SessionKey) -> None:
        self._count_high(self._entries.pop(key), -1)
        if self._on_change is not None:
            self._on_change(key, 0, "")

    def _changed(self, key: SessionKey, entry: SessionEntry) -> None:
        if self._on_change is not None:
            node = max(entry.kv_tokens, key=entry.kv_tokens.__getitem__, default="")
            self._on_change(key, entry.kv_tokens.get(node, 0), node)

    def _count_high(self, entry: SessionEntry, change: int) -> None:
        if entry.high and entry.last_node is not None:
            self.high_sessions[entry.last_node] += change
            if self.high_sessions[entry.last_node] <= 0:
                del self.high_sessions[entry.last_node]
