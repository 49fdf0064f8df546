"""KV pages between CUDA memory and the node's tiers, on a real GPU.

Copies to and from the device are asynchronous: each test first keeps a stream busy
(`hold_stream`), so that a copy queued behind that work has not run yet when something that does
not wait for it reads the bytes. The store's loads report a layer once its bytes are in device
memory, for a reader on any stream; the connector's, once the forward's stream is made to wait for
them. Neither takes a page in before its bytes have left the device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from node_manager.connector import worker as worker_module
from node_manager.connector.kv_client import NodeKVClient
from node_manager.connector.plan import LoadSpec, SaveSpec, TailSave
from node_manager.connector.worker import WorkerSide
from node_manager.kv.ipc_server import LocalKVServer
from node_manager.kv.loader import RowTarget
from node_manager.kv.pages import Tier
from node_manager.kv.slots import DramArena, copy_rows
from node_manager.kv.store import TieredStore
from symphony.kv_addressing import tail_key
from symphony.kv_geometry import page_layout
from tests.cuda.conftest import hold_stream
from tests.helpers import TEST_MODEL, wait_until
from tests.unit.kv_store_support import (
    BLOCK,
    GEOMETRY,
    LAYERS,
    PAGE,
    SENTINEL,
    TIMEOUT,
    WORDS,
    MakeStore,
    load_rows,
    page_data,
    save_session,
    tokens,
)
from tests.unit.test_connector_worker import check_an_abandoned_load

CACHE_BLOCKS = 16  # vLLM blocks in each layer of the fake engine's cache


def read_from_another_stream(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s bytes as a stream that has not waited for the current one sees them."""
    side = torch.cuda.Stream(tensor.device)
    with torch.cuda.stream(side):
        copy = tensor.to("cpu")  # blocking for `side` only
    return copy


def test_the_dram_arena_is_pinned_for_the_device() -> None:
    arena = DramArena("symphony-cuda-test-arena", GEOMETRY, 64 * PAGE, pin_for_cuda=True)
    try:
        assert arena.pinned, "cudaHostRegister of the arena failed: host-device copies would be synchronous"
        attached = DramArena.attach(arena.name, GEOMETRY, 64 * PAGE, writable=True, pin_for_cuda=True)
        try:
            assert attached.pinned, "the engine's own mapping of the arena must be pinned too"
        finally:
            attached.close()
    finally:
        arena.close()


@pytest.mark.parametrize("to_device", [True, False], ids=["host-to-device", "device-to-host"])
@pytest.mark.parametrize(
    ("dst_rows", "src_rows"),
    [
        ([0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]),
        ([5, 0, 9, 2, 14, 7], [1, 3, 2, 8, 0, 11]),
        ([5, 0, 9, 2, 14, 7], [3, 4, 5, 6, 7, 8]),
        ([3, 4, 5, 6, 7, 8], [1, 3, 2, 8, 0, 11]),
    ],
    ids=["runs", "scattered", "from-one-run", "into-one-run"],
)
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_copy_rows_across_devices_lands_once_the_stream_is_done(
    to_device: bool, dst_rows: list[int], src_rows: list[int], pinned: bool
) -> None:
    source = page_data(16, seed=1)[0]
    host = torch.full((16, WORDS), SENTINEL, dtype=torch.int64, pin_memory=pinned)
    device = torch.full((16, WORDS), SENTINEL, dtype=torch.int64, device="cuda")
    if to_device:
        host.copy_(source)
        src, dst = host, device
    else:
        device.copy_(source)
        src, dst = device, host
    hold_stream()
    copy_rows(dst, dst_rows, src, src_rows)
    torch.cuda.current_stream().synchronize()  # copy_rows' contract: done once the stream is
    assert torch.equal(dst.cpu()[dst_rows], source[src_rows])
    untouched = [row for row in range(16) if row not in dst_rows]
    assert (dst.cpu()[untouched] == SENTINEL).all()


@pytest.mark.parametrize("source_tier", [Tier.HBM, Tier.DRAM, Tier.SSD])
def test_a_layer_reported_ready_is_in_device_memory(make_store: MakeStore, ssd_dir: Path, source_tier: Tier) -> None:
    blocks = 5
    store = make_store(device="cuda", hbm_pages=64, dram_pages=64)
    data = save_session(store, "s", blocks, seed=3)
    assert store.write_behind.flush(TIMEOUT)
    if source_tier is Tier.HBM:
        promoted = store.loads.promote("acme", "s", tier=Tier.HBM).wait_all(TIMEOUT)
        assert all(not r.failed for r in promoted)
        assert store.hbm.pages.device.type == "cuda"
    elif source_tier is Tier.SSD:
        store.close()
        store = make_store(device="cuda", hbm_pages=64, dram_pages=64)  # same directory: SSD only
        store.sessions.put("acme", "s", tokens(blocks, base=30_000))
    rows = [9, 2, 4, 11, 0]
    dest = [torch.full((12, WORDS), SENTINEL, dtype=torch.int64, device="cuda") for _ in range(LAYERS)]
    hold_stream()
    handle = store.loads.into_rows("acme", "s", target=RowTarget(dest, rows))
    for layer in range(LAYERS):
        result = handle.layer_ready(layer).result(TIMEOUT)
        assert not result.failed
        assert result.by_tier.get(source_tier) == blocks, result.by_tier
        assert torch.equal(read_from_another_stream(dest[layer])[rows], data[layer]), f"layer {layer}"


def test_pages_saved_from_device_memory_are_the_bytes_the_caller_queued(make_store: MakeStore) -> None:
    store = make_store(device="cuda", hbm_pages=0, dram_pages=64)
    data = page_data(4, seed=4)
    on_device = [torch.zeros_like(layer, device="cuda") for layer in data]
    store.sessions.put("acme", "s", tokens(4, base=40_000))
    hold_stream()
    for layer in range(LAYERS):  # the pages are produced on the caller's stream, behind other work
        on_device[layer].copy_(data[layer].pin_memory(), non_blocking=True)
    for layer in range(LAYERS):
        assert store.ingest.save_layer("acme", "s", layer, 0, on_device[layer]).result(TIMEOUT) == 4
    dest, results = load_rows(store, "s", 4)
    assert all(not r.failed for r in results)
    assert all(torch.equal(dest[layer], data[layer]) for layer in range(LAYERS))


# ---- the connector's worker side, with a fake engine's cache in device memory ----------------------


@pytest.fixture
def store(make_store: MakeStore) -> TieredStore:
    return make_store(device="cuda", hbm_pages=0, dram_pages=128)


@contextlib.contextmanager
def attached_worker(store: TieredStore, socket_path: Path) -> Iterator[tuple[WorkerSide, list[torch.Tensor]]]:
    """A worker side attached to a real store's channel, over a cache of CACHE_BLOCKS blocks per
    layer in device memory (bfloat16, as vLLM's); yields it and each layer's cache as int64 rows."""
    server = LocalKVServer(store, socket_path)
    worker = WorkerSide(
        str(server.path), layer_wait_s=TIMEOUT, model=TEST_MODEL, declared_layout=page_layout(GEOMETRY, "cuda", "vllm")
    )
    caches = {
        _layer_name(layer): torch.zeros(CACHE_BLOCKS, PAGE // 2, dtype=torch.bfloat16, device="cuda")
        for layer in range(LAYERS)
    }
    try:
        worker.register(caches)
        yield worker, [kv.view(torch.int64) for kv in caches.values()]
    finally:
        worker.close()
        server.close()


@pytest.fixture
def connector(store: TieredStore, tmp_path: Path) -> Iterator[tuple[WorkerSide, list[torch.Tensor]]]:
    with attached_worker(store, tmp_path / "kv.sock") as attached:
        yield attached


def _layer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


@pytest.mark.parametrize("block_ids", [(3, 4, 5), (9, 2, 14)], ids=["consecutive", "scattered"])
def test_the_connector_saves_only_bytes_that_have_left_the_device(
    store: TieredStore, connector: tuple[WorkerSide, list[torch.Tensor]], block_ids: tuple[int, ...]
) -> None:
    worker, pages = connector
    blocks = len(block_ids)
    data = page_data(blocks, seed=5)
    for layer in range(LAYERS):
        pages[layer][list(block_ids)] = data[layer].cuda()
    torch.cuda.synchronize()
    spec = SaveSpec("acme", "s", 0, block_ids, tuple(tokens(blocks, base=50_000)))
    hold_stream()  # the forward's stream: its saves queue behind this
    for layer in range(LAYERS):
        worker.save_layer([spec], _layer_name(layer), pages[layer].view(torch.bfloat16))
    worker.finish_saves()
    wait_until(lambda: store.loadable_prefix_blocks("acme", "s") == blocks, TIMEOUT, "the saves' commit")
    dest, results = load_rows(store, "s", blocks)
    assert all(not r.failed for r in results)
    for layer in range(LAYERS):
        assert torch.equal(dest[layer], data[layer]), f"layer {layer}: the store took in bytes not yet copied"


@pytest.mark.parametrize("block_ids", [(3, 4, 5, 6, 7), (12, 1, 8, 0, 6)], ids=["consecutive", "scattered"])
def test_a_layer_the_connector_loaded_is_in_the_cache_when_the_forward_reads_it(
    store: TieredStore, connector: tuple[WorkerSide, list[torch.Tensor]], block_ids: tuple[int, ...]
) -> None:
    worker, pages = connector
    blocks = len(block_ids)
    data = save_session(store, "s", blocks, seed=6)
    last_key = store.sessions.get("acme", "s").blocks.block_keys[-1]
    hold_stream(worker._load_stream)  # the copies run late: the forward's stream must wait for them
    worker.start_loads([LoadSpec("acme", "s", 0, block_ids, last_key)])
    for layer in range(LAYERS):
        worker.wait_layer(_layer_name(layer))
        seen = pages[layer][list(block_ids)].cpu()  # queued on the forward's stream, as attention is
        assert torch.equal(seen, data[layer]), f"layer {layer}: the forward read it before its bytes landed"
    assert worker.take_load_errors() == set()
    wait_until(lambda: store.pinned_pages() == 0, TIMEOUT, "the load's pages released")


def test_the_forward_waits_for_loads_behind_its_own_earlier_work(
    store: TieredStore, connector: tuple[WorkerSide, list[torch.Tensor]]
) -> None:
    """A block the forward's stream still writes when the step's loads start is loaded after it."""
    worker, pages = connector
    data = save_session(store, "s", 2, seed=8)
    last_key = store.sessions.get("acme", "s").blocks.block_keys[-1]
    hold_stream()
    for layer in range(LAYERS):  # earlier work of the forward, still queued, writes the blocks
        pages[layer][[4, 5]] = SENTINEL
    worker.start_loads([LoadSpec("acme", "s", 0, (4, 5), last_key)])
    for layer in range(LAYERS):
        worker.wait_layer(_layer_name(layer))
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        assert torch.equal(pages[layer][[4, 5]].cpu(), data[layer]), f"layer {layer}: overwritten by older work"


def test_a_partial_last_block_saved_and_loaded_through_device_memory(
    store: TieredStore, connector: tuple[WorkerSide, list[torch.Tensor]]
) -> None:
    worker, pages = connector
    history = tokens(2, base=60_000, tail=BLOCK - 1)  # two full blocks and a tail one token short
    data = page_data(3, seed=7)
    for layer in range(LAYERS):
        pages[layer][[1, 2, 3]] = data[layer].cuda()
    for layer in range(LAYERS):
        worker.save_layer(
            [SaveSpec("acme", "s", 0, (1, 2), tuple(history[: 2 * BLOCK]))], _layer_name(layer), pages[layer]
        )
    worker.finish_saves()
    wait_until(lambda: store.loadable_prefix_blocks("acme", "s") == 2, TIMEOUT, "the full blocks' commit")
    hold_stream()  # the request finished; its tail's copies queue behind the forward's work
    worker.save_tails([TailSave("r1", SaveSpec("acme", "s", 2, (3,), tuple(history)))])
    wait_until(lambda: store.loadable_tail_tokens("acme", "s") == BLOCK - 1, TIMEOUT, "the tail's commit")
    parent = store.sessions.get("acme", "s").blocks.block_keys[1]
    key = tail_key(parent, history[2 * BLOCK :])
    host = [torch.full((3, WORDS), SENTINEL, dtype=torch.int64) for _ in range(LAYERS)]
    results = store.loads.into_rows(
        "acme", "s", 0, 3, target=RowTarget(host, [0, 1, 2]), last_key=key, tail_tokens=BLOCK - 1
    ).wait_all(TIMEOUT)
    assert all(not r.failed for r in results)
    for layer in range(LAYERS):
        assert torch.equal(host[layer], data[layer]), f"layer {layer}: the store took in the tail before its bytes"
    hold_stream(worker._load_stream)
    # The next turn loads all three into other blocks: the tail before the forward, the rest by layer.
    worker.start_loads(
        [
            LoadSpec("acme", "s", 0, (8, 9), store.sessions.get("acme", "s").blocks.block_keys[1]),
            LoadSpec("acme", "s", 2, (10,), key, tail_tokens=BLOCK - 1),
        ]
    )
    for layer in range(LAYERS):
        worker.wait_layer(_layer_name(layer))
        assert torch.equal(pages[layer][[8, 9, 10]].cpu(), data[layer]), f"layer {layer}"
    assert worker.take_load_errors() == set()


def test_a_loads_pages_go_back_only_once_its_copies_are_done(
    store: TieredStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    released_with_copies_done: list[bool] = []
    streams: list[torch.cuda.Stream] = []

    class Watched(NodeKVClient):
        def release(self, load_id: int) -> None:
            released_with_copies_done.append(streams[0].query())
            super().release(load_id)

    monkeypatch.setattr(worker_module, "NodeKVClient", Watched)  # the loader's client, made as it starts
    with attached_worker(store, tmp_path / "kv.sock") as (worker, _):
        assert worker._load_stream is not None
        streams.append(worker._load_stream)
        save_session(store, "s", 4, seed=10)
        last_key = store.sessions.get("acme", "s").blocks.block_keys[-1]
        hold_stream(worker._load_stream)
        worker.start_loads([LoadSpec("acme", "s", 0, (0, 1, 2, 3), last_key)])
        for layer in range(LAYERS):
            worker.wait_layer(_layer_name(layer))
        wait_until(lambda: store.pinned_pages() == 0, TIMEOUT, "the load's pages released")
        assert released_with_copies_done == [True]


def test_a_load_the_forward_gave_up_on_copies_nothing_more_on_the_device(
    make_store: MakeStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_an_abandoned_load(make_store, tmp_path, monkeypatch, "cuda")
