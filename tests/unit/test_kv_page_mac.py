"""Pages carry MACs keyed by the cluster's secret (`PageMac`): a store never delivers a page whose
MAC it cannot verify, whether the page comes from its SSD tier, a peer's stream or a WritePages
call, and segments written under another secret are set aside like another model's.

The stores and peers here are real (shared-memory arena, segment files, gRPC, page stream); "the
attacker" knows everything but the secret: the format, the block keys, the token ids."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from node_manager.kv.page_stream import PageStreamServer
from node_manager.kv.pages import PageMac
from node_manager.kv.prefetch import PrefetchQueue
from node_manager.kv.puller import PeerPuller
from node_manager.kv.segments import encode_header, parse_header
from node_manager.kv.service import KVStoreService
from node_manager.kv.store import TieredStore
from node_manager.kv.transfer import page_batch
from symphony.rpc import kv_pb2, kv_pb2_grpc
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
SECRET = b"the cluster's secret, 32 chars.."
OTHER_SECRET = b"someone else's secret, 32 chars."


def test_segments_under_another_secret_are_set_aside_and_load_under_their_own(
    make_store: MakeStore, ssd_dir: Path
) -> None:
    first = make_store(page_secret=SECRET)
    data = save_session(first, "s", BLOCKS, seed=1, base=0)
    first.close()
    files = segment_files(ssd_dir)
    assert files and {parse_header(p.read_bytes()).key_id for p in files} == {PageMac(SECRET).key_id}

    other = make_store(page_secret=OTHER_SECRET, ssd_keep_other_models=True)
    assert other.stats()["pages"] == 0  # not one page indexed: each would fail its check
    assert metric(other, "symphony_kv_ssd_segments_other_model_total", action="kept") == len(files)
    assert metric(other, "symphony_kv_ssd_segments_damaged_total") == 0  # another secret is not damage
    other.sessions.put("acme", "s", tokens(BLOCKS, base=0))
    assert other.loadable_prefix_blocks("acme", "s") == 0
    other.close()

    again = make_store(page_secret=SECRET)  # the secret they were written under: they load, byte for byte
    again.sessions.put("acme", "s", tokens(BLOCKS, base=0))
    tensors, results = load_rows(again, "s", BLOCKS)
    assert all(r.failed == () for r in results)
    assert all(torch.equal(tensors[layer], data[layer]) for layer in range(LAYERS))


def test_by_default_segments_under_another_secret_are_deleted(make_store: MakeStore, ssd_dir: Path) -> None:
    first = make_store(page_secret=SECRET)
    save_session(first, "s", BLOCKS, seed=4, base=0)
    first.close()
    files = segment_files(ssd_dir)
    other = make_store(page_secret=OTHER_SECRET)
    assert other.stats()["pages"] == 0 and not any(path.exists() for path in files)
    assert metric(other, "symphony_kv_ssd_segments_other_model_total", action="dropped") == len(files)


def test_a_page_forged_on_disk_without_the_secret_is_never_delivered(make_store: MakeStore, ssd_dir: Path) -> None:
    """Someone who can write the SSD directory but does not know the secret replaces a page's bytes
    and gives it a well-formed entry: the right key id, a fresh table checksum, and a MAC made
    under the only key they have. The rebuild indexes the segment (its format is sound); the load
    refuses the page and delivers the rest."""
    first = make_store(page_secret=SECRET)
    save_session(first, "s", BLOCKS, seed=2, base=0)
    first.close()
    path = segment_files(ssd_dir)[0]
    raw = bytearray(path.read_bytes())
    header = parse_header(bytes(raw))
    victim = header.entries[0]
    forged_page = (bytes(range(256)) * header.page_bytes)[: header.page_bytes]
    raw[header.page_offset(0) : header.page_offset(1)] = forged_page
    guess = PageMac(b"a guess at the secret, 32 chars.")
    entries = [
        type(victim)(victim.block_key, victim.layer, guess.tag(victim.block_key, victim.layer, forged_page)),
        *header.entries[1:],
    ]
    raw[: header.header_len] = encode_header(header.seq, header.page_bytes, header.model, entries, header.key_id)
    path.write_bytes(bytes(raw))

    store = make_store(page_secret=SECRET)
    store.sessions.put("acme", "s", tokens(BLOCKS, base=0))
    assert metric(store, "symphony_kv_ssd_segments_damaged_total") == 0  # well-formed: indexed
    tensors, results = load_rows(store, "s", BLOCKS)
    block = store.sessions.get("acme", "s").blocks.block_keys.index(victim.block_key)
    failed = {(r.layer, b) for r in results for b in r.failed}
    assert failed == {(victim.layer, block)}
    forged = torch.frombuffer(bytearray(forged_page), dtype=torch.int64)
    assert not torch.equal(tensors[victim.layer][block], forged)  # its bytes never reached the rows


async def _serve(store: TieredStore) -> tuple[grpc.aio.Server, str, PageStreamServer]:
    stream = PageStreamServer(store, "127.0.0.1", 0, timeout_s=TIMEOUT)
    puller = PeerPuller(store, TIMEOUT)
    queue = PrefetchQueue(store, store.metrics, puller, max_pending=4, concurrency=1)
    server = grpc.aio.server()
    kv_pb2_grpc.add_KVStoreServicer_to_server(KVStoreService("node", store, queue, puller, stream.port), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}", stream


@pytest.fixture
async def impostor(make_store: MakeStore, tmp_path: Path) -> AsyncIterator[tuple[TieredStore, str]]:
    """A peer that speaks the protocol and holds the session, under another secret."""
    store = make_store(directory=tmp_path / "impostor", page_secret=OTHER_SECRET)
    server, address, stream = await _serve(store)
    yield store, address
    await server.stop(None)
    stream.close()


@pytest.mark.parametrize("connected", [True, False], ids=["page-stream", "grpc"])
async def test_a_peer_without_the_secret_installs_no_page(
    impostor: tuple[TieredStore, str], make_store: MakeStore, connected: bool
) -> None:
    store, address = impostor
    save_session(store, "s", BLOCKS, seed=3)
    receiver = make_store(page_secret=SECRET)
    puller = PeerPuller(receiver, timeout_s=TIMEOUT, use_page_stream=connected)
    try:
        if connected:
            await puller.connect(address)
        reply = await puller.pull("acme", "s", address)
    finally:
        await puller.close()
    assert not reply.complete and reply.pages_received == 0
    assert reply.pages_rejected == BLOCKS * LAYERS  # every page it sent failed its MAC
    assert receiver.stats()["pages"] == 0
    assert receiver.loadable_prefix_blocks("acme", "s") == 0


async def test_write_pages_keeps_only_pages_tagged_under_the_secret(make_store: MakeStore) -> None:
    store = make_store(page_secret=SECRET)
    server, address, stream = await _serve(store)
    ids = tokens(BLOCKS, base=0)
    ref = kv_pb2.SessionRef(tenant="acme", session_id="s")
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = kv_pb2_grpc.KVStoreStub(channel)
            await stub.PutSession(kv_pb2.PutSessionRequest(session=ref, token_ids=ids), timeout=TIMEOUT)
            keys = store.sessions.get("acme", "s").blocks.block_keys
            page = (bytes(range(256)) * store.geometry.page_bytes)[: store.geometry.page_bytes]
            data = page * BLOCKS
            forged = await stub.WritePages(
                iter([page_batch(PageMac(OTHER_SECRET), ref, keys, layer, 0, data) for layer in range(LAYERS)]),
                timeout=TIMEOUT,
            )
            assert (forged.pages_stored, forged.pages_rejected) == (0, BLOCKS * LAYERS)
            assert store.loadable_prefix_blocks("acme", "s") == 0
            genuine = await stub.WritePages(
                iter([page_batch(PageMac(SECRET), ref, keys, layer, 0, data) for layer in range(LAYERS)]),
                timeout=TIMEOUT,
            )
            assert (genuine.pages_stored, genuine.pages_rejected) == (BLOCKS * LAYERS, 0)  # the control
            assert store.loadable_prefix_blocks("acme", "s") == BLOCKS
    finally:
        await server.stop(None)
        stream.close()
