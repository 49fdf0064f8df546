"""Fixtures of the scheduler's integration tests: a real scheduler (uvicorn) polling fake node
managers (real gRPC) in front of fake engines (real HTTP)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from scheduler.cost_profile import DEFAULT_PROFILE
from scheduler.server import server_config
from scheduler.state import SchedulerState
from symphony.config import load_config
from tests.helpers import async_wait_until, free_port
from tests.integration.fakes import FakeEngine, FakeNodeManager, ready_status

StartScheduler = Callable[..., Awaitable[tuple[str, SchedulerState]]]


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    fake = FakeEngine()
    await fake.start()
    yield fake
    await fake.stop()


Servers = dict[str, tuple[uvicorn.Server, "asyncio.Task[None]"]]


@pytest.fixture
def scheduler_servers() -> Servers:
    """The schedulers `start_scheduler` started, by URL: a test may stop one (`stop_scheduler`)."""
    return {}


async def stop_scheduler(servers: Servers, url: str) -> None:
    server, task = servers.pop(url)
    server.should_exit = True
    await task


@pytest.fixture
async def start_scheduler(tmp_path: Path, scheduler_servers: Servers) -> AsyncIterator[StartScheduler]:
    """Start a scheduler in front of `nodes`; its home (control state: scheduler.control) is the
    test's `tmp_path` unless `home` names another, so a second one started there is a restart."""
    servers = scheduler_servers

    async def start(
        nodes: list[FakeNodeManager],
        quotas: dict[str, Any] | None = None,
        cluster: dict[str, Any] | None = None,
        home: Path | None = None,
        **scheduler: Any,
    ) -> tuple[str, SchedulerState]:
        port = free_port()
        settings = {
            "port": port,
            "node_addresses": [n.address for n in nodes],
            "poll_interval_ms": 20,
            "node_down_after_ms": 300,
            "connect_timeout_s": 1.0,
            **scheduler,
        }
        config = load_config(
            env={"SYMPHONY_HOME": str(home or tmp_path)},
            overrides={"scheduler": settings, "quotas": quotas or {}, "cluster": cluster or {}},
        )
        state = SchedulerState(config)
        server = uvicorn.Server(server_config(config, state))  # as `symphony scheduler` serves it
        task = asyncio.create_task(server.serve())
        url = f"http://127.0.0.1:{port}"
        servers[url] = (server, task)
        await async_wait_until(lambda: server.started, 10, "the scheduler to listen")
        return url, state

    yield start
    for url in list(servers):
        await stop_scheduler(servers, url)


MakeNode = Callable[..., Awaitable[FakeNodeManager]]
# Costs under which an advisory's warm-up pass in the engine costs less than loading the KV at the
# request's arrival (as on a GPU host with long histories): advisories move KV into the engine's
# cache. Given to a dispatcher only (`Dispatcher.profile`): routing keeps the default costs.
WARM_UPS_PAY = dataclasses.replace(DEFAULT_PROFILE, request_overhead_ms=0.0, step_ms=0.0)


@pytest.fixture
async def make_node() -> AsyncIterator[MakeNode]:
    started: list[FakeNodeManager] = []

    async def make(engine_url: str, node_id: str = "node-0", **status: Any) -> FakeNodeManager:
        node = FakeNodeManager(ready_status(node_id, engine_url, **status))
        await node.start()
        started.append(node)
        return node

    yield make
    for node in started:
        await node.stop()


async def ready(client: httpx.AsyncClient, count: int = 1) -> None:
    async def ready() -> bool:
        body = (await client.get("/readyz")).json()
        return body["ready_nodes"] == count

    await async_wait_until(ready, 10, f"{count} ready node(s)")


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
