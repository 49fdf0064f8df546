"""`symphony bench calibrate` and `validate` on the live cluster, tiny: the simulator is fitted to the
real engines, then replays the requests a real policy run served."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from eval.bench_calibrate import ProbePlan, calibrate, compare, live_figures, replay_turns, sim_figures, simulate_replay
from eval.bench_cluster import measure_policies
from eval.loadgen import LoadSettings, RequestRecord
from eval.workloads import SHAREGPT_SAMPLE, HumanTiming, load_sharegpt
from tests.e2e.conftest import LiveCluster

pytestmark = pytest.mark.e2e

QUICK = ProbePlan(prefill_tokens=(32, 256), decode_points=((1, 32), (2, 32), (1, 256)), rounds=1, output_tokens=16)


def test_the_simulator_is_fitted_to_the_engines_and_replays_a_live_run(
    live_cluster: LiveCluster, tmp_path: Path
) -> None:
    config = live_cluster.config()  # its secret too: the benchmark's schedulers join it
    preset, details = asyncio.run(calibrate(config, live_cluster.model, QUICK))
    engine = preset.engine
    # Real CPU engines: prefill costs grow with the prompt, a decode step has a cost, KV has room.
    assert engine.prefill_ms_per_token > 0 and engine.step_ms + engine.decode_ms_per_seq > 0
    assert engine.kv_blocks > 0 and engine.block_size == config.engine.block_size
    assert details["fit_r2"]["prefill"] > 0.8
    assert len(details["prefill_samples"]) == 2  # the first engine alone
    assert len(details["prefill_samples_beside_busy"]) == 2 * config.cluster.nodes  # every engine, neighbours busy
    assert engine.neighbour_slowdown >= 0
    records: dict[str, list[RequestRecord]] = {}
    asyncio.run(
        measure_policies(
            config,
            live_cluster.model,
            tmp_path,
            ["recompute"],
            LoadSettings(users=2, duration_s=20, max_answer_tokens=16),
            HumanTiming(time_scale=0.02),
            load_sharegpt(SHAREGPT_SAMPLE, limit=4),
            records_by_policy=records,
        )
    )
    live = live_figures(records["recompute"])
    nodes = [config.node_id(i) for i in range(config.cluster.nodes)]
    simulated = sim_figures(simulate_replay(preset, "recompute", nodes, replay_turns(records["recompute"])))
    assert simulated["requests"] == live["requests"] >= 2  # the simulator served every request the cluster did
    errors = compare(live, simulated)
    assert all(math.isfinite(e) and e >= 0 for e in errors.values()), errors
