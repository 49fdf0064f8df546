"""gRPC NodeManager service: what the scheduler's poller reads."""

from __future__ import annotations

import grpc

from node_manager.engine import Engine
from symphony.rpc import node_pb2, node_pb2_grpc


class NodeManagerService(node_pb2_grpc.NodeManagerServicer):
    def __init__(
        self,
        node_id: str,
        engine: Engine,
        served_model: str,
        model_fingerprint: bytes,
        secret_check: bytes = b"",
        engine_url: str = "",
    ) -> None:
        self.node_id = node_id
        self.engine = engine
        self.engine_url = engine_url  # where schedulers reach the engine (node.advertise_*); "": its own URL
        self.served_model = served_model
        self.model_fingerprint = model_fingerprint
        self.secret_check = secret_check  # symphony.tenancy.secret_check of the cluster secret

    async def Health(
        self, request: node_pb2.HealthRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.HealthResponse:
        return node_pb2.HealthResponse(serving=True, engine_state=self.engine.state)

    async def Status(self, request: node_pb2.StatusRequest, context: grpc.aio.ServicerContext) -> node_pb2.NodeStatus:
        engine = self.engine
        load = engine.load
        status = node_pb2.NodeStatus(
            node_id=self.node_id,
            engine_state=engine.state,
            engine_url=self.engine_url or engine.url,
            served_model=self.served_model,
            max_model_len=engine.config.max_model_len,
            block_size=engine.config.block_size,
            engine_restarts=engine.process.restarts,
            last_engine_error=engine.process.last_error,
            metrics_age_ms=engine.metrics_age_ms(),
            model_fingerprint=self.model_fingerprint,
            secret_check=self.secret_check,
        )
        # Figures from an engine that is not serving describe requests that no longer exist.
        if load is not None and status.engine_state == node_pb2.ENGINE_STATE_READY:
            status.num_requests_running = load.running
            status.num_requests_waiting = load.waiting
            status.kv_cache_usage = load.kv_usage
            status.engine_kv_tokens = load.kv_tokens
        return status
