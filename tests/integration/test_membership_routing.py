"""A scheduler that follows etcd's member list (cluster.etcd_endpoints, scheduler.membership_watch)
against a real etcd and fake node managers: it starts with no node, routes to nodes as they
register, stops routing to one whose lease ends (a clean stop revokes it; a node that stops
renewing leaves within its TTL), keeps its nodes while etcd is unreachable, and never drops a node
given in its configuration."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from node_manager.main import node_registration
from scheduler.kv_index import NodePrefix
from symphony.config import load_config
from symphony.etcd_client import EtcdClient
from symphony.kv_addressing import ModelFingerprint, chain_block_keys
from symphony.kv_geometry import KVGeometry, hf_config_for
from symphony.membership import Member, Registration, members, members_prefix
from tests.etcd_support import running_etcd
from tests.helpers import async_wait_until, free_port_run, wait_until
from tests.integration.conftest import CHAT, MakeNode, StartScheduler
from tests.integration.fakes import FakeEngine

PREFIX = "/symphony-routing-test"
TTL_S = 2
POLL = {"membership_poll_ms": 100}


@pytest.fixture
async def etcd(tmp_path: Path) -> AsyncIterator[tuple[str, int]]:
    """(client URL, pid) of a running etcd."""
    with running_etcd(tmp_path / "etcd") as (url, process):
        yield url, process.pid


def _cluster(url: str) -> dict[str, object]:
    return {"etcd_endpoints": [url], "etcd_prefix": PREFIX, "membership_ttl_s": TTL_S}


async def _register(url: str, node_id: str, address: str) -> Registration:
    registration = Registration(EtcdClient([url]), PREFIX, Member(node_id=node_id, address=address), ttl_s=TTL_S)
    await asyncio.to_thread(registration.start)
    return registration


async def _node_ids(client: httpx.AsyncClient) -> set[str]:
    return set((await client.get("/readyz")).json()["nodes"])


async def test_nodes_join_as_they_register_and_leave_when_their_lease_ends(
    etcd: tuple[str, int], make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    url, _ = etcd
    first, second = await make_node(engine.url, "node-0"), await make_node(engine.url, "node-1")
    model = ModelFingerprint(first.status.model_fingerprint)
    first.kv.blocks = list(chain_block_keys(model, "default", list(range(64)), 32).block_keys)
    base, state = await start_scheduler([], cluster=_cluster(url), **POLL)
    async with httpx.AsyncClient(base_url=base, timeout=5) as client:
        assert await _node_ids(client) == set()
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 503
        registration = await _register(url, "node-0", first.address)
        await async_wait_until(lambda: state.kv_synced("node-0"), 10, "node-0 to join and its blocks to be indexed")
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        # node-1 registers, then stops renewing (a hung or cut-off node): a lease nobody keeps.
        etcd_client = EtcdClient([url])
        lease = etcd_client.grant(TTL_S)
        key = members_prefix(PREFIX) + b"node-1"
        etcd_client.put(key, Member(node_id="node-1", address=second.address).model_dump_json().encode(), lease=lease)
        await async_wait_until(
            lambda: {n.node_id for n in state.cluster.nodes} == {"node-0", "node-1"}, 10, "node-1 to join"
        )
        # Gone within its TTL (etcd expires leases on its own clock, up to a second late) and a poll.
        await async_wait_until(
            lambda: [n.node_id for n in state.cluster.nodes] == ["node-0"], 3 * TTL_S, "node-1 to leave"
        )
        assert await _node_ids(client) == {"node-0"}
        assert state.kv_index is not None and state.kv_index.node_ids == ["node-0"]
        assert 'symphony_node_up{node="node-0"} 1.0' in (await client.get("/metrics")).text
        coordination = (await client.get("/readyz")).json()["coordination"]
        assert coordination["etcd"] == [url] and coordination["membership_error"] == ""
        assert coordination["members_joined"] == [first.address]
        # A clean stop revokes the lease: node-0 leaves at once, its index slot, copies and series go.
        await asyncio.to_thread(registration.stop)
        await async_wait_until(lambda: not state.cluster.nodes, 2, "node-0 to leave")
        assert state.kv_index.node_ids == [] and state.kv_prefix(first.kv.blocks) == {}
        assert 'symphony_node_up{node="node-0"}' not in (await client.get("/metrics")).text
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 503
        # node-1 comes back first and takes node-0's slot, with none of node-0's blocks.
        second.kv.blocks = []
        later = await _register(url, "node-1", second.address)
        await async_wait_until(lambda: state.kv_synced("node-1"), 10, "node-1 to join again")
        assert state.kv_index.node("node-1").slot == 0 and state.kv_prefix(first.kv.blocks) == {}
        # node-0 comes back: a new slot, its blocks indexed again from its snapshot.
        registration = await _register(url, "node-0", first.address)
        await async_wait_until(lambda: state.kv_synced("node-0"), 10, "node-0 to join again")
        assert state.kv_index.node("node-0").slot == 1
        assert state.kv_prefix(first.kv.blocks) == {"node-0": NodePrefix(2, dram=2)}
        metrics = (await client.get("/metrics")).text
        assert 'symphony_membership_changes_total{change="join"} 4.0' in metrics
        assert 'symphony_membership_changes_total{change="leave"} 2.0' in metrics
        for held in (registration, later):
            await asyncio.to_thread(held.stop)


async def test_etcd_unreachable_changes_nothing_and_configured_nodes_are_never_dropped(
    etcd: tuple[str, int], make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    url, pid = etcd
    configured, member = await make_node(engine.url, "node-0"), await make_node(engine.url, "node-1")
    # node_addresses names node-0: it is followed whatever etcd says
    base, state = await start_scheduler([configured], cluster=_cluster(url), **POLL)
    async with httpx.AsyncClient(base_url=base, timeout=5) as client:
        registration = await _register(url, "node-1", member.address)
        await async_wait_until(
            lambda: {n.node_id for n in state.cluster.nodes} == {"node-0", "node-1"}, 10, "node-1 to join"
        )
        signal_sent = False
        try:
            os.kill(pid, signal.SIGSTOP)  # etcd hangs: every read times out
            signal_sent = True
            watch = state.membership
            assert watch is not None
            await async_wait_until(lambda: watch.failing != "", 10, "a membership read to fail")
            assert {n.node_id for n in state.cluster.nodes} == {"node-0", "node-1"}
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        finally:
            if signal_sent:
                os.kill(pid, signal.SIGCONT)
        await async_wait_until(lambda: watch.failing == "", 10, "membership to be read again")
        await asyncio.to_thread(registration.stop)
        await async_wait_until(
            lambda: [n.node_id for n in state.cluster.nodes] == ["node-0"], 5, "node-1 to leave, node-0 to stay"
        )
        assert "symphony_membership_read_failures_total" in (await client.get("/metrics")).text


def test_a_node_manager_registers_its_name_address_and_region(tmp_path: Path) -> None:
    settings = {"cluster": {"nodes": 3, "etcd_endpoints": ["http://127.0.0.1:2379"]}}
    regional = load_config(
        env={"SYMPHONY_HOME": str(tmp_path)},
        overrides={**settings, "regions": {"layout": ["us-east:1", "eu-west:2"]}, "kv": {"data_plane": "grpc"}},
    )
    registration = node_registration(regional, 2)
    assert registration is not None and registration.ttl_s == 5 and registration.prefix == "/symphony"
    assert registration.member == Member(node_id="node-2", address=regional.node_grpc_address(2), region="eu-west")
    plain = load_config(env={"SYMPHONY_HOME": str(tmp_path)}, overrides={"cluster": {"nodes": 2}})
    assert node_registration(plain, 0) is None


def _node_process(home: Path, url: str, ttl_s: int) -> tuple[list[str], Path, int]:
    """`symphony node --index 0` with its engine off, in etcd `url`: its command, log and gRPC port."""
    grpc_port = free_port_run(1)
    model = home / "tiny-model"
    model.mkdir()
    geometry = KVGeometry(num_layers=2, kv_heads=3, head_size=64, block_size=32)
    (model / "config.json").write_text(json.dumps(hf_config_for(geometry)))
    (model / "model.safetensors").write_bytes(b"")
    config = home / "symphony.toml"
    config.write_text(f"""
home = "{home}"
[cluster]
nodes = 1
secret = "membership routing test secret"
etcd_endpoints = ["{url}"]
etcd_prefix = "{PREFIX}"
membership_ttl_s = {ttl_s}
[node]
grpc_port_base = {grpc_port}
engine_port_base = {free_port_run(1)}
[engine]
enabled = false
model = "{model}"
[kv]
hbm_bytes = {4 << 20}
dram_bytes = {8 << 20}
ssd_bytes = {16 << 20}
metrics_port_base = {free_port_run(1)}
""")
    command = [sys.executable, "-m", "symphony.cli", "node", "--config", str(config), "--index", "0"]
    return command, home / "node.out", grpc_port


def _member_ids(url: str) -> list[str]:
    return [m.node_id for m in members(EtcdClient([url]), PREFIX)]


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGKILL"])
def test_a_node_manager_is_a_member_while_it_runs(etcd: tuple[str, int], tmp_path: Path, stop: str) -> None:
    """A stop (SIGTERM) revokes its lease: it is no member by the time the process has exited. A
    killed one (SIGKILL) renews no more and leaves within its TTL."""
    url, _ = etcd
    command, log_path, grpc_port = _node_process(tmp_path, url, TTL_S)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYMPHONY_")}
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_until(lambda: _member_ids(url) == ["node-0"], 60, "the node manager to register")
        # It renews: still a member after several TTLs.
        deadline = time.monotonic() + 2.5 * TTL_S
        while time.monotonic() < deadline:
            assert process.poll() is None and _member_ids(url) == ["node-0"]
            time.sleep(0.2)
        process.send_signal(getattr(signal, stop))
        if stop == "SIGTERM":
            process.wait(20)
            assert process.returncode == 0 and _member_ids(url) == [], log_path.read_text(errors="replace")[-2000:]
        else:
            process.wait(5)
            wait_until(lambda: _member_ids(url) == [], 3 * TTL_S, "the killed node to leave")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        # A node manager killed with -9 leaves its store's shared memory (named by its node and
        # port; `symphony up`'s supervisor sweeps it).
        for segment in Path("/dev/shm").glob(f"symphony-kv-node-0-{grpc_port}*"):
            segment.unlink(missing_ok=True)
