"""Copy lanes: torch runs single-threaded on them without changing anyone else's thread count."""

from __future__ import annotations

import concurrent.futures

import torch

from node_manager.kv.loader import copy_lanes


def test_lanes_run_torch_single_threaded_and_leave_other_threads_alone() -> None:
    before = torch.get_num_threads()
    lanes = copy_lanes(2)
    try:
        counts = {lanes.submit(torch.get_num_threads).result(10) for _ in range(8)}
        assert counts == {1}
    finally:
        lanes.shutdown()
    assert torch.get_num_threads() == before
    with concurrent.futures.ThreadPoolExecutor(1) as other:  # a thread torch initializes later
        assert other.submit(torch.get_num_threads).result(10) == before


def test_lanes_are_all_started_up_front() -> None:
    lanes = copy_lanes(3)
    try:
        assert len(lanes._threads) == 3
    finally:
        lanes.shutdown()
