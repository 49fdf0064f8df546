"""Three real node-manager processes (`symphony node`, engine disabled) exchanging KV over gRPC:
prefetch from a peer (and from a near peer first), layer-ordered streams, restart with the SSD
index rebuilt, bad input, a peer that dies mid-stream, and kill -9 during SSD writes."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import torch

from node_manager.kv.pages import PageMac
from node_manager.kv.slots import DramArena
from node_manager.kv.transfer import page_batch
from symphony.config_secrets import new_cluster_secret
from symphony.kv_addressing import ModelFingerprint, chain_block_keys
from symphony.kv_geometry import KVGeometry, hf_config_for
from symphony.rpc import kv_pb2, kv_pb2_grpc
from tests.helpers import OTHER_MODEL, TEST_MODEL, async_wait_until, free_port, free_port_run, wait_until

GEOMETRY = KVGeometry(num_layers=6, kv_heads=3, head_size=64, block_size=32)  # SmolLM2 pages, fewer layers
TENANT = "acme"
SECRET = new_cluster_secret()  # the nodes' cluster secret: pages written to them carry MACs under it
MAC = PageMac(SECRET.encode())


@dataclass
class Node:
    index: int
    address: str
    metrics_url: str
    argv: list[str]
    log: Path
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env)

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _model_dir(root: Path) -> Path:
    """A model folder the node reads the KV geometry from; the engine is disabled, so no real weights."""
    model = root / "tiny-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(hf_config_for(GEOMETRY)))
    (model / "model.safetensors").write_bytes(b"")
    return model


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Node]]:
    home = tmp_path_factory.mktemp("kv-home")
    grpc_base, metrics_base = free_port_run(3), free_port_run(3)
    config = home / "symphony.toml"
    config.write_text(f"""
home = "{home}"
[cluster]
nodes = 3
secret = "{SECRET}"
[node]
grpc_port_base = {grpc_base}
engine_port_base = {free_port_run(3)}
[engine]
enabled = false
model = "{_model_dir(home)}"
[kv]
hbm_bytes = {16 << 20}
dram_bytes = {32 << 20}
ssd_bytes = {256 << 20}
metrics_port_base = {metrics_base}
""")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYMPHONY_")}
    result = [
        Node(
            i,
            f"127.0.0.1:{grpc_base + i}",
            f"http://127.0.0.1:{metrics_base + i}/metrics",
            [sys.executable, "-m", "symphony.cli", "node", "--config", str(config), "--index", str(i)],
            home / f"node-{i}.out",
            env,
        )
        for i in range(3)
    ]
    for node in result:
        node.start()
    try:
        for node in result:
            _wait_serving(node)
        yield result
    finally:
        for node in result:
            node.stop()


def _wait_serving(node: Node) -> None:
    def serving() -> bool:
        assert node.process is not None
        if node.process.poll() is not None:
            raise AssertionError(f"node exited: {node.log.read_text(errors='replace')[-2000:]}")
        try:
            with grpc.insecure_channel(node.address) as channel:
                kv_pb2_grpc.KVStoreStub(channel).GetStoreInfo(kv_pb2.StoreInfoRequest(), timeout=1)
            return True
        except grpc.RpcError:
            return False

    wait_until(serving, 60, f"node {node.index} to serve gRPC")


@pytest.fixture
async def stubs(nodes: list[Node]) -> AsyncIterator[list[kv_pb2_grpc.KVStoreStub]]:
    options = [("grpc.max_receive_message_length", 5 << 20)]
    channels = [grpc.aio.insecure_channel(n.address, options=options) for n in nodes]
    yield [kv_pb2_grpc.KVStoreStub(c) for c in channels]
    for channel in channels:
        await channel.close()


def _session(name: str, tokens: int, seed: int) -> tuple[kv_pb2.SessionRef, list[int], list[torch.Tensor]]:
    rng = random.Random(seed)
    token_ids = [rng.randrange(49152) for _ in range(tokens)]
    blocks = tokens // GEOMETRY.block_size
    gen = torch.Generator().manual_seed(seed)
    pages = [
        torch.randint(-(2**62), 2**62, (blocks, GEOMETRY.page_words), dtype=torch.int64, generator=gen)
        for _ in range(GEOMETRY.num_layers)
    ]
    return kv_pb2.SessionRef(tenant=TENANT, session_id=name), token_ids, pages


async def _model(stub: kv_pb2_grpc.KVStoreStub) -> ModelFingerprint:
    """The fingerprint the node computed for its model folder (what its keys and checksums hang off)."""
    return ModelFingerprint((await stub.GetStoreInfo(kv_pb2.StoreInfoRequest(), timeout=5)).model_fingerprint)


def _batches(
    ref: kv_pb2.SessionRef, token_ids: list[int], pages: list[torch.Tensor], model: ModelFingerprint
) -> list[kv_pb2.PageBatch]:
    keys = chain_block_keys(model, ref.tenant, token_ids, GEOMETRY.block_size).block_keys
    return [
        page_batch(MAC, ref, keys, layer, 0, layer_pages.numpy().tobytes()) for layer, layer_pages in enumerate(pages)
    ]


async def _upload(
    stub: kv_pb2_grpc.KVStoreStub, ref: kv_pb2.SessionRef, token_ids: list[int], pages: list[torch.Tensor]
) -> None:
    await stub.PutSession(kv_pb2.PutSessionRequest(session=ref, token_ids=token_ids), timeout=10)
    reply = await stub.WritePages(iter(_batches(ref, token_ids, pages, await _model(stub))), timeout=30)
    assert (reply.pages_stored, reply.pages_rejected) == (len(pages) * pages[0].shape[0], 0)


async def _download(stub: kv_pb2_grpc.KVStoreStub, ref: kv_pb2.SessionRef) -> dict[tuple[int, int], bytes]:
    """Every page a node streams back, keyed (layer, block); also checks the stream's layer order."""
    got: dict[tuple[int, int], bytes] = {}
    last_layer = -1
    request = kv_pb2.FetchPagesRequest(session=ref, model_fingerprint=await _model(stub))
    async for batch in stub.FetchPages(request, timeout=30):
        assert batch.layer >= last_layer, "pages must stream in layer order"
        assert batch.ByteSize() <= 4 * 1024 * 1024
        last_layer = batch.layer
        for i in range(len(batch.checksums)):
            page = batch.data[i * GEOMETRY.page_bytes : (i + 1) * GEOMETRY.page_bytes]
            got[(batch.layer, batch.first_block + i)] = page
    return got


def _expected(pages: list[torch.Tensor]) -> dict[tuple[int, int], bytes]:
    return {
        (layer, b): layer_pages[b].numpy().tobytes()
        for layer, layer_pages in enumerate(pages)
        for b in range(layer_pages.shape[0])
    }


def _tier(status: kv_pb2.SessionStatus, tier: int) -> kv_pb2.TierResidency:
    return next(t for t in status.tiers if t.tier == tier)


async def test_prefetch_pulls_a_session_from_the_peer_into_the_top_tier(
    stubs: list[kv_pb2_grpc.KVStoreStub], nodes: list[Node]
) -> None:
    ref, token_ids, pages = _session("chat-1", 2048 + 17, seed=1)
    await _upload(stubs[0], ref, token_ids, pages)
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await stubs[1].GetSessionStatus(kv_pb2.SessionStatusRequest(session=ref), timeout=5)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND

    done = await stubs[1].Prefetch(
        kv_pb2.PrefetchRequest(
            session=ref, target_tier=kv_pb2.TIER_HBM, deadline_ms=5000, source_peer=nodes[0].address, wait_ms=30_000
        ),
        timeout=40,
    )
    assert done.state == kv_pb2.PREFETCH_STATE_DONE, done
    assert done.pages_from_peer == GEOMETRY.num_layers * 64
    assert done.pages_in_target == GEOMETRY.num_layers * 64
    # These nodes serve no model: the top tier ends at the store's own device pool, and says so.
    assert done.engine_cached_tokens == 0 and "serves no model" in done.engine_note
    again = await stubs[1].GetPrefetch(kv_pb2.PrefetchRef(prefetch_id=done.prefetch_id), timeout=5)
    assert again.state == kv_pb2.PREFETCH_STATE_DONE

    status = await stubs[1].GetSessionStatus(
        kv_pb2.SessionStatusRequest(session=ref, include_token_ids=True), timeout=5
    )
    assert list(status.token_ids) == token_ids and status.num_blocks == 64 and status.loadable_prefix_blocks == 64
    assert status.data_port > 0  # every node advertises its raw page stream (pulls prefer it to FetchPages)
    assert _tier(status, kv_pb2.TIER_HBM).complete_prefix_blocks == 64
    assert list(_tier(status, kv_pb2.TIER_DRAM).blocks_per_layer) == [64] * GEOMETRY.num_layers
    assert await _download(stubs[1], ref) == _expected(pages)


async def test_a_prefetch_takes_a_near_peers_blocks_first_and_only_the_rest_from_the_far_one(
    stubs: list[kv_pb2_grpc.KVStoreStub], nodes: list[Node]
) -> None:
    """Node 0 (another region's, say) holds all 64 blocks of the session, node 1 (the target's
    region) its first 48. Node 2 pulls those 48 from node 1 and only the last 16 from node 0; with
    a near peer that lacks the session, everything comes from node 0. The pages are the session's
    either way."""
    ref, token_ids, pages = _session("near-far", 2048 + 17, seed=7)
    await _upload(stubs[0], ref, token_ids, pages)
    await _upload(stubs[1], ref, token_ids[: 48 * 32], [layer_pages[:48] for layer_pages in pages])
    layers = GEOMETRY.num_layers

    def prefetch(session: kv_pb2.SessionRef) -> kv_pb2.PrefetchRequest:
        return kv_pb2.PrefetchRequest(
            session=session,
            target_tier=kv_pb2.TIER_DRAM,
            deadline_ms=5000,
            source_peer=nodes[0].address,
            near_peer=nodes[1].address,
            near_blocks=48,
            wait_ms=30_000,
        )

    done = await stubs[2].Prefetch(prefetch(ref), timeout=40)
    assert done.state == kv_pb2.PREFETCH_STATE_DONE, done
    assert (done.pages_from_near_peer, done.pages_from_peer) == (48 * layers, 64 * layers)
    assert await _download(stubs[2], ref) == _expected(pages)

    other, other_ids, other_pages = _session("far-only", 1024, seed=8)  # node 1 never had it
    await _upload(stubs[0], other, other_ids, other_pages)
    done = await stubs[2].Prefetch(prefetch(other), timeout=40)
    assert done.state == kv_pb2.PREFETCH_STATE_DONE, done
    assert (done.pages_from_near_peer, done.pages_from_peer) == (0, 32 * layers)
    assert await _download(stubs[2], other) == _expected(other_pages)


async def test_another_process_maps_the_dram_arena(stubs: list[kv_pb2_grpc.KVStoreStub]) -> None:
    ref, token_ids, pages = _session("arena", 256, seed=2)
    await _upload(stubs[0], ref, token_ids, pages)
    info = await stubs[0].GetStoreInfo(kv_pb2.StoreInfoRequest(), timeout=5)
    status = await stubs[0].GetSessionStatus(
        kv_pb2.SessionStatusRequest(session=ref, include_dram_slots=True), timeout=5
    )
    geometry = KVGeometry(info.num_layers, info.kv_heads, info.head_size, info.block_size, info.dtype)
    arena = DramArena.attach(info.dram_arena_name, geometry, info.dram_capacity_bytes)
    try:
        slots = list(status.dram_slots)
        assert len(slots) == GEOMETRY.num_layers * 8 and min(slots) >= 0
        for layer in range(GEOMETRY.num_layers):
            for block in range(8):
                slot = slots[layer * 8 + block]
                assert torch.equal(arena.pages[slot], pages[layer][block])
    finally:
        arena.close()


async def test_restart_after_kill_serves_everything_from_disk(
    stubs: list[kv_pb2_grpc.KVStoreStub], nodes: list[Node]
) -> None:
    ref, token_ids, pages = _session("persist", 1024, seed=3)
    await _upload(stubs[0], ref, token_ids, pages)

    async def on_ssd() -> bool:
        status = await stubs[0].GetSessionStatus(kv_pb2.SessionStatusRequest(session=ref), timeout=5)
        return _tier(status, kv_pb2.TIER_SSD).complete_prefix_blocks == 32

    await async_wait_until(on_ssd, 20, "the write-behind to put the session on SSD")
    nodes[0].kill()
    nodes[0].start()
    _wait_serving(nodes[0])
    status = await stubs[0].PutSession(kv_pb2.PutSessionRequest(session=ref, token_ids=token_ids), timeout=10)
    assert _tier(status, kv_pb2.TIER_SSD).complete_prefix_blocks == 32
    assert _tier(status, kv_pb2.TIER_DRAM).complete_prefix_blocks == 0  # DRAM died with the process
    assert await _download(stubs[0], ref) == _expected(pages)
    async with httpx.AsyncClient() as client:
        metrics = (await client.get(nodes[0].metrics_url, timeout=5)).text
    assert 'symphony_kv_load_hits_total{tier="SSD"}' in metrics


async def test_demote_leaves_a_session_on_ssd_only(stubs: list[kv_pb2_grpc.KVStoreStub]) -> None:
    ref, token_ids, pages = _session("demote", 512, seed=5)
    await _upload(stubs[0], ref, token_ids, pages)
    # Straight after the upload: the write-behind may still be busy; demote waits for it.
    status = await stubs[0].DemoteSession(kv_pb2.DemoteRequest(session=ref, tier=kv_pb2.TIER_DRAM), timeout=40)
    assert list(_tier(status, kv_pb2.TIER_DRAM).blocks_per_layer) == [0] * GEOMETRY.num_layers
    assert _tier(status, kv_pb2.TIER_SSD).complete_prefix_blocks == 16
    assert status.loadable_prefix_blocks == 16
    assert await _download(stubs[0], ref) == _expected(pages)


async def test_a_running_node_serves_its_block_events(stubs: list[kv_pb2_grpc.KVStoreStub]) -> None:
    """WatchBlocks on a `symphony node` process: a snapshot, then the blocks an upload stores."""
    stub = stubs[0]
    watch = stub.WatchBlocks(kv_pb2.WatchBlocksRequest(), timeout=60)
    try:
        batch = await asyncio.wait_for(watch.read(), 10)
        assert batch.snapshot_begin and batch.node_id == "node-0" and batch.epoch
        while not batch.snapshot_end:
            batch = await asyncio.wait_for(watch.read(), 10)
        ref, token_ids, pages = _session("watched", 128, seed=6)
        await _upload(stub, ref, token_ids, pages)
        keys = set(chain_block_keys(await _model(stub), TENANT, token_ids, GEOMETRY.block_size).block_keys)
        stored: set[bytes] = set()
        while not keys <= stored:
            batch = await asyncio.wait_for(watch.read(), 10)
            stored.update(
                key
                for event in batch.events
                if event.kind == kv_pb2.BLOCK_EVENT_STORED and event.tier == kv_pb2.TIER_DRAM
                for key in event.block_keys
            )
    finally:
        watch.cancel()


async def test_bad_requests_get_clear_codes(stubs: list[kv_pb2_grpc.KVStoreStub]) -> None:
    stub = stubs[0]
    unknown = kv_pb2.SessionRef(tenant=TENANT, session_id="never-seen")
    model = await _model(stub)
    cases = [
        (stub.GetSessionStatus(kv_pb2.SessionStatusRequest(session=unknown), timeout=5), grpc.StatusCode.NOT_FOUND),
        (
            stub.Prefetch(kv_pb2.PrefetchRequest(session=unknown, target_tier=kv_pb2.TIER_HBM), timeout=5),
            grpc.StatusCode.NOT_FOUND,
        ),
        (stub.GetPrefetch(kv_pb2.PrefetchRef(prefetch_id="nope"), timeout=5), grpc.StatusCode.NOT_FOUND),
        (
            stub.GetSessionStatus(kv_pb2.SessionStatusRequest(session=kv_pb2.SessionRef(session_id="x")), timeout=5),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            stub.Prefetch(kv_pb2.PrefetchRequest(session=unknown, target_tier=kv_pb2.TIER_SSD), timeout=5),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            stub.Prefetch(
                kv_pb2.PrefetchRequest(session=unknown, target_tier=kv_pb2.TIER_HBM, source_peer="no port"), timeout=5
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            stub.Prefetch(
                kv_pb2.PrefetchRequest(session=unknown, target_tier=kv_pb2.TIER_DRAM, engine_cache_salt="s"), timeout=5
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (  # a near peer goes with a far one, and blocks to take from it
            stub.Prefetch(
                kv_pb2.PrefetchRequest(session=unknown, target_tier=kv_pb2.TIER_DRAM, near_peer="a:1", near_blocks=4),
                timeout=5,
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            stub.Prefetch(
                kv_pb2.PrefetchRequest(
                    session=unknown, target_tier=kv_pb2.TIER_DRAM, source_peer="a:1", near_peer="b:2"
                ),
                timeout=5,
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            stub.Prefetch(
                kv_pb2.PrefetchRequest(
                    session=unknown, target_tier=kv_pb2.TIER_DRAM, source_peer="a:1", near_peer="a:1", near_blocks=4
                ),
                timeout=5,
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            stub.Prefetch(
                kv_pb2.PrefetchRequest(
                    session=unknown, target_tier=kv_pb2.TIER_DRAM, source_peer="a:1", near_peer="no port", near_blocks=4
                ),
                timeout=5,
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            stub.Prefetch(
                kv_pb2.PrefetchRequest(session=unknown, target_tier=kv_pb2.TIER_HBM, engine_cache_salt="s" * 257),
                timeout=5,
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            stub.PutSession(kv_pb2.PutSessionRequest(session=unknown, priority=17), timeout=5),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            stub.FetchPages(kv_pb2.FetchPagesRequest(session=unknown, model_fingerprint=model), timeout=5),
            grpc.StatusCode.NOT_FOUND,
        ),
        # Another model's pages never leave a node, and a fetch must say which model it is for.
        (stub.FetchPages(kv_pb2.FetchPagesRequest(session=unknown), timeout=5), grpc.StatusCode.FAILED_PRECONDITION),
        (
            stub.FetchPages(kv_pb2.FetchPagesRequest(session=unknown, model_fingerprint=OTHER_MODEL), timeout=5),
            grpc.StatusCode.FAILED_PRECONDITION,
        ),
        (
            stub.DemoteSession(kv_pb2.DemoteRequest(session=unknown, tier=kv_pb2.TIER_DRAM), timeout=5),
            grpc.StatusCode.NOT_FOUND,
        ),
        (
            stub.DemoteSession(kv_pb2.DemoteRequest(session=unknown, tier=kv_pb2.TIER_SSD), timeout=5),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    ]
    for call, code in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            result = await call if not hasattr(call, "__aiter__") else [b async for b in call]
            del result
        assert err.value.code() == code, (code, err.value.details())
    ref, token_ids, pages = _session("bad-pages", 64, seed=4)
    await stub.PutSession(kv_pb2.PutSessionRequest(session=ref, token_ids=token_ids), timeout=5)
    batch = _batches(ref, token_ids, pages, model)[0]
    batch.first_block = 1  # two pages starting at block 1 overrun a 2-block session
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.WritePages(iter([batch]), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (await stub.GetStoreInfo(kv_pb2.StoreInfoRequest(), timeout=5)).page_bytes == GEOMETRY.page_bytes


async def _pull_through(
    peer: kv_pb2_grpc.KVStoreServicer, puller: kv_pb2_grpc.KVStoreStub, ref: kv_pb2.SessionRef
) -> kv_pb2.PullReply:
    """Serve `peer` (a fault-injecting servicer) on a free port and have `puller` pull `ref` from it."""
    server = grpc.aio.server()
    kv_pb2_grpc.add_KVStoreServicer_to_server(peer, server)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    await server.start()
    try:
        return await puller.Pull(kv_pb2.PullRequest(session=ref, peer=address), timeout=30)
    finally:
        await server.stop(grace=None)


async def _assert_kept_only_verified(
    stub: kv_pb2_grpc.KVStoreStub, ref: kv_pb2.SessionRef, pages: list[torch.Tensor], count: int
) -> None:
    """The node holds exactly `count` pages of `ref`, each byte-exact: nothing corrupt was kept."""
    kept = await _download(stub, ref)
    expected = _expected(pages)
    assert len(kept) == count
    assert all(expected[key] == value for key, value in kept.items())


class _DyingPeer(kv_pb2_grpc.KVStoreServicer):
    """Fault injection: forwards a real node's stream, flips one byte in the second batch, and dies
    (UNAVAILABLE) after the third, as a peer that crashes mid-transfer would."""

    def __init__(self, upstream: kv_pb2_grpc.KVStoreStub) -> None:
        self.upstream = upstream
        self.sent: list[kv_pb2.PageBatch] = []

    async def GetSessionStatus(self, request, context):  # type: ignore[no-untyped-def]
        status = await self.upstream.GetSessionStatus(request, timeout=5)
        status.data_port = 0  # no raw page stream: the puller falls back to FetchPages, which this test breaks
        return status

    async def FetchPages(self, request, context):  # type: ignore[no-untyped-def]
        async for batch in self.upstream.FetchPages(request, timeout=30):
            if len(self.sent) == 1:
                data = bytearray(batch.data)
                data[100] ^= 0xFF
                batch.data = bytes(data)
            self.sent.append(batch)
            yield batch
            if len(self.sent) == 3:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "peer went away")


async def test_peer_dying_mid_stream_leaves_a_partial_verified_copy(stubs: list[kv_pb2_grpc.KVStoreStub]) -> None:
    ref, token_ids, pages = _session("dying", 2048, seed=5)
    await _upload(stubs[0], ref, token_ids, pages)
    peer = _DyingPeer(stubs[0])
    reply = await _pull_through(peer, stubs[1], ref)
    sent_pages = sum(len(b.checksums) for b in peer.sent)
    assert not reply.complete and "UNAVAILABLE" in reply.error
    assert reply.pages_expected == GEOMETRY.num_layers * 64
    assert (reply.pages_received, reply.pages_rejected) == (sent_pages - 1, 1)
    await _assert_kept_only_verified(stubs[1], ref, pages, sent_pages - 1)
    status = await stubs[1].GetSessionStatus(kv_pb2.SessionStatusRequest(session=ref), timeout=5)
    assert status.loadable_prefix_blocks < 64


class _DyingStream(kv_pb2_grpc.KVStoreServicer):
    """Fault injection on the raw page stream: advertises a proxy in front of a real node's stream that
    flips one byte in the second frame and cuts the connection after the third."""

    def __init__(self, upstream: kv_pb2_grpc.KVStoreStub) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.upstream_port = 0
        self.frames: list[tuple[int, int, int]] = []  # (layer, first block, pages) forwarded
        self.thread = threading.Thread(target=self._proxy, daemon=True)
        self.thread.start()

    async def GetSessionStatus(self, request, context):  # type: ignore[no-untyped-def]
        status = await self.upstream.GetSessionStatus(request, timeout=5)
        self.upstream_port, status.data_port = status.data_port, self.listener.getsockname()[1]
        return status

    def _proxy(self) -> None:
        client, _ = self.listener.accept()
        with client, socket.create_connection(("127.0.0.1", self.upstream_port), timeout=30) as upstream:
            upstream.sendall(client.recv(65536))  # the request: one small write
            reader = upstream.makefile("rb")
            while len(self.frames) < 3:
                header = reader.read(20)
                _, layer, first_block, count, page_bytes = struct.unpack("<BxxxIIII", header)
                body = bytearray(reader.read(count * (8 + page_bytes)))
                if len(self.frames) == 1:
                    body[count * 8 + 100] ^= 0xFF  # a byte inside the first page of this frame
                client.sendall(header + body)
                self.frames.append((layer, first_block, count))
        self.listener.close()


async def test_peer_stream_cut_mid_transfer_keeps_only_verified_pages(stubs: list[kv_pb2_grpc.KVStoreStub]) -> None:
    ref, token_ids, pages = _session("dying-stream", 2048, seed=6)
    await _upload(stubs[0], ref, token_ids, pages)
    peer = _DyingStream(stubs[0])
    reply = await _pull_through(peer, stubs[1], ref)
    sent_pages = sum(count for _, _, count in peer.frames)
    assert [layer for layer, _, _ in peer.frames] == sorted(layer for layer, _, _ in peer.frames)  # layer order
    assert not reply.complete and "broke" in reply.error
    assert (reply.pages_received, reply.pages_rejected) == (sent_pages - 1, 1)
    await _assert_kept_only_verified(stubs[1], ref, pages, sent_pages - 1)


_WRITER = """
import sys, random, torch
from pathlib import Path
from node_manager.kv.store import TieredStore
from node_manager.kv.store_config import StoreConfig
from symphony.kv_geometry import KVGeometry, hf_config_for
g = KVGeometry(6, 3, 64, 32)
store = TieredStore(g, StoreConfig(hbm_bytes=0, dram_bytes=64 << 20, ssd_bytes=1 << 30, ssd_dir=Path(sys.argv[1]),
                                   arena_name=sys.argv[2], model=bytes.fromhex(sys.argv[3]),
                                   segment_max_bytes=1 << 20))
for n in range(10_000):
    store.sessions.put("t", f"s{n}", [random.randrange(1000) for _ in range(256)])
    for layer in range(6):
        pages = torch.full((8, g.page_words), n * 10 + layer, dtype=torch.int64)
        store.ingest.save_layer("t", f"s{n}", layer, 0, pages)
    store.write_behind.flush()
"""


def test_kill_9_during_writes_leaves_no_torn_page(tmp_path: Path) -> None:
    from node_manager.kv.store import TieredStore
    from node_manager.kv.store_config import StoreConfig

    ssd = tmp_path / "ssd"
    arena = f"symphony-test-kill-{os.getpid()}"
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(ssd), arena, TEST_MODEL.hex()], stderr=subprocess.PIPE
    )
    try:
        wait_until(
            lambda: writer.poll() is None and len(list(ssd.glob("*.kvseg"))) >= 20,
            60,
            "the writer to commit some segments",
        )
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    for leftover in (arena, f"{arena}-blocks"):  # the killed store's arena and block index
        Path("/dev/shm", leftover).unlink(missing_ok=True)
    geometry = KVGeometry(6, 3, 64, 32)
    store = TieredStore(
        geometry,
        StoreConfig(
            hbm_bytes=0,
            dram_bytes=8 << 20,
            ssd_bytes=1 << 30,
            ssd_dir=ssd,
            arena_name=arena + "-check",
            model=TEST_MODEL,
        ),
    )
    try:
        assert not list(ssd.glob("*.tmp"))
        stats = store.stats()
        assert stats["ssd_pages"] >= 20 * 6
        # Every page the rebuilt index lists reads back and passes its checksum.
        pages = list(store.directory.ssd_copies())
        assert len(pages) == stats["ssd_pages"]
        staging = [torch.empty(1, geometry.page_words, dtype=torch.int64) for _ in range(6)]
        bad = 0
        for key, layer, location, checksum in pages:
            segment = store.ssd.segments[location.seq]
            view = memoryview(staging[layer][0].numpy()).cast("B")
            store.ssd.read_into(segment, [(location.index, view)])
            bad += store.ssd.mac.tag(key, layer, view) != checksum
        assert bad == 0
    finally:
        store.close()


def test_a_node_whose_metrics_port_is_taken_fails_without_leaving_its_arena(tmp_path: Path) -> None:
    grpc_port = free_port_run(1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = tmp_path / "symphony.toml"
        config.write_text(f"""
home = "{tmp_path}"
[node]
grpc_port_base = {grpc_port}
[engine]
enabled = false
model = "{_model_dir(tmp_path)}"
[kv]
hbm_bytes = {16 << 20}
dram_bytes = {32 << 20}
ssd_bytes = {256 << 20}
metrics_port_base = {taken.getsockname()[1]}
""")
        env = {k: v for k, v in os.environ.items() if not k.startswith("SYMPHONY_")}
        done = subprocess.run(
            [sys.executable, "-m", "symphony.cli", "node", "--config", str(config), "--index", "0"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode != 0
    assert "Address already in use" in done.stderr
    assert not list(Path("/dev/shm").glob(f"symphony-kv-node-0-{grpc_port}*"))


def test_a_second_node_manager_on_a_nodes_ssd_directory_is_refused(nodes: list[Node]) -> None:
    """Node 0's index started again beside it (other ports, the same home: the same SSD directory)
    exits with an error naming the directory, before touching its segments; node 0 serves on."""
    first = nodes[0]
    env = {
        **first.env,
        "SYMPHONY_NODE_GRPC_PORT_BASE": str(free_port_run(1)),
        "SYMPHONY_KV_METRICS_PORT_BASE": "0",
    }
    done = subprocess.run(first.argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "is in use by another node manager" in done.stderr and "kv/node-0" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    _wait_serving(first)  # still serving, its lock still held
