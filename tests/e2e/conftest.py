"""A real local cluster for the end-to-end suites: `symphony up --nodes 2` with real vLLM CPU engines
serving SmolLM2, started once per test session (engines take ~30-60 s to start here)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from symphony.config import default_home, load_config
from symphony.models import DEFAULT_MODEL_NAME, fetch_default_model
from tests.helpers import free_port, free_port_run, wait_until

NODES = 2
STARTUP_TIMEOUT_S = 420


@dataclass
class LiveCluster:
    url: str
    process: subprocess.Popen[bytes]
    home: Path
    output: Path
    model: str
    engine_ports: list[int]
    grpc_ports: list[int]
    kv_metrics_ports: list[int]
    kv_sockets: list[Path]

    def readyz(self) -> dict[str, Any]:
        return httpx.get(self.url + "/readyz", timeout=5).json()

    def node_state(self, node: str) -> dict[str, Any]:
        return self.readyz()["nodes"][node]

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5).text

    def node_metric(self, index: int, name: str, **labels: str) -> float:
        """One sample from node `index`'s KV metrics (0 when not yet exported)."""
        text = httpx.get(f"http://127.0.0.1:{self.kv_metrics_ports[index]}/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return 0.0

    def output_tail(self, lines: int = 40) -> str:
        return "\n".join(self.output.read_text(errors="replace").splitlines()[-lines:])


def reset_engine_cache(engine_url: str) -> None:
    """Empty vLLM's own prefix cache. vLLM refuses while a request holds blocks, and a finished
    request holds its blocks one engine step longer while its partial last block is copied out:
    retried until vLLM agrees, not guessed with a sleep."""
    wait_until(
        lambda: httpx.post(engine_url + "/reset_prefix_cache", timeout=30).json()["success"],
        30,
        "vLLM's prefix cache to be reset",
    )


def _write_config(
    home: Path,
    model_dir: Path,
    scheduler_port: int,
    grpc_base: int,
    engine_base: int,
    metrics_base: int,
    nodes: int,
    engine: str,
    kv: str,
) -> Path:
    config = home / "symphony.toml"
    config.write_text(f"""
home = "{home}"

[cluster]
nodes = {nodes}

[scheduler]
port = {scheduler_port}

[node]
grpc_port_base = {grpc_base}
engine_port_base = {engine_base}

[kv]
metrics_port_base = {metrics_base}
{kv}

[engine]
model = "{model_dir}"
kv_cache_space_gib = 1
max_model_len = 8192
# 16,384 tokens of KV per engine: small enough that a test can fill it with prefetched sessions.
extra_args = ["--num-gpu-blocks-override", "512"]
{engine}
""")
    return config


def start_cluster(
    home: Path,
    model_dir: Path,
    *,
    nodes: int = NODES,
    engine_toml: str = "",
    kv_toml: str = "",
    env: dict[str, str] | None = None,
    model: str = DEFAULT_MODEL_NAME,
) -> LiveCluster:
    """`symphony up` on `home` with a config of its own ports (plus `engine_toml` and `kv_toml`, lines
    of those tables); returns once it says it is up. Stop it with `stop_cluster`."""
    scheduler_port, grpc_base, engine_base = free_port(), free_port_run(nodes), free_port_run(nodes)
    metrics_base = free_port_run(nodes)
    config = _write_config(
        home, model_dir, scheduler_port, grpc_base, engine_base, metrics_base, nodes, engine_toml, kv_toml
    )
    output = home / "up.out"
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("SYMPHONY_")}
    # The engines' /reset_prefix_cache (dev endpoint): the connector suite empties vLLM's own cache
    # so a resumed turn can only get its history from Symphony's tiers.
    child_env["VLLM_SERVER_DEV_MODE"] = "1"
    child_env.update(env or {})
    with output.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "symphony.cli", "up", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=child_env,
        )
    cluster = LiveCluster(
        f"http://127.0.0.1:{scheduler_port}",
        process,
        home,
        output,
        model,
        [engine_base + i for i in range(nodes)],
        [grpc_base + i for i in range(nodes)],
        [metrics_base + i for i in range(nodes)],
        [load_config(config, env={}).kv_socket_path(i) for i in range(nodes)],
    )
    start = output.stat().st_size  # a home used before has an earlier run's output

    def up() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"`symphony up` exited with {process.returncode}:\n{cluster.output_tail()}")
        with output.open("rb") as fh:
            fh.seek(start)
            return b"Symphony is up" in fh.read()

    try:
        wait_until(up, STARTUP_TIMEOUT_S, f"the {nodes}-node cluster to be up", interval_s=0.5)
    except BaseException:
        stop_cluster(cluster)
        raise
    return cluster


def stop_cluster(cluster: LiveCluster) -> None:
    """SIGTERM, as Ctrl-C would: the node managers flush their saves to SSD before they exit."""
    process = cluster.process
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def live_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveCluster]:
    model_dir = fetch_default_model(default_home(), progress=lambda _: None)
    cluster = start_cluster(tmp_path_factory.mktemp("symphony-home"), model_dir)
    try:
        yield cluster
    finally:
        stop_cluster(cluster)
