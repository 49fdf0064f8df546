"""Checks of the configuration's sections that have grown their own rules (`symphony.config`
calls them from its validation): the regions and the coordination store. Each raises through
`check(ok, key, message)`, which raises the ConfigError naming the key.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlsplit

from symphony.config_schema import SymphonyConfig
from symphony.residency_rules import known_tenants

Check = Callable[[bool, str, str], None]
Port = Callable[[str, int], None]


def region_checks(config: SymphonyConfig, check: Check, port: Port) -> list[int]:
    """Check `[regions]`; the ports a multi-region cluster adds (none for one region)."""
    r = config.regions
    try:
        topology = config.topology()
    except ValueError as exc:
        key, _, message = str(exc).partition(": ")
        check(False, key, message)
        raise AssertionError("check raises") from exc
    for name in ("probe_interval_ms", "region_down_after_ms"):
        check(getattr(r, name) > 0, f"regions.{name}", "must be positive")
    check(
        r.region_down_after_ms >= r.probe_interval_ms,
        "regions.region_down_after_ms",
        "must be at least regions.probe_interval_ms",
    )
    if topology is None:
        check(not config.scheduler.region, "scheduler.region", "needs regions.layout")
        return []
    check(
        not config.scheduler.region or config.scheduler.region in topology.names,
        "scheduler.region",
        f"{config.scheduler.region!r} is not in regions.layout ({', '.join(topology.names)})",
    )
    total = sum(len(region.nodes) for region in topology.regions)
    check(
        config.cluster.nodes == total,
        "cluster.nodes",
        f"{config.cluster.nodes}, but regions.layout places {total} nodes",
    )
    tenants = known_tenants(config.scheduler.api_keys)
    for tenant in topology.residency:
        check(
            tenant in tenants,
            "regions.residency",
            f"tenant {tenant!r} has no API key (scheduler.api_keys names {', '.join(sorted(tenants))}): "
            "its rule would never apply",
        )
    check(
        config.kv.data_plane == "grpc",
        "kv.data_plane",
        'must be "grpc" with regions.layout: a page stream goes to the port its peer advertises, past the '
        "WAN links, where gRPC pulls go through them",
    )
    count = len(topology.regions)
    port("scheduler.port + regions - 1", config.scheduler.port + count - 1)
    port("regions.scheduler_port_base", r.scheduler_port_base)
    port("regions.scheduler_port_base + regions - 1", r.scheduler_port_base + count - 1)
    plan = topology.link_plan(r.link_port_base)
    port("regions.link_port_base", r.link_port_base)
    port("regions.link_port_base + links", r.link_port_base + len(plan))
    ports = [config.scheduler.port + i for i in range(1, count)]
    ports += [r.scheduler_port_base + i for i in range(count)]
    return ports + [r.link_port_base] + [link.port for link in plan]


def coordination_checks(config: SymphonyConfig, check: Check) -> None:
    """`cluster.etcd_*` and the membership settings."""
    c = config.cluster
    check(len(c.etcd_endpoints) <= 16, "cluster.etcd_endpoints", "at most 16 endpoints")
    for endpoint in c.etcd_endpoints:
        parts = urlsplit(endpoint)
        check(
            parts.scheme in ("http", "https") and bool(parts.hostname) and parts.path in ("", "/"),
            "cluster.etcd_endpoints",
            f"{endpoint!r} is not an etcd client URL such as http://127.0.0.1:2379",
        )
    check(
        c.etcd_prefix.startswith("/") and len(c.etcd_prefix) <= 128,
        "cluster.etcd_prefix",
        f"{c.etcd_prefix!r} must start with / (at most 128 characters)",
    )
    check(2 <= c.membership_ttl_s <= 600, "cluster.membership_ttl_s", f"{c.membership_ttl_s} outside 2..600")
    poll = config.scheduler.membership_poll_ms
    check(50 <= poll <= 60_000, "scheduler.membership_poll_ms", f"{poll} outside 50..60000")
    replicas = config.scheduler.replicas
    check(1 <= replicas <= 8, "scheduler.replicas", f"{replicas} outside 1..8")
    last = config.scheduler.port + replicas - 1
    check(replicas == 1 or last <= 65535, "scheduler.port + scheduler.replicas - 1", f"port {last} outside 1..65535")
    port = c.etcd_port_base
    check(1 <= port <= 65534, "cluster.etcd_port_base", f"{port} outside 1..65534 (its peer port is the next)")
    check(
        replicas == 1 or c.ha or bool(c.etcd_endpoints),
        "scheduler.replicas",
        f"{replicas} replicas share their state through etcd: set cluster.ha (symphony up --ha) "
        "or cluster.etcd_endpoints",
    )
    check(
        not (c.ha or replicas > 1) or config.topology() is None,
        "cluster.ha",
        "scheduler replicas with regions.layout are not supported yet: one scheduler per region",
    )


def coordination_ports(config: SymphonyConfig) -> list[int]:
    """The ports a local cluster's replicas and its own etcd take (scheduler.host)."""
    ports = [config.scheduler.port + i for i in range(1, config.scheduler.replicas)]
    if config.cluster.ha and not config.cluster.etcd_endpoints:
        ports += [config.cluster.etcd_port_base, config.cluster.etcd_port_base + 1]
    return ports
