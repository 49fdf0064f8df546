"""vLLM's KV events as Symphony block keys: which blocks the engine's own prefix cache holds.

vLLM (`--kv-events-config`) publishes one `KVEventBatch` per engine step that changed its prefix
cache: `BlockStored` (full blocks just cached: their vLLM hashes, the parent's hash, their token ids),
`BlockRemoved` (evicted hashes) and `AllBlocksCleared` (`/reset_prefix_cache`; vLLM queues it with
the events of its next engine step, so an idle engine reports a reset with its next request's
blocks, just before them). Hashes are the first 64 bits of vLLM's sha256 block hashes, as ints
(`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, on by default in 0.32), or the 32 bytes. `EngineEventKeys`
turns each batch into `emit(kind, keys)` calls, kind "stored", "removed" or "cleared", keys being
Symphony's chained block keys (`symphony.kv_addressing.block_key`, rooted in
`tenant_root(model, tenant)`), so the engine's cache can sit in the cluster's KV index beside the
node's tiers.

How a block gets its key. vLLM's hashes chain like Symphony's keys but over other bytes (and vLLM's
`cache_salt`), so they cannot be converted, only followed: the translation keeps a bounded map vLLM
hash -> key. A chain's first block (no parent) carries the request's `cache_salt` in its
`extra_keys`; the scheduler sets it to `engine_cache_salt(tenant)` (`symphony.tenancy`), and
`TenantSalts` finds the tenant whose salt it is among the tenants the node knows. Every later block
is `block_key(parent's key, its block_size token ids)`; a BlockStored of several blocks holds
block_size ids per block, in order.

What is not translated, counted per reason (`DropCounter`) and never guessed: a salt of no known
tenant (a client's own salt, or a tenant not seen yet: its blocks are dropped, and so are their
children, whose parent is then unknown), blocks with other extra keys (LoRA, multimodal inputs,
prompt embeddings: not what Symphony's token keys name), another block size, another medium than
vLLM's own cache ("GPU", also on CPU: offloading tiers report "CPU" or "STORAGE") and other KV cache
groups than the first.

Invariant: every key emitted "stored" and not since "removed" or "cleared" is in the map (the
consumer's view of the engine tier is at most the map). vLLM may cache one hash in two physical
blocks (two requests that computed it in one step), and reports each copy stored and removed, so
the map counts copies: a key is "stored" when its first copy comes and "removed" when its last goes.
When the map is full the least recently used entry is forgotten and reported "removed": the view
then under-reports the engine's cache, never over-reports it. Lost events (a gap in vLLM's sequence
numbers, an undecodable batch, an engine restart) empty the map and emit "cleared".

Wire schema. The structs below mirror vLLM 0.32's (`vllm.distributed.kv_events`): importing vLLM
in the node manager costs ~5 s and ~300 MiB per node (it pulls in its whole config and torch
stack) for three structs. tests/unit/test_engine_event_keys.py encodes batches with vLLM's own
classes and decodes them with these, and checks the field names, so a vLLM upgrade that changes
the wire fails there. Fields vLLM adds later are ignored (msgspec skips unknown map keys and
trailing array items).

Threads: `EngineEventKeys` and `TenantSalts` are used by one thread (the subscriber's); `emit` runs
on it. The tenant source is read from it too, so it must be thread-safe (`SessionRegistry` is).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import msgspec

from symphony.kv_addressing import BlockKey, ModelFingerprint, block_key, tenant_root
from symphony.logs import get_logger
from symphony.tenancy import DEFAULT_TENANT, engine_cache_salt

log = get_logger(__name__)

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
Emit = Callable[[str, Sequence[BlockKey]], None]
ENGINE_MEDIUM = "GPU"  # vLLM's name for its own KV cache, whatever the device (`MEDIUM_GPU`)
MAX_TENANTS = 65_536  # salts remembered (least recently used beyond): far more tenants than one node serves
VllmHash = bytes | int  # sha256 bytes; a 64-bit int under VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES


# ---- vLLM 0.32's wire format (see the module docstring) -----------------------------------------
class _Event(msgspec.Struct, tag=True):  # tagged by class name, like vLLM's KVCacheEvent
    pass


class BlockStored(_Event):
    block_hashes: list[VllmHash]
    parent_block_hash: VllmHash | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # per block; the salt: (salt,) on a chain's first
    group_idx: int | None = None


class BlockRemoved(_Event):
    block_hashes: list[VllmHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


# ---- tenants -------------------------------------------------------------------------------------
class TenantSource(Protocol):
    """The tenants the node has seen (`node_manager.kv.sessions.SessionRegistry`). Thread-safe."""

    def tenant_generation(self) -> int: ...  # changes whenever `tenants` gains one

    def tenants(self) -> list[str]: ...


class TenantSalts:
    """Which tenant a `cache_salt` names: `engine_cache_salt(tenant)` of the tenants in `always`
    (kept) and of those `source` reports, these least recently used first, at most `max_tenants`.
    An unknown salt reads the source again if it has gained a tenant since (one integer compare
    otherwise), so a tenant's first blocks are attributed once its session is registered."""

    def __init__(
        self,
        source: TenantSource | None = None,
        always: Iterable[str] = (DEFAULT_TENANT,),
        max_tenants: int = MAX_TENANTS,
        key: bytes = b"",
    ) -> None:
        if max_tenants <= 0:
            raise ValueError("max_tenants must be positive")
        self._key = key  # the cluster's secret, which keys the scheduler's salts
        self._always = {engine_cache_salt(tenant, key=key): tenant for tenant in always}
        self._learned: OrderedDict[str, str] = OrderedDict()
        self._source = source
        self._generation: int | None = None  # the source's, when last read
        self._max = max_tenants

    def learn(self, tenant: str) -> None:
        salt = engine_cache_salt(tenant, key=self._key)
        if salt in self._always:
            return
        self._learned[salt] = tenant
        self._learned.move_to_end(salt)
        while len(self._learned) > self._max:
            self._learned.popitem(last=False)

    def tenant_of(self, salt: str) -> str | None:
        tenant = self._lookup(salt)
        if tenant is None and self._source is not None:
            generation = self._source.tenant_generation()
            if generation != self._generation:
                self._generation = generation
                for name in self._source.tenants():
                    self.learn(name)
                tenant = self._lookup(salt)
        return tenant

    def _lookup(self, salt: str) -> str | None:
        tenant = self._always.get(salt)
        if tenant is None:
            tenant = self._learned.get(salt)
            if tenant is not None:
                self._learned.move_to_end(salt)
        return tenant


# ---- translation ---------------------------------------------------------------------------------
class DropCounter(Protocol):
    """Where counts go (`node_manager.engine_events.EngineEventMetrics`); `dropped(reason, blocks)`:
    blocks not translated; `lost(reason)`: the engine tier's view was lost and emitted "cleared";
    `forgotten(blocks)`: live entries the bounded map let go (reported "removed")."""

    def dropped(self, reason: str, blocks: int) -> None: ...

    def lost(self, reason: str) -> None: ...

    def forgotten(self, blocks: int) -> None: ...


class _Entry:
    __slots__ = ("copies", "key")

    def __init__(self, key: BlockKey) -> None:
        self.key = key
        self.copies = 0  # physical blocks of vLLM's cache under this hash


class EngineEventKeys:
    """Translates one engine's event stream (see the module docstring). Feed it every message in
    order with `feed`; call `reset` when the engine is gone or restarts."""

    def __init__(
        self,
        model: ModelFingerprint,
        block_size: int,
        salts: TenantSalts,
        emit: Emit,
        max_blocks: int,
        counts: DropCounter | None = None,
    ) -> None:
        if block_size <= 0 or max_blocks <= 0:
            raise ValueError("block_size and max_blocks must be positive")
        self._model = model
        self._block_size = block_size
        self._salts = salts
        self._emit = emit
        self._max_blocks = max_blocks
        self._counts = counts
        self._blocks: OrderedDict[VllmHash, _Entry] = OrderedDict()  # least recently used first
        self._next_seq = 0  # a (re)started engine's publisher numbers its batches from 0
        # Consecutive emits of one kind within a batch go out as one call.
        self._run_kind = ""
        self._run: list[BlockKey] = []

    @property
    def live_blocks(self) -> int:
        """Hashes whose keys are held, each emitted "stored" and not since removed."""
        return len(self._blocks)

    def feed(self, seq: int, payload: bytes) -> None:
        """One published message: vLLM's sequence number and its msgpack `KVEventBatch`. A number
        other than the next expected one means batches were lost (a larger one: dropped by ZMQ; a
        smaller one: a new publisher, the engine restarted), and so does an undecodable payload:
        "cleared" first, then this batch's events."""
        if seq != self._next_seq:
            self._lose("gap" if seq > self._next_seq else "restart")
        self._next_seq = seq + 1
        try:
            batch = _DECODER.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("undecodable KV event batch", seq=seq, error=str(exc)[:200])
            self._lose("undecodable")
            return
        self.batch(batch)

    def batch(self, batch: KVEventBatch) -> None:
        """One decoded batch, its events in order (no sequence check)."""
        try:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self._stored(event)
                elif isinstance(event, BlockRemoved):
                    self._removed(event)
                else:
                    self._blocks.clear()
                    self._out(CLEARED, ())
                    self._lost_count("all_blocks_cleared")
        finally:
            self._flush()

    def reset(self, reason: str, restarted: bool = True) -> None:
        """Forget every block and emit "cleared": the engine's cache is gone (it stopped, crashed or
        restarts: `restarted`, the next batch is a new publisher's first, sequence number 0), or
        the view can no longer be trusted (the same engine goes on: its numbering too)."""
        self._run_kind, self._run = "", []  # a run an exception cut short is superseded
        self._lose(reason)
        self._flush()
        if restarted:
            self._next_seq = 0

    # -- events ---------------------------------------------------------------------------------
    def _stored(self, event: BlockStored) -> None:
        hashes = event.block_hashes
        reason = self._unusable(event)
        if reason:
            self._drop(reason, len(hashes))
            return
        parent_key = self._parent_key(event)
        if parent_key is None:
            return  # dropped and counted
        bs = self._block_size
        extra = event.extra_keys or ()
        salted = event.parent_block_hash is None  # the first block's extra keys are its salt (`_parent_key`)
        for i, vllm_hash in enumerate(hashes):
            if i < len(extra) and extra[i] is not None and not (i == 0 and salted):
                self._drop("extra_keys", len(hashes) - i)  # this block and its children are not token-keyed
                return
            entry = self._blocks.get(vllm_hash)
            if entry is None:
                entry = _Entry(block_key(parent_key, event.token_ids[i * bs : (i + 1) * bs]))
                self._blocks[vllm_hash] = entry
                self._bound()
            else:
                self._blocks.move_to_end(vllm_hash)
            entry.copies += 1
            if entry.copies == 1:
                self._out(STORED, (entry.key,))
            parent_key = entry.key

    def _unusable(self, event: BlockStored) -> str:
        """Why no block of `event` can be translated, "" if they can be."""
        if event.medium != ENGINE_MEDIUM:
            return "other_medium"
        if event.group_idx not in (None, 0):
            return "other_group"
        if event.block_size != self._block_size:
            return "block_size"
        if len(event.token_ids) != self._block_size * len(event.block_hashes):
            return "malformed"
        if event.lora_name is not None:
            return "lora"
        return ""

    def _parent_key(self, event: BlockStored) -> BlockKey | None:
        """The key the event's first block chains from: its parent's, or its tenant's root for a
        chain's first block; None (counted) when neither is known."""
        blocks = len(event.block_hashes)
        if event.parent_block_hash is not None:
            parent = self._blocks.get(event.parent_block_hash)
            if parent is None:
                self._drop("unknown_parent", blocks)
                return None
            self._blocks.move_to_end(event.parent_block_hash)
            return parent.key
        first = event.extra_keys[0] if event.extra_keys else None
        if first is None:
            self._drop("no_salt", blocks)  # a request sent to the engine without a cache_salt
            return None
        if len(first) != 1 or not isinstance(first[0], str):
            self._drop("extra_keys", blocks)
            return None
        tenant = self._salts.tenant_of(first[0])
        if tenant is None:
            self._drop("unknown_salt", blocks)
            return None
        return tenant_root(self._model, tenant)

    def _removed(self, event: BlockRemoved) -> None:
        if event.medium != ENGINE_MEDIUM or event.group_idx not in (None, 0):
            self._drop("other_medium" if event.medium != ENGINE_MEDIUM else "other_group", len(event.block_hashes))
            return
        for vllm_hash in event.block_hashes:
            entry = self._blocks.get(vllm_hash)
            if entry is None:
                continue  # a block never translated (dropped when stored), or one already forgotten
            entry.copies -= 1
            if entry.copies <= 0:
                del self._blocks[vllm_hash]
                self._out(REMOVED, (entry.key,))

    # -- bookkeeping ----------------------------------------------------------------------------
    def _bound(self) -> None:
        forgotten = 0
        while len(self._blocks) > self._max_blocks:
            _, entry = self._blocks.popitem(last=False)
            self._out(REMOVED, (entry.key,))
            forgotten += 1
        if forgotten and self._counts is not None:
            self._counts.forgotten(forgotten)

    def _lose(self, reason: str) -> None:
        self._blocks.clear()
        self._out(CLEARED, ())
        self._lost_count(reason)

    def _lost_count(self, reason: str) -> None:
        if self._counts is not None:
            self._counts.lost(reason)

    def _drop(self, reason: str, blocks: int) -> None:
        if self._counts is not None:
            self._counts.dropped(reason, blocks)

    def _out(self, kind: str, keys: Iterable[BlockKey]) -> None:
        if kind != self._run_kind or kind == CLEARED:
            self._flush()
            self._run_kind = kind
        self._run.extend(keys)
        if kind == CLEARED:
            self._flush()

    def _flush(self) -> None:
        kind, keys = self._run_kind, self._run
        self._run_kind, self._run = "", []
        if kind:
            self._emit(kind, keys)
