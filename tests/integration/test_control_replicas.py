"""Scheduler replicas share the admin API's changes through etcd (symphony.control_etcd,
scheduler.control_watch), against a real etcd: a change made on one replica reaches the other
(tiers, a session tier set back to normal, quota changes and clears, residency rules), a replica
started later restores them all, and a watch whose revision was compacted catches up from a
snapshot."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from scheduler.app import create_app
from scheduler.control_watch import ControlWatch
from scheduler.state import SchedulerState
from symphony.config import SymphonyConfig
from symphony.control_etcd import EtcdControlStore, TenantEntry
from symphony.control_state import Changed, SessionPriority
from symphony.etcd_client import EtcdClient
from tests.etcd_support import running_etcd
from tests.helpers import async_wait_until
from tests.integration.test_control_state import ADMIN_HEADERS, _config

PREFIX = "/symphony-control-test"


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[str]:
    with running_etcd(tmp_path / "etcd") as (url, _):
        yield url


def _replica_config(home: Path, url: str, **scheduler: Any) -> SymphonyConfig:
    return _config(home, cluster={"etcd_endpoints": [url], "etcd_prefix": PREFIX}, **scheduler)


@pytest.fixture
async def replicas(tmp_path: Path, etcd: str) -> AsyncIterator[list[SchedulerState]]:
    """Two replicas of one scheduler on homes of their own, following each other's changes."""
    started = []
    for name in ("a", "b"):
        state = SchedulerState(_replica_config(tmp_path / name, etcd))
        assert state.control_watch is not None
        state.control_watch.start(asyncio.get_running_loop())
        started.append(state)
    yield started
    for state in started:
        assert state.control_watch is not None
        state.control_watch.stop()


async def _admin(state: SchedulerState, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    app = create_app(state.config, state)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://scheduler") as http:
        return await http.request(method, "/admin/v1" + path, json=body, headers=ADMIN_HEADERS)


async def test_a_change_on_one_replica_reaches_the_other(
    replicas: list[SchedulerState], tmp_path: Path, etcd: str
) -> None:
    a, b = replicas
    assert (await _admin(a, "PUT", "/priorities", {"tenant": "acme", "priority": "high"})).status_code == 200
    session = {"tenant": "globex", "session_id": "chat/7?x=1", "priority": "low"}
    assert (await _admin(b, "PUT", "/priorities", session)).status_code == 200
    limits = {"tenant": "globex", "limits": {"max_inflight": 3, "weight": 2.5}}
    assert (await _admin(a, "PUT", "/quotas", limits)).status_code == 200
    assert (await _admin(b, "PUT", "/quotas", {"tenant": "acme", "limits": None})).status_code == 200

    def agree() -> bool:
        return all(
            s.priorities.of("acme", None).value == "high"
            and s.priorities.of("globex", "chat/7?x=1").value == "low"
            and s.quotas.limits("globex").max_inflight == 3
            and s.quotas.limits("acme").requests_per_s == 0  # cleared, over the configuration's 5
            for s in (a, b)
        )

    await async_wait_until(agree, 10, "both replicas to hold all four changes")
    listings = [(await _admin(s, "GET", "/priorities")).json() for s in (a, b)]
    assert listings[0] == listings[1]

    # Back to the configuration on one replica: the other follows (a deleted entry).
    assert (await _admin(a, "PUT", "/priorities", {**session, "priority": "normal"})).status_code == 200
    assert (await _admin(a, "PUT", "/priorities", {"tenant": "acme", "priority": "normal"})).status_code == 200
    await async_wait_until(
        lambda: (
            b.priorities.of("globex", "chat/7?x=1").value == "normal"
            and b.priorities.of("acme", None).value == "normal"
        ),
        10,
        "b to see the tiers set back",
    )
    # acme's quota entry stays (cleared), its tier is gone from it.
    assert b.quotas.limits("acme").requests_per_s == 0

    # A replica started later restores everything from etcd.
    late = SchedulerState(_replica_config(tmp_path / "late", etcd))
    assert late.quotas.limits("globex").max_inflight == 3 and late.quotas.limits("acme").requests_per_s == 0
    assert late.priorities.of("globex", "chat/7?x=1").value == "normal" and len(late.priorities) == 0


async def test_residency_rules_are_shared_by_a_regions_replicas(tmp_path: Path, etcd: str) -> None:
    replicas = [SchedulerState(_replica_config(tmp_path / n, etcd, region="eu-west")) for n in ("a", "b")]
    for state in replicas:
        assert state.control_watch is not None
        state.control_watch.start(asyncio.get_running_loop())
    try:
        a, b = replicas
        rule = {"tenant": "acme", "regions": ["eu-west"]}
        assert (await _admin(a, "PUT", "/residency", rule)).status_code == 200

        def allowed(state: SchedulerState) -> bool:
            assert state.topology is not None
            return not state.topology.allowed("acme", "us-east") and state.topology.allowed("acme", "eu-west")

        await async_wait_until(lambda: allowed(b), 10, "b to hold the rule")
        assert (await _admin(b, "PUT", "/residency", {"tenant": "acme", "regions": None})).status_code == 200
        await async_wait_until(
            lambda: a.topology is not None and a.topology.allowed("acme", "us-east"), 10, "a to drop it"
        )
        # Another region's replicas keep their own control state.
        other = SchedulerState(_replica_config(tmp_path / "us", etcd, region="us-east"))
        assert other.control.residency_changes == {}
    finally:
        for state in replicas:
            assert state.control_watch is not None
            state.control_watch.stop()


async def test_a_watch_behind_a_compaction_catches_up_from_a_snapshot(etcd: str) -> None:
    client = EtcdClient([etcd])
    store = EtcdControlStore(client, PREFIX, "scheduler", 1000)
    writer = EtcdControlStore(client, PREFIX, "scheduler", 1000)
    client.put(writer.tenant_key("gone"), TenantEntry(priority="low").model_dump_json().encode())
    store.load()  # the watch starts after this revision, remembering "gone"
    client.delete(writer.tenant_key("gone"))
    client.put(writer.tenant_key("acme"), TenantEntry(priority="high").model_dump_json().encode())
    session = SessionPriority(tenant="acme", session_id="s", priority="low")
    client.put(writer.session_key("acme", "s"), session.model_dump_json().encode())
    revision = client.snapshot(b"/", 100)[1]
    compaction = {"revision": str(revision), "physical": True}
    async with httpx.AsyncClient() as http:
        (await http.post(f"{etcd}/v3/kv/compaction", json=compaction)).raise_for_status()
    seen: list[tuple[Changed, Any]] = []
    watch = ControlWatch(store, lambda changed, entry: seen.append((changed, entry)))
    watch.start(asyncio.get_running_loop())
    try:
        await async_wait_until(lambda: len(seen) == 3, 10, "the snapshot's three changes")
    finally:
        watch.stop()
    assert sorted(seen, key=lambda item: (item[0].tenant, item[0].session_id or "")) == [
        (Changed("acme"), TenantEntry(priority="high")),
        (Changed("acme", "s"), session),
        (Changed("gone"), None),
    ]
    assert watch.revision == revision
