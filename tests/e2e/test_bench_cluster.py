"""`symphony bench cluster`'s measurement on the live cluster, tiny: two policies, each with its own
scheduler in front of the cluster's nodes, replaying ShareGPT users with typing advisories; and one
policy serving a few open-loop shared-prefix requests (token-id prompts through /v1/completions)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from eval.bench_cluster import measure_policies
from eval.live_workloads import SharedPrefixWorkload
from eval.loadgen import LoadSettings, RequestRecord
from eval.open_loop import SharedPrefixSettings
from eval.workloads import SHAREGPT_SAMPLE, HumanTiming, load_sharegpt
from tests.e2e.conftest import LiveCluster

pytestmark = pytest.mark.e2e


def test_two_policies_replay_the_same_users(live_cluster: LiveCluster, tmp_path: Path) -> None:
    config = live_cluster.config()  # its secret too: the benchmark's schedulers join it
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
        assert (tmp_path / f"{policy}-r0.csv").read_text().count("\n") == summary["completed"] + 1
    # Symphony's advisories moved the KV of resumed turns ahead of them; the baseline's did nothing.
    assert sum(result["symphony"]["advised_requests_kv_ready"].values()) >= 1
    assert result["recompute"]["advised_requests_kv_ready"] == {"yes": 0.0, "no": 0.0}


def test_open_loop_shared_prefix_requests_are_served_and_their_reuse_counted(
    live_cluster: LiveCluster, tmp_path: Path
) -> None:
    config = live_cluster.config()  # its secret too: the benchmark's schedulers join it
    settings = LoadSettings(users=1, duration_s=6, max_answer_tokens=4)
    shared = SharedPrefixSettings(groups=2, prefix_tokens=(192, 256), question_tokens=(16, 32), rate_per_s=1.5)
    prepared = SharedPrefixWorkload(shared).prepare(settings)
    records: dict[str, list[RequestRecord]] = {}
    result = asyncio.run(
        measure_policies(
            config,
            live_cluster.model,
            tmp_path,
            ["prefix_trie"],
            settings,
            HumanTiming(),
            [],
            records_by_policy=records,
            prepared=prepared,
        )
    )
    summary = result["prefix_trie"]
    assert summary["errors"] == 0 and summary["completed"] == prepared.info["requests"] >= 2, summary
    assert all(r.output_tokens == 4 for r in records["prefix_trie"])  # ignore_eos: every answer its length
    # A second request of a group found its group's prefix existing, if the first was done by then.
    assert summary["prefix_tokens_existed"] == sum(r.existed_tokens for r in records["prefix_trie"])
    assert 0 <= summary["prefix_tokens_cached"] <= summary["prefix_tokens_existed"]
    # The nodes' heartbeats alone reach the index within the run; a lag is a bucket bound, > 0.
    assert 0 < summary["index_lag_ms_p99"] < float("inf"), summary["index_lag_ms_p99"]
