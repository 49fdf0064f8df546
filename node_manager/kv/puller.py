"""Pull a session's missing pages from a peer node manager.

The peer's session status (over gRPC) says which blocks it can deliver and where its raw page
stream listens; the pages then come over that stream, or over gRPC's FetchPages when the peer has
no stream or it cannot be reached. Either way every page is checked against its checksum before the
store keeps it, and a transfer cut short leaves a partial result, never a bad page.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import grpc

from node_manager.kv.page_stream import fetch_pages
from node_manager.kv.prefetch import PullOutcome
from node_manager.kv.store import KVStoreError, TieredStore
from node_manager.kv.transfer import MAX_MESSAGE_BYTES, MESSAGE_OVERHEAD, PRIORITY_FROM_PROTO, submit_batch
from symphony.logs import get_logger
from symphony.rpc import kv_pb2, kv_pb2_grpc

log = get_logger("node_manager.kv.puller")


class PeerPuller:
    """Pulls sessions from peer node managers over long-lived channels (one per peer)."""

    def __init__(self, store: TieredStore, timeout_s: float, max_peers: int = 256,
                 use_page_stream: bool = True) -> None:
        self._store = store
        self._timeout_s = timeout_s
        self._max_peers = max_peers
        self._use_page_stream = use_page_stream
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, peer: str) -> kv_pb2_grpc.KVStoreStub:
        channel = self._channels.get(peer)
        if channel is None:
            if len(self._channels) >= self._max_peers:
                oldest = self._channels.pop(next(iter(self._channels)))  # insertion order: the oldest
                asyncio.get_running_loop().create_task(oldest.close())
            options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES + MESSAGE_OVERHEAD)]
            channel = grpc.aio.insecure_channel(peer, options=options)
            self._channels[peer] = channel
        return kv_pb2_grpc.KVStoreStub(channel)

    async def connect(self, peer: str, timeout_s: float | None = None) -> None:
        """Open the channel to `peer` now, so the first pull does not pay the connection set-up
        (a TCP and HTTP/2 handshake, milliseconds) while a request may be waiting on it."""
        self._stub(peer)
        await asyncio.wait_for(self._channels[peer].channel_ready(), timeout_s or self._timeout_s)

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
        with self._store.foreground_transfer():  # the write-behind waits: a request may be waiting on this
            if not (self._use_page_stream and remote.data_port
                    and await self._pull_stream(peer, remote.data_port, request, reply)):
                await self._pull_grpc(stub, peer, request, reply)
        reply.complete = not reply.error and reply.pages_received == reply.pages_expected
        self._store.metrics.peer_pages.labels("stored").inc(reply.pages_received)
        self._store.metrics.peer_pages.labels("rejected").inc(reply.pages_rejected)
        if reply.error:
            log.warning("KV pull from peer stopped early", peer=peer, session=session_id,
                        received=reply.pages_received, expected=reply.pages_expected, error=reply.error)
        return reply

    async def _pull_stream(self, peer: str, port: int, request: kv_pb2.FetchPagesRequest,
                           reply: kv_pb2.PullReply) -> bool:
        """Read the pages over the peer's raw stream; False (nothing read) if it cannot be reached."""
        host = peer.rpartition(":")[0]
        stop = threading.Event()
        try:
            outcome = await asyncio.to_thread(fetch_pages, self._store, host, port, request, self._timeout_s, stop)
        except OSError as exc:
            log.info("peer page stream unreachable; pulling over gRPC", peer=peer, port=port, error=str(exc))
            return False
        except asyncio.CancelledError:
            stop.set()  # the reading thread stops at its next frame
            raise
        if outcome.error and not outcome.received:
            # Busy, or refused before any page: gRPC gets the same pages, or the peer's status code.
            log.info("peer page stream gave nothing; pulling over gRPC", peer=peer, error=outcome.error)
            return False
        reply.pages_received = outcome.stored
        reply.pages_rejected = outcome.received - outcome.stored  # bad checksum, or no room
        if outcome.error:
            reply.error = f"peer {peer}: {outcome.error}"
        return True

    async def _pull_grpc(self, stub: kv_pb2_grpc.KVStoreStub, peer: str, request: kv_pb2.FetchPagesRequest,
                         reply: kv_pb2.PullReply) -> None:
        # Saves run on the store's I/O threads while the next batch arrives; they are awaited at the end.
        pending: list[concurrent.futures.Future[int]] = []
        submitted = 0
        try:
            async for batch in stub.FetchPages(request, timeout=self._timeout_s):
                future, count = submit_batch(self._store, batch)
                if future is not None:
                    pending.append(future)
                submitted += count
        except grpc.aio.AioRpcError as exc:
            reply.error = f"peer {peer} stream broke: {exc.code().name}: {exc.details()}"
        except (ValueError, KVStoreError) as exc:
            reply.error = f"peer {peer} sent a malformed batch: {exc}"
        for future in pending:
            reply.pages_received += await asyncio.wrap_future(future)
        reply.pages_rejected = submitted - reply.pages_received  # bad checksum, or no room

    async def pull_outcome(self, tenant: str, session_id: str, peer: str) -> PullOutcome:
        reply = await self.pull(tenant, session_id, peer)
        return PullOutcome(reply.pages_received, reply.complete, reply.error)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
