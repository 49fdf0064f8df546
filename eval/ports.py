"""Free local ports for the private clusters that benchmarks and tests start.

A port found free now is bound only later, once the process that will listen on it has started. In
between, the kernel may hand the same port to someone else: as the source port of an outgoing
connection, or to a listener that asked for port 0 (a node's page stream, vLLM's own sockets). Both
come from the kernel's ephemeral range, so the ports picked here lie below it, where only an explicit
bind can take them. They are never Symphony's default ports, so a private cluster never takes the
ports of one started with the defaults (`make run`).
"""

from __future__ import annotations

import collections
import dataclasses
import random
import socket
import threading
from pathlib import Path

from symphony.config import ClusterConfig, KVConfig, NodeConfig, RegionsConfig, SchedulerConfig, SymphonyConfig
from symphony.config_secrets import new_cluster_secret

LOWEST_PORT = 10_000  # above the well-known services
DEFAULT_NODES = 8  # of a cluster started with the defaults, whose ports are left alone
DEFAULT_REGIONS = 4  # ... and of a multi-region one (symphony.regions: entries, schedulers, links)
# Symphony's defaults: the scheduler's port, and each node's engine, KV metrics and gRPC ports;
# each region's entry and scheduler, and the WAN links' ports.
DEFAULT_PORTS = frozenset(
    [
        *(SchedulerConfig().port + i for i in range(DEFAULT_REGIONS)),
        *(RegionsConfig().scheduler_port_base + i for i in range(DEFAULT_REGIONS)),
        *(
            RegionsConfig().link_port_base + i
            for i in range(1 + DEFAULT_REGIONS * (DEFAULT_REGIONS - 1) + (DEFAULT_REGIONS - 1) * DEFAULT_NODES)
        ),
        *(
            base + i
            for base in (NodeConfig().engine_port_base, KVConfig().metrics_port_base, NodeConfig().grpc_port_base)
            for i in range(DEFAULT_NODES)
        ),
        ClusterConfig().etcd_port_base,  # `symphony up --ha`'s etcd: client and peer
        ClusterConfig().etcd_port_base + 1,
    ]
)
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_EPHEMERAL_START = 32_768  # the kernel's default, where the range cannot be read
ATTEMPTS = 200
# Ports handed out lately by this process. A port found free is not held, so without this two picks
# made before either cluster binds (a cluster's scheduler and its nodes, say) could name the same
# run; and the kernel's port 0 hands a just-closed port straight back. Bounded: only the latest
# RECENT_PORTS are remembered, far more than one cluster or test session starts at once.
RECENT_PORTS = 4096
_recent: collections.deque[int] = collections.deque(maxlen=RECENT_PORTS)
_recent_lock = threading.Lock()  # guards _recent: pytest-xdist aside, tests pick from threads too


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range."""
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return LINUX_EPHEMERAL_START


def free_port() -> int:
    return free_port_run(1)


def free_port_run(count: int) -> int:
    """The first of `count` consecutive ports free now (node i listens on base + i), below the
    ephemeral range when it leaves room there, else wherever the kernel finds a free one."""
    top = ephemeral_start() - count
    with _recent_lock:
        # A second round forgets what was handed out: on a host with little room below the
        # ephemeral range, remembering must not be what runs the picker dry.
        for _ in range(2):
            for _ in range(ATTEMPTS):
                base = random.randrange(LOWEST_PORT, top) if top > LOWEST_PORT else _kernel_free_port()
                ports = range(base, base + count)
                if (
                    ports[-1] <= 65535
                    and DEFAULT_PORTS.isdisjoint(ports)
                    and _not_handed_out(ports)
                    and all(map(_port_free, ports))
                ):
                    _recent.extend(ports)
                    return base
            _recent.clear()
    raise RuntimeError(f"no run of {count} free ports found")


def _not_handed_out(ports: range) -> bool:
    """No port of `ports` was handed out lately. Caller holds _recent_lock."""
    return not any(port in ports for port in _recent)


def _kernel_free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def private_cluster_config(config: SymphonyConfig, home: Path, nodes: int, *, regions: int = 0) -> SymphonyConfig:
    """`config` moved off everything a running cluster holds: its own `home` (logs, run files, SSD
    segments under home/kv), free ports for the scheduler (one per region with `regions`, and then
    their schedulers and WAN links too) and for each of `nodes` nodes' gRPC, engine and KV metrics,
    and page streams on ports the kernel picks, one scheduler and no etcd (never the user's), and a new
    cluster secret of its own (never `config`'s:
    the private cluster's files are kept when a benchmark fails), which the benchmark's own
    schedulers must share. A benchmark adds its own settings on top."""
    entries = max(1, regions)
    # The links' control API; per ordered region pair, to its scheduler; per region, to each node elsewhere.
    links = 1 + regions * (regions - 1) + max(0, regions - 1) * nodes
    return dataclasses.replace(
        config,
        home=str(home),
        # One scheduler, no etcd: a benchmark's cluster is its own, and never joins the user's etcd.
        cluster=dataclasses.replace(
            config.cluster,
            nodes=nodes,
            secret=new_cluster_secret(),
            ha=False,
            etcd_endpoints=[],
            etcd_port_base=free_port_run(2),
        ),
        scheduler=dataclasses.replace(config.scheduler, port=free_port_run(entries), node_addresses=[], replicas=1),
        node=dataclasses.replace(  # reached where it listens: a proxy of the user's is not the benchmark's
            config.node,
            grpc_port_base=free_port_run(nodes),
            engine_port_base=free_port_run(nodes),
            advertise_host="",
            advertise_grpc_port_base=0,
            advertise_engine_port_base=0,
            advertise_data_port_base=0,
        ),
        kv=dataclasses.replace(config.kv, metrics_port_base=free_port_run(nodes), ssd_dir="", data_port_base=0),
        regions=dataclasses.replace(
            config.regions, scheduler_port_base=free_port_run(entries), link_port_base=free_port_run(links)
        )
        if regions
        else config.regions,
    )
