"""The network scenario's links (eval.faults.network) over real loopback TCP: each node's three
listeners relay to where the node listens, and a fault on one node's link breaks all three of its
listeners and none of another node's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from eval.faults import LINK_KINDS
from eval.faults.crashes import LINK_HOLD_S, schedule
from eval.faults.network import LATENCY_SPIKE_MS, NodeLinks, linked_config
from eval.ports import private_cluster_config
from symphony.config import SymphonyConfig, load_config
from tests.helpers import echo

PING = b"ping"
NODES = 2


def test_a_link_schedule_holds_each_fault_for_a_drawn_time_on_a_node() -> None:
    faults = schedule(3, nodes=NODES, replicas=2, rounds=2, kinds=LINK_KINDS)
    assert sorted(f.kind for f in faults) == sorted(LINK_KINDS * 2)
    assert all(LINK_HOLD_S[0] <= f.hold_s <= LINK_HOLD_S[1] and 0 <= f.target < NODES for f in faults)
    assert faults[0].describe().startswith(f"{faults[0].kind} node-{faults[0].target} for ")
    assert schedule(3, nodes=NODES, replicas=2, rounds=2, kinds=LINK_KINDS) == faults  # the seed's


@pytest.fixture
async def linked(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[SymphonyConfig, NodeLinks]]:
    """A linked private config whose nodes' gRPC, engine and page-stream ports are echo servers,
    and the links in front of them."""
    config = linked_config(private_cluster_config(load_config(env={}), tmp_path_factory.mktemp("home"), NODES))

    host, n = config.node.host, config.node
    servers = [
        await asyncio.start_server(echo, host, base + i)
        for base in (n.grpc_port_base, n.engine_port_base, config.kv.data_port_base)
        for i in range(NODES)
    ]
    links = NodeLinks(config)
    await links.start()
    yield config, links
    await links.close()
    for server in servers:
        server.close()
        await server.wait_closed()


def advertised(config: SymphonyConfig, node: int) -> list[int]:
    """Node `node`'s gRPC, engine and page-stream ports, as the cluster reaches them."""
    grpc_port = int(config.node_grpc_address(node).rpartition(":")[2])
    engine_port = int(config.engine_advertised_url(node).rpartition(":")[2])
    return [grpc_port, engine_port, config.kv_advertised_data_port(node, 0)]


async def round_trip(host: str, port: int, timeout_s: float = 5.0) -> float:
    """Seconds for PING to come back through `port`; raises ConnectionError when refused or reset."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        started = time.monotonic()
        writer.write(PING)
        await writer.drain()
        got = await asyncio.wait_for(reader.readexactly(len(PING)), timeout_s)
        assert got == PING
        return time.monotonic() - started
    except asyncio.IncompleteReadError as exc:  # reset by the link
        raise ConnectionResetError("the link ended the connection") from exc
    finally:
        writer.close()


async def test_a_partition_cuts_every_listener_of_one_node_and_heals(linked: tuple[SymphonyConfig, NodeLinks]) -> None:
    config, links = linked
    host = config.node.host
    assert config.node_grpc_address(1) != config.node_grpc_listen(1)  # the node is reached through its link
    for node in range(NODES):
        for port in advertised(config, node):
            await round_trip(host, port)
    links.cut(1, "link_partition")
    for port in advertised(config, 1):
        with pytest.raises(ConnectionError):
            await round_trip(host, port)
    for port in advertised(config, 0):  # another node's link carries on
        await round_trip(host, port)
    links.heal(1)
    for port in advertised(config, 1):
        await round_trip(host, port)
    counted = links.counters()
    assert counted["node-1"]["refused"] == 3 and counted["node-0"]["refused"] == 0
    assert counted["node-1"]["bytes_to_node"] == counted["node-1"]["bytes_from_node"] == 6 * len(PING)


async def test_a_blackhole_holds_what_was_sent_until_it_heals(linked: tuple[SymphonyConfig, NodeLinks]) -> None:
    config, links = linked
    host, engine = config.node.host, advertised(config, 0)[1]
    reader, writer = await asyncio.open_connection(host, engine)
    links.cut(0, "link_blackhole")
    writer.write(PING)
    await writer.drain()
    with pytest.raises(TimeoutError):  # accepted, not reset, and nothing comes back
        await asyncio.wait_for(reader.readexactly(len(PING)), 0.5)
    links.heal(0)
    assert await asyncio.wait_for(reader.readexactly(len(PING)), 5.0) == PING  # held, then delivered
    writer.close()


async def test_a_latency_spike_slows_each_way_of_one_node(linked: tuple[SymphonyConfig, NodeLinks]) -> None:
    config, links = linked
    host = config.node.host
    links.cut(1, "link_latency")
    slow = await round_trip(host, advertised(config, 1)[0])
    fast = await round_trip(host, advertised(config, 0)[0])
    assert slow >= 2 * LATENCY_SPIKE_MS / 1000 > fast
    links.heal(1)
    assert await round_trip(host, advertised(config, 1)[0]) < 2 * LATENCY_SPIKE_MS / 1000
