"""The generated gRPC messages: round trips, defaults, and stubs in step with proto/."""

from __future__ import annotations

from symphony import protogen
from symphony.rpc import node_pb2, node_pb2_grpc


def test_node_status_round_trips_through_bytes() -> None:
    status = node_pb2.NodeStatus(
        node_id="node-3",
        engine_state=node_pb2.ENGINE_STATE_READY,
        engine_url="http://10.0.0.7:8103",
        served_model="SmolLM2-135M-Instruct",
        max_model_len=8192,
        block_size=32,
        num_requests_running=5,
        num_requests_waiting=2,
        kv_cache_usage=0.375,
        metrics_age_ms=80,
        engine_restarts=1,
        last_engine_error="killed by SIGKILL",
    )
    decoded = node_pb2.NodeStatus.FromString(status.SerializeToString())
    assert decoded == status
    assert decoded.kv_cache_usage == 0.375 and decoded.engine_state == node_pb2.ENGINE_STATE_READY


def test_unset_fields_read_as_zero_values() -> None:
    empty = node_pb2.NodeStatus.FromString(b"")
    assert empty.engine_state == node_pb2.ENGINE_STATE_UNSPECIFIED
    assert (empty.num_requests_running, empty.kv_cache_usage, empty.engine_url) == (0, 0.0, "")


def test_health_response_round_trip() -> None:
    reply = node_pb2.HealthResponse(serving=True, engine_state=node_pb2.ENGINE_STATE_RESTARTING)
    assert node_pb2.HealthResponse.FromString(reply.SerializeToString()) == reply


def test_engine_state_names_are_stable() -> None:
    # The scheduler shows these names (lower-cased, prefix dropped) in /readyz and `symphony status`.
    names = [node_pb2.EngineState.Name(v) for v in node_pb2.EngineState.values()]
    assert names == [
        "ENGINE_STATE_UNSPECIFIED",
        "ENGINE_STATE_STARTING",
        "ENGINE_STATE_READY",
        "ENGINE_STATE_RESTARTING",
        "ENGINE_STATE_FAILED",
        "ENGINE_STATE_STOPPED",
    ]


def test_service_exposes_health_and_status() -> None:
    service = node_pb2.DESCRIPTOR.services_by_name["NodeManager"]
    assert sorted(m.name for m in service.methods) == ["Health", "Status"]
    assert hasattr(node_pb2_grpc, "NodeManagerStub") and hasattr(node_pb2_grpc, "NodeManagerServicer")


def test_stubs_on_disk_match_the_proto_sources() -> None:
    assert protogen.stale_stubs() == []


def test_every_prefetch_state_has_its_wire_value() -> None:
    from node_manager.kv.prefetch import PrefetchState
    from symphony.rpc import kv_pb2

    wire = {state.proto for state in PrefetchState}
    assert len(wire) == len(PrefetchState)
    assert kv_pb2.PREFETCH_STATE_UNSPECIFIED not in wire
    assert PrefetchState.PARTIAL.proto == kv_pb2.PREFETCH_STATE_PARTIAL
