"""`symphony up --ha` (cluster.ha): two scheduler replicas over an etcd the cluster starts, one
real vLLM node. The node registers in etcd and both replicas route to it; an admin change made at
one replica reaches the other; replica 0 killed with -9 costs an SDK client given both URLs no
error, and when `symphony up` brings it back it restores the change from etcd and rebuilds its KV
index from the node; at temperature 0 both replicas give the same answer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from client_sdk import AdminClient, SymphonyClient
from symphony.config import default_home
from symphony.models import fetch_default_model
from tests.e2e.conftest import HA_ADMIN_TOKEN, LiveCluster, start_cluster, stop_cluster
from tests.helpers import wait_until

pytestmark = pytest.mark.e2e

# Over 100 tokens with the system prompt: whole blocks (32 tokens) of it reach the node's tiers
# and its block stream.
SYSTEM = "You are a helpful assistant who answers questions about geography briefly and exactly. " * 5
QUESTION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is the capital of France? Answer in one word."},
]


@pytest.fixture
def ha_cluster(tmp_path_factory: pytest.TempPathFactory, own_engines: None) -> Iterator[LiveCluster]:
    model_dir = fetch_default_model(default_home(), progress=lambda _: None)
    cluster = start_cluster(tmp_path_factory.mktemp("symphony-ha"), model_dir, nodes=1, ha=True)
    try:
        yield cluster
    finally:
        stop_cluster(cluster)


def _replicas(cluster: LiveCluster) -> list[str]:
    port = int(cluster.url.rsplit(":", 1)[1])
    return [cluster.url, f"http://127.0.0.1:{port + 1}"]


def _ready_nodes(url: str, cluster: LiveCluster) -> int:
    try:
        return int(httpx.get(url + "/readyz", timeout=5, headers=cluster.internal_headers).json()["ready_nodes"])
    except (httpx.HTTPError, ValueError, KeyError):
        return -1


def _answer(client: SymphonyClient, session: str) -> str:
    reply = client.chat(session, QUESTION, max_tokens=8, temperature=0)
    return str(reply.choices[0].message.content)


def test_replicas_share_the_node_and_admin_changes_and_a_killed_one_costs_no_error(ha_cluster: LiveCluster) -> None:
    cluster = ha_cluster
    first, second = _replicas(cluster)
    # The node joined both replicas through etcd (no node_addresses configured).
    wait_until(lambda: _ready_nodes(second, cluster) == 1, 60, "replica 1 to route to the node")
    assert "etcd" in cluster.output_tail() and "replica 1" in cluster.output_tail()
    own = SymphonyClient(first, model=cluster.model, max_retries=0)
    other = SymphonyClient(second, model=cluster.model, max_retries=0)
    both = SymphonyClient([first, second], model=cluster.model, max_retries=1, timeout=300)
    admin = AdminClient([first, second], token=HA_ADMIN_TOKEN)
    try:
        answer = _answer(own, "ha-1")
        assert "Paris" in answer and _answer(other, "ha-2") == answer  # greedy: the same on both

        assert admin.set_priority("default", "low")["priority"] == "low"  # at replica 0
        listing = AdminClient(second, token=HA_ADMIN_TOKEN)
        try:
            wait_until(lambda: listing.priorities()["tenants"] == {"default": "low"}, 10, "replica 1 to see it")
        finally:
            listing.close()

        os.kill(cluster.scheduler_pid(replica=0), signal.SIGKILL)
        wait_until(lambda: _ready_nodes(first, cluster) < 0, 10, "replica 0 to be gone")
        assert _answer(both, "ha-3") == answer  # replica 1 answers; the client saw no error
        assert both.replicas.index == 1

        # `symphony up` restarts replica 0; it restores the admin change from etcd, finds the node,
        # and rebuilds its KV index from the node's block stream (the blocks of the turns above).
        wait_until(lambda: _ready_nodes(first, cluster) == 1, 120, "replica 0 to be back with the node")

        def index_rebuilt() -> bool:
            node = httpx.get(first + "/readyz", timeout=5, headers=cluster.internal_headers).json()["nodes"]["node-0"]
            index = node.get("kv_index", {})
            return index.get("state") == "synced" and sum(index.get("blocks", {}).values()) > 0

        wait_until(index_rebuilt, 30, "replica 0's KV index to be rebuilt from node-0")
        restored = AdminClient(first, token=HA_ADMIN_TOKEN)
        try:
            assert restored.priorities()["tenants"] == {"default": "low"}
        finally:
            restored.close()
        assert _answer(own, "ha-4") == answer
        shown = subprocess.run(
            [sys.executable, "-m", "symphony.cli", "status", "--config", str(cluster.home / "symphony.toml")],
            capture_output=True,
            text=True,
            timeout=60,
            env={k: v for k, v in os.environ.items() if not k.startswith("SYMPHONY_")},
        )
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert f"replica 1 {second}: ready (1 ready)" in shown.stdout
        assert "1 member(s) joined" in shown.stdout and "NOT READ" not in shown.stdout
    finally:
        for client in (own, other, both):
            client.close()
        admin.close()
