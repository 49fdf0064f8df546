"""A crashed engine: the scheduler routes around it, the node manager restarts it and says so.

The engine is one of the shared cluster's: the test ends once it is back (and the next test waits
until every node is ready and idle, or gets a new cluster if this one never recovers)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import openai
import pytest

from symphony.process import group_members
from tests.e2e.conftest import LiveCluster
from tests.helpers import wait_until

pytestmark = pytest.mark.e2e


def _shm_of_group(pgid: int) -> set[Path]:
    paths = set()
    for pid in group_members(pgid):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        paths |= {Path(line[line.index("/dev/shm/") :].strip()) for line in maps.splitlines() if "/dev/shm/" in line}
    return paths


def test_killed_engine_is_routed_around_and_restarted(live_cluster: LiveCluster) -> None:
    engine_pid = live_cluster.engine_pid(1)
    # Not necessarily 0: an engine whose port was taken at start-up was restarted already.
    restarts_before = live_cluster.node_state("node-1")["engine_restarts"]
    shm_before = _shm_of_group(os.getpgid(engine_pid))
    assert shm_before, "vLLM maps shared memory for its engine-core queues"

    os.kill(engine_pid, signal.SIGKILL)
    wait_until(lambda: live_cluster.node_state("node-1")["state"] != "ready", 5, "node-1 to be marked down")

    client = openai.OpenAI(base_url=live_cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for i in range(3):
        raw = client.chat.completions.with_raw_response.create(
            model=live_cluster.model,
            messages=[{"role": "user", "content": f"Say the number {i}."}],
            max_tokens=8,
            extra_headers={"X-Session-ID": f"e2e-crash-{i}"},
        )
        assert raw.parse().choices[0].message.content
        assert raw.headers["x-symphony-node"] == "node-0"

    wait_until(
        lambda: live_cluster.node_state("node-1")["state"] == "ready", 300, "node-1's engine to restart", interval_s=1.0
    )
    node = live_cluster.node_state("node-1")
    assert node["engine_restarts"] == restarts_before + 1
    assert "SIGKILL" in node["last_engine_error"]
    assert f'symphony_node_engine_restarts{{node="node-1"}} {restarts_before + 1}.0' in live_cluster.metrics()
    # The killed engine could not unlink its shared memory; the node manager did, all but its own
    # segments, which the engine maps too and the restarted engine attached again: the DRAM arena
    # (its worker) and the block index (its scheduler).
    own = {p for p in shm_before if p.name.startswith("symphony-kv-node-1-")}
    assert {p.name.endswith("-blocks") for p in own} == {True, False} and len(own) == 2, shm_before
    assert not [p for p in shm_before - own if p.exists()]
    assert all(p.exists() for p in own)
    restarted = live_cluster.engine_pid(1)
    assert own <= _shm_of_group(os.getpgid(restarted)), "the restarted engine maps the arena and index again"
    assert "node-1: engine restarting" in live_cluster.output.read_text()
