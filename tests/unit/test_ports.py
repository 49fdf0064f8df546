"""Ports picked for private clusters: free, and out of the kernel's ephemeral range, where a port
could be handed to an outgoing connection or a port-0 listener before the cluster binds it."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

import pytest

from eval import ports
from symphony.config import SymphonyConfig, load_config


def test_a_run_of_ports_lies_below_the_ephemeral_range_and_is_free() -> None:
    start = ports.ephemeral_start()
    for _ in range(20):
        base = ports.free_port_run(3)
        assert base >= ports.LOWEST_PORT and base + 2 < start
        assert all(ports._port_free(base + i) for i in range(3))


def test_a_port_in_use_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        held = taken.getsockname()[1]
        free = ports._kernel_free_port()
        # The picker draws the held port first, then a free one.
        draws = iter([held, free])
        monkeypatch.setattr(ports.random, "randrange", lambda low, high: next(draws))
        monkeypatch.setattr(ports, "ephemeral_start", lambda: 65_000)
        monkeypatch.setattr(ports, "LOWEST_PORT", 1_024)
        assert ports.free_port() == free


def test_without_room_below_the_ephemeral_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_start", lambda: ports.LOWEST_PORT)
    port = ports.free_port()
    assert ports._port_free(port)
    assert port not in ports.DEFAULT_PORTS


def test_picks_made_before_anything_binds_never_overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster's ports are all picked before any of it binds, and the kernel's port 0 hands a
    just-closed port straight back: the picker itself keeps two runs apart."""
    monkeypatch.setattr(ports, "_recent", ports.collections.deque(maxlen=ports.RECENT_PORTS))
    monkeypatch.setattr(ports, "ephemeral_start", lambda: ports.LOWEST_PORT)  # the kernel's path
    monkeypatch.setattr(ports, "_port_free", lambda port: True)  # this test is about the picker's memory
    same = 20_000
    draws = iter([same, same + 1, same, same + 3])  # a port of the first run is drawn twice more
    monkeypatch.setattr(ports, "_kernel_free_port", lambda: next(draws))
    assert ports.free_port_run(2) == same
    assert ports.free_port_run(2) == same + 3  # same + 1 and same overlap the first run


def test_many_runs_picked_in_a_row_are_disjoint() -> None:
    runs = [range(base, base + 3) for base in (ports.free_port_run(3) for _ in range(200))]
    picked = [port for run in runs for port in run]
    assert len(set(picked)) == len(picked)


@pytest.mark.parametrize(("nodes", "regions"), [(1, 0), (2, 0), (3, 3)])
def test_a_private_cluster_takes_no_port_or_file_of_a_default_one(tmp_path: Path, nodes: int, regions: int) -> None:
    """Every port and path a running cluster on the defaults holds (`make run`, or `symphony up
    --regions`) moves: found by walking the configuration, so a key added later is checked too.
    Every process of the private cluster listens somewhere none of it else does."""
    default = load_config(None, env={"SYMPHONY_HOME": str(tmp_path / "default")})
    private = ports.private_cluster_config(default, tmp_path / "private", nodes, regions=regions)
    assert private.home_path == tmp_path / "private" and private.cluster.nodes == nodes
    held_by_default = _listening(default, ports.DEFAULT_NODES, ports.DEFAULT_REGIONS)
    taken = _listening(private, nodes, regions)
    assert not taken & held_by_default
    assert private.kv.data_port_base == 0  # a page stream binds port 0: the kernel's pick
    assert not private.cluster.ha and not private.cluster.etcd_endpoints and private.scheduler.replicas == 1
    # A secret of its own, in the configuration its benchmark's own schedulers are given too.
    assert len(private.cluster.secret) == 64 and not default.cluster.secret
    given = dataclasses.replace(default, cluster=dataclasses.replace(default.cluster, secret="s" * 32))
    assert ports.private_cluster_config(given, tmp_path / "p2", nodes).cluster.secret not in {"", "s" * 32}
    assert all(not private.kv_ssd_dir(i).is_relative_to(default.home_path) for i in range(nodes))
    checked = {
        f"{section.name}.{key.name}"
        for section in dataclasses.fields(default)
        if dataclasses.is_dataclass(getattr(default, section.name))
        for key in dataclasses.fields(getattr(default, section.name))
        if key.name.endswith(("port", "port_base"))
    }
    assert checked == _PORT_KEYS | _ADVERTISED, "a new port key: say where a private cluster puts it"
    # A proxy in front of the user's nodes is not in front of the benchmark's: reached where they listen.
    proxied = dataclasses.replace(
        default,
        node=dataclasses.replace(default.node, advertise_host="gw", **dict.fromkeys(_ADVERTISED_NODE_KEYS, 20000)),
    )
    moved = ports.private_cluster_config(proxied, tmp_path / "p3", nodes).node
    assert moved.advertise_host == "" and all(getattr(moved, key) == 0 for key in _ADVERTISED_NODE_KEYS)


_PORT_KEYS = {
    "cluster.etcd_port_base",
    "scheduler.port",
    "node.grpc_port_base",
    "node.engine_port_base",
    "kv.data_port_base",
    "kv.metrics_port_base",
    "regions.scheduler_port_base",
    "regions.link_port_base",
}


_ADVERTISED_NODE_KEYS = ("advertise_grpc_port_base", "advertise_engine_port_base", "advertise_data_port_base")
_ADVERTISED = {f"node.{key}" for key in _ADVERTISED_NODE_KEYS}  # where others reach a node; nothing listens


def _listening(config: SymphonyConfig, nodes: int, regions: int) -> set[int]:
    """The ports a cluster of `config` with `nodes` nodes and `regions` regions listens on (as
    `DEFAULT_PORTS` counts them)."""
    links = 1 + regions * (regions - 1) + max(0, regions - 1) * nodes
    listed = [
        *(config.scheduler.port + i for i in range(max(1, regions))),
        *(config.node.grpc_port_base + i for i in range(nodes)),
        *(config.node.engine_port_base + i for i in range(nodes)),
        *(config.kv.metrics_port_base + i for i in range(nodes)),
        config.cluster.etcd_port_base,  # where `symphony up --ha` would start its etcd
        config.cluster.etcd_port_base + 1,
    ]
    if regions:
        listed += [config.regions.scheduler_port_base + i for i in range(regions)]
        listed += [config.regions.link_port_base + i for i in range(links)]
    return set(listed)
