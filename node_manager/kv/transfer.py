"""Node-to-node KV transfer: serve a session's pages as a gRPC stream, and pull one from a peer.

The stream goes layer by layer (all requested blocks of layer 0, then layer 1, ...) so a receiver
can start using early layers while later ones are in flight. Messages stay under 4 MiB (gRPC's
default limit) and every page carries its checksum; the receiver derives block keys from the token
ids itself, so a page is stored only if its bytes match *its own* key and layer. A stream that breaks
midway leaves the verified pages stored and the rest missing: a partial result, never a bad page.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import warnings
from collections.abc import AsyncIterator, Sequence

import grpc
import torch

from node_manager.kv.loader import RowTarget
from node_manager.kv.pages import Priority, page_checksum
from node_manager.kv.prefetch import PullOutcome
from node_manager.kv.store import TieredStore
from symphony.kv_addressing import BlockKey
from symphony.logs import get_logger
from symphony.rpc import kv_pb2, kv_pb2_grpc

log = get_logger("node_manager.kv.transfer")

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
_MESSAGE_OVERHEAD = 64 * 1024  # room for the session ref, checksums and framing
# Blocks staged per round of the outgoing stream, bounding the memory one stream holds.
_STAGE_BYTES = 64 * 1024 * 1024

PRIORITY_TO_PROTO = {Priority.LOW: kv_pb2.PRIORITY_LOW, Priority.NORMAL: kv_pb2.PRIORITY_NORMAL,
                     Priority.HIGH: kv_pb2.PRIORITY_HIGH}
PRIORITY_FROM_PROTO = {v: k for k, v in PRIORITY_TO_PROTO.items()}


def pages_per_message(page_bytes: int) -> int:
    return max(1, (MAX_MESSAGE_BYTES - _MESSAGE_OVERHEAD) // page_bytes)


async def stream_pages(store: TieredStore, tenant: str, session_id: str, first_block: int,
                       num_blocks: int | None) -> AsyncIterator[kv_pb2.PageBatch]:
    """The pages of blocks [first_block, first_block + num_blocks) in layer order, from any tier."""
    record = store.session(tenant, session_id)
    end = record.blocks.num_blocks if not num_blocks else min(record.blocks.num_blocks, first_block + num_blocks)
    geometry = store.geometry
    chunk_blocks = max(1, _STAGE_BYTES // geometry.block_bytes)
    per_message = pages_per_message(geometry.page_bytes)
    ref = kv_pb2.SessionRef(tenant=tenant, session_id=session_id)
    for chunk_start in range(first_block, end, chunk_blocks):
        count = min(chunk_blocks, end - chunk_start)
        staging = [torch.empty(count, geometry.page_words, dtype=torch.int64) for _ in range(geometry.num_layers)]
        handle = store.load(tenant, session_id, chunk_start, count, RowTarget(staging, list(range(count))))
        for layer in range(geometry.num_layers):
            result = await handle.wait_layer(layer)
            failed = set(result.failed)
            # Send runs of loaded blocks; a failed page is simply absent, and the receiver sees the gap.
            run_start = None
            for offset in range(count + 1):
                ok = offset < count and chunk_start + offset not in failed
                if ok and run_start is None:
                    run_start = offset
                if run_start is not None and (not ok or offset - run_start == per_message):
                    first = chunk_start + run_start
                    yield page_batch(ref, record.blocks.block_keys[first:chunk_start + offset], layer, first,
                                     staging[layer][run_start:offset].numpy().tobytes())
                    run_start = offset if ok else None


def page_batch(ref: kv_pb2.SessionRef, keys: Sequence[BlockKey], layer: int, first_block: int,
               data: bytes) -> kv_pb2.PageBatch:
    """A batch of `len(keys)` pages of one layer (bytes back to back), each with its checksum."""
    page_bytes = len(data) // len(keys) if keys else 0
    view = memoryview(data)
    checksums = [page_checksum(key, layer, view[i * page_bytes:(i + 1) * page_bytes]) for i, key in enumerate(keys)]
    return kv_pb2.PageBatch(session=ref, layer=layer, first_block=first_block, checksums=checksums, data=data)


def verified_pages(store: TieredStore, batch: kv_pb2.PageBatch) -> tuple[list[tuple[int, torch.Tensor]], int]:
    """Split a batch into runs of pages that pass their checksum: ([(first block, pages)], rejected)."""
    record = store.session(batch.session.tenant, batch.session.session_id)
    page_bytes = store.geometry.page_bytes
    count = len(batch.checksums)
    if len(batch.data) != count * page_bytes or batch.first_block + count > record.blocks.num_blocks:
        raise ValueError(f"page batch does not fit: {count} checksums, {len(batch.data)} bytes, "
                         f"blocks from {batch.first_block} of {record.blocks.num_blocks}")
    if batch.layer >= store.geometry.num_layers:
        raise ValueError(f"layer {batch.layer} outside 0..{store.geometry.num_layers - 1}")
    view = memoryview(batch.data)
    good = [page_checksum(record.blocks.block_keys[batch.first_block + i], batch.layer,
                          view[i * page_bytes:(i + 1) * page_bytes]) == batch.checksums[i] for i in range(count)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only bytes: we only read them
        pages = torch.frombuffer(batch.data, dtype=torch.int64).view(count, -1) if count else None
    runs: list[tuple[int, torch.Tensor]] = []
    i = 0
    while i < count:
        if not good[i]:
            i += 1
            continue
        j = i
        while j < count and good[j]:
            j += 1
        assert pages is not None
        runs.append((batch.first_block + i, pages[i:j]))
        i = j
    return runs, good.count(False)


def submit_batch(store: TieredStore, batch: kv_pb2.PageBatch) -> tuple[list[concurrent.futures.Future[int]], int, int]:
    """Start saving a batch's verified pages: (save futures, pages submitted, pages rejected). The
    futures keep the batch's bytes alive until the copies are done."""
    runs, rejected = verified_pages(store, batch)
    futures = [store.save_layer(batch.session.tenant, batch.session.session_id, batch.layer, first, pages)
               for first, pages in runs]
    return futures, sum(len(p) for _, p in runs), rejected


async def store_batch(store: TieredStore, batch: kv_pb2.PageBatch) -> tuple[int, int]:
    """Save a batch's verified pages; returns (stored, rejected)."""
    futures, submitted, rejected = submit_batch(store, batch)
    stored = sum([await asyncio.wrap_future(f) for f in futures])
    return stored, rejected + submitted - stored


class PeerPuller:
    """Pulls sessions from peer node managers over long-lived channels (one per peer)."""

    def __init__(self, store: TieredStore, timeout_s: float, max_peers: int = 256) -> None:
        self._store = store
        self._timeout_s = timeout_s
        self._max_peers = max_peers
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, peer: str) -> kv_pb2_grpc.KVStoreStub:
        channel = self._channels.get(peer)
        if channel is None:
            if len(self._channels) >= self._max_peers:
                oldest = self._channels.pop(next(iter(self._channels)))  # insertion order: the oldest
                asyncio.get_running_loop().create_task(oldest.close())
            options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES + _MESSAGE_OVERHEAD)]
            channel = grpc.aio.insecure_channel(peer, options=options)
            self._channels[peer] = channel
        return kv_pb2_grpc.KVStoreStub(channel)

    async def pull(self, tenant: str, session_id: str, peer: str) -> kv_pb2.PullReply:
        """Fetch every page of the session that no local tier holds, from the first missing block."""
        stub = self._stub(peer)
        ref = kv_pb2.SessionRef(tenant=tenant, session_id=session_id)
        reply = kv_pb2.PullReply()
        try:
            remote = await stub.GetSessionStatus(kv_pb2.SessionStatusRequest(session=ref, include_token_ids=True),
                                                 timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            reply.error = f"peer {peer}: {exc.code().name}: {exc.details()}"
            return reply
        priority = PRIORITY_FROM_PROTO.get(remote.priority)
        record = self._store.put_session(tenant, session_id, list(remote.token_ids), priority)
        start = self._store.loadable_prefix_blocks(tenant, session_id)
        first = min(start, remote.loadable_prefix_blocks)
        wanted = remote.loadable_prefix_blocks - first
        reply.pages_expected = wanted * self._store.geometry.num_layers
        if wanted <= 0:
            reply.complete = record.blocks.num_blocks <= start
            return reply
        request = kv_pb2.FetchPagesRequest(session=ref, first_block=first, num_blocks=wanted)
        # Saves run on the store's I/O threads while the next batch arrives; they are awaited at the end.
        pending: list[concurrent.futures.Future[int]] = []
        submitted = 0
        try:
            async for batch in stub.FetchPages(request, timeout=self._timeout_s):
                futures, count, rejected = submit_batch(self._store, batch)
                pending += futures
                submitted += count
                reply.pages_rejected += rejected
        except grpc.aio.AioRpcError as exc:
            reply.error = f"peer {peer} stream broke: {exc.code().name}: {exc.details()}"
            log.warning("KV pull from peer stopped early", peer=peer, session=session_id,
                        received=reply.pages_received, expected=reply.pages_expected, error=exc.code().name)
        except ValueError as exc:
            reply.error = f"peer {peer} sent a malformed batch: {exc}"
        for future in pending:
            reply.pages_received += await asyncio.wrap_future(future)
        reply.pages_rejected += submitted - reply.pages_received  # verified but not kept (no room)
        reply.complete = not reply.error and reply.pages_received == reply.pages_expected
        return reply

    async def pull_outcome(self, tenant: str, session_id: str, peer: str) -> PullOutcome:
        reply = await self.pull(tenant, session_id, peer)
        return PullOutcome(reply.pages_received, reply.complete, reply.error)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
