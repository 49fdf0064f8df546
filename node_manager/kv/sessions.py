"""Session histories: which token history, and so which block keys, a (tenant, session id) names.

`SessionRegistry` keeps the records, least recently used first, at most `max_sessions` of them;
forgetting a record keeps its pages (other sessions may share them). `check_range` and
`addressed_keys` map a caller's block range onto a record. Records hold no pages: the page directory
does, keyed by block key.

Lock: the registry takes the store's lock (`TieredStore.lock`, reentrant) itself; a caller may hold
it. Chaining a history's keys (hashing every token) runs outside it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from node_manager.kv.directory import SessionKey
from node_manager.kv.errors import HistoryChanged, InvalidRequest, SessionNotFound
from node_manager.kv.pages import Priority
from node_manager.kv.store_config import StoreConfig
from symphony.kv_addressing import BlockKey, SessionBlocks, chain_after, tail_key, tenant_root, token_array
from symphony.kv_geometry import KVGeometry


@dataclass(slots=True)
class SessionRecord:
    key: SessionKey
    token_ids: np.ndarray  # read-only uint32 (`token_array`)
    blocks: SessionBlocks
    priority: Priority


class SessionRegistry:
    """The registered session histories. `on_priority_change(record)` runs under the store's lock
    after `set_priority`, and after `put` changes a registered session's priority, so the pages it
    saved can be reordered for eviction."""

    def __init__(
        self,
        lock: threading.RLock,
        geometry: KVGeometry,
        config: StoreConfig,
        on_priority_change: Callable[[SessionRecord], None],
    ) -> None:
        self._lock = lock
        self._geometry = geometry
        self._config = config
        self._on_priority_change = on_priority_change
        self._records: OrderedDict[SessionKey, SessionRecord] = OrderedDict()
        # Registered sessions per tenant (no entry at 0), and how many times a tenant gained its
        # first one: what the engine's KV events are attributed with (`tenants`).
        self._tenant_sessions: dict[str, int] = {}
        self._tenant_generation = 0

    def __len__(self) -> int:
        return len(self._records)

    def put(
        self, tenant: str, session_id: str, token_ids: Sequence[int] | np.ndarray, priority: Priority | None = None
    ) -> SessionRecord:
        """Register a session's token history (or extend it). A history that does not extend the
        stored one (an edited conversation) replaces it; its keys are recomputed."""
        if not tenant or not session_id:
            raise InvalidRequest("tenant and session_id must be non-empty")
        if len(token_ids) > self._config.max_session_tokens:
            raise InvalidRequest(
                f"{len(token_ids)} tokens exceed kv.max_session_tokens ({self._config.max_session_tokens})"
            )
        key = (tenant, session_id)
        try:
            tokens = token_array(token_ids)
        except (ValueError, OverflowError, TypeError) as exc:
            raise InvalidRequest(f"bad token ids: {exc}") from None
        with self._lock:
            record = self._records.get(key)
        blocks = chain_after(
            self._config.model,
            tenant,
            tokens,
            self._geometry.block_size,
            record.token_ids if record else None,
            record.blocks if record else None,
        )
        with self._lock:
            old = self._records.get(key)
            new_priority = priority if priority is not None else (old.priority if old else Priority.NORMAL)
            record = SessionRecord(key, tokens, blocks, new_priority)
            self._records[key] = record
            self._records.move_to_end(key)
            if old is None:
                self._count_tenant(tenant, +1)
            while len(self._records) > self._config.max_sessions:
                # Forgetting a session keeps its pages (other sessions may share them); they age out.
                (forgotten_tenant, _), _ = self._records.popitem(last=False)
                self._count_tenant(forgotten_tenant, -1)
            if old is not None and old.priority != new_priority:
                self._on_priority_change(record)
        return record

    def _count_tenant(self, tenant: str, delta: int) -> None:
        count = self._tenant_sessions.get(tenant, 0) + delta
        if count > 0:
            if tenant not in self._tenant_sessions:
                self._tenant_generation += 1
            self._tenant_sessions[tenant] = count
        else:
            self._tenant_sessions.pop(tenant, None)

    def tenant_generation(self) -> int:
        """Grows whenever a tenant without registered sessions registers one: a reader of `tenants`
        need not read them again until it changes. Any thread."""
        with self._lock:
            return self._tenant_generation

    def tenants(self) -> list[str]:
        """The tenants with registered sessions (at most `max_sessions`). Any thread."""
        with self._lock:
            return list(self._tenant_sessions)

    def get(self, tenant: str, session_id: str) -> SessionRecord:
        """The session's record, now the most recently used; SessionNotFound if none is registered."""
        with self._lock:
            record = self._records.get((tenant, session_id))
            if record is None:
                raise SessionNotFound(f"no session {session_id!r} for this tenant")
            self._records.move_to_end(record.key)
            return record

    def addresses(
        self,
        tenant: str,
        session_id: str,
        first_block: int,
        count: int,
        last_key: BlockKey | None,
        tail_tokens: int = 0,
    ) -> bool:
        """Whether the registered history has blocks first_block.. (the last a partial one of
        `tail_tokens` tokens, if given), the last of them keyed `last_key` if given: a load can be
        served. False for an unknown session or another history."""
        with self._lock:
            record = self._records.get((tenant, session_id))
        if record is None:
            return False
        try:
            check_range(self._geometry, record, 0, first_block, count, tail_tokens)
            addressed_keys(record, first_block, count, last_key, tail_tokens)
        except (InvalidRequest, HistoryChanged):
            return False
        return True

    def set_priority(self, tenant: str, session_id: str, priority: Priority) -> None:
        with self._lock:
            record = self.get(tenant, session_id)
            record.priority = priority
            self._on_priority_change(record)

    def blocks_of(self, key: Hashable) -> int:
        """Full blocks of the session registered under `key`, 0 if none (the HBM eviction order).
        Caller holds the lock."""
        record = self._records.get(key) if isinstance(key, tuple) else None
        return record.blocks.num_blocks if record else 0


def check_range(
    geometry: KVGeometry, record: SessionRecord, layer: int, first_block: int, count: int, tail_tokens: int = 0
) -> None:
    """Raise InvalidRequest unless `layer` exists and blocks first_block.. lie within the history
    (one partial block past the full ones when `tail_tokens` is given)."""
    if not 0 <= layer < geometry.num_layers:
        raise InvalidRequest(f"layer {layer} outside 0..{geometry.num_layers - 1}")
    partial = 1 if tail_tokens else 0  # a partial last block may follow the full ones
    if first_block < 0 or count < 0 or first_block + count > record.blocks.num_blocks + partial:
        raise InvalidRequest(
            f"blocks {first_block}..{first_block + count - 1} outside the session's "
            f"{record.blocks.num_blocks} full blocks"
        )


def addressed_keys(
    record: SessionRecord, first_block: int, count: int, last_key: BlockKey | None, tail_tokens: int = 0
) -> tuple[BlockKey, ...]:
    """The keys of blocks first_block.. of the session's history. With `last_key`, the caller's key
    for the last of them: keys are chained, so one equal key means every block before it is the
    same content too, and a history re-registered with other tokens in the meantime raises
    HistoryChanged instead of serving or storing another history's pages under this one.

    `tail_tokens` > 0: the last block is a partial one, its first `tail_tokens` tokens only (a
    turn that ended mid-block, `tail_key`). Its key comes from the registered tokens, so a caller
    can address the partial tail of an earlier turn whose history this one continues, never a
    tail of tokens the session does not hold."""
    if tail_tokens:
        block_size = record.blocks.block_size
        last = first_block + count - 1
        start = last * block_size
        if (
            not 0 < tail_tokens < block_size
            or count < 1
            or last > record.blocks.num_blocks
            or start + tail_tokens > len(record.token_ids)
        ):
            raise InvalidRequest(f"no partial block of {tail_tokens} tokens at block {last} of the session")
        parent = record.blocks.block_keys[last - 1] if last else tenant_root(record.blocks.model, record.blocks.tenant)
        keys = (
            *record.blocks.block_keys[first_block:last],
            tail_key(parent, record.token_ids[start : start + tail_tokens]),
        )
    else:
        keys = record.blocks.block_keys[first_block : first_block + count]
    if last_key is not None and keys and keys[-1] != last_key:
        raise HistoryChanged(f"session {record.key[1]!r} holds another history at block {first_block + count - 1}")
    return keys
