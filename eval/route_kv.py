"""The cluster KV index that `symphony bench route` prices policies that locate KV with
(`PolicyTraits.locates_kv`): the scheduler's own `ClusterKVIndex` and `KVLocator`, fed as the
scheduler feeds them.

Token ids are synthetic (`Streams`): tokenization is excluded from the bench, as it is from the
decision it times. A session's prompt is its tenant's system prompt (shared by every session of the
tenant, so its blocks have the same keys in all of them), the history the session had when the bench
began, then one message (an answer and a question, 64-511 tokens) per turn routed since: each prompt
extends the last, as a chat's does. The histories are sized so that the index holds `index_blocks`
distinct blocks once populated: the tenants' system prompts plus each session's own blocks.

Population (`FleetIndex.populate`) is what each node's block event stream delivers to a scheduler
that subscribes: a snapshot of everything the node holds, cut into batches of `batch_entries` by the
node manager's own code (`node_manager.kv.block_watch.chunk_snapshot`), turned into the protobuf
messages the node sends and back into the index's batches as `scheduler.kv_watch` does, and applied
in order. What a node holds: the system prompts of the tenants whose sessions it hosts (engine
cache and DRAM), and for each session homed there its history, in SSD, and for the more recent ones
in DRAM (40%), the engine's cache (10%) and the store's HBM pool (2%); 10% of the sessions have a
copy in another node's DRAM (a pull or a prefetch brought it). After every routed turn the chosen
node reports the prompt's blocks stored in its engine cache and DRAM, in a live batch.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from node_manager.kv.block_events import TIER_ENGINE, BlockEventSettings, EventBatch
from node_manager.kv.block_watch import StreamHeader, chunk_snapshot, to_proto
from scheduler.kv_index import ClusterKVIndex, Outcome
from scheduler.kv_locator import KVLocator, apply_located
from scheduler.kv_watch import to_batch
from scheduler.routing import NodeSnapshot, RouteRequest
from symphony.kv_addressing import BlockKey, ModelFingerprint, keys_after
from symphony.rpc import kv_pb2

FINGERPRINT = ModelFingerprint(bytes(32))  # every simulated node serves one model
SYSTEM_TOKENS = (256, 2048)  # a tenant's system prompt: uniform in [low, high)
MESSAGE_TOKENS = (64, 512)  # what a turn adds (the answer, then the next question)
OWN_BLOCKS_SPREAD = 0.5  # a session's own history: its mean share of blocks, +-50%
VOCABULARY = 50_000
# Shares of a node's sessions (by recency) whose history a tier holds, fastest first; SSD holds all.
IN_HBM, IN_ENGINE, IN_DRAM = 0.02, 0.10, 0.40
COPIED = 0.10  # sessions with a copy in another node's DRAM


class Streams:
    """Each session's prompt, turn by turn, as synthetic token ids; deterministic for a seed."""

    def __init__(
        self, *, sessions: int, tenants: int, nodes: int, index_blocks: int, block_size: int, seed: int = 0
    ) -> None:
        self.sessions, self.tenants, self.nodes, self.block_size, self.seed = sessions, tenants, nodes, block_size, seed
        rng = np.random.default_rng((seed, 0))
        self.system = [
            _read_only(rng.integers(1, VOCABULARY, int(rng.integers(*SYSTEM_TOKENS)), dtype="<u4"))
            for _ in range(tenants)
        ]
        system_blocks = sum(len(ids) // block_size for ids in self.system)
        own_total = max(0, index_blocks - system_blocks)
        mean = own_total / sessions
        own = rng.integers(int(mean * (1 - OWN_BLOCKS_SPREAD)), int(mean * (1 + OWN_BLOCKS_SPREAD)) + 1, sessions)
        own += (own_total - int(own.sum())) // sessions  # the sum made exact: index_blocks in all
        own[: (own_total - int(own.sum())) % sessions] += 1
        self.own_blocks = np.maximum(own, 0)
        # History tokens: the own blocks in full, then a partial block (never completing one more).
        remainder = np.array([len(ids) % block_size for ids in self.system])[np.arange(sessions) % tenants]
        self.history = self.own_blocks * block_size + rng.integers(0, block_size - remainder)
        self.home = rng.integers(0, nodes, sessions)  # the node that served the session last
        self.recency = rng.random(sessions)  # its place in its node's tiers: 0 the most recent
        copy = (self.home + rng.integers(1, max(2, nodes), sessions)) % nodes
        self.copy = np.where((rng.random(sessions) < COPIED) & (nodes > 1), copy, -1)

    @property
    def blocks(self) -> int:
        """Distinct blocks the histories and system prompts hold: what population indexes."""
        return sum(len(ids) // self.block_size for ids in self.system) + int(self.own_blocks.sum())

    def tenant_of(self, session: int) -> int:
        return session % self.tenants

    def tenant(self, session: int) -> str:
        return f"tenant-{self.tenant_of(session)}"

    def _messages(self, session: int, turn: int) -> list[int]:
        """The lengths of the messages of turns 0..turn."""
        rng = np.random.default_rng((self.seed, 2, session))
        return rng.integers(*MESSAGE_TOKENS, turn + 1).tolist()

    def tokens(self, session: int, turn: int) -> int:
        """The prompt's length in tokens at `turn` (0: the first turn the bench routes)."""
        system = len(self.system[self.tenant_of(session)])
        return system + int(self.history[session]) + sum(self._messages(session, turn))

    def ids(self, session: int, turn: int) -> np.ndarray:
        """The prompt's token ids at `turn`; read-only '<u4', like the tokenizer's."""
        system = self.system[self.tenant_of(session)]
        own = self.tokens(session, turn) - len(system)
        rng = np.random.default_rng((self.seed, 1, session))
        return _read_only(np.concatenate((system, rng.integers(1, VOCABULARY, own, "<u4"))))

    def history_ids(self, session: int) -> np.ndarray:
        """The session's tokens when the bench began (what the nodes hold blocks of)."""
        ids = self.ids(session, 0)
        return ids[: len(self.system[self.tenant_of(session)]) + int(self.history[session])]


def _read_only(ids: np.ndarray) -> np.ndarray:
    ids.flags.writeable = False
    return ids


@dataclass(frozen=True, slots=True)
class Population:
    blocks: int  # index entries after population
    seconds: float
    batches: int  # snapshot batches applied
    block_events: int  # (block, tier) entries the snapshots carried, all nodes together


def node_ids(nodes: int) -> list[str]:
    return [f"node-{i}" for i in range(nodes)]


def cluster_index(nodes: int, max_blocks: int) -> ClusterKVIndex:
    """The index as the scheduler builds it (`SchedulerState`), its nodes added."""
    index = ClusterKVIndex(max_blocks, max(1, nodes))
    for node_id in node_ids(nodes):
        index.add_node(node_id)
    return index


class FleetIndex:
    """The scheduler's cluster KV index (`cluster_index`) over `streams.nodes` nodes, fed their block
    event streams."""

    def __init__(self, streams: Streams, index: ClusterKVIndex, *, batch_entries: int | None = None) -> None:
        self.streams = streams
        self.index = index
        self.node_ids = node_ids(streams.nodes)
        if index.node_ids != self.node_ids:
            raise ValueError("the index's nodes are not the streams' (see cluster_index)")
        self.batch_entries = batch_entries or BlockEventSettings().batch_entries
        self._seq = dict.fromkeys(self.node_ids, 0)
        self._system_keys = [
            list(keys_after(FINGERPRINT, f"tenant-{t}", ids, streams.block_size, ()))
            for t, ids in enumerate(streams.system)
        ]
        self.live_batches = 0

    # -- what the scheduler asks (SchedulerState.kv_holders, kv_synced) ----------------------------
    def locator(self, max_sessions: int, max_donor_blocks: int) -> KVLocator:
        return KVLocator(self.index.prefix, self.index.synced, max_sessions, max_donor_blocks)

    @staticmethod
    def locate(
        locator: KVLocator,
        request: RouteRequest,
        ids: np.ndarray,
        nodes: Sequence[NodeSnapshot],
        block_size: int,
        copies_of: Callable[[str], Mapping[str, int]],
    ) -> RouteRequest:
        """`RequestLocator.locate` once the request's token ids are known: per available node, the
        prefix the index says it holds (and one an earlier request is computing there), and the
        session a pull of a shared prefix would name (`copies_of(session id)`: the session table's
        copies of it)."""
        located = locator.locate(
            request.tenant,
            request.session_id,
            ids,
            FINGERPRINT,
            block_size,
            [n.node_id for n in nodes if n.available],
            request.kv_tokens,
        )
        return apply_located(request, located, copies_of)

    # -- what the nodes send ----------------------------------------------------------------------
    def populate(self, progress: tqdm | None = None) -> Population:
        """Every node's snapshot, node after node, as its stream would deliver it."""
        started = time.perf_counter()
        streams = self.streams
        by_home = np.argsort(streams.home, kind="stable")
        homes = streams.home[by_home]
        copied = np.flatnonzero(streams.copy >= 0)
        copies = copied[np.argsort(streams.copy[copied], kind="stable")]
        copy_nodes = streams.copy[copies]
        batches = events = 0
        for node, node_id in enumerate(self.node_ids):
            hosted = by_home[np.searchsorted(homes, node) : np.searchsorted(homes, node, side="right")]
            held: dict[int, list[BlockKey]] = {kv_pb2.TIER_ENGINE: [], kv_pb2.TIER_HBM: [], kv_pb2.TIER_DRAM: []}
            held[kv_pb2.TIER_SSD] = []
            for tenant in sorted({streams.tenant_of(int(s)) for s in hosted}):
                held[TIER_ENGINE] += self._system_keys[tenant]
                held[kv_pb2.TIER_DRAM] += self._system_keys[tenant]
            rank = np.argsort(np.argsort(streams.recency[hosted])) / max(1, len(hosted))
            for session, place in zip(hosted.tolist(), rank.tolist(), strict=True):
                own = self._own_keys(session)
                held[kv_pb2.TIER_SSD] += own
                for tier, share in ((kv_pb2.TIER_HBM, IN_HBM), (TIER_ENGINE, IN_ENGINE), (kv_pb2.TIER_DRAM, IN_DRAM)):
                    if place < share:
                        held[tier] += own
            lo, hi = np.searchsorted(copy_nodes, node), np.searchsorted(copy_nodes, node, side="right")
            for session in copies[lo:hi].tolist():
                held[kv_pb2.TIER_DRAM] += self._own_keys(session)
            before = self.index.blocks
            snapshot = chunk_snapshot(self._seq[node_id], [(t, k) for t, k in held.items() if k], self.batch_entries)
            for batch in snapshot:
                self._apply(node_id, batch)
            batches += len(snapshot)
            events += sum(len(keys) for keys in held.values())
            if progress is not None:
                progress.update(self.index.blocks - before)
        return Population(self.index.blocks, time.perf_counter() - started, batches, events)

    def served(self, node_id: str, keys: Sequence[BlockKey]) -> None:
        """The node served a prompt whose full blocks are `keys`: its engine cache and its DRAM hold
        them now (the connector saves every block it computes), in live batches."""
        if not keys:
            return
        held = [(TIER_ENGINE, list(keys)), (kv_pb2.TIER_DRAM, list(keys))]
        for batch in chunk_snapshot(0, held, self.batch_entries):
            self._seq[node_id] += 1
            live = dataclasses.replace(batch, seq=self._seq[node_id], snapshot_begin=False, snapshot_end=False)
            self._apply(node_id, live)
            self.live_batches += 1

    def _own_keys(self, session: int) -> list[BlockKey]:
        known = self._system_keys[self.streams.tenant_of(session)]
        ids = self.streams.history_ids(session)
        return list(keys_after(FINGERPRINT, self.streams.tenant(session), ids, self.streams.block_size, known))

    def _apply(self, node_id: str, batch: EventBatch) -> None:
        header = StreamHeader(node_id, FINGERPRINT, self.streams.block_size, f"epoch-{node_id}")
        message = to_proto(batch, header)
        applied = self.index.apply(
            node_id, to_batch(message), now_s=time.monotonic(), now_unix_ms=time.time_ns() // 1_000_000
        )
        if applied.outcome is not Outcome.APPLIED:  # pragma: no cover - the batches above are in order
            raise RuntimeError(f"{node_id}: batch {batch.seq} not applied ({applied.reason})")
