"""PeerPuller against a real peer in this process: the KV gRPC service on a real server, beside a real
page stream, both over one sender store (the two node-process version is in
tests/integration/test_kv_nodes.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from node_manager.kv.loader import RowTarget
from node_manager.kv.page_stream import PageStreamServer
from node_manager.kv.prefetch import PrefetchQueue
from node_manager.kv.puller import PeerPuller
from node_manager.kv.service import KVStoreService
from node_manager.kv.store import TieredStore
from symphony.rpc import kv_pb2, kv_pb2_grpc
from tests.helpers import free_port
from tests.unit.kv_store_support import BLOCK, LAYERS, TIMEOUT, WORDS, MakeStore, page_data, save_session, tokens

BLOCKS = 5


class _CountingService(KVStoreService):
    """The real service, counting the status calls a pull makes."""

    status_calls = 0

    async def GetSessionStatus(
        self, request: kv_pb2.SessionStatusRequest, context: grpc.aio.ServicerContext
    ) -> kv_pb2.SessionStatus:
        self.status_calls += 1
        return await super().GetSessionStatus(request, context)


@dataclass
class _Peer:
    address: str
    store: TieredStore
    service: _CountingService
    stream: PageStreamServer


@pytest.fixture
async def peer(make_store: MakeStore, tmp_path: Path) -> AsyncIterator[_Peer]:
    store = make_store(directory=tmp_path / "peer")  # its own SSD: what a receiver holds comes from the pull
    stream = PageStreamServer(store, "127.0.0.1", 0, timeout_s=TIMEOUT)
    own_puller = PeerPuller(store, TIMEOUT)
    service = _CountingService(
        "peer",
        store,
        PrefetchQueue(store, store.metrics, own_puller, max_pending=4, concurrency=1),
        own_puller,
        stream.port,
    )
    server = grpc.aio.server()
    kv_pb2_grpc.add_KVStoreServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield _Peer(f"127.0.0.1:{port}", store, service, stream)
    await server.stop(None)
    stream.close()


def _pages(store: TieredStore, session: str) -> list[torch.Tensor]:
    return [store.dram.pages[slots] for slots in store.dram_slots("acme", session)]


async def test_connect_opens_the_channel_and_learns_the_page_stream(peer: _Peer, make_store: MakeStore) -> None:
    puller = PeerPuller(make_store(), timeout_s=TIMEOUT)
    try:
        await puller.connect(peer.address)
        channel = puller._channels[peer.address]
        assert channel.get_state() is grpc.ChannelConnectivity.READY
        assert puller._data_ports[peer.address] == peer.stream.port
        puller._stub(peer.address)
        assert puller._channels[peer.address] is channel  # the pull's stub rides the warm channel
    finally:
        await puller.close()


async def test_a_connected_pull_takes_the_status_from_the_page_stream(peer: _Peer, make_store: MakeStore) -> None:
    data = save_session(peer.store, "s", BLOCKS, seed=1)
    receiver = make_store()
    puller = PeerPuller(receiver, timeout_s=TIMEOUT)
    try:
        await puller.connect(peer.address)
        reply = await puller.pull("acme", "s", peer.address)
    finally:
        await puller.close()
    assert (reply.complete, reply.pages_expected, reply.pages_received, reply.error) == (
        True,
        BLOCKS * LAYERS,
        BLOCKS * LAYERS,
        "",
    )
    assert peer.service.status_calls == 0
    assert (
        receiver.sessions.get("acme", "s").token_ids.tolist() == peer.store.sessions.get("acme", "s").token_ids.tolist()
    )
    assert all(torch.equal(got, want) for got, want in zip(_pages(receiver, "s"), data, strict=True))


async def test_a_first_pull_asks_grpc_for_the_status_and_later_ones_do_not(peer: _Peer, make_store: MakeStore) -> None:
    save_session(peer.store, "a", BLOCKS, seed=2)
    save_session(peer.store, "b", BLOCKS, seed=3)
    puller = PeerPuller(make_store(), timeout_s=TIMEOUT)
    try:
        first = await puller.pull("acme", "a", peer.address)
        second = await puller.pull("acme", "b", peer.address)
        again = await puller.pull("acme", "b", peer.address)  # all held here now: nothing to fetch
    finally:
        await puller.close()
    assert first.complete and first.pages_received == BLOCKS * LAYERS
    assert second.complete and second.pages_received == BLOCKS * LAYERS
    assert (again.complete, again.pages_expected, again.pages_received) == (True, 0, 0)
    assert peer.service.status_calls == 1


async def test_a_pull_only_fetches_the_blocks_it_lacks(peer: _Peer, make_store: MakeStore) -> None:
    data = save_session(peer.store, "s", BLOCKS, seed=4)
    receiver = make_store()
    receiver.sessions.put("acme", "s", tokens(2, 40_000))  # the first two blocks already here
    for layer in range(LAYERS):
        assert receiver.ingest.save_layer("acme", "s", layer, 0, data[layer][:2]).result(TIMEOUT) == 2
    puller = PeerPuller(receiver, timeout_s=TIMEOUT)
    try:
        await puller.connect(peer.address)
        reply = await puller.pull("acme", "s", peer.address)
    finally:
        await puller.close()
    assert (reply.complete, reply.pages_expected, reply.pages_received) == (True, 3 * LAYERS, 3 * LAYERS)
    assert all(torch.equal(got, want) for got, want in zip(_pages(receiver, "s"), data, strict=True))


@pytest.mark.parametrize("stream", [True, False])
async def test_a_pull_brings_the_peers_partial_tail_after_the_full_blocks(
    peer: _Peer, make_store: MakeStore, stream: bool
) -> None:
    data = save_session(peer.store, "s", BLOCKS, seed=7)
    history = peer.store.sessions.get("acme", "s").token_ids.tolist()
    tail_tokens = BLOCK - 1
    peer.store.sessions.put("acme", "s", [*history, *range(5, 5 + tail_tokens)])  # the turn ended mid-block
    tail = page_data(1, seed=8)
    for layer in range(LAYERS):
        assert (
            peer.store.ingest.save_layer("acme", "s", layer, BLOCKS, tail[layer], tail_tokens=tail_tokens).result(
                TIMEOUT
            )
            == 1
        )
    assert peer.store.loadable_tail_tokens("acme", "s") == tail_tokens
    receiver = make_store()
    puller = PeerPuller(receiver, timeout_s=TIMEOUT, use_page_stream=stream)
    try:
        reply = await puller.pull("acme", "s", peer.address)
        again = await puller.pull("acme", "s", peer.address)  # all held here now: nothing to fetch
    finally:
        await puller.close()
    assert (reply.complete, reply.pages_expected, reply.pages_received, reply.error) == (
        True,
        (BLOCKS + 1) * LAYERS,
        (BLOCKS + 1) * LAYERS,
        "",
    )
    assert (again.complete, again.pages_expected) == (True, 0)
    assert receiver.loadable_tail_tokens("acme", "s") == tail_tokens
    dest = [torch.zeros(BLOCKS + 1, WORDS, dtype=torch.int64) for _ in range(LAYERS)]
    results = receiver.loads.into_rows(
        "acme", "s", 0, BLOCKS + 1, target=RowTarget(dest, list(range(BLOCKS + 1))), tail_tokens=tail_tokens
    ).wait_all(TIMEOUT)
    assert all(not r.failed for r in results)
    assert all(torch.equal(dest[layer], torch.cat([data[layer], tail[layer]])) for layer in range(LAYERS))


async def test_a_second_pull_of_a_session_under_way_joins_it(peer: _Peer, make_store: MakeStore) -> None:
    """An advisory's move and its request's own pull ask for the same session at once: one pull runs,
    both get its reply, and each page is stored once. A later pull runs anew (it finds all held)."""
    data = save_session(peer.store, "s", BLOCKS, seed=6)
    receiver = make_store()
    puller = PeerPuller(receiver, timeout_s=TIMEOUT)
    try:
        await puller.connect(peer.address)
        first, second = await asyncio.gather(
            puller.pull("acme", "s", peer.address), puller.pull("acme", "s", peer.address)
        )
        later = await puller.pull("acme", "s", peer.address)
    finally:
        await puller.close()
    assert first is second and first.complete and first.pages_received == BLOCKS * LAYERS
    stored = receiver.metrics.registry.get_sample_value("symphony_kv_peer_pages_total", {"outcome": "stored"})
    assert stored == BLOCKS * LAYERS
    assert (later.complete, later.pages_expected, later.pages_received) == (True, 0, 0)
    assert all(torch.equal(got, want) for got, want in zip(_pages(receiver, "s"), data, strict=True))


async def test_an_unknown_session_reports_the_peers_not_found(peer: _Peer, make_store: MakeStore) -> None:
    puller = PeerPuller(make_store(), timeout_s=TIMEOUT)
    try:
        await puller.connect(peer.address)
        reply = await puller.pull("acme", "nobody", peer.address)
    finally:
        await puller.close()
    assert not reply.complete and "NOT_FOUND" in reply.error


async def test_a_stale_page_stream_port_falls_back_and_is_relearned(peer: _Peer, make_store: MakeStore) -> None:
    save_session(peer.store, "s", BLOCKS, seed=5)
    puller = PeerPuller(make_store(), timeout_s=TIMEOUT)
    try:
        await puller.connect(peer.address)
        puller._data_ports[peer.address] = free_port()  # as if the peer restarted on another port
        reply = await puller.pull("acme", "s", peer.address)
    finally:
        await puller.close()
    assert reply.complete and reply.pages_received == BLOCKS * LAYERS
    assert peer.service.status_calls == 1
    assert puller._data_ports[peer.address] == peer.stream.port


async def test_connect_to_a_dead_peer_fails_within_its_timeout(make_store: MakeStore) -> None:
    puller = PeerPuller(make_store(), timeout_s=TIMEOUT)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await puller.connect(f"127.0.0.1:{free_port()}", timeout_s=0.3)
        assert failed.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        await puller.close()


@pytest.mark.parametrize("connected", [True, False], ids=["page-stream-status", "grpc-status"])
async def test_a_pull_limited_to_a_prefix_fetches_only_its_blocks(
    peer: _Peer, make_store: MakeStore, connected: bool
) -> None:
    """A shared prefix pulled under the name of a session whose history goes on past it: only the
    first blocks come, and the receiver's copy is whole up to there. A later pull of the rest
    fetches only what is missing."""
    data = save_session(peer.store, "s", BLOCKS, seed=4)
    receiver = make_store()
    puller = PeerPuller(receiver, timeout_s=TIMEOUT)
    try:
        if connected:
            await puller.connect(peer.address)
        prefix = await puller.pull("acme", "s", peer.address, max_blocks=2)
        held = receiver.loadable_prefix_blocks("acme", "s")
        rest = await puller.pull("acme", "s", peer.address)
    finally:
        await puller.close()
    assert (prefix.complete, prefix.pages_expected, prefix.pages_received) == (True, 2 * LAYERS, 2 * LAYERS)
    assert held == 2
    assert (rest.complete, rest.pages_received) == (True, (BLOCKS - 2) * LAYERS)
    assert all(torch.equal(got, want) for got, want in zip(_pages(receiver, "s"), data, strict=True))


async def test_a_pull_of_a_peers_full_blocks_leaves_its_partial_tail(peer: _Peer, make_store: MakeStore) -> None:
    """`max_blocks` counts full blocks: a limit equal to the peer's stops short of its partial last
    block (a near pull, whose far pull registers a longer history where that page is no use)."""
    save_session(peer.store, "s", BLOCKS, seed=9)
    history = peer.store.sessions.get("acme", "s").token_ids.tolist()
    peer.store.sessions.put("acme", "s", [*history, *range(5, 5 + BLOCK - 1)])
    tail = page_data(1, seed=10)
    for layer in range(LAYERS):
        saved = peer.store.ingest.save_layer("acme", "s", layer, BLOCKS, tail[layer], tail_tokens=BLOCK - 1)
        assert saved.result(TIMEOUT) == 1
    receiver = make_store()
    puller = PeerPuller(receiver, timeout_s=TIMEOUT)
    try:
        reply = await puller.pull("acme", "s", peer.address, max_blocks=BLOCKS)
    finally:
        await puller.close()
    assert (reply.complete, reply.pages_expected, reply.pages_received) == (True, BLOCKS * LAYERS, BLOCKS * LAYERS)
    assert receiver.loadable_prefix_blocks("acme", "s") == BLOCKS
    assert receiver.loadable_tail_tokens("acme", "s") == 0


async def test_a_pull_from_a_peer_with_less_of_the_history_keeps_the_longer_one_here(
    peer: _Peer, make_store: MakeStore
) -> None:
    """The receiver knows the session's whole history (a far pull registered it, say); a peer with
    its first 3 blocks sends those and leaves the history as it was, so the pages of the far pull
    still under way, past those 3, stay wanted."""
    data = save_session(peer.store, "s", 3, seed=11, base=70_000)
    receiver = make_store()
    whole = tokens(BLOCKS, 70_000)
    receiver.sessions.put("acme", "s", whole)
    puller = PeerPuller(receiver, timeout_s=TIMEOUT)
    try:
        reply = await puller.pull("acme", "s", peer.address)
    finally:
        await puller.close()
    assert reply.complete and reply.pages_received == 3 * LAYERS
    assert receiver.sessions.get("acme", "s").token_ids.tolist() == whole
    assert receiver.loadable_prefix_blocks("acme", "s") == 3
    got = [store_pages[:3] for store_pages in _pages(receiver, "s")]
    assert all(torch.equal(g, want) for g, want in zip(got, data, strict=True))
