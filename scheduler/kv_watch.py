"""Feeds the cluster KV index (`scheduler.kv_index`) from every node's block event stream.

One asyncio task per node calls `KVStore.WatchBlocks` on the channel the node monitor opened for
it, converts each BlockEventBatch to the index's `BlockBatch`, applies it, and resubscribes when
the stream ends: from where the index left off (epoch, after_seq) when it is in sync, empty (the
node answers with a snapshot) when it is not. Resubscriptions wait a back-off that doubles from
BACKOFF_INITIAL_S to `backoff_max_s`, reset once a stream has run `timeout_s` without a fault.

Failure modes, each ending the stream and counted in symphony_kv_watch_reconnects{reason}:
- no batch or heartbeat within `timeout_s` (3 of the nodes' 1 s heartbeats by default): "timeout";
- the stream ends or fails: "ended", or the gRPC status ("unavailable", "unimplemented": a node
  manager without block events, retried at the longest back-off);
- the index reports a gap (its reason: "gap", "heartbeat_ahead", ...): resubscribe for a snapshot;
- a batch whose model fingerprint is not the one the node reports in Status: refused, logged, the
  node's entries dropped ("fingerprint"); the node is watched again after the back-off (its Status
  catches up within a poll period when it restarted with another model).

A node is in "fallback" (`synced` False, gauge symphony_kv_index_fallback{node} = 1) unless its
stream is up, has delivered a batch within `timeout_s`, and the index holds it in sync: routing then
uses the session table's hints for it. The dispatcher asks `prefix(keys)`, which answers for synced
nodes only, or the index itself plus `synced(node_id)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from scheduler.kv_index import (
    BlockBatch,
    BlockEvent,
    ClusterKVIndex,
    EventKind,
    IndexTier,
    NodePrefix,
    Outcome,
)
from scheduler.metrics import SchedulerMetrics
from scheduler.node_monitor import NodeMonitor, NodeView
from symphony.kv_addressing import BLOCK_KEY_BYTES, BlockKey
from symphony.logs import get_logger
from symphony.rpc import kv_pb2

log = get_logger(__name__)
STOP_WAIT_S = 1.0  # `stop` cancels a watch task again if it has not ended by then

BACKOFF_INITIAL_S = 0.1
_TIERS = {
    kv_pb2.TIER_ENGINE: IndexTier.ENGINE,
    kv_pb2.TIER_HBM: IndexTier.HBM,
    kv_pb2.TIER_DRAM: IndexTier.DRAM,
    kv_pb2.TIER_SSD: IndexTier.SSD,
}
_KINDS = {
    kv_pb2.BLOCK_EVENT_STORED: EventKind.STORED,
    kv_pb2.BLOCK_EVENT_REMOVED: EventKind.REMOVED,
    kv_pb2.BLOCK_EVENT_CLEARED: EventKind.CLEARED,
}
_REQUESTS_KEPT = 32  # resubscriptions remembered per node (status, tests)


class MalformedBatch(ValueError):
    pass


def to_batch(message: kv_pb2.BlockEventBatch) -> BlockBatch:
    """The index's form of a batch. Events of a kind or tier this scheduler does not know are
    skipped (a newer node's). Raises MalformedBatch when a block key is not 32 bytes."""
    events = []
    for event in message.events:
        kind, tier = _KINDS.get(event.kind), _TIERS.get(event.tier)
        if kind is None or tier is None:
            continue
        keys = b"".join(event.block_keys)
        if len(keys) != BLOCK_KEY_BYTES * len(event.block_keys):
            raise MalformedBatch(f"block keys must be {BLOCK_KEY_BYTES} bytes")
        events.append(BlockEvent(kind, tier, keys))
    return BlockBatch(
        message.epoch,
        message.seq,
        tuple(events),
        message.snapshot_begin,
        message.snapshot_end,
        message.published_unix_ms,
    )


@dataclass
class _Link:
    """One node's stream, as its task sees it."""

    view: NodeView
    node_id: str  # the name the index has for it (the view's, once the node reported it)
    connected: bool = False
    last_batch_s: float = float("-inf")
    snapshot_started_s: float | None = None
    requests: deque[tuple[str, int]] = field(default_factory=lambda: deque(maxlen=_REQUESTS_KEPT))
    reconnects: int = 0
    last_error: str = ""
    task: asyncio.Task[None] | None = None


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel `tasks` and wait for them to end. Bounded per round: on Python 3.11
    `asyncio.wait_for` can swallow a cancel that lands as its read completes (CPython gh-86296),
    and the stream then reads on; cancelled again until it ends."""
    for task in tasks:
        task.cancel()
    while tasks:
        _, pending = await asyncio.wait(tasks, timeout=STOP_WAIT_S)
        for task in pending:
            task.cancel()
        tasks = list(pending)


class KVWatch:
    """The block event streams of the monitor's nodes, applied to `index`."""

    def __init__(
        self,
        monitor: NodeMonitor,
        index: ClusterKVIndex,
        metrics: SchedulerMetrics,
        *,
        timeout_s: float,
        backoff_max_s: float,
        clock: Callable[[], float] = time.monotonic,
        unix_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
    ) -> None:
        self.monitor = monitor
        self.index = index
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.backoff_max_s = backoff_max_s
        self._clock = clock
        self._unix_ms = unix_ms
        self._started = False
        self._links = [_Link(view, view.node_id) for view in monitor.nodes]
        self._by_id = {link.node_id: link for link in self._links}
        for link in self._links:
            index.add_node(link.node_id)
        self.metrics.kv_index_bytes.set(index.approx_bytes())

    # -- what the dispatcher asks -----------------------------------------------------------------
    def synced(self, node_id: str) -> bool:
        """The index's entries for the node are current: its stream is up, delivered a batch within
        `timeout_s`, and every batch since a snapshot was applied in order."""
        link = self._link(node_id)
        return (
            link is not None
            and link.connected
            and self._clock() - link.last_batch_s <= self.timeout_s
            and self.index.synced(link.node_id)
        )

    def prefix(self, keys: Sequence[BlockKey]) -> dict[str, NodePrefix]:
        """`ClusterKVIndex.prefix` for the synced nodes only (the rest are in fallback)."""
        return {node: held for node, held in self.index.prefix(keys).items() if self.synced(node)}

    def describe(self) -> dict[str, dict[str, object]]:
        """Per node, the index's state and the stream's, for /readyz and `symphony status`."""
        now = self._clock()
        self._follow_renames()
        out: dict[str, dict[str, object]] = {}
        for link in self._links:
            detail = self.index.describe(link.node_id, now)
            detail["fallback"] = not self.synced(link.node_id)
            detail["connected"] = link.connected
            detail["reconnects"] = link.reconnects
            detail["last_error"] = link.last_error
            out[link.view.node_id] = detail
        return out

    def requests(self, node_id: str) -> list[tuple[str, int]]:
        """The (epoch, after_seq) of the node's recent subscriptions, oldest first."""
        link = self._link(node_id)
        return list(link.requests) if link is not None else []

    def export_gauges(self) -> None:
        m = self.metrics
        m.kv_index_blocks.set(self.index.blocks)
        m.kv_index_bytes.set(self.index.approx_bytes())
        self._follow_renames()
        for link in self._links:
            if link.view.reported:
                m.kv_index_fallback.labels(link.node_id).set(0 if self.synced(link.node_id) else 1)

    # -- lifecycle --------------------------------------------------------------------------------
    def _begin(self, link: _Link) -> None:
        link.task = asyncio.create_task(self._run(link), name=f"kv-watch-{link.view.address}")

    async def start(self) -> None:
        self._started = True
        for link in self._links:
            self._begin(link)

    async def stop(self) -> None:
        self._started = False
        await _cancel([link.task for link in self._links if link.task is not None])
        for link in self._links:
            link.task, link.connected = None, False

    def add(self, view: NodeView) -> None:
        """Watch a node the monitor joined (at once if the watch runs). ValueError when the index
        has no slot left (the monitor's bound is the index's)."""
        link = _Link(view, view.node_id)
        self.index.add_node(link.node_id)
        self._links.append(link)
        self._by_id[link.node_id] = link
        if self._started:
            self._begin(link)

    async def remove(self, view: NodeView) -> None:
        """Stop watching a node that left (before the monitor closes its channel) and drop what
        the index holds of it, freeing its slot."""
        self._follow_renames()
        link = next((link for link in self._links if link.view is view), None)
        if link is None:
            return
        self._links.remove(link)
        del self._by_id[link.node_id]
        if link.task is not None:
            await _cancel([link.task])
        self.index.remove_node(link.node_id)
        with contextlib.suppress(KeyError):  # no series if it never reported
            self.metrics.kv_index_fallback.remove(link.node_id)

    # -- one node ---------------------------------------------------------------------------------
    def _link(self, node_id: str) -> _Link | None:
        return self._by_id.get(node_id)

    def _follow_renames(self) -> None:
        """Take the names the nodes reported in Status (the views start under their addresses)."""
        for link in self._links:
            name = link.view.node_id
            if name != link.node_id and name not in self._by_id:
                self.index.rename_node(link.node_id, name)
                del self._by_id[link.node_id]
                link.node_id = name
                self._by_id[name] = link

    def _ready(self, link: _Link) -> bool:
        """Whether the node can be watched: its channel is open and it reported its model."""
        self._follow_renames()
        view = link.view
        return view.kv is not None and view.reported and bool(view.model_fingerprint)

    async def _run(self, link: _Link) -> None:
        backoff = BACKOFF_INITIAL_S
        while True:
            if not self._ready(link):
                await asyncio.sleep(self.monitor.poll_interval_s)
                continue
            started = self._clock()
            try:
                reason = await self._stream(link)
            except Exception:  # a bug must not end this node's watch for good
                log.exception("block stream failed", node=link.node_id)
                reason = "error"
            link.connected = False
            link.snapshot_started_s = None
            link.reconnects += 1
            link.last_error = reason
            lost = self.index.stream_lost(link.node_id)
            if lost:
                self.metrics.kv_index_resyncs.labels(lost).inc()
            self.metrics.kv_watch_reconnects.labels(reason).inc()
            if self._clock() - started >= self.timeout_s:
                backoff = BACKOFF_INITIAL_S  # it ran a while: a fresh fault, not a failing node
            wait = self.backoff_max_s if reason == "unimplemented" else min(backoff, self.backoff_max_s)
            await asyncio.sleep(wait)
            backoff = min(backoff * 2, self.backoff_max_s)

    async def _stream(self, link: _Link) -> str:
        """Watch the node until the stream must be replaced; returns why."""
        assert link.view.kv is not None
        epoch, after_seq = self.index.resume_point(link.node_id)
        link.requests.append((epoch, after_seq))
        call = link.view.kv.WatchBlocks(kv_pb2.WatchBlocksRequest(epoch=epoch, after_seq=after_seq))
        try:
            while True:
                try:
                    message = await asyncio.wait_for(call.read(), self.timeout_s)
                except TimeoutError:
                    return "timeout"
                if message is grpc.aio.EOF:
                    return "ended"
                reason = self._on_batch(link, message)
                if reason:
                    return reason
        except grpc.aio.AioRpcError as exc:
            reason = exc.code().name.lower()
            if reason != link.last_error:  # once per run of the same failure: a down node retries quietly
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("node sends no block events; its KV hints come from the session table", node=link.node_id)
                else:
                    log.info("block stream failed", node=link.node_id, error=f"{exc.code().name}: {exc.details()}")
            return reason
        finally:
            call.cancel()

    def _on_batch(self, link: _Link, message: kv_pb2.BlockEventBatch) -> str:
        """Apply one batch; returns a reason to resubscribe, or ""."""
        node_id = link.node_id
        if message.model_fingerprint != link.view.model_fingerprint:
            (log.warning if link.last_error != "fingerprint" else log.debug)(
                "block events of another model refused",
                node=node_id,
                batch_model=message.model_fingerprint.hex()[:12],
                status_model=link.view.model_fingerprint.hex()[:12],
            )
            self.index.drop_node(node_id, "fingerprint")
            self.metrics.kv_index_resyncs.labels("fingerprint").inc()
            return "fingerprint"
        now = self._clock()
        arrival_ms = self._unix_ms()
        try:
            batch = to_batch(message)
        except MalformedBatch as exc:
            log.warning("malformed block event batch", node=node_id, error=str(exc))
            self.index.drop_node(node_id, "malformed")
            self.metrics.kv_index_resyncs.labels("malformed").inc()
            return "malformed"
        link.connected, link.last_batch_s = True, now
        if batch.snapshot_begin:
            link.snapshot_started_s = now
        applied = self.index.apply(node_id, batch, now_s=now, now_unix_ms=arrival_ms)
        applied_at = self._clock()
        if batch.published_unix_ms > 0:
            self.metrics.kv_index_lag.observe(max(0, arrival_ms - batch.published_unix_ms) / 1000)
        if applied.outcome is Outcome.RESYNC:
            log.info("block stream out of sync", node=node_id, reason=applied.reason, seq=batch.seq, epoch=batch.epoch)
            self.metrics.kv_index_resyncs.labels(applied.reason).inc()
            return applied.reason
        m = self.metrics
        if applied.resynced:
            m.kv_index_resyncs.labels(applied.resynced).inc()
        for kind, tier, blocks in applied.blocks:
            m.kv_index_events.labels(kind.value, tier.name.lower()).inc()
            m.kv_index_event_blocks.labels(kind.value, tier.name.lower()).inc(blocks)
        if applied.evicted:
            m.kv_index_evictions.inc(applied.evicted)
        if applied.snapshot_done:
            seconds = applied_at - (link.snapshot_started_s if link.snapshot_started_s is not None else now)
            link.snapshot_started_s = None
            m.kv_index_snapshot.observe(seconds)
            log.info(
                "kv index synced from snapshot",
                node=node_id,
                epoch=batch.epoch,
                seq=batch.seq,
                blocks=self.index.tier_blocks(node_id),
                seconds=round(seconds, 3),
            )
        return ""
