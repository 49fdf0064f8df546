"""KV of one model never reaches another: the SSD rebuild, peer pulls and the connector's checks.

The stores here are real (shared-memory arena, segment files, gRPC service, page stream); "another
model" is a store opened under another fingerprint, as a node restarted with another dtype or another
revision of the weights is."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from node_manager.connector.lookup import check_hello_model
from node_manager.kv.errors import ModelMismatch, SessionNotFound
from node_manager.kv.page_stream import PageStreamServer
from node_manager.kv.pages import Tier
from node_manager.kv.prefetch import PrefetchQueue
from node_manager.kv.puller import PeerPuller
from node_manager.kv.segments import parse_header
from node_manager.kv.service import KVStoreService
from node_manager.kv.store import TieredStore
from node_manager.kv.transfer import stream_pages
from symphony.rpc import kv_pb2, kv_pb2_grpc
from tests.helpers import OTHER_MODEL, TEST_MODEL
from tests.unit.kv_store_support import (
    LAYERS,
    TIMEOUT,
    MakeStore,
    load_rows,
    metric,
    save_session,
    segment_files,
    tokens,
)

BLOCKS = 3


def _models_on_disk(directory: Path) -> set[bytes]:
    return {parse_header(path.read_bytes()).model for path in segment_files(directory)}


def _reopen(make_store: MakeStore, model: bytes, **overrides: object) -> TieredStore:
    return make_store(model=model, **overrides)


# ---- the SSD rebuild ------------------------------------------------------------------------------


def test_segments_of_another_model_are_dropped_at_rebuild(make_store: MakeStore, ssd_dir: Path) -> None:
    """The issue's reproduction at the store: a bfloat16 node's history on SSD, then a float16 node
    (same page size) on the same directory. Nothing of it is loadable, the files are gone, and the
    drop is counted."""
    first = make_store()
    save_session(first, "mid-1", BLOCKS, seed=1, base=0)
    first.close()
    files = segment_files(ssd_dir)
    assert files

    other = _reopen(make_store, OTHER_MODEL)
    assert other.stats()["pages"] == 0
    assert not any(path.exists() for path in files)
    assert metric(other, "symphony_kv_ssd_segments_other_model_total", action="dropped") == len(files)
    assert metric(other, "symphony_kv_ssd_segments_damaged_total") == 0  # another model is not damage
    other.sessions.put("acme", "mid-1", tokens(BLOCKS, base=0))
    assert other.loadable_prefix_blocks("acme", "mid-1") == 0
    _, results = load_rows(other, "mid-1", BLOCKS)
    assert all(r.failed == tuple(range(BLOCKS)) for r in results)


def test_kept_segments_stay_unloaded_count_against_capacity_and_serve_a_rollback(
    make_store: MakeStore, ssd_dir: Path
) -> None:
    first = make_store()
    data = save_session(first, "s", BLOCKS, seed=2, base=0)
    first.close()
    files = segment_files(ssd_dir)
    kept_bytes = sum(path.stat().st_size for path in files)

    other = _reopen(make_store, OTHER_MODEL, ssd_keep_other_models=True)
    assert _models_on_disk(ssd_dir) == {TEST_MODEL}
    assert other.stats()["pages"] == 0 and other.stats()["ssd_bytes"] == kept_bytes
    assert metric(other, "symphony_kv_ssd_segments_other_model_total", action="kept") == len(files)
    assert metric(other, "symphony_kv_ssd_other_model_segments") == len(files)
    other.sessions.put("acme", "s", tokens(BLOCKS, base=0))
    assert other.loadable_prefix_blocks("acme", "s") == 0  # on disk, not loaded
    save_session(other, "new", 1, seed=3, base=50_000)  # its own segment takes a name none of those has
    assert other.write_behind.flush(TIMEOUT)
    assert all(path.exists() for path in files) and len(segment_files(ssd_dir)) > len(files)
    other.close()

    rollback = _reopen(make_store, TEST_MODEL)  # the old model again: its pages load, byte for byte
    rollback.sessions.put("acme", "s", tokens(BLOCKS, base=0))
    tensors, results = load_rows(rollback, "s", BLOCKS)
    assert all(r.failed == () for r in results)
    assert all(torch.equal(tensors[layer], data[layer]) for layer in range(LAYERS))
    # ...and the model it rolled back from was dropped (the default): no segment of it is left.
    assert metric(rollback, "symphony_kv_ssd_segments_other_model_total", action="dropped") >= 1
    assert _models_on_disk(ssd_dir) == {TEST_MODEL}


def test_kept_segments_are_the_first_to_go_when_room_is_needed(make_store: MakeStore, ssd_dir: Path) -> None:
    """Kept segments are older than anything this model writes from now on, even when their files
    are newer than this model's own (a rollback after the other model wrote)."""
    mine = make_store()
    save_session(mine, "mine", BLOCKS, seed=4, base=0, flush_each=True)
    mine.close()
    own = segment_files(ssd_dir)
    theirs = _reopen(make_store, OTHER_MODEL, ssd_keep_other_models=True)
    save_session(theirs, "theirs", BLOCKS, seed=5, base=90_000, flush_each=True)
    theirs.close()
    kept = [path for path in segment_files(ssd_dir) if path not in own]
    assert kept and all(path.exists() for path in own)
    # One segment per layer (flush_each), so every save takes the same room.
    session_bytes = sum(path.stat().st_size for path in own)
    assert len(own) == len(kept) == LAYERS
    # Room for both and one more save: a second save of this model needs the room of one session.
    back = _reopen(make_store, TEST_MODEL, ssd_keep_other_models=True, ssd_bytes=3 * session_bytes)
    save_session(back, "new", BLOCKS, seed=6, base=120_000, flush_each=True)
    assert back.write_behind.flush(TIMEOUT)
    assert all(path.exists() for path in kept + own)  # there was room: nothing went
    save_session(back, "newer", BLOCKS, seed=7, base=150_000, flush_each=True)
    assert back.write_behind.flush(TIMEOUT)
    assert not any(path.exists() for path in kept)  # the other model's segments went...
    assert all(path.exists() for path in own)  # ...not this model's older ones
    back.sessions.put("acme", "mine", tokens(BLOCKS, base=0))
    assert all(all(layer) for layer in back.residency("acme", "mine")[Tier.SSD])
    assert metric(back, "symphony_kv_ssd_other_model_segments") == 0


# ---- peers ----------------------------------------------------------------------------------------


class _UncheckedService(KVStoreService):
    """A sender that hands out pages without checking the requester's model (an older or a hostile
    node): the receiver must refuse them by itself."""

    async def FetchPages(self, request, context):  # type: ignore[no-untyped-def,override]
        async for batch in stream_pages(
            self.store,
            request.session.tenant,
            request.session.session_id,
            request.first_block,
            request.num_blocks or None,
        ):
            yield batch


async def _serve(store: TieredStore, service_type: type[KVStoreService], data_port: int) -> tuple[grpc.aio.Server, str]:
    puller = PeerPuller(store, TIMEOUT)
    queue = PrefetchQueue(store, store.metrics, puller, max_pending=4, concurrency=1)
    server = grpc.aio.server()
    kv_pb2_grpc.add_KVStoreServicer_to_server(service_type("peer", store, queue, puller, data_port), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
async def sender(make_store: MakeStore, tmp_path: Path) -> AsyncIterator[tuple[TieredStore, str]]:
    store = make_store(directory=tmp_path / "sender")
    stream = PageStreamServer(store, "127.0.0.1", 0, timeout_s=TIMEOUT)
    server, address = await _serve(store, KVStoreService, stream.port)
    yield store, address
    await server.stop(None)
    stream.close()


@pytest.mark.parametrize("connected", [True, False], ids=["page-stream", "grpc"])
async def test_a_peer_of_another_model_gets_no_pages_and_gives_none(
    sender: tuple[TieredStore, str], make_store: MakeStore, connected: bool
) -> None:
    store, address = sender
    save_session(store, "s", BLOCKS, seed=6)
    receiver = make_store(model=OTHER_MODEL)
    puller = PeerPuller(receiver, timeout_s=TIMEOUT, use_page_stream=connected)
    try:
        if connected:
            await puller.connect(address)
        reply = await puller.pull("acme", "s", address)
    finally:
        await puller.close()
    assert (reply.complete, reply.pages_received) == (False, 0)
    assert "model" in reply.error
    with pytest.raises(SessionNotFound):
        receiver.sessions.get("acme", "s")  # not even its token history was registered
    assert receiver.stats()["pages"] == 0
    refused_by = "sender" if connected else "receiver"  # the stream refuses first; gRPC's status reaches the receiver
    owner = store if connected else receiver
    assert metric(owner, "symphony_kv_peer_refused_total", side=refused_by) >= 1


async def test_a_receiver_refuses_a_sender_that_does_not_check(make_store: MakeStore, tmp_path: Path) -> None:
    store = make_store(directory=tmp_path / "sender")
    save_session(store, "s", BLOCKS, seed=7)
    server, address = await _serve(store, _UncheckedService, data_port=0)  # no page stream: gRPC only
    receiver = make_store(model=OTHER_MODEL)
    puller = PeerPuller(receiver, timeout_s=TIMEOUT)
    try:
        reply = await puller.pull("acme", "s", address)
    finally:
        await puller.close()
        await server.stop(None)
    assert reply.pages_received == 0 and "the peer serves model" in reply.error
    assert metric(receiver, "symphony_kv_peer_refused_total", side="receiver") == 1
    with pytest.raises(SessionNotFound):
        receiver.sessions.get("acme", "s")


async def test_fetch_pages_needs_the_requesters_model(sender: tuple[TieredStore, str]) -> None:
    store, address = sender
    save_session(store, "s", 1, seed=8)
    ref = kv_pb2.SessionRef(tenant="acme", session_id="s")
    async with grpc.aio.insecure_channel(address) as channel:
        stub = kv_pb2_grpc.KVStoreStub(channel)
        for fingerprint in (b"", OTHER_MODEL):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                _ = [
                    b
                    async for b in stub.FetchPages(kv_pb2.FetchPagesRequest(session=ref, model_fingerprint=fingerprint))
                ]
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        got = [b async for b in stub.FetchPages(kv_pb2.FetchPagesRequest(session=ref, model_fingerprint=TEST_MODEL))]
        assert len(got) == LAYERS
        info = await stub.GetStoreInfo(kv_pb2.StoreInfoRequest())
        status = await stub.GetSessionStatus(kv_pb2.SessionStatusRequest(session=ref))
    assert info.model_fingerprint == status.model_fingerprint == TEST_MODEL


def test_check_model_names_both_models(make_store: MakeStore) -> None:
    store = make_store()
    store.check_model(TEST_MODEL, "sender")
    names_both = f"requester serves model {OTHER_MODEL.hex()[:12]}, this node {TEST_MODEL.hex()[:12]}"
    with pytest.raises(ModelMismatch, match=names_both):
        store.check_model(OTHER_MODEL, "sender")
    with pytest.raises(ModelMismatch, match="peer serves model none"):
        store.check_model(b"", "receiver")
    assert metric(store, "symphony_kv_peer_refused_total", side="sender") == 1
    assert metric(store, "symphony_kv_peer_refused_total", side="receiver") == 1


# ---- the connector --------------------------------------------------------------------------------


def test_the_connector_refuses_a_node_manager_of_another_model() -> None:
    check_hello_model({"model_fingerprint": TEST_MODEL.hex()}, TEST_MODEL)
    for hello in ({"model_fingerprint": OTHER_MODEL.hex()}, {}):
        with pytest.raises(ValueError, match="tiers are not used"):
            check_hello_model(hello, TEST_MODEL)
