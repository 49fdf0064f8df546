"""Run one node manager: its gRPC server, KV store and supervised vLLM engine, until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Sequence

import grpc

from node_manager.engine import Engine, engine_cpu_cores, engine_launch
from node_manager.engine_events import EngineEventMetrics, counting_emit, engine_block_events
from node_manager.identity import identify_served_model
from node_manager.kv_runtime import GRPC_OPTIONS, start_kv
from node_manager.service import NodeManagerService
from symphony.cluster_tls import add_port, cluster_tls
from symphony.config import SymphonyConfig
from symphony.etcd_client import EtcdClient
from symphony.kv_addressing import BlockKey
from symphony.kv_geometry import geometry_from_model_dir
from symphony.logs import get_logger
from symphony.loop_watchdog import LoopWatchdog
from symphony.membership import Member, Registration
from symphony.models import ModelInfo
from symphony.rpc import node_pb2_grpc
from symphony.tenancy import engine_key, secret_check

log = get_logger(__name__)


def node_registration(config: SymphonyConfig, index: int) -> Registration | None:
    """Node `index`'s membership in etcd (cluster.etcd_endpoints; None without): its name, the
    address schedulers reach its gRPC at, and its region."""
    if not config.cluster.etcd_endpoints:
        return None
    topology = config.topology()
    member = Member(
        node_id=config.node_id(index),
        address=config.node_grpc_address(index),
        region=topology.region_of_node(index) if topology is not None else "",
    )
    client = EtcdClient(config.cluster.etcd_endpoints)
    return Registration(client, config.cluster.etcd_prefix, member, ttl_s=config.cluster.membership_ttl_s)


async def run_node(config: SymphonyConfig, index: int, model: ModelInfo) -> None:
    node_id = config.node_id(index)
    kv_socket = config.kv_socket_path(index) if config.engine.kv_connector else None
    local_nodes = config.cluster.nodes if not config.scheduler.node_addresses else 1
    cores = engine_cpu_cores(config.engine.cpu_cores, index, local_nodes, os.cpu_count() or 1)
    geometry = geometry_from_model_dir(model.path, config.engine.block_size, config.engine.dtype)
    # Reads the weights unless their hashes are cached (see symphony.model_identity): off the loop.
    identity, _ = await asyncio.to_thread(identify_served_model, config.engine, model.path, geometry, config.home_path)
    launch = engine_launch(
        config.engine,
        model,
        config.node.host,
        config.engine_port(index),
        kv_socket=kv_socket,
        cpu_cores=cores,
        identity=identity,
        kv_events_endpoint=config.engine_events_endpoint(index) if config.engine.kv_events else None,
        api_key=engine_key(config.cluster.secret.encode()),
    )
    engine = Engine(
        f"{node_id}-engine",
        launch,
        config.engine,
        config.home_path / "logs" / f"{node_id}-engine.log",
        config.node.engine_scrape_interval_ms / 1000,
    )
    server = grpc.aio.server(options=GRPC_OPTIONS)
    node_pb2_grpc.add_NodeManagerServicer_to_server(
        NodeManagerService(
            node_id,
            engine,
            model.served_name,
            identity.fingerprint,
            secret_check(config.cluster.secret.encode()),
            engine_url=config.engine_advertised_url(index),
        ),
        server,
    )
    serving = config.engine.enabled and config.engine.kv_connector  # the engine loads from this node's tiers
    tls = cluster_tls(config)  # node RPCs and page streams for the cluster's members only
    kv = await start_kv(
        config, index, geometry, identity.fingerprint, server, engine if serving else None, model.served_name, tls
    )
    # The one wiring point of the engine tier's block events (vLLM's prefix cache as Symphony block
    # keys): each is counted, then published to the node's block event log as TIER_ENGINE, which
    # streams it to the scheduler's KV index (WatchBlocks).
    events_metrics = EngineEventMetrics(kv.store.metrics.registry)
    count, publish = counting_emit(events_metrics), kv.events.engine_emitter()

    def emit(kind: str, keys: Sequence[BlockKey]) -> None:
        count(kind, keys)
        publish(kind, keys)

    engine.follow_block_events(
        engine_block_events(config, index, identity.fingerprint, geometry, kv.store.sessions, emit, events_metrics)
    )
    address = config.node_grpc_listen(index)
    if add_port(server, address, tls) == 0:
        await kv.close()
        raise OSError(f"cannot listen on {address} (port in use?)")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    registration = node_registration(config, index)
    if registration is not None:  # a member from now on: schedulers following etcd join it
        await asyncio.to_thread(registration.begin)
    watchdog = LoopWatchdog()  # a stalled loop answers no status poll: the node would look down
    watchdog.start()
    # The engine starts after the gRPC port is up, so the scheduler sees STARTING rather than nothing.
    if config.engine.enabled:
        engine.start()
    else:
        await engine.stop()  # reports STOPPED: this node serves KV only
    log.info(
        "node manager listening",
        node=node_id,
        grpc=address,
        engine=launch.url if config.engine.enabled else "disabled",
        model=model.served_name,
        fingerprint=identity.short,
    )
    try:
        await stop.wait()
    finally:
        log.info(
            "node manager stopping",
            node=node_id,
            loop_stalls=watchdog.stalls,
            longest_stall_ms=round(watchdog.longest_s * 1000),
        )
        if registration is not None:  # leave first: schedulers stop sending before the engine goes
            await asyncio.to_thread(registration.stop)
            registration.client.close()
            # Schedulers see the leave at their next read of the members: a request routed here
            # meanwhile still finds the engine up.
            await asyncio.sleep(config.scheduler.membership_poll_ms / 1000)
        await watchdog.stop()
        await engine.stop()
        kv.end_streams()  # WatchBlocks streams end with OK, not cancelled by the server's stop
        await server.stop(grace=1.0)
        await kv.close()
