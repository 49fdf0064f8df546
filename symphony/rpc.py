"""The generated gRPC modules, imported in one place so a missing build step gives one clear error."""

try:
    from symphony.v1 import kv_pb2, kv_pb2_grpc, node_pb2, node_pb2_grpc
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "Symphony's gRPC stubs are missing (they are generated from proto/ at install time); "
        "run `make proto` or reinstall with `pip install -e .`"
    ) from exc

__all__ = ["kv_pb2", "kv_pb2_grpc", "node_pb2", "node_pb2_grpc"]
