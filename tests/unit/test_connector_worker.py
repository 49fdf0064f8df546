"""node_manager.connector.worker: when a finished request's blocks may be freed (no vLLM, no node
manager: the bookkeeping vLLM's `get_finished` contract asks of it), and a load the forward gave up
on (a real store behind the node-local channel, a CPU cache shaped as vLLM's)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from node_manager.connector import worker as worker_module
from node_manager.connector.kv_client import NodeKVClient
from node_manager.connector.plan import LoadSpec, SaveSpec, TailSave
from node_manager.connector.worker import WorkerSide
from node_manager.kv.ipc_server import LocalKVServer
from tests.helpers import TEST_MODEL, wait_until
from tests.unit.kv_store_support import GEOMETRY, LAYERS, TIMEOUT, MakeStore, save_session


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[WorkerSide]:
    # Never connects: nothing here calls out.
    side = WorkerSide(str(tmp_path / "absent.sock"), layer_wait_s=1.0, model=TEST_MODEL, declared_layout="")
    yield side
    side.close()


def _tail(request_id: str) -> TailSave:
    return TailSave(request_id, SaveSpec("acme", "s", 1, (2,), tuple(range(6))))


def test_a_tail_save_is_reported_once_and_only_for_a_request_vllm_named_finished(worker: WorkerSide) -> None:
    # No DRAM arena attached: the save is given up, but the blocks must still be freed.
    worker.save_tails([_tail("r1")])
    assert worker.saved_tails(set()) is None  # vLLM has not named r1 finished to this worker yet
    assert worker.saved_tails({"r1", "r2"}) == {"r1"}  # r2 saved no tail: not ours to report
    assert worker.saved_tails({"r1"}) is None  # reported once
    # Named finished in one step, its tail saved in a later one: reported then.
    assert worker.saved_tails({"r3"}) is None
    worker.save_tails([_tail("r3")])
    assert worker.saved_tails(set()) == {"r3"}


def test_a_load_the_forward_gave_up_on_copies_nothing_more(
    make_store: MakeStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_an_abandoned_load(make_store, tmp_path, monkeypatch, "cpu")


def check_an_abandoned_load(
    make_store: MakeStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """Once `wait_layer` times out, vLLM recomputes the step's blocks: a late layer must not land
    over them, nor be reported again, and the next step's load gets its own pages. The fault: the
    node manager's first layer arrives only after the timeout. (tests/cuda runs it on a GPU.)"""
    store = make_store(hbm_pages=0, dram_pages=64)
    data = save_session(store, "s", 3, seed=9)
    last_key = store.sessions.get("acme", "s").blocks.block_keys[-1]
    server = LocalKVServer(store, tmp_path / "kv.sock")
    late = threading.Event()

    class LateFirstLayer(NodeKVClient):
        def load(self, items, timeout_s=30.0):  # type: ignore[no-untyped-def]
            load_id, layers = super().load(items, timeout_s)

            def held() -> Iterator[tuple[int, np.ndarray]]:
                late.wait(TIMEOUT)
                yield from layers

            return load_id, held()

    monkeypatch.setattr(worker_module, "NodeKVClient", LateFirstLayer)
    caches = {
        _name(layer): torch.zeros(8, GEOMETRY.page_bytes // 2, dtype=torch.bfloat16, device=device)
        for layer in range(LAYERS)
    }
    pages = [kv.view(torch.int64) for kv in caches.values()]
    worker = WorkerSide(str(server.path), layer_wait_s=0.2, model=TEST_MODEL, declared_layout="")
    try:
        worker._declared_layout = worker_module.cache_page_layout(caches[_name(0)], GEOMETRY, "auto")
        worker.register(caches)
        worker.start_loads([LoadSpec("acme", "s", 0, (1, 2, 3), last_key)])
        worker.wait_layer(_name(0))  # times out: the step's blocks are recomputed
        assert worker.take_load_errors() == {1, 2, 3}
        late.set()
        wait_until(lambda: store.pinned_pages() == 0, TIMEOUT, "the abandoned load's pages released")
        assert all(not page[[1, 2, 3]].any() for page in pages), "a layer was copied into blocks being recomputed"
        worker._layer_wait_s = TIMEOUT  # the next step's load is not meant to time out
        worker.start_loads([LoadSpec("acme", "s", 0, (4, 5, 6), last_key)])
        for layer in range(LAYERS):
            worker.wait_layer(_name(layer))
            assert torch.equal(pages[layer][[4, 5, 6]].cpu(), data[layer]), f"layer {layer} of the next load"
        assert worker.take_load_errors() == set(), "the abandoned step's blocks reported again"
        assert all(not page[[1, 2, 3]].any() for page in pages)
    finally:
        late.set()
        worker.close()
        server.close()


def _name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"
