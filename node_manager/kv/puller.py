"""Pull a session's missing pages from a peer node manager.

The peer's session status says which blocks it can deliver; the pages then come over the peer's raw
page stream, or over gRPC's FetchPages when the peer has no stream or it cannot be reached. Once the
stream's port is known (from `connect` or an earlier status), the status comes over the stream's own
connection, ahead of the pages; otherwise from a GetSessionStatus call. Either way every page is
checked against its checksum before the store keeps it, and a transfer cut short leaves a partial
result, never a bad page.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from node_manager.kv.errors import KVStoreError, SessionNotFound
from node_manager.kv.page_stream import Plan, StreamOutcome, fetch_pages
from node_manager.kv.pages import Priority
from node_manager.kv.prefetch import PullOutcome
from node_manager.kv.sessions import SessionRecord
from node_manager.kv.store import TieredStore
from node_manager.kv.transfer import MAX_MESSAGE_BYTES, MESSAGE_OVERHEAD, submit_batch
from symphony.cluster_tls import ClusterTLS, grpc_channel
from symphony.logs import get_logger
from symphony.rpc import kv_pb2, kv_pb2_grpc

log = get_logger(__name__)


@dataclass(slots=True)
class _Pull:
    """One pull under way: the session, what is asked of it and what came so far."""

    ref: kv_pb2.SessionRef
    max_blocks: int  # > 0: only the session's first this many blocks
    reply: kv_pb2.PullReply = field(default_factory=kv_pb2.PullReply)
    tail: list[kv_pb2.FetchPagesRequest] = field(default_factory=list)  # the peer's partial last block, if wanted


class PeerPuller:
    """Pulls sessions from peer node managers over long-lived channels (one per peer)."""

    def __init__(
        self,
        store: TieredStore,
        timeout_s: float,
        max_peers: int = 256,
        use_page_stream: bool = True,
        tls: ClusterTLS | None = None,
    ) -> None:
        """`tls`: the cluster's credentials; with them a peer is pulled from only if its certificate
        is the cluster CA's (gRPC and page stream alike), so an address that names no member gives
        nothing."""
        self._store = store
        self._tls = tls
        self._stream_tls = tls.client_context() if tls is not None else None
        self._timeout_s = timeout_s
        self._max_peers = max_peers
        self._use_page_stream = use_page_stream
        self._channels: dict[str, grpc.aio.Channel] = {}
        # Each peer's page stream port, as its last status or store info gave it: a pull then asks the
        # stream itself for the session's status instead of a gRPC round trip first. Bounded with the
        # channels (an entry leaves with its peer's channel).
        self._data_ports: dict[str, int] = {}
        # Pulls under way, by (tenant, session, peer): a second pull of the same session from the same
        # peer joins the first. Bounded by the pulls running at once (an entry leaves when it ends).
        self._running: dict[tuple[str, str, str, int], asyncio.Task[kv_pb2.PullReply]] = {}

    def _stub(self, peer: str) -> kv_pb2_grpc.KVStoreStub:
        channel = self._channels.get(peer)
        if channel is None:
            if len(self._channels) >= self._max_peers:
                oldest = next(iter(self._channels))  # insertion order: the oldest
                self._data_ports.pop(oldest, None)
                asyncio.get_running_loop().create_task(self._channels.pop(oldest).close())
            options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES + MESSAGE_OVERHEAD)]
            channel = grpc_channel(peer, self._tls, options)
            self._channels[peer] = channel
        return kv_pb2_grpc.KVStoreStub(channel)

    async def connect(self, peer: str, timeout_s: float | None = None) -> None:
        """Open the channel to `peer` now and learn where its page stream listens, so the first pull
        pays neither the connection set-up (a TCP and HTTP/2 handshake) nor a status round trip while
        a request may be waiting on it."""
        info = await self._stub(peer).GetStoreInfo(
            kv_pb2.StoreInfoRequest(), timeout=timeout_s or self._timeout_s, wait_for_ready=True
        )
        self._data_ports[peer] = info.data_port

    async def pull(self, tenant: str, session_id: str, peer: str, max_blocks: int = 0) -> kv_pb2.PullReply:
        """Fetch every page of the session that no local tier holds, from the first missing block (up to
        block `max_blocks` when > 0: a prefix of the session, which another request shares).

        A pull of the same session from the same peer that is already running is joined, not
        repeated: a request that reaches a node while its advisory's move is still pulling the
        history asks for the same pages (the scheduler waits for them, `Dispatcher._pull_for_request`),
        and two pulls would fetch and store every page twice. The joiner gets the running pull's reply."""
        key = (tenant, session_id, peer, max_blocks)
        running = self._running.get(key)
        if running is None or running.done():
            running = asyncio.create_task(
                self._pull(tenant, session_id, peer, max_blocks), name=f"kv-pull-{session_id}"
            )
            self._running[key] = running
            running.add_done_callback(lambda done: self._forget(key, done))
        # Shielded: one caller going away (a cancelled prefetch) must not stop the pull the other awaits.
        return await asyncio.shield(running)

    def _forget(self, key: tuple[str, str, str, int], done: asyncio.Task[kv_pb2.PullReply]) -> None:
        if self._running.get(key) is done:
            del self._running[key]

    async def _pull(self, tenant: str, session_id: str, peer: str, max_blocks: int) -> kv_pb2.PullReply:
        pull = _Pull(kv_pb2.SessionRef(tenant=tenant, session_id=session_id), max_blocks)
        reply = pull.reply
        with self._store.write_behind.foreground_transfer():  # the write-behind waits: a request may be waiting on this
            if not await self._pull_with_session(peer, pull):
                await self._pull_after_status(peer, pull)
            if pull.tail and not reply.error:
                await self._pull_grpc(peer, pull.tail[0], reply)
        if reply.pages_expected:
            reply.complete = not reply.error and reply.pages_received == reply.pages_expected
            self._store.metrics.peer_pages.labels("stored").inc(reply.pages_received)
            self._store.metrics.peer_pages.labels("rejected").inc(reply.pages_rejected)
        if reply.error:
            log.warning(
                "KV pull from peer stopped early",
                peer=peer,
                session=session_id,
                received=reply.pages_received,
                expected=reply.pages_expected,
                error=reply.error,
            )
        return reply

    def _plan(self, pull: _Pull, remote: kv_pb2.SessionStatus) -> kv_pb2.FetchPagesRequest | None:
        """Register the session as the peer describes it and choose the blocks to fetch: from the
        first one no local tier holds to the end of what the peer can deliver, or to block
        `pull.max_blocks` when > 0 (None: nothing). The peer's partial last block, when it has one
        and this node not and no limit stops short of it (`max_blocks` counts full blocks: one equal
        to the peer's does), goes into `pull.tail` (fetched after the full blocks, over gRPC: the
        page stream carries whole blocks). A history registered here that the peer's is a prefix of
        stays (another pull of the session may be bringing its later blocks)."""
        ref, reply, tail, max_blocks = pull.ref, pull.reply, pull.tail, pull.max_blocks
        tenant, session_id = ref.tenant, ref.session_id
        # Before the session is registered here: another model's token history and pages stay out.
        self._store.check_model(remote.model_fingerprint, "receiver")
        priority = Priority.from_proto(remote.priority)
        record = self._registered(tenant, session_id, remote.token_ids, priority)
        start = self._store.loadable_prefix_blocks(tenant, session_id)
        deliverable = remote.loadable_prefix_blocks
        if max_blocks:
            deliverable = min(deliverable, max_blocks)
        first = min(start, deliverable)
        wanted = deliverable - first
        layers = self._store.geometry.num_layers
        reply.pages_expected = wanted * layers
        if (
            remote.loadable_tail_tokens
            and (not max_blocks or max_blocks > remote.loadable_prefix_blocks)
            and deliverable == remote.loadable_prefix_blocks == record.blocks.num_blocks
            and self._store.loadable_tail_tokens(tenant, session_id) < remote.loadable_tail_tokens
        ):
            tail.append(
                kv_pb2.FetchPagesRequest(
                    session=ref,
                    first_block=record.blocks.num_blocks,
                    num_blocks=1,
                    tail_tokens=remote.loadable_tail_tokens,
                    model_fingerprint=self._store.model,
                )
            )
            reply.pages_expected += layers
        if wanted <= 0:
            reply.complete = min(record.blocks.num_blocks, max_blocks or record.blocks.num_blocks) <= start and not tail
            return None
        return kv_pb2.FetchPagesRequest(
            session=ref, first_block=first, num_blocks=wanted, model_fingerprint=self._store.model
        )

    def _registered(
        self, tenant: str, session_id: str, token_ids: Sequence[int], priority: Priority | None
    ) -> SessionRecord:
        """The session registered with the peer's history (and priority), unless the history here
        extends it: then that one is kept."""
        history: Sequence[int] | np.ndarray = list(token_ids)
        try:
            here = self._store.sessions.get(tenant, session_id).token_ids
        except SessionNotFound:
            here = None
        if here is not None and len(here) > len(history) and np.array_equal(here[: len(history)], history):
            history = here
        return self._store.sessions.put(tenant, session_id, history, priority)

    async def _pull_with_session(self, peer: str, pull: _Pull) -> bool:
        """The pull over one page stream connection that first describes the session; False (nothing
        done) if the peer's stream port is unknown or the stream gave no session status."""
        port = self._data_ports.get(peer, 0) if self._use_page_stream else 0
        if not port:
            return False
        planned: list[kv_pb2.FetchPagesRequest] = []
        reply = pull.reply

        def plan(remote: kv_pb2.SessionStatus) -> kv_pb2.FetchPagesRequest | None:
            request = self._plan(pull, remote)
            planned.extend([request] if request is not None else [])
            return request

        opening = kv_pb2.FetchPagesRequest(session=pull.ref, with_session=True, model_fingerprint=self._store.model)
        outcome = await self._stream(peer, port, opening, plan)
        if outcome is None or outcome.status is None:
            # Unreachable, busy, or an unknown session: gRPC's status says which (and where the stream is now).
            return False
        if planned:
            if not self._took(peer, outcome, reply):
                await self._pull_grpc(peer, planned[0], reply)
        elif outcome.error:  # the session could not be registered here
            reply.error = f"peer {peer}: {outcome.error}"
        return True

    async def _pull_after_status(self, peer: str, pull: _Pull) -> None:
        reply = pull.reply
        try:
            remote = await self._stub(peer).GetSessionStatus(
                kv_pb2.SessionStatusRequest(session=pull.ref, include_token_ids=True), timeout=self._timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            reply.error = f"peer {peer}: {exc.code().name}: {exc.details()}"
            return
        self._data_ports[peer] = remote.data_port
        try:
            request = self._plan(pull, remote)
        except KVStoreError as exc:  # another model's session, or one that cannot be registered here
            reply.error = f"peer {peer}: {exc}"
            return
        if request is None:
            return
        outcome = None
        if self._use_page_stream and remote.data_port:
            outcome = await self._stream(peer, remote.data_port, request)
        if outcome is None or not self._took(peer, outcome, reply):
            await self._pull_grpc(peer, request, reply)

    async def _stream(
        self, peer: str, port: int, request: kv_pb2.FetchPagesRequest, plan: Plan | None = None
    ) -> StreamOutcome | None:
        """Run one page stream on a thread; None if the peer's stream cannot be reached."""
        host = peer.rpartition(":")[0]
        stop = threading.Event()
        try:
            return await asyncio.to_thread(
                fetch_pages, self._store, host, port, request, self._timeout_s, stop, plan, self._stream_tls
            )
        except OSError as exc:
            log.info("peer page stream unreachable; pulling over gRPC", peer=peer, port=port, error=str(exc))
            return None
        except asyncio.CancelledError:
            stop.set()  # the reading thread stops at its next frame
            raise

    def _took(self, peer: str, outcome: StreamOutcome, reply: kv_pb2.PullReply) -> bool:
        """Count a stream's pages into the reply; False (nothing counted) if it delivered no page and
        said why (busy, or refused): gRPC then gets the same pages, or the peer's status code."""
        if outcome.error and not outcome.received:
            log.info("peer page stream gave nothing; pulling over gRPC", peer=peer, error=outcome.error)
            return False
        reply.pages_received += outcome.stored
        reply.pages_rejected += outcome.received - outcome.stored  # bad checksum, or no room
        if outcome.error:
            reply.error = f"peer {peer}: {outcome.error}"
        return True

    async def _pull_grpc(self, peer: str, request: kv_pb2.FetchPagesRequest, reply: kv_pb2.PullReply) -> None:
        # Saves run on the store's I/O threads while the next batch arrives; they are awaited at the end.
        pending: list[concurrent.futures.Future[int]] = []
        submitted = received = 0
        try:
            async for batch in self._stub(peer).FetchPages(request, timeout=self._timeout_s):
                future, count = submit_batch(self._store, batch)
                if future is not None:
                    pending.append(future)
                submitted += count
        except grpc.aio.AioRpcError as exc:
            reply.error = f"peer {peer} stream broke: {exc.code().name}: {exc.details()}"
        except (ValueError, KVStoreError) as exc:
            reply.error = f"peer {peer} sent a malformed batch: {exc}"
        for future in pending:
            received += await asyncio.wrap_future(future)
        reply.pages_received += received
        reply.pages_rejected += submitted - received  # bad checksum, or no room

    async def pull_outcome(self, tenant: str, session_id: str, peer: str, max_blocks: int = 0) -> PullOutcome:
        reply = await self.pull(tenant, session_id, peer, max_blocks)
        return PullOutcome(reply.pages_received, reply.complete, reply.error)

    async def close(self) -> None:
        for running in list(self._running.values()):
            running.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
