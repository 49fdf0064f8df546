"""node_manager.connector.worker: when a finished request's blocks may be freed (no vLLM, no node
manager: the bookkeeping vLLM's `get_finished` contract asks of it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from node_manager.connector.plan import SaveSpec, TailSave
from node_manager.connector.worker import WorkerSide
from tests.helpers import TEST_MODEL


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
