"""The scheduler's node view: applying status replies (pure bookkeeping, no gRPC)."""

from __future__ import annotations

import grpc

from scheduler.node_monitor import NodeMonitor
from symphony.rpc import node_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def status(node_id: str, **fields: object) -> node_pb2.NodeStatus:
    return node_pb2.NodeStatus(
        node_id=node_id,
        engine_state=node_pb2.ENGINE_STATE_READY,
        engine_url="http://e:1",
        served_model="m",
        max_model_len=4096,
        **fields,
    )


def test_fresh_load_figures_are_taken() -> None:
    cluster = NodeMonitor(["a:1"], poll_interval_s=0.1, down_after_s=1.0, clock=Clock())
    node = cluster.nodes[0]
    cluster.apply_status(
        node,
        status(
            "node-0",
            num_requests_running=3,
            num_requests_waiting=2,
            kv_cache_usage=0.5,
            engine_kv_tokens=10_240,
            metrics_age_ms=80,
        ),
    )
    assert (node.node_id, node.running, node.waiting, node.kv_usage) == ("node-0", 3, 2, 0.5)
    assert node.reported
    snapshot = cluster.snapshot("m")[0]
    assert (snapshot.kv_usage, snapshot.kv_tokens) == (0.5, 10_240)  # what the policy prices context by


def test_a_request_waiting_for_its_pull_keeps_its_place_on_the_node() -> None:
    """Routed, not yet sent (its KV being pulled): its room is not offered to another request."""
    cluster = NodeMonitor(["a:1"], poll_interval_s=0.1, down_after_s=1.0, clock=Clock(), max_running=2)
    node = cluster.nodes[0]
    cluster.apply_status(node, status("node-0", metrics_age_ms=80))
    node.inflight = 1
    assert cluster.snapshot("m")[0].rooms == 1
    with node.reserving():
        assert cluster.snapshot("m")[0].rooms == 0 and node.reserved == 1
    assert node.reserved == 0 and cluster.snapshot("m")[0].rooms == 1


def test_stale_load_figures_are_not_routed_on() -> None:
    cluster = NodeMonitor(["a:1"], poll_interval_s=0.1, down_after_s=1.0, clock=Clock())
    node = cluster.nodes[0]
    cluster.apply_status(node, status("node-0", num_requests_running=3, metrics_age_ms=80))
    cluster.apply_status(node, status("node-0", num_requests_running=7, metrics_age_ms=5000))
    assert (node.running, node.waiting) == (0, 0)
    assert cluster.snapshot("m")[0].available, "a serving engine stays routable on the scheduler's own count"


def test_duplicate_names_are_made_unique_by_address() -> None:
    cluster = NodeMonitor(["a:1", "b:2"], poll_interval_s=0.1, down_after_s=1.0, clock=Clock())
    first, second = cluster.nodes
    cluster.apply_status(first, status("node-0"))
    cluster.apply_status(second, status("node-0"))
    assert (first.node_id, second.node_id) == ("node-0", "node-0@b:2")
    assert cluster.by_id("node-0@b:2") is second


def test_node_that_never_answered_is_unreachable_and_unreported() -> None:
    cluster = NodeMonitor(["a:1"], poll_interval_s=0.1, down_after_s=1.0, clock=Clock())
    assert not cluster.nodes[0].reported
    assert cluster.states() == {"a:1": "unreachable"}
    assert cluster.served_models() == {}


def test_late_nodes_are_routed_to_only_when_none_is_up_to_date_and_never_once_refused() -> None:
    clock = Clock()
    cluster = NodeMonitor(["a:1", "b:2"], poll_interval_s=0.1, down_after_s=1.0, clock=clock)
    a, b = cluster.nodes
    cluster.apply_status(a, status("node-0"))
    cluster.apply_status(b, status("node-1"))
    clock.now += 0.5
    cluster.apply_status(b, status("node-1"))
    clock.now += 0.8  # a is 1.3 s late, b 0.8 s: b alone is up
    assert [v.available for v in cluster.snapshot("m")] == [False, True]
    clock.now += 0.5  # both late (a saturated host): both still listen, both are tried
    cluster.poll_failed(a, grpc.StatusCode.DEADLINE_EXCEEDED, "slow")
    assert [v.available for v in cluster.snapshot("m")] == [True, True]
    cluster.poll_failed(b, grpc.StatusCode.UNAVAILABLE, "connection refused")  # b is gone
    assert [v.available for v in cluster.snapshot("m")] == [True, False]
    assert cluster.states() == {"node-0": "unreachable", "node-1": "unreachable"}
    clock.now += 10.0  # late beyond the lag limit: down for good
    assert [v.available for v in cluster.snapshot("m")] == [False, False]
    cluster.apply_status(b, status("node-1"))  # b is back
    assert [v.available for v in cluster.snapshot("m")] == [False, True]
