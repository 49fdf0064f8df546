"""The engine's KV events: how vLLM publishes them for the node, and the thread that receives them.

vLLM's publisher (`--kv-events-config`, `kv_events_config`) runs in the engine core and binds a ZMQ
PUB socket at the node's endpoint (`SymphonyConfig.engine_events_endpoint`: an ipc socket, which
vLLM binds as given; it would append nothing for data-parallel rank 0, the only one a node's engine
has). Each message is three frames: topic (empty), an 8-byte big-endian sequence number that
starts at 0 with each publisher, and one msgpack `KVEventBatch`. `EngineEventSubscriber` connects a
SUB socket to it (ZMQ reconnects by itself while the engine starts or restarts), hands every message
to the translation (`node_manager.engine_event_keys.EngineEventKeys`), which calls `emit(kind,
keys)`.

`engine_block_events` builds the node's subscriber from the configuration; `node_manager.main`
calls it in one place with the `emit` the node's events go to.

Threads: one daemon thread per subscriber owns its ZMQ context and socket and calls `emit`; every
receive waits at most `poll_s`, so `stop` returns within about that. `engine_lost` may be called from
any thread (the engine supervisor's event loop): the thread then drops whatever the socket still
queues from the old engine, emits "cleared" and expects the next engine's first batch.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge

from node_manager.engine_event_keys import Emit, EngineEventKeys, TenantSalts, TenantSource
from symphony.config import SymphonyConfig
from symphony.config_schema import flag_values
from symphony.kv_addressing import BlockKey, ModelFingerprint
from symphony.kv_geometry import KVGeometry
from symphony.logs import get_logger
from symphony.tenancy import DEFAULT_TENANT

log = get_logger(__name__)

_DRAIN = 256  # messages handled between two looks at stop and engine_lost
_RCVHWM = 10_000  # batches queued in the SUB socket before ZMQ drops (a gap: "cleared")
_MIN_MAX_BLOCKS = 1024


def kv_events_config(endpoint: str) -> dict[str, object]:
    """vLLM's --kv-events-config publishing on `endpoint`. No replay socket (a gap clears the
    engine tier's view instead), so its replay buffer is kept at one batch, not vLLM's 10,000."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "replay_endpoint": None,
        "buffer_steps": 1,
        "topic": "",
    }


def engine_kv_blocks(extra_args: Sequence[str], kv_cache_space_gib: int, geometry: KVGeometry) -> int:
    """The blocks of the engine's KV cache: --num-gpu-blocks-override when `extra_args` sets it,
    else what VLLM_CPU_KVCACHE_SPACE holds (an upper bound: vLLM's CPU cache is that size)."""
    given = (int(v) for v in flag_values(extra_args, "--num-gpu-blocks-override") if v.isdigit())
    return next(given, kv_cache_space_gib * 1024**3 // geometry.block_bytes)


class EngineEventMetrics:
    """The translation's counts, on the node's KV metrics registry; also a `DropCounter`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.batches = Counter("symphony_engine_kv_batches_total", "KV event batches received from vLLM", registry=r)
        self.dropped_blocks = Counter(
            "symphony_engine_kv_blocks_dropped_total",
            "Blocks vLLM reported that were not translated to block keys, by reason",
            ["reason"],
            registry=r,
        )
        self.view_lost = Counter(
            "symphony_engine_kv_view_lost_total",
            "Times the engine tier's view was emptied ('cleared'), by reason",
            ["reason"],
            registry=r,
        )
        self.forgotten_blocks = Counter(
            "symphony_engine_kv_blocks_forgotten_total",
            "Engine blocks forgotten by the bounded hash map (reported removed while vLLM may hold them)",
            registry=r,
        )
        self.live_blocks = Gauge(
            "symphony_engine_kv_blocks_live", "Engine blocks whose block keys are held as stored", registry=r
        )
        self.events = Counter(
            "symphony_engine_block_events_total", "Engine tier block events emitted, by kind", ["kind"], registry=r
        )
        self.event_keys = Counter(
            "symphony_engine_block_event_keys_total",
            "Block keys in the engine tier's events, by kind",
            ["kind"],
            registry=r,
        )

    def dropped(self, reason: str, blocks: int) -> None:
        self.dropped_blocks.labels(reason).inc(blocks)

    def lost(self, reason: str) -> None:
        self.view_lost.labels(reason).inc()

    def forgotten(self, blocks: int) -> None:
        self.forgotten_blocks.inc(blocks)


def counting_emit(metrics: EngineEventMetrics) -> Emit:
    """An `emit` that only counts the events (symphony_engine_block_events_total and _keys_total)."""

    def emit(kind: str, keys: Sequence[BlockKey]) -> None:
        metrics.events.labels(kind).inc()
        metrics.event_keys.labels(kind).inc(len(keys))

    return emit


class EngineEventSubscriber:
    """Receives one engine's KV events at `endpoint` and emits them as Symphony block keys (see the
    module docstring). `start` once, `stop` once; `emit` runs on this subscriber's thread, and an
    exception from it is logged and resynchronises the view ("cleared") rather than ending the thread."""

    def __init__(
        self,
        endpoint: str,
        model: ModelFingerprint,
        block_size: int,
        salts: TenantSalts,
        emit: Emit,
        *,
        max_blocks: int,
        metrics: EngineEventMetrics | None = None,
        poll_s: float = 0.1,
        name: str = "engine-kv-events",
    ) -> None:
        self.endpoint = endpoint
        self._metrics = metrics
        self._keys = EngineEventKeys(model, block_size, salts, emit, max_blocks, metrics)
        self._poll_ms = max(1, int(poll_s * 1000))
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._lost: str | None = None  # why the engine's cache is gone, until the thread acts on it
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.connected = threading.Event()  # set once the first SUB socket is connected (tests)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop receiving (a pending `engine_lost` is acted on first); blocks until the thread ends,
        at most about `timeout_s`. Idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("engine KV event subscriber did not stop in time", endpoint=self.endpoint)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def engine_lost(self, reason: str) -> None:
        """The engine stopped, crashed or is restarting: its cache is gone. Any thread."""
        with self._lock:
            self._lost = reason

    # -- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        context = zmq.Context()  # its own: the I/O thread ends with this subscriber
        sock: zmq.Socket[bytes] | None = None
        try:
            sock = self._connect(context)
            while True:
                with self._lock:
                    lost, self._lost = self._lost, None
                if lost is not None:
                    sock.close(linger=0)  # drops what the old engine's publisher left queued
                    sock = self._connect(context)
                    self._guarded(partial(self._keys.reset, lost))
                if self._stop.is_set():
                    return
                if sock.poll(self._poll_ms, zmq.POLLIN):
                    self._drain(sock)
        except Exception as exc:  # a ZMQ failure: no more events, so no view either
            log.error("engine KV event subscriber failed", endpoint=self.endpoint, error=repr(exc))
            self._guarded(partial(self._keys.reset, "subscriber_failed"))
        finally:
            if sock is not None:
                sock.close(linger=0)
            context.term()

    def _connect(self, context: zmq.Context[zmq.Socket[bytes]]) -> zmq.Socket[bytes]:
        sock = context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, _RCVHWM)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self.endpoint)
        self.connected.set()
        return sock

    def _drain(self, sock: zmq.Socket[bytes]) -> None:
        for _ in range(_DRAIN):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._handle(frames)
        if self._metrics is not None:
            self._metrics.live_blocks.set(self._keys.live_blocks)

    def _handle(self, frames: Sequence[bytes]) -> None:
        if self._metrics is not None:
            self._metrics.batches.inc()
        if len(frames) != 3 or len(frames[1]) != 8:
            log.warning("malformed KV event message", frames=len(frames))
            self._guarded(partial(self._keys.reset, "undecodable", restarted=False))
            return
        seq = int.from_bytes(frames[1], "big")
        self._guarded(partial(self._keys.feed, seq, frames[2]))

    def _guarded(self, step: Callable[[], None]) -> None:
        """Run a translation step; an exception (from `emit`, or a bug) is logged and the view
        resynchronised: every block forgotten and "cleared" emitted, if `emit` takes it."""
        try:
            step()
        except Exception as exc:
            log.warning("engine KV event translation failed", endpoint=self.endpoint, error=repr(exc))
            with contextlib.suppress(Exception):
                self._keys.reset("emit_error", restarted=False)


def ipc_path(endpoint: str) -> Path | None:
    """The socket file of an ipc:// endpoint, None for any other transport."""
    return Path(endpoint.removeprefix("ipc://")) if endpoint.startswith("ipc://") else None


def engine_block_events(
    config: SymphonyConfig,
    index: int,
    model: ModelFingerprint,
    geometry: KVGeometry,
    tenants: TenantSource,
    emit: Emit,
    metrics: EngineEventMetrics | None = None,
) -> EngineEventSubscriber | None:
    """Node `index`'s subscriber to its engine's KV events, None when the node runs no engine or
    `engine.kv_events` is off. Tenants: `default`, those of the configured API keys, and those of
    the sessions the node's store registers (`tenants`)."""
    engine = config.engine
    if not (engine.enabled and engine.kv_events):
        return None
    max_blocks = engine.kv_events_max_blocks or max(
        _MIN_MAX_BLOCKS, 2 * engine_kv_blocks(engine.extra_args, engine.kv_cache_space_gib, geometry)
    )
    return EngineEventSubscriber(
        config.engine_events_endpoint(index),
        model,
        geometry.block_size,
        TenantSalts(tenants, always=configured_tenants(config), key=config.cluster.secret.encode()),
        emit,
        max_blocks=max_blocks,
        metrics=metrics,
        name=f"{config.node_id(index)}-kv-events",
    )


def configured_tenants(config: SymphonyConfig) -> list[str]:
    """The tenants a node knows without seeing their sessions: `default`, and those of the API keys
    (on a local cluster the scheduler's and the nodes' configuration are one)."""
    return [DEFAULT_TENANT, *sorted({entry.partition(":")[0] for entry in config.scheduler.api_keys})]
