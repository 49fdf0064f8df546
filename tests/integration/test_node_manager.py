"""The node manager's gRPC service over a real server, supervising a stand-in engine process that
serves /health and vLLM-style /metrics (the real vLLM engine runs in tests/e2e)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from node_manager.engine import Engine, EngineLaunch
from node_manager.service import NodeManagerService
from symphony.config import EngineConfig
from symphony.rpc import node_pb2, node_pb2_grpc
from tests.helpers import TEST_MODEL, async_wait_until, free_port

FAKE_CHILD = Path(__file__).with_name("fake_child.py")


def vllm_metrics(running: int, waiting: int, kv: float) -> str:
    labels = '{engine="0",model_name="m"}'
    return (
        f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{labels} {running}.0\n"
        f"vllm:num_requests_waiting{labels} {waiting}.0\n"
        f'vllm:num_requests_waiting_by_reason{{engine="0",model_name="m",reason="capacity"}} 9.0\n'
        f"vllm:kv_cache_usage_perc{labels} {kv}\n"
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",num_gpu_blocks="320"} 1.0\n'
    )


@dataclass
class NodeUnderTest:
    stub: node_pb2_grpc.NodeManagerStub
    engine: Engine
    metrics_file: Path

    async def status(self) -> node_pb2.NodeStatus:
        return await self.stub.Status(node_pb2.StatusRequest(), timeout=2)


@pytest.fixture(params=["filtering engine", "whole metrics only"])
async def node(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[NodeUnderTest]:
    metrics_file = tmp_path / "metrics.txt"
    metrics_file.write_text(vllm_metrics(3, 2, 0.25))
    port = free_port()
    argv = [
        sys.executable,
        str(FAKE_CHILD),
        "--port",
        str(port),
        "--metrics",
        str(metrics_file),
        "--request-log",
        str(tmp_path / "requests.log"),
    ]
    if request.param == "filtering engine":
        argv.append("--filter-metrics")
    launch = EngineLaunch(argv, dict(os.environ), f"http://127.0.0.1:{port}")
    config = EngineConfig(max_model_len=4096, restart_backoff_s=0.05, restart_backoff_max_s=0.1)
    engine = Engine("node-7-engine", launch, config, tmp_path / "engine.log", scrape_interval_s=0.02)
    server = grpc.aio.server()
    node_pb2_grpc.add_NodeManagerServicer_to_server(NodeManagerService("node-7", engine, "m", TEST_MODEL), server)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    await server.start()
    engine.start()
    channel = grpc.aio.insecure_channel(address)
    try:
        yield NodeUnderTest(node_pb2_grpc.NodeManagerStub(channel), engine, metrics_file)
    finally:
        await channel.close()
        await engine.stop()
        await server.stop(grace=None)


async def test_status_reports_the_engine_and_its_load(node: NodeUnderTest) -> None:
    health = await node.stub.Health(node_pb2.HealthRequest(), timeout=2)
    assert health.serving

    async def loaded() -> bool:
        return (await node.status()).num_requests_running == 3

    await async_wait_until(loaded, 20, "the scraped load to show in Status")
    status = await node.status()
    assert status.node_id == "node-7"
    assert status.engine_state == node_pb2.ENGINE_STATE_READY
    assert status.engine_url == node.engine.url
    assert (status.served_model, status.max_model_len, status.block_size) == ("m", 4096, 32)
    assert status.model_fingerprint == TEST_MODEL
    assert (status.num_requests_waiting, status.kv_cache_usage) == (2, 0.25)  # by-reason series not added
    assert status.engine_kv_tokens == 320 * 32  # the filtered scrape asks for the cache config too
    assert status.metrics_age_ms < 5000

    node.metrics_file.write_text(vllm_metrics(0, 7, 0.5))

    async def updated() -> bool:
        return (await node.status()).num_requests_waiting == 7

    await async_wait_until(updated, 10, "new load figures")
    # A filtering engine is asked for the three gauges and the cache config alone; one that cannot filter, after one
    # try, for the whole page.
    scrapes = [path for path in node.metrics_file.with_name("requests.log").read_text().split() if "metrics" in path]
    filtered = [path for path in scrapes if path.startswith("/metrics/?")]
    if "--filter-metrics" in node.engine.process.argv:
        assert scrapes == filtered and all(path.count("name%5B%5D=vllm") == 4 for path in filtered)
    else:
        assert len(filtered) == 1 and scrapes[0] == filtered[0] and len(scrapes) > 2


async def test_engine_crash_is_restarted_and_reported(node: NodeUnderTest) -> None:
    async def state_is(state: int, restarts: int) -> bool:
        status = await node.status()
        return status.engine_state == state and status.engine_restarts == restarts

    await async_wait_until(lambda: state_is(node_pb2.ENGINE_STATE_READY, 0), 20, "engine ready")
    await node.engine.process.kill_for_test(signal.SIGKILL)
    await async_wait_until(lambda: state_is(node_pb2.ENGINE_STATE_READY, 1), 20, "engine restarted")
    status = await node.status()
    assert "SIGKILL" in status.last_engine_error
    health = await node.stub.Health(node_pb2.HealthRequest(), timeout=2)
    assert health.engine_state == node_pb2.ENGINE_STATE_READY


async def test_stopped_engine_reports_stopped_without_load(node: NodeUnderTest) -> None:
    await async_wait_until(lambda: node.engine.process.state.value == "ready", 20, "engine ready")
    await node.engine.stop()
    status = await node.status()
    assert status.engine_state == node_pb2.ENGINE_STATE_STOPPED
    assert (status.num_requests_running, status.num_requests_waiting, status.kv_cache_usage) == (0, 0, 0.0)
