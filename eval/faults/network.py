"""Scenario 2 of the fault suite: the network in front of a node broken under load.

Each node of the bench's cluster is reached through an emulated link of its own
(`symphony.wan_link`): one `LinkPipe` per node carries its gRPC, its engine's HTTP and its page
stream, at the addresses the node advertises (`node.advertise_*`). So the schedulers' status polls,
block-event streams and engine requests to a node, and its peers' pulls from it, all cross that
node's link. What a node dials itself (etcd, its peers' links) does not cross its own: a fault
cuts the traffic *to* one node, as a failed switch port or a firewall rule in front of it would.

The faults (`LINK_KINDS`), one at a time on a node drawn from the seed, each held for a drawn time
and then healed:
- `link_partition`: new connections refused, open ones reset;
- `link_blackhole`: nothing moves and nothing is reset (no RST): senders block as TCP's would, and
  what was held goes on once it heals;
- `link_latency`: `LATENCY_SPIKE_MS` more one way on every segment.
The probes, the recovery measure and the checker are the crash scenario's (`eval.faults.crashes`):
every request ends within the bound with an answer equal to its reference or a well-formed error,
and the cluster is whole again after each heal.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from eval.ports import free_port_run
from symphony.config import SymphonyConfig
from symphony.wan_link import LinkFault, LinkPipe, LinkShape, WanLink

# The links' shape while healthy: a LAN (the faults are the scenario, not the link).
LAN = LinkShape(rtt_ms=0.2, bandwidth_mbps=10_000.0)
LATENCY_SPIKE_MS = 300.0  # one way, on top of the LAN's
FAULTS = {
    "link_partition": (LinkFault.PARTITION, 0.0),
    "link_blackhole": (LinkFault.BLACKHOLE, 0.0),
    "link_latency": (LinkFault.NONE, LATENCY_SPIKE_MS),
}
# A link's connections at once: the schedulers' pools to an engine (a few dozen each under the
# overload scenario's clients), their gRPC channels, and the peers' page streams.
MAX_CONNECTIONS = 1024


def linked_config(config: SymphonyConfig) -> SymphonyConfig:
    """`config` (a private cluster's) with each node advertised at a link's listeners: free ports
    for its gRPC, engine and page stream, and the page stream on a fixed port (a link needs its
    target before the node starts)."""
    nodes = config.cluster.nodes
    return dataclasses.replace(
        config,
        node=dataclasses.replace(
            config.node,
            advertise_grpc_port_base=free_port_run(nodes),
            advertise_engine_port_base=free_port_run(nodes),
            advertise_data_port_base=free_port_run(nodes),
        ),
        kv=dataclasses.replace(config.kv, data_port_base=free_port_run(nodes)),
    )


class NodeLinks:
    """The links in front of a `linked_config` cluster's nodes: node i's three listeners share one
    pipe, so a fault breaks all three at once. One event loop (the bench's); start before the
    nodes, close after them."""

    def __init__(self, config: SymphonyConfig, seed: int = 0) -> None:
        n, host = config.node, config.node.host
        self.pipes: list[LinkPipe] = []
        self.links: list[WanLink] = []
        for i in range(config.cluster.nodes):
            pipe = LinkPipe(LAN, seed + i)
            self.pipes.append(pipe)
            for listen, target in (
                (n.advertise_grpc_port_base, n.grpc_port_base),
                (n.advertise_engine_port_base, n.engine_port_base),
                (n.advertise_data_port_base, config.kv.data_port_base),
            ):
                assert listen and target, "NodeLinks needs a linked_config"
                self.links.append(
                    WanLink(
                        LAN, host, target + i, host=host, port=listen + i, pipe=pipe, max_connections=MAX_CONNECTIONS
                    )
                )

    async def start(self) -> None:
        for link in self.links:
            await link.start()

    async def close(self) -> None:
        for link in self.links:
            await link.close()

    def cut(self, node: int, kind: str) -> None:
        """Break node `node`'s link as `kind` (one of `FAULTS`) says."""
        fault, extra_ms = FAULTS[kind]
        self.pipes[node].set_fault(fault, extra_ms)

    def heal(self, node: int) -> None:
        self.pipes[node].set_fault(LinkFault.NONE)

    def counters(self) -> dict[str, Any]:
        """Per node: connections relayed and refused, bytes each way (what crossed the links)."""
        found: dict[str, Any] = {}
        per_node = len(self.links) // max(1, len(self.pipes))
        for i in range(len(self.pipes)):
            mine = self.links[i * per_node : (i + 1) * per_node]
            found[f"node-{i}"] = {
                "connections": sum(link.counters.connections for link in mine),
                "refused": sum(link.counters.refused for link in mine),
                "bytes_to_node": sum(link.counters.bytes["forward"] for link in mine),
                "bytes_from_node": sum(link.counters.bytes["reverse"] for link in mine),
            }
        return found
