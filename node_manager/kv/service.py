"""gRPC KVStore service: the store, prefetch queue and peer transfer behind validated requests.

Errors map to gRPC codes a client can act on: NOT_FOUND (unknown session or prefetch),
INVALID_ARGUMENT (malformed request), RESOURCE_EXHAUSTED (queues full, too many block event
subscribers: retry later), ABORTED (a block event subscriber fell behind: resubscribe), UNAVAILABLE
(the node is stopping). Nothing a client sends produces UNKNOWN/INTERNAL.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator

import grpc

from node_manager.kv.block_events import SubscriptionEnded, TooManySubscribers
from node_manager.kv.block_watch import StreamHeader, watch_blocks
from node_manager.kv.errors import InvalidRequest, ModelMismatch, SessionNotFound, StoreBusy
from node_manager.kv.pages import Priority, Tier
from node_manager.kv.prefetch import PrefetchJob, PrefetchQueue, PrefetchQueueFull
from node_manager.kv.puller import PeerPuller
from node_manager.kv.store import TieredStore
from node_manager.kv.transfer import session_status, store_batch, stream_pages
from symphony.rpc import kv_pb2, kv_pb2_grpc

MAX_ID_LEN = 256
MAX_DEADLINE_MS = 24 * 3600 * 1000
MAX_SALT_CHARS = 256  # a cache_salt names a tenant or user; anything longer is a mistake
DEMOTE_FLUSH_TIMEOUT_S = 30.0
_PEER = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}$")
_TIER_FROM_PROTO = {kv_pb2.TIER_HBM: Tier.HBM, kv_pb2.TIER_DRAM: Tier.DRAM, kv_pb2.TIER_SSD: Tier.SSD}
_TIER_TO_PROTO = {v: k for k, v in _TIER_FROM_PROTO.items()}


class _Invalid(Exception):
    pass


def _session(ref: kv_pb2.SessionRef) -> tuple[str, str]:
    for name, value in (("tenant", ref.tenant), ("session_id", ref.session_id)):
        if not value:
            raise _Invalid(f"session.{name} is required")
        if len(value) > MAX_ID_LEN:
            raise _Invalid(f"session.{name} longer than {MAX_ID_LEN} characters")
    return ref.tenant, ref.session_id


def _priority(value: int) -> Priority | None:
    if value == kv_pb2.PRIORITY_UNSPECIFIED:
        return None
    priority = Priority.from_proto(value)
    if priority is None:
        raise _Invalid(f"unknown priority {value}")
    return priority


def _peer(value: str) -> str:
    if value and not _PEER.match(value):
        raise _Invalid(f"peer {value!r} is not host:port")
    return value


async def _abort_for(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    if isinstance(exc, SessionNotFound):
        await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
    if isinstance(exc, StoreBusy | PrefetchQueueFull):
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    if isinstance(exc, ModelMismatch):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


_CLIENT_ERRORS = (_Invalid, InvalidRequest, SessionNotFound, StoreBusy, PrefetchQueueFull, ModelMismatch, ValueError)


class KVStoreService(kv_pb2_grpc.KVStoreServicer):
    def __init__(
        self, node_id: str, store: TieredStore, prefetches: PrefetchQueue, puller: PeerPuller, data_port: int = 0
    ) -> None:
        self.node_id = node_id
        self.data_port = data_port
        self.store = store
        self.prefetches = prefetches
        self.puller = puller

    async def GetStoreInfo(
        self, request: kv_pb2.StoreInfoRequest, context: grpc.aio.ServicerContext
    ) -> kv_pb2.StoreInfo:
        g = self.store.geometry
        c = self.store.config
        return kv_pb2.StoreInfo(
            node_id=self.node_id,
            num_layers=g.num_layers,
            kv_heads=g.kv_heads,
            head_size=g.head_size,
            block_size=g.block_size,
            dtype=g.dtype,
            page_bytes=g.page_bytes,
            dram_arena_name=self.store.dram.name,
            dram_arena_slots=self.store.dram.num_slots,
            hbm_capacity_bytes=c.hbm_bytes,
            dram_capacity_bytes=c.dram_bytes,
            ssd_capacity_bytes=c.ssd_bytes,
            data_port=self.data_port,
            model_fingerprint=c.model,
        )

    async def PutSession(
        self, request: kv_pb2.PutSessionRequest, context: grpc.aio.ServicerContext
    ) -> kv_pb2.SessionStatus:
        try:
            tenant, session_id = _session(request.session)
            self.store.sessions.put(tenant, session_id, list(request.token_ids), _priority(request.priority))
            return self._status(tenant, session_id, False, False)
        except _CLIENT_ERRORS as exc:
            await _abort_for(context, exc)
            raise AssertionError("unreachable") from None

    async def GetSessionStatus(
        self, request: kv_pb2.SessionStatusRequest, context: grpc.aio.ServicerContext
    ) -> kv_pb2.SessionStatus:
        try:
            tenant, session_id = _session(request.session)
            return self._status(tenant, session_id, request.include_token_ids, request.include_dram_slots)
        except _CLIENT_ERRORS as exc:
            await _abort_for(context, exc)
            raise AssertionError("unreachable") from None

    async def DemoteSession(
        self, request: kv_pb2.DemoteRequest, context: grpc.aio.ServicerContext
    ) -> kv_pb2.SessionStatus:
        try:
            tenant, session_id = _session(request.session)
            tier = _TIER_FROM_PROTO.get(request.tier)
            if tier is None or tier is Tier.SSD:
                raise _Invalid("tier must be TIER_HBM or TIER_DRAM")
            self.store.sessions.get(tenant, session_id)  # NOT_FOUND before waiting on the write-behind
            # Pages saved moments ago may still be on their way to SSD; only SSD-held copies drop.
            await asyncio.to_thread(self.store.write_behind.flush, DEMOTE_FLUSH_TIMEOUT_S)
            self.store.demote(tenant, session_id, tier)
            return self._status(tenant, session_id, False, False)
        except _CLIENT_ERRORS as exc:
            await _abort_for(context, exc)
            raise AssertionError("unreachable") from None

    def _status(self, tenant: str, session_id: str, tokens: bool, slots: bool) -> kv_pb2.SessionStatus:
        status = session_status(self.store, tenant, session_id, token_ids=tokens, data_port=self.data_port)
        num_blocks = status.num_blocks
        for tier, layers in self.store.residency(tenant, session_id).items():
            prefix = 0
            while prefix < num_blocks and all(layer[prefix] for layer in layers):
                prefix += 1
            status.tiers.append(
                kv_pb2.TierResidency(
                    tier=_TIER_TO_PROTO[tier],
                    blocks_per_layer=[sum(layer) for layer in layers],
                    complete_prefix_blocks=prefix,
                )
            )
        if slots:
            for layer in self.store.dram_slots(tenant, session_id):
                status.dram_slots.extend(layer)
        return status

    async def WritePages(
        self, request_iterator: AsyncIterator[kv_pb2.PageBatch], context: grpc.aio.ServicerContext
    ) -> kv_pb2.WritePagesReply:
        reply = kv_pb2.WritePagesReply()
        try:
            async for batch in request_iterator:
                _session(batch.session)
                stored, rejected = await store_batch(self.store, batch)
                reply.pages_stored += stored
                reply.pages_rejected += rejected
        except _CLIENT_ERRORS as exc:
            await _abort_for(context, exc)
        return reply

    async def FetchPages(
        self, request: kv_pb2.FetchPagesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kv_pb2.PageBatch]:
        try:
            tenant, session_id = _session(request.session)
            self.store.check_model(request.model_fingerprint, "sender")
            async for batch in stream_pages(
                self.store, tenant, session_id, request.first_block, request.num_blocks or None, request.tail_tokens
            ):
                yield batch
        except _CLIENT_ERRORS as exc:
            await _abort_for(context, exc)

    async def Pull(self, request: kv_pb2.PullRequest, context: grpc.aio.ServicerContext) -> kv_pb2.PullReply:
        try:
            tenant, session_id = _session(request.session)
            if not request.peer:
                raise _Invalid("peer is required")
            return await self.puller.pull(tenant, session_id, _peer(request.peer))
        except _CLIENT_ERRORS as exc:
            await _abort_for(context, exc)
            raise AssertionError("unreachable") from None

    async def Prefetch(
        self, request: kv_pb2.PrefetchRequest, context: grpc.aio.ServicerContext
    ) -> kv_pb2.PrefetchStatus:
        try:
            tenant, session_id = _session(request.session)
            target = _TIER_FROM_PROTO.get(request.target_tier)
            if target not in (Tier.HBM, Tier.DRAM):
                raise _Invalid("target_tier must be TIER_HBM or TIER_DRAM")
            if request.deadline_ms > MAX_DEADLINE_MS:
                raise _Invalid(f"deadline_ms {request.deadline_ms} is more than a day away")
            peer = _peer(request.source_peer)
            near_peer = _peer(request.near_peer)
            if (near_peer or request.near_blocks) and not (peer and near_peer and request.near_blocks):
                raise _Invalid("near_peer and near_blocks go together, with source_peer")
            if near_peer == peer and peer:
                raise _Invalid("near_peer is source_peer")
            salt = request.engine_cache_salt
            if salt and target is not Tier.HBM:
                raise _Invalid("engine_cache_salt goes with target_tier TIER_HBM (the engine's own cache)")
            if len(salt) > MAX_SALT_CHARS:
                raise _Invalid(f"engine_cache_salt is longer than {MAX_SALT_CHARS} characters")
            if not peer:
                self.store.sessions.get(tenant, session_id)  # NOT_FOUND now rather than a failed job later
            job = self.prefetches.submit(
                (tenant, session_id),
                target,
                request.deadline_ms / 1000,
                _priority(request.priority) or Priority.NORMAL,
                peer,
                salt,
                max_blocks=request.max_blocks,
                near=(near_peer, request.near_blocks),
            )
        except _CLIENT_ERRORS as exc:
            await _abort_for(context, exc)
            raise AssertionError("unreachable") from None
        return await self._report(job, request.wait_ms)

    async def GetPrefetch(
        self, request: kv_pb2.PrefetchRef, context: grpc.aio.ServicerContext
    ) -> kv_pb2.PrefetchStatus:
        return await self._report_known(self.prefetches.get(request.prefetch_id), request, context)

    async def CancelPrefetch(
        self, request: kv_pb2.PrefetchRef, context: grpc.aio.ServicerContext
    ) -> kv_pb2.PrefetchStatus:
        return await self._report_known(self.prefetches.cancel(request.prefetch_id), request, context)

    async def WatchBlocks(
        self, request: kv_pb2.WatchBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kv_pb2.BlockEventBatch]:
        store = self.store
        header = StreamHeader(self.node_id, store.model, store.geometry.block_size, store.events.epoch)
        try:
            async for batch in watch_blocks(store, header, request.epoch, request.after_seq):
                yield batch
        except TooManySubscribers as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except SubscriptionEnded as exc:
            if exc.reason == "lagging":
                await context.abort(
                    grpc.StatusCode.ABORTED, "fell behind the node's block events; resubscribe after the last seq"
                )
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the node is stopping")

    async def _report_known(
        self, job: PrefetchJob | None, request: kv_pb2.PrefetchRef, context: grpc.aio.ServicerContext
    ) -> kv_pb2.PrefetchStatus:
        if job is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no prefetch {request.prefetch_id!r}")
        assert job is not None
        return await self._report(job, request.wait_ms)

    async def _report(self, job: PrefetchJob, wait_ms: int) -> kv_pb2.PrefetchStatus:
        if wait_ms:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(job.finished.wait(), min(wait_ms, MAX_DEADLINE_MS) / 1000)
        return kv_pb2.PrefetchStatus(
            prefetch_id=job.id,
            state=job.state.proto,
            pages_in_target=job.pages_in_target,
            pages_failed=job.pages_failed,
            pages_from_peer=job.pages_from_peer,
            pages_from_near_peer=job.pages_from_near_peer,
            lead_time_ms=int(job.lead_time_s * 1000),
            error=job.error,
            engine_cached_tokens=job.engine_cached_tokens,
            engine_note=job.engine_note,
        )
