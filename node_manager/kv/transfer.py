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
from collections.abc import AsyncIterator, Iterator, Sequence

import torch

from node_manager.kv.errors import InvalidRequest
from node_manager.kv.loader import LayerResult, LayerwiseLoad, RowTarget
from node_manager.kv.pages import PageMac
from node_manager.kv.sessions import SessionRecord, addressed_keys
from node_manager.kv.store import TieredStore
from symphony.kv_addressing import BlockKey
from symphony.logs import get_logger
from symphony.rpc import kv_pb2

log = get_logger(__name__)

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MESSAGE_OVERHEAD = 64 * 1024  # room for the session ref, checksums and framing
# Blocks staged per round of the outgoing stream, bounding the memory one stream holds.
_STAGE_BYTES = 64 * 1024 * 1024


def pages_per_message(page_bytes: int) -> int:
    return max(1, (MAX_MESSAGE_BYTES - MESSAGE_OVERHEAD) // page_bytes)


def stream_chunks(store: TieredStore, first_block: int, end: int) -> Iterator[tuple[int, int]]:
    """(first block, count) of the chunks a stream of blocks [first_block, end) is sent in: at most
    _STAGE_BYTES each, which bounds what one stream stages or keeps pinned at a time."""
    chunk_blocks = max(1, _STAGE_BYTES // store.geometry.block_bytes)
    for chunk_start in range(first_block, end, chunk_blocks):
        yield chunk_start, min(chunk_blocks, end - chunk_start)


def staged_load(
    store: TieredStore, record: SessionRecord, first_block: int, count: int
) -> tuple[list[torch.Tensor], LayerwiseLoad]:
    """Start loading `count` blocks into fresh staging tensors (one per layer), from whichever tiers hold them."""
    geometry = store.geometry
    staging = [torch.empty(count, geometry.page_words, dtype=torch.int64) for _ in range(geometry.num_layers)]
    handle = store.loads.into_rows(
        record.key[0], record.key[1], first_block, count, target=RowTarget(staging, list(range(count)))
    )
    return staging, handle


def loaded_runs(result: LayerResult, chunk_start: int, count: int, per_message: int) -> Iterator[tuple[int, int]]:
    """Runs [start, end) of chunk offsets whose pages loaded, at most `per_message` long. A failed page
    is simply left out, and the receiver sees the gap."""
    failed = set(result.failed)
    run_start = None
    for offset in range(count + 1):
        ok = offset < count and chunk_start + offset not in failed
        if ok and run_start is None:
            run_start = offset
        if run_start is not None and (not ok or offset - run_start == per_message):
            yield run_start, offset
            run_start = offset if ok else None


def session_status(
    store: TieredStore, tenant: str, session_id: str, *, token_ids: bool, data_port: int = 0
) -> kv_pb2.SessionStatus:
    """What a puller needs of a session before asking for its pages: its length, priority, the
    blocks every layer can deliver, and (with `token_ids`) the ids its block keys derive from."""
    record = store.sessions.get(tenant, session_id)
    status = kv_pb2.SessionStatus(
        session=kv_pb2.SessionRef(tenant=tenant, session_id=session_id),
        num_tokens=len(record.token_ids),
        num_blocks=record.blocks.num_blocks,
        priority=record.priority.proto,
        loadable_prefix_blocks=store.loadable_prefix_blocks(tenant, session_id),
        loadable_tail_tokens=store.loadable_tail_tokens(tenant, session_id),
        data_port=data_port,
        model_fingerprint=store.model,
    )
    if token_ids:
        status.token_ids.extend(record.token_ids.tolist())
    return status


def stream_end(
    store: TieredStore, tenant: str, session_id: str, first_block: int, num_blocks: int | None
) -> tuple[SessionRecord, int]:
    """The session and the end of the block range a fetch asks for (0 or None blocks: to the end)."""
    record = store.sessions.get(tenant, session_id)
    if first_block > record.blocks.num_blocks:
        raise InvalidRequest(f"first_block {first_block} beyond the session's {record.blocks.num_blocks}")
    if not num_blocks:
        return record, record.blocks.num_blocks
    return record, min(record.blocks.num_blocks, first_block + num_blocks)


async def stream_pages(
    store: TieredStore, tenant: str, session_id: str, first_block: int, num_blocks: int | None, tail_tokens: int = 0
) -> AsyncIterator[kv_pb2.PageBatch]:
    """The pages of blocks [first_block, first_block + num_blocks) in layer order, from any tier.
    With `tail_tokens`, the one block right after the full ones, the session's partial tail."""
    if tail_tokens:
        async for batch in _stream_tail(store, tenant, session_id, first_block, num_blocks, tail_tokens):
            yield batch
        return
    record, end = stream_end(store, tenant, session_id, first_block, num_blocks)
    per_message = pages_per_message(store.geometry.page_bytes)
    ref = kv_pb2.SessionRef(tenant=tenant, session_id=session_id)
    for chunk_start, count in stream_chunks(store, first_block, end):
        staging, handle = staged_load(store, record, chunk_start, count)
        for layer in range(store.geometry.num_layers):
            result = await handle.wait_layer(layer)
            for start, stop in loaded_runs(result, chunk_start, count, per_message):
                yield page_batch(
                    store.ssd.mac,
                    ref,
                    record.blocks.block_keys[chunk_start + start : chunk_start + stop],
                    layer,
                    chunk_start + start,
                    staging[layer][start:stop].numpy().tobytes(),
                )


async def _stream_tail(
    store: TieredStore, tenant: str, session_id: str, first_block: int, num_blocks: int | None, tail_tokens: int
) -> AsyncIterator[kv_pb2.PageBatch]:
    record = store.sessions.get(tenant, session_id)
    if first_block != record.blocks.num_blocks or num_blocks not in (None, 1):
        raise InvalidRequest(f"a partial tail is the one block after the session's {record.blocks.num_blocks}")
    staging = [torch.empty(1, store.geometry.page_words, dtype=torch.int64) for _ in range(store.geometry.num_layers)]
    handle = store.loads.into_rows(
        tenant, session_id, first_block, 1, target=RowTarget(staging, [0]), tail_tokens=tail_tokens
    )
    key = addressed_keys(record, first_block, 1, None, tail_tokens)[0]  # the load above checked the range
    ref = kv_pb2.SessionRef(tenant=tenant, session_id=session_id)
    for layer in range(store.geometry.num_layers):
        result = await handle.wait_layer(layer)
        if not result.failed:
            data = staging[layer].numpy().tobytes()
            yield page_batch(store.ssd.mac, ref, [key], layer, first_block, data, tail_tokens)


def page_batch(
    mac: PageMac,
    ref: kv_pb2.SessionRef,
    keys: Sequence[BlockKey],
    layer: int,
    first_block: int,
    data: bytes,
    tail_tokens: int = 0,
) -> kv_pb2.PageBatch:
    """A batch of `len(keys)` pages of one layer (bytes back to back), each with its MAC under
    `mac`; the last a partial block of `tail_tokens` tokens if that is > 0."""
    page_bytes = len(data) // len(keys) if keys else 0
    checksums = mac.run_tags(keys, layer, memoryview(data), page_bytes)
    return kv_pb2.PageBatch(
        session=ref, layer=layer, first_block=first_block, checksums=checksums, data=data, tail_tokens=tail_tokens
    )


def submit_batch(store: TieredStore, batch: kv_pb2.PageBatch) -> tuple[concurrent.futures.Future[int] | None, int]:
    """Start saving a batch's pages, each kept only if its bytes in DRAM match its checksum: (the
    save's future, or None for an empty batch; pages submitted). The future keeps the batch's bytes
    alive until the copy is done. The block keys are the receiver's own, so a page sent under the
    wrong block or layer fails its check like a flipped bit."""
    count = len(batch.checksums)
    if len(batch.data) != count * store.geometry.page_bytes:
        raise ValueError(f"page batch does not fit: {count} checksums, {len(batch.data)} bytes")
    if not count:
        return None, 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only bytes: the save only reads them
        pages = torch.frombuffer(batch.data, dtype=torch.int64).view(count, -1)
    future = store.ingest.save_layer(
        batch.session.tenant,
        batch.session.session_id,
        batch.layer,
        batch.first_block,
        pages,
        list(batch.checksums),
        tail_tokens=batch.tail_tokens,
    )
    return future, count


async def store_batch(store: TieredStore, batch: kv_pb2.PageBatch) -> tuple[int, int]:
    """Save a batch's verified pages; returns (stored, rejected: bad checksum or no room)."""
    future, submitted = submit_batch(store, batch)
    stored = await asyncio.wrap_future(future) if future is not None else 0
    return stored, submitted - stored
