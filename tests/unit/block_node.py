"""A scripted node for the KV watcher's tests: a real grpc.aio server implementing only
KVStore.WatchBlocks, by the contract in kv.proto (snapshots in several batches, replay after
(epoch, after_seq), live batches, heartbeats), with faults a test injects on purpose: a lost batch,
a heartbeat ahead, a dropped or silent stream, another model's fingerprint, a restart."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from symphony.kv_addressing import BlockKey
from symphony.rpc import kv_pb2, kv_pb2_grpc
from tests.helpers import TEST_MODEL

_END, _ABORT = "end", "abort"
TIERS = (kv_pb2.TIER_ENGINE, kv_pb2.TIER_HBM, kv_pb2.TIER_DRAM, kv_pb2.TIER_SSD)


class BlockNode(kv_pb2_grpc.KVStoreServicer):
    def __init__(self, *, epoch: str = "boot-1", snapshot_keys_per_batch: int = 3, model: bytes = TEST_MODEL) -> None:
        self.epoch, self.seq = epoch, 0
        self.model = model  # the fingerprint its batches carry
        self.contents: dict[int, set[BlockKey]] = {tier: set() for tier in TIERS}  # the truth
        self.log: list[kv_pb2.BlockEventBatch] = []  # live batches kept for replay
        self.requests: list[tuple[str, int]] = []  # every subscription's (epoch, after_seq)
        self.snapshot_keys_per_batch = snapshot_keys_per_batch
        self._streams: list[asyncio.Queue[kv_pb2.BlockEventBatch | str]] = []
        self.server: grpc.aio.Server | None = None
        self.address = ""

    async def start(self) -> None:
        self.server = grpc.aio.server()
        kv_pb2_grpc.add_KVStoreServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)

    @property
    def streams(self) -> int:
        return len(self._streams)

    # -- what the node does -----------------------------------------------------------------------
    def _batch(self, seq: int, events: list[kv_pb2.BlockEvent], **flags: bool) -> kv_pb2.BlockEventBatch:
        return kv_pb2.BlockEventBatch(
            node_id="node-0",
            model_fingerprint=self.model,
            block_size=4,
            epoch=self.epoch,
            seq=seq,
            events=events,
            published_unix_ms=time.time_ns() // 1_000_000,
            **flags,
        )

    def publish(self, *events: tuple[int, int, list[BlockKey]], lose: bool = False) -> kv_pb2.BlockEventBatch:
        """Apply (kind, tier, keys) events and send them as the next live batch; `lose`: the batch
        never reaches the open streams (a gap), though a replay would carry it."""
        for kind, tier, keys in events:
            if kind == kv_pb2.BLOCK_EVENT_STORED:
                self.contents[tier].update(keys)
            elif kind == kv_pb2.BLOCK_EVENT_REMOVED:
                self.contents[tier].difference_update(keys)
            else:
                self.contents[tier].clear()
        self.seq += 1
        batch = self._batch(
            self.seq, [kv_pb2.BlockEvent(kind=kind, tier=tier, block_keys=keys) for kind, tier, keys in events]
        )
        self.log.append(batch)
        if not lose:
            self._send(batch)
        return batch

    def heartbeat(self, ahead: int = 0) -> None:
        self._send(self._batch(self.seq + ahead, []))

    def send_raw(self, batch: kv_pb2.BlockEventBatch) -> None:
        self._send(batch)

    def end_streams(self, *, abort: bool = False) -> None:
        for queue in self._streams:
            queue.put_nowait(_ABORT if abort else _END)

    def restart(self, epoch: str) -> None:
        """A new node manager: a new sequence; what it holds it reports in its next snapshot."""
        self.end_streams(abort=True)
        self.epoch, self.seq, self.log = epoch, 0, []

    def _send(self, batch: kv_pb2.BlockEventBatch) -> None:
        for queue in self._streams:
            queue.put_nowait(batch)

    def _snapshot(self) -> list[kv_pb2.BlockEventBatch]:
        events = []
        for tier in TIERS:
            keys = sorted(self.contents[tier])
            for start in range(0, len(keys), self.snapshot_keys_per_batch):
                chunk = keys[start : start + self.snapshot_keys_per_batch]
                events.append(kv_pb2.BlockEvent(kind=kv_pb2.BLOCK_EVENT_STORED, tier=tier, block_keys=chunk))
        batches = [self._batch(self.seq, [event]) for event in events] or [self._batch(self.seq, [])]
        batches[0].snapshot_begin = True
        batches[-1].snapshot_end = True
        return batches

    async def WatchBlocks(self, request, context) -> AsyncIterator[kv_pb2.BlockEventBatch]:
        self.requests.append((request.epoch, request.after_seq))
        held = [b for b in self.log if b.seq > request.after_seq]
        resumable = request.epoch == self.epoch and (
            request.after_seq == self.seq or bool(held and held[0].seq == request.after_seq + 1)
        )
        first = held if resumable else self._snapshot()
        queue: asyncio.Queue[kv_pb2.BlockEventBatch | str] = asyncio.Queue()
        self._streams.append(queue)  # no await since `first` was taken: nothing published is missed
        try:
            for batch in first:
                yield batch
            while True:
                item = await queue.get()
                if item == _END:
                    return
                if item == _ABORT:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "node manager stopping")
                assert not isinstance(item, str)
                yield item
        finally:
            self._streams.remove(queue)
