"""`symphony bench resume`'s measurement on the live cluster, at a small context: every path gets
its history from where the path says (checked through what the engine had to prefill)."""

from __future__ import annotations

import grpc
import openai
import pytest

from eval.bench_resume import FOLLOW_UP_TOKENS, PATHS, Node, measure
from symphony.rpc import kv_pb2_grpc
from tests.e2e.conftest import LiveCluster

pytestmark = pytest.mark.e2e

CONTEXT = 256  # 8 blocks: small enough for CI, long enough to load across blocks and layers


def test_every_resume_path_gets_its_history_from_the_intended_place(live_cluster: LiveCluster) -> None:
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}") for port in live_cluster.grpc_ports]
    try:
        nodes = [Node(openai.OpenAI(base_url=f"http://127.0.0.1:{engine}/v1", api_key="unused", max_retries=0,
                                    timeout=300),
                      kv_pb2_grpc.KVStoreStub(channel), f"127.0.0.1:{grpc_port}",
                      f"http://127.0.0.1:{metrics}/metrics", live_cluster.home / "kv" / f"node-{i}",
                      live_cluster.kv_sockets[i])
                 for i, (engine, channel, grpc_port, metrics) in enumerate(zip(
                     live_cluster.engine_ports, channels, live_cluster.grpc_ports, live_cluster.kv_metrics_ports,
                     strict=True))]
        result = measure(nodes, f"http://127.0.0.1:{live_cluster.engine_ports[0]}", live_cluster.model,
                         context_tokens=CONTEXT, trials=1, block_size=32, gap_s=0.2)
    finally:
        for channel in channels:
            channel.close()
    assert set(result["ttft_ms"]) == set(PATHS)
    assert all(ms > 0 for ms in result["ttft_ms"].values())
    # Only recompute prefills the history; every other path computes the follow-up message alone.
    assert result["prefill_tokens_computed"] == {path: FOLLOW_UP_TOKENS + (CONTEXT if path == "recompute" else 0)
                                                 for path in PATHS}
    # The on-demand SSD load waited on layers, and the bench read those waits back.
    assert result["layer_wait_ms_p50"] >= 0 and result["layer_wait_ms_p99"] >= result["layer_wait_ms_p50"]
    assert isinstance(result["outputs_identical"], bool)
    assert 0 < result["match_ms_p50"] <= result["match_ms_p99"]
