"""The live cluster's two nodes as `bench resume` addresses them (engine, KV service, metrics, SSD
directory, local KV channel), for the tests that drive its paths."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc
import openai

from eval.resume_runner import Node
from symphony.kv_transfer import params_key
from symphony.rpc import kv_pb2_grpc
from tests.e2e.conftest import LiveCluster


@contextlib.contextmanager
def resume_nodes(cluster: LiveCluster) -> Iterator[list[Node]]:
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}") for port in cluster.grpc_ports]
    try:
        yield [
            Node(
                openai.OpenAI(
                    base_url=f"http://127.0.0.1:{engine}/v1", api_key=cluster.engine_key, max_retries=0, timeout=300
                ),
                kv_pb2_grpc.KVStoreStub(channel),
                f"127.0.0.1:{grpc_port}",
                f"http://127.0.0.1:{metrics}/metrics",
                cluster.home / "kv" / f"node-{i}",
                cluster.kv_sockets[i],
                params_key(cluster.secret),
            )
            for i, (engine, channel, grpc_port, metrics) in enumerate(
                zip(cluster.engine_ports, channels, cluster.grpc_ports, cluster.kv_metrics_ports, strict=True)
            )
        ]
    finally:
        for channel in channels:
            channel.close()
