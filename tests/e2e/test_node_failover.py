"""A node manager and its engine killed with -9 in the middle of a multi-session run: requests that
had not started answering are re-sent to the other node (no client sees an error), the dead node is
marked down within a second, the cluster keeps serving, and `symphony up` brings the node back.

The node is one of the shared cluster's: the test ends once it is back (and the next test waits
until every node is ready and idle, or gets a new cluster if this one never recovers)."""

from __future__ import annotations

import asyncio
import os
import signal

import openai
import pytest

from symphony.process import group_members
from tests.e2e.conftest import LiveCluster
from tests.helpers import async_wait_until, wait_until

pytestmark = pytest.mark.e2e

SESSIONS = 6


async def _turn(client: openai.AsyncOpenAI, model: str, session: str, text: str, max_tokens: int) -> str:
    raw = await client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        max_tokens=max_tokens,
        temperature=0,
        extra_headers={"X-Session-ID": session},
    )
    assert raw.parse().choices[0].message.content is not None
    return raw.headers["x-symphony-node"]


def test_a_killed_node_costs_no_client_an_error(live_cluster: LiveCluster) -> None:
    retries_before = _retries(live_cluster)
    asyncio.run(_run(live_cluster))
    assert _retries(live_cluster) > retries_before, "a request in flight on the killed node was re-sent"
    # `symphony up` restarts the dead node manager, which starts its engine again.
    wait_until(
        lambda: live_cluster.node_state("node-1")["state"] == "ready", 300, "node-1 to come back", interval_s=1.0
    )


def _retries(cluster: LiveCluster) -> float:
    for line in cluster.metrics().splitlines():
        if line.startswith('symphony_dispatch_retries_total{node="node-1"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _run(cluster: LiveCluster) -> None:
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = cluster.model
    try:
        first = await asyncio.gather(
            *[_turn(client, model, f"failover-{i}", f"Count from {i} to {i + 5}.", 8) for i in range(SESSIONS)]
        )
        assert set(first) == {"node-0", "node-1"}, "per-request balancing put sessions on both nodes"
        # Second turns, long enough to be in flight when node-1 dies.
        second = [
            asyncio.create_task(_turn(client, model, f"failover-{i}", "Now write a short poem about it.", 96))
            for i in range(SESSIONS)
        ]
        await async_wait_until(lambda: cluster.node_state("node-1")["inflight"] > 0, 60, "a request on node-1")
        engine = cluster.engine_pid(1)
        victims = [cluster.node_manager_pid(1), *group_members(os.getpgid(engine))]
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        # Marked down within a second (node_down_after_ms), plus a poll period and this check's own.
        await async_wait_until(lambda: cluster.node_state("node-1")["state"] != "ready", 1.5, "node-1 marked down")
        served = await asyncio.gather(*second)  # every one answered: no client-visible error
        assert len(served) == SESSIONS
        # The cluster keeps serving, on the node that is left.
        third = await asyncio.gather(*[_turn(client, model, f"failover-{i}", "Thanks!", 4) for i in range(SESSIONS)])
        assert set(third) == {"node-0"}
    finally:
        await client.close()
