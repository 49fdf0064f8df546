"""Idle connections on a real cluster: the scheduler and each vLLM engine keep a client's idle
connection past the time httpx's pools (so the `openai` client's, our node managers' and the
benchmarks') reuse one. Were the server to close it at that time, as uvicorn's 5 s default does, a
request sent on it as it closed would break (`bench faults` saw probes fail so)."""

from __future__ import annotations

import asyncio

import pytest
from openai._constants import DEFAULT_CONNECTION_LIMITS

from tests.e2e.conftest import LiveCluster
from tests.helpers import idle_connection_reused

pytestmark = pytest.mark.e2e


def test_the_scheduler_and_engines_keep_connections_the_clients_pools_reuse(live_cluster: LiveCluster) -> None:
    expiry = DEFAULT_CONNECTION_LIMITS.keepalive_expiry
    assert expiry is not None
    idle_s = expiry + 0.5
    servers = [(live_cluster.url, "/healthz")]
    servers += [(f"http://127.0.0.1:{port}", "/health") for port in live_cluster.engine_ports]

    async def all_of_them() -> list[list[bytes]]:
        return await asyncio.gather(*(idle_connection_reused(url, path, idle_s) for url, path in servers))

    for (url, _), statuses in zip(servers, asyncio.run(all_of_them()), strict=True):
        assert statuses == [b"HTTP/1.1 200 OK"] * 2, (url, statuses)
