"""`symphony bench resume`'s measurement on the live cluster, at a small context: every path gets
its history from where the path says (checked through what the engine had to prefill)."""

from __future__ import annotations

import pytest

from eval.bench_resume import measure
from eval.resume_runner import FOLLOW_UP_TOKENS, PATHS
from tests.e2e.conftest import LiveCluster
from tests.e2e.resume_support import resume_nodes

pytestmark = pytest.mark.e2e

CONTEXT = 256  # 8 blocks: small enough for CI, long enough to load across blocks and layers


def test_every_resume_path_gets_its_history_from_the_intended_place(live_cluster: LiveCluster) -> None:
    with resume_nodes(live_cluster) as nodes:
        result = measure(
            nodes,
            f"http://127.0.0.1:{live_cluster.engine_ports[0]}",
            live_cluster.model,
            context_tokens=CONTEXT,
            trials=1,
            block_size=32,
            gap_s=0.2,
        )
    assert set(result["ttft_ms"]) == set(PATHS)
    assert all(ms > 0 for ms in result["ttft_ms"].values())
    # Only recompute prefills the history; every other path computes the follow-up message alone.
    assert result["prefill_tokens_computed"] == {
        path: FOLLOW_UP_TOKENS + (CONTEXT if path == "recompute" else 0) for path in PATHS
    }
    # The on-demand SSD load waited on layers, and the bench read those waits back.
    assert result["layer_wait_ms_p50"] >= 0 and result["layer_wait_ms_p99"] >= result["layer_wait_ms_p50"]
    assert isinstance(result["outputs_identical"], bool)
    assert 0 < result["match_ms_p50"] <= result["match_ms_p99"]
    assert 0 < result["match_cpu_ms_p50"] <= result["match_cpu_ms_p99"]
    assert 0 < result["match_after_trials_ms_p50"] <= result["match_after_trials_ms_p99"]
    assert result["match_quiet_wait_s"] >= 0
    assert 0 <= result["match_probe_steal_frac"] <= 1
