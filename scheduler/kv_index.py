"""The scheduler's cluster KV index: which nodes hold which blocks, in which tiers, learned from the
nodes' block event streams (`KVStore.WatchBlocks`, proto/symphony/v1/kv.proto). Pure: no I/O, no
clocks (callers pass times in), no protobuf (`scheduler.kv_watch` converts batches to `BlockBatch`).

A lookup is per tenant and model without saying so: block keys are sha256 chains rooted in the
model fingerprint and the tenant (`symphony.kv_addressing`), so the keys of one tenant's prompt
under one model never name another tenant's or model's blocks. A node that serves another model
simply never matches.

Per node, the stream's contract (BlockEventBatch's comment in kv.proto) is applied as a small state
machine, `apply`:
- a batch with snapshot_begin replaces what the index knew of the node (its entries are cleared,
  lazily, O(1)); the node is RESYNCING until the batch with snapshot_end, whose seq the live
  batches continue from. A snapshot under another epoch than the one known means the node restarted.
- a live batch must carry seq = last + 1 of the same epoch; a heartbeat (no events, not a snapshot)
  must carry seq = last. Anything else (a seq jump, a heartbeat ahead, a seq going back, another
  epoch without a snapshot) is a gap: the node becomes RESYNCING and `apply` answers RESYNC, and the
  caller must resubscribe with `resume_point` (empty: a snapshot). The node's entries stay (mostly
  right) until that snapshot replaces them; `synced` is False meanwhile, so routing must not use them.
Storage, LRU bound, lazy clears and the collision odds of its 8-byte keys: `scheduler.kv_table`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum, IntEnum, StrEnum
from typing import NamedTuple

import numpy as np

from scheduler.kv_table import EVICT_FRACTION, NUM_TIERS, TICK_LIMIT, BlockTable, index_keys
from symphony.kv_addressing import BlockKey

MAX_NODES = 64  # node slots: bits of the table's masks


class IndexTier(IntEnum):
    """Tiers, fastest first (the table's mask columns)."""

    ENGINE = 0  # vLLM's own prefix cache: no load at all
    HBM = 1
    DRAM = 2
    SSD = 3


class EventKind(Enum):
    STORED = "stored"  # the node holds the blocks in the tier now
    REMOVED = "removed"  # the node no longer holds the blocks in the tier
    CLEARED = "cleared"  # the node holds nothing in the tier (no keys)


class SyncState(StrEnum):
    NO_EVENTS = "no_events"  # nothing applied yet
    RESYNCING = "resyncing"  # a snapshot is under way, or a gap was seen and one is needed
    SYNCED = "synced"  # a snapshot and every live batch after it, in order


@dataclass(frozen=True, slots=True)
class BlockEvent:
    kind: EventKind
    tier: IndexTier
    keys: bytes = b""  # 32-byte block keys back to back


@dataclass(frozen=True, slots=True)
class BlockBatch:
    """One BlockEventBatch, as the index takes it."""

    epoch: str
    seq: int
    events: tuple[BlockEvent, ...] = ()
    snapshot_begin: bool = False
    snapshot_end: bool = False
    published_unix_ms: int = 0


class Outcome(Enum):
    APPLIED = "applied"  # applied (or a heartbeat in step)
    RESYNC = "resync"  # out of sync: resubscribe from `resume_point`


@dataclass(frozen=True, slots=True)
class Applied:
    outcome: Outcome
    reason: str = ""  # RESYNC: gap, heartbeat_ahead, out_of_order, epoch, snapshot_end, malformed
    evicted: int = 0  # blocks evicted for room while applying
    blocks: tuple[tuple[EventKind, IndexTier, int], ...] = ()  # block keys applied per event
    snapshot_done: bool = False  # the batch ended a snapshot
    resynced: str = ""  # a snapshot began while SYNCED: "restart" (new epoch) or "expired" (seq gone)


# How long a sample of where the index's blocks sit is reused (fastest_tiers): a sample costs ~0.5 ms
# at 1M blocks and ~2.4 ms at 10M, and each entry of the global layer reads /summary every ~100 ms.
SAMPLE_MAX_AGE_S = 1.0


class NodePrefix(NamedTuple):
    """How much of a chain of block keys one node holds: `blocks` leading blocks (contiguous from
    the first), of which `engine`, `hbm`, `dram` and `ssd` have that tier as their fastest there.
    (A named tuple: built for every holder on every lookup, ~3x cheaper than a frozen dataclass.)"""

    blocks: int
    engine: int = 0
    hbm: int = 0
    dram: int = 0
    ssd: int = 0


@dataclass(slots=True)
class NodeSync:
    """One node's stream state, as the index has applied it."""

    node_id: str
    slot: int
    state: SyncState = SyncState.NO_EVENTS
    epoch: str = ""
    seq: int = 0  # the last live batch applied (or the snapshot's seq)
    in_snapshot: bool = False
    last_event_s: float | None = None  # caller's clock when the last batch was applied
    lag_ms: float = 0.0  # arrival - published_unix_ms of the last batch (clocks of two hosts)
    events_applied: int = 0  # block events applied (snapshot ones included)
    batches_applied: int = 0
    resyncs: int = 0  # gaps seen, snapshots forced on a synced node, snapshots cut short
    restarts: int = 0  # snapshots under a new epoch after one was known
    last_resync_reason: str = ""
    reasons: dict[str, int] = field(default_factory=dict)


class ClusterKVIndex:
    """Block key -> the nodes holding it and their tiers; bounded by `max_blocks` (LRU)."""

    def __init__(
        self,
        max_blocks: int,
        max_nodes: int = MAX_NODES,
        *,
        evict_fraction: float = EVICT_FRACTION,
        tick_limit: int = TICK_LIMIT,
    ) -> None:
        self.table = BlockTable(max_blocks, max_nodes, evict_fraction=evict_fraction, tick_limit=tick_limit)
        self.max_nodes = max_nodes
        self._nodes: dict[str, NodeSync] = {}
        self._ids: list[str] = []  # node id by slot ("" for a slot freed by remove_node)
        self._free_slots: list[int] = []  # slots of removed nodes, reused first
        self._samples = 0  # samples taken by fastest_tiers: each takes other buckets
        # (when, (generation, slots), mix) of the last sample; the generation counts nodes added and removed
        self._sample: tuple[float, tuple[int, tuple[int, ...]], NodePrefix] = (0.0, (0, ()), NodePrefix(0))
        self._generation = 0

    # -- nodes ------------------------------------------------------------------------------------
    def add_node(self, node_id: str) -> NodeSync:
        """Give `node_id` a slot (idempotent): one a removed node freed, else a new one. Raises
        ValueError past `max_nodes` nodes at once."""
        if node_id in self._nodes:
            return self._nodes[node_id]
        if self._free_slots:
            slot = self._free_slots.pop()
            self._ids[slot] = node_id
        elif len(self._ids) < self.max_nodes:
            slot = len(self._ids)
            self._ids.append(node_id)
        else:
            raise ValueError(f"the index has room for {self.max_nodes} nodes")
        node = NodeSync(node_id, slot)
        self._nodes[node_id] = node
        self._generation += 1
        return node

    def remove_node(self, node_id: str) -> None:
        """The node left the cluster: forget what it holds (lazily, O(1), as `drop_node`) and free
        its slot for the next node added. A later add of the same id starts from a snapshot."""
        node = self._nodes.pop(node_id, None)
        if node is None:
            return
        self.table.clear(node.slot, list(IndexTier))
        self._ids[node.slot] = ""
        self._free_slots.append(node.slot)
        self._generation += 1

    def rename_node(self, old: str, new: str) -> None:
        """The node `old` is called `new` now (its manager reported its name); its entries stay."""
        if old == new:
            return
        if new in self._nodes:
            raise ValueError(f"node {new!r} is in the index already")
        node = self._nodes.pop(old)
        node.node_id = new
        self._nodes[new] = node
        self._ids[node.slot] = new

    def node(self, node_id: str) -> NodeSync:
        return self._nodes[node_id]

    @property
    def node_ids(self) -> list[str]:
        return [node_id for node_id in self._ids if node_id]

    def synced(self, node_id: str) -> bool:
        node = self._nodes.get(node_id)
        return node is not None and node.state is SyncState.SYNCED

    def resume_point(self, node_id: str) -> tuple[str, int]:
        """WatchBlocksRequest (epoch, after_seq) to resubscribe with: where the node left off when
        synced, else ("", 0), which makes the node start with a snapshot."""
        node = self._nodes[node_id]
        return (node.epoch, node.seq) if node.state is SyncState.SYNCED else ("", 0)

    def stream_lost(self, node_id: str) -> str:
        """The node's stream ended. A snapshot it cut short must be taken again: the node becomes
        RESYNCING and the reason ("snapshot_cut") is returned; a synced node resumes where it was
        (""): its entries stay, though the caller must treat them as stale until it does."""
        node = self._nodes[node_id]
        if node.in_snapshot:
            self._out_of_sync(node, "snapshot_cut")
            return "snapshot_cut"
        return ""

    def drop_node(self, node_id: str, reason: str) -> None:
        """Forget what the node holds (lazily, O(1)) and require a snapshot: its batches were refused
        (another model) or it is no longer watched."""
        node = self._nodes[node_id]
        self.table.clear(node.slot, list(IndexTier))
        self._out_of_sync(node, reason)

    # -- applying a node's batches ----------------------------------------------------------------
    def apply(self, node_id: str, batch: BlockBatch, *, now_s: float, now_unix_ms: int) -> Applied:
        """Apply one batch of `node_id`'s stream; times are the caller's (monotonic seconds for the
        node's last event, Unix ms for its lag). RESYNC: nothing of the batch was applied."""
        node = self._nodes[node_id]
        resynced = ""
        if batch.snapshot_begin:
            if node.state is SyncState.SYNCED:  # we asked to resume; the node answered with a snapshot
                resynced = "restart" if batch.epoch != node.epoch else "expired"
                self._count_resync(node, resynced)
            if node.epoch and batch.epoch != node.epoch:
                node.restarts += 1
            self.table.clear(node.slot, list(IndexTier))
            node.epoch, node.in_snapshot, node.state = batch.epoch, True, SyncState.RESYNCING
        elif node.in_snapshot:
            if batch.epoch != node.epoch:
                return self._resync(node, "epoch")
        elif batch.snapshot_end:
            return self._resync(node, "snapshot_end")  # an end with no beginning
        elif node.state is not SyncState.SYNCED:
            return self._resync(node, "not_synced")
        elif batch.epoch != node.epoch:
            return self._resync(node, "epoch")
        elif not batch.events:  # a heartbeat: seq = the last live batch's
            if batch.seq != node.seq:
                return self._resync(node, "heartbeat_ahead" if batch.seq > node.seq else "out_of_order")
        elif batch.seq != node.seq + 1:
            return self._resync(node, "gap" if batch.seq > node.seq else "out_of_order")
        try:
            evicted, blocks = self._apply_events(node, batch.events)
        except ValueError:  # a key that is not 32 bytes: the stream cannot be trusted
            return self._resync(node, "malformed")
        done = batch.snapshot_end and node.in_snapshot
        if done:
            node.in_snapshot, node.state = False, SyncState.SYNCED
        if not node.in_snapshot:
            node.seq = batch.seq
        node.last_event_s = now_s
        node.lag_ms = float(now_unix_ms - batch.published_unix_ms)
        node.batches_applied += 1
        node.events_applied += len(batch.events)
        self.table.sweep_step()
        return Applied(Outcome.APPLIED, evicted=evicted, blocks=blocks, snapshot_done=done, resynced=resynced)

    def _apply_events(
        self, node: NodeSync, events: Sequence[BlockEvent]
    ) -> tuple[int, tuple[tuple[EventKind, IndexTier, int], ...]]:
        keys = [index_keys(e.keys) for e in events]  # every key checked before any is applied
        evicted = 0
        blocks = []
        for event, event_keys in zip(events, keys, strict=True):
            if event.kind is EventKind.STORED:
                evicted += self.table.store(event_keys, node.slot, event.tier)
            elif event.kind is EventKind.REMOVED:
                self.table.remove(event_keys, node.slot, event.tier)
            else:
                self.table.clear(node.slot, [event.tier])
            blocks.append((event.kind, event.tier, len(event_keys)))
        return evicted, tuple(blocks)

    def _resync(self, node: NodeSync, reason: str) -> Applied:
        self._out_of_sync(node, reason)
        return Applied(Outcome.RESYNC, reason=reason)

    def _out_of_sync(self, node: NodeSync, reason: str) -> None:
        node.state, node.in_snapshot = SyncState.RESYNCING, False
        self._count_resync(node, reason)

    @staticmethod
    def _count_resync(node: NodeSync, reason: str) -> None:
        node.resyncs += 1
        node.last_resync_reason = reason
        node.reasons[reason] = node.reasons.get(reason, 0) + 1

    # -- lookups ----------------------------------------------------------------------------------
    def prefix(self, keys: Sequence[BlockKey]) -> dict[str, NodePrefix]:
        """Per node holding the first of `keys` (a chain, first block first): how many leading blocks
        it holds and in which fastest tiers. Nodes holding none are absent. Stamps the blocks some
        node holds (LRU). Says nothing of sync: callers check `synced` (or use KVWatch.prefix)."""
        if not keys:
            return {}
        counts = self.table.prefix_counts(index_keys(b"".join(keys)))
        if counts is None:
            return {}
        counts = counts[:, : len(self._ids)]
        totals = counts.sum(axis=0)
        holders = np.flatnonzero(totals)
        ids = self._ids
        make = NodePrefix._make
        # One conversion to Python ints for all the holders, not one per node: rows (blocks, tiers...).
        rows = np.concatenate((totals[None, holders], counts[:, holders])).T.tolist()
        return {ids[slot]: make(row) for slot, row in zip(holders.tolist(), rows, strict=True)}

    def fastest_tiers(self, node_ids: Iterable[str], now_s: float, max_age_s: float = SAMPLE_MAX_AGE_S) -> NodePrefix:
        """Where the blocks of `node_ids` sit, from a sample of the index (`BlockTable.fastest_sample`,
        a different one each time): `engine`, `hbm`, `dram`, `ssd` are sampled blocks with that
        tier as their fastest on one of those nodes (a block two of them hold counts twice),
        `blocks` their sum. Unknown nodes are skipped. The table is sampled again once the last
        sample is `max_age_s` old (by the caller's clock `now_s`) or the nodes differ."""
        slots = tuple(self._nodes[n].slot for n in node_ids if n in self._nodes)
        key = (self._generation, slots)  # a slot another node took since is another sample
        taken_s, sampled, mix = self._sample
        if sampled != key or not 0 <= now_s - taken_s < max_age_s:
            self._samples += 1
            counts = self.table.fastest_sample(offset=self._samples)[:, list(slots)].sum(axis=1).tolist()
            mix = NodePrefix(sum(counts), *counts)
            self._sample = (now_s, key, mix)
        return mix

    def tier_blocks(self, node_id: str) -> dict[str, int]:
        """Blocks the node holds per tier, as the index knows them."""
        slot = self._nodes[node_id].slot
        return {tier.name.lower(): int(self.table.tier_counts[tier, slot]) for tier in IndexTier}

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def blocks(self) -> int:
        """Entries held (at most max_blocks); lazily cleared ones count until swept or touched."""
        return self.table.count

    @property
    def evictions(self) -> int:
        return self.table.evictions + self.table.conflict_evictions

    def approx_bytes(self) -> int:
        """The table's arrays plus ~600 bytes of state per node."""
        return self.table.approx_bytes() + 600 * len(self._nodes)

    def describe(self, node_id: str, now_s: float) -> dict[str, object]:
        """The node's index state for /readyz and `symphony status`."""
        node = self._nodes[node_id]
        return {
            "state": str(node.state),
            "epoch": node.epoch,
            "seq": node.seq,
            "last_event_age_s": None if node.last_event_s is None else round(now_s - node.last_event_s, 3),
            "lag_ms": round(node.lag_ms, 1),
            "events_applied": node.events_applied,
            "resyncs": node.resyncs,
            "restarts": node.restarts,
            "last_resync_reason": node.last_resync_reason,
            "blocks": self.tier_blocks(node_id),
        }


assert len(IndexTier) == NUM_TIERS
