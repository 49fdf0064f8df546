"""Assemble one node's KV store, prefetch queue, peer puller and gRPC service from the config."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client import start_http_server

from node_manager.engine_warmup import EngineView, EngineWarmer
from node_manager.kv.block_events import BlockEventLog, BlockEventSettings
from node_manager.kv.ipc_server import LocalKVServer
from node_manager.kv.metrics import KVMetrics
from node_manager.kv.page_stream import PageStreamServer
from node_manager.kv.prefetch import PrefetchQueue
from node_manager.kv.puller import PeerPuller
from node_manager.kv.service import KVStoreService
from node_manager.kv.store import TieredStore
from node_manager.kv.store_config import StoreConfig
from node_manager.kv.transfer import MAX_MESSAGE_BYTES
from symphony.cluster_tls import ClusterTLS
from symphony.config import SymphonyConfig
from symphony.kv_addressing import ModelFingerprint
from symphony.kv_geometry import KVGeometry
from symphony.kv_transfer import params_key
from symphony.logs import get_logger
from symphony.rpc import kv_pb2_grpc

log = get_logger(__name__)

# Room above the 4 MiB page batches for framing; both directions of node-to-node streams.
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES + 256 * 1024),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES + 256 * 1024),
]


@dataclass
class KVRuntime:
    store: TieredStore
    prefetches: PrefetchQueue
    puller: PeerPuller
    service: KVStoreService
    page_stream: PageStreamServer | None
    local_channel: LocalKVServer
    warmer: EngineWarmer | None = None
    ssd_lock: SsdLock | None = None  # held until `close`: the SSD directory is this node's alone

    @property
    def events(self) -> BlockEventLog:
        """The node's block event log (WatchBlocks; `engine_emitter()` for the engine tier)."""
        return self.store.events

    def end_streams(self) -> None:
        """End the WatchBlocks streams cleanly: before the gRPC server stops, so that they finish
        with OK rather than being cancelled. `close` does it too."""
        self.store.events.close()

    async def close(self) -> None:
        try:
            self.end_streams()
            await asyncio.to_thread(self.local_channel.close)
            await self.prefetches.close()
            if self.warmer is not None:
                await self.warmer.aclose()
            await self.puller.close()
            if self.page_stream is not None:
                await asyncio.to_thread(self.page_stream.close)
            await asyncio.to_thread(self.store.close)
        finally:
            if self.ssd_lock is not None:
                self.ssd_lock.release()


class SsdDirectoryInUse(OSError):
    pass


class SsdLock:
    """This node manager's hold on its SSD directory: an exclusive flock on `.lock` in it, on a
    descriptor no child inherits (O_CLOEXEC). The kernel frees it when the process dies, so a killed
    node's successor takes it at once. flock itself, not a lock library: one that falls back to a
    marker file where flock is missing would outlive a killed holder."""

    def __init__(self, directory: Path) -> None:
        """Two node managers sharing an SSD directory (one index given twice, one `kv.ssd_dir` for
        two nodes, a predecessor still running) would delete and overwrite each other's segments:
        the second raises SsdDirectoryInUse before it touches any (OSError where the filesystem
        has no flock)."""
        directory.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.release()
            raise SsdDirectoryInUse(
                f"the SSD directory {directory} is in use by another node manager: give each node its own "
                "(kv.ssd_dir, the node index) or stop the other first"
            ) from None
        except OSError:
            self.release()
            raise

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor releases the flock
            self._fd = None


def block_event_settings(config: SymphonyConfig) -> BlockEventSettings:
    kv = config.kv
    return BlockEventSettings(
        ring_batches=kv.block_events_ring_batches,
        ring_entries=kv.block_events_ring_entries,
        batch_entries=kv.block_events_batch_entries,
        subscriber_backlog=kv.block_events_subscriber_backlog,
        max_subscribers=kv.block_events_max_subscribers,
        engine_keys=kv.block_events_engine_keys,
        heartbeat_s=kv.block_events_heartbeat_s,
    )


def store_config(config: SymphonyConfig, index: int, model: ModelFingerprint) -> StoreConfig:
    kv = config.kv
    # One arena name per node port: a restarted node manager replaces what a killed one left behind.
    arena = f"symphony-kv-{config.node_id(index)}-{config.node.grpc_port_base + index}"
    return StoreConfig(
        hbm_bytes=kv.hbm_bytes,
        dram_bytes=kv.dram_bytes,
        ssd_bytes=kv.ssd_bytes,
        ssd_dir=config.kv_ssd_dir(index),
        arena_name=arena,
        model=model,
        device=kv.device,
        io_threads=kv.io_threads,
        max_inflight_jobs=kv.max_inflight_jobs,
        segment_max_bytes=kv.segment_max_bytes,
        ssd_writers=kv.ssd_writers,
        max_sessions=kv.max_sessions,
        max_session_tokens=kv.max_session_tokens,
        ssd_keep_other_models=kv.ssd_keep_other_models,
        ssd_headroom_bytes=kv.ssd_headroom_bytes,
        page_secret=config.cluster.secret.encode(),
    )


async def start_kv(
    config: SymphonyConfig,
    index: int,
    geometry: KVGeometry,
    model: ModelFingerprint,
    server: grpc.aio.Server,
    engine: EngineView | None = None,
    served_model: str = "",
    tls: ClusterTLS | None = None,
) -> KVRuntime:
    """`model`: the fingerprint of the model whose KV the store holds. With `engine` (a node serving a
    model through Symphony's connector), top-tier prefetches end in that engine's own prefix cache.
    `tls`: the cluster's credentials, for the page stream and the pulls from peers (members only)."""
    async with contextlib.AsyncExitStack() as undo:  # on failure: what was started, in reverse
        ssd_lock = SsdLock(config.kv_ssd_dir(index))  # first: before anything reads or deletes there
        undo.callback(ssd_lock.release)
        metrics = KVMetrics()
        port = config.kv_metrics_port(index)
        if port:  # bound before the store exists: a port in use then fails the start without leaving its arena
            start_http_server(port, addr=config.node.host, registry=metrics.registry)
        # One log per start: a new epoch, so every subscriber begins with a snapshot of what it rebuilt.
        events = BlockEventLog(block_event_settings(config), metrics)
        store = await _build_store(geometry, store_config(config, index, model), metrics, events)
        undo.push_async_callback(asyncio.to_thread, store.close)
        tcp = config.kv.data_plane == "tcp"
        page_stream = (
            PageStreamServer(
                store,
                config.node.host,
                config.kv_data_port(index),
                config.kv.peer_timeout_s,
                tls=tls.server_context() if tls is not None else None,
            )
            if tcp
            else None
        )
        if page_stream is not None:
            undo.push_async_callback(asyncio.to_thread, page_stream.close)
        # The kv_transfer_params' key (symphony.kv_transfer); with no secret, none: a key derived from
        # nothing would be anyone's, so the connector then takes no request onto the tiers.
        signing = params_key(config.cluster.secret.encode()) if config.cluster.secret else b""
        local_channel = LocalKVServer(store, config.kv_socket_path(index), params_key=signing)
        puller = PeerPuller(store, config.kv.peer_timeout_s, use_page_stream=tcp, tls=tls)
        warmer = (
            EngineWarmer(
                engine,
                served_model,
                metrics,
                max_kv_usage=config.kv.engine_warmup_max_kv_usage,
                timeout_s=config.kv.engine_warmup_timeout_s,
                params_key=signing,
            )
            if engine is not None
            else None
        )
        prefetches = PrefetchQueue(
            store,
            metrics,
            puller.pull_outcome,
            max_pending=config.kv.max_pending_prefetches,
            concurrency=config.kv.prefetch_concurrency,
            warm=warmer.warm if warmer else None,
        )
        local_channel.prefetches = prefetches
        data_port = config.kv_advertised_data_port(index, page_stream.port) if page_stream else 0
        service = KVStoreService(config.node_id(index), store, prefetches, puller, data_port)
        kv_pb2_grpc.add_KVStoreServicer_to_server(service, server)
        log.info(
            "KV store ready",
            node=config.node_id(index),
            page_bytes=geometry.page_bytes,
            hbm_mib=config.kv.hbm_bytes >> 20,
            dram_mib=config.kv.dram_bytes >> 20,
            ssd_mib=config.kv.ssd_bytes >> 20,
            ssd_dir=str(store.ssd.directory),
            metrics_port=port or "off",
            page_stream_port=page_stream.port if page_stream else "off",
            local_channel=str(local_channel.path),
        )
        undo.pop_all()  # started: `KVRuntime.close` ends it all
    return KVRuntime(store, prefetches, puller, service, page_stream, local_channel, warmer, ssd_lock)


async def _build_store(
    geometry: KVGeometry, settings: StoreConfig, metrics: KVMetrics, events: BlockEventLog
) -> TieredStore:
    """The store, its SSD index rebuilt (every segment header read): off the event loop. Cancelled
    meanwhile, it waits for the rebuild, which goes on in its thread deleting segments (the
    directory stays held until then), and closes what it built (its arena)."""
    build = asyncio.ensure_future(asyncio.to_thread(TieredStore, geometry, settings, metrics, events))
    try:
        return await asyncio.shield(build)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            built = await build
            await asyncio.to_thread(built.close)
        raise
