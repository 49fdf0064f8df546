"""`symphony bench cluster`'s measurement on the live cluster, tiny: two policies, each with its own
scheduler in front of the cluster's nodes, replaying ShareGPT users with typing advisories."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from eval.bench_cluster import measure_policies
from eval.loadgen import LoadSettings
from eval.workloads import SHAREGPT_SAMPLE, HumanTiming, load_sharegpt
from symphony.config import load_config
from tests.e2e.conftest import LiveCluster

pytestmark = pytest.mark.e2e


def test_two_policies_replay_the_same_users(live_cluster: LiveCluster, tmp_path: Path) -> None:
    config = load_config(live_cluster.home / "symphony.toml", env={})
    settings = LoadSettings(users=2, duration_s=20, max_answer_tokens=16)
    result = asyncio.run(
        measure_policies(
            config,
            live_cluster.model,
            tmp_path,
            ["symphony", "recompute"],
            settings,
            HumanTiming(time_scale=0.02),
            load_sharegpt(SHAREGPT_SAMPLE, limit=4),
            records_dir=tmp_path,
        )
    )
    for policy in ("symphony", "recompute"):
        summary = result[policy]
        assert summary["errors"] == 0 and summary["completed"] >= 2, summary
        assert summary["prefill_tokens_total"] >= summary["prefill_tokens_computed"] > 0
        assert 0 < summary["ttft_ms_p50"] <= summary["ttft_ms_p95"]
        assert sum(summary["requests_by_node"].values()) == summary["completed"]
        assert (tmp_path / f"{policy}.csv").read_text().count("\n") == summary["completed"] + 1
    # Symphony's advisories moved the KV of resumed turns ahead of them; the baseline's did nothing.
    assert sum(result["symphony"]["advised_requests_kv_ready"].values()) >= 1
    assert result["recompute"]["advised_requests_kv_ready"] == {"yes": 0.0, "no": 0.0}
