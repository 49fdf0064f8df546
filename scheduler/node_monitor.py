"""The scheduler's view of its nodes, kept fresh by polling each node manager's gRPC Status."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import grpc

from scheduler.routing import NO_WORK, NodeSnapshot, PrefillWork
from symphony.cluster_tls import ClusterTLS, grpc_channel
from symphony.logs import get_logger
from symphony.rpc import kv_pb2_grpc, node_pb2, node_pb2_grpc

log = get_logger(__name__)

READY = node_pb2.ENGINE_STATE_READY
# How long nodes whose status replies are late (not refused) are still routed to when no node is
# up to date: covers a saturated host's hiccups, not a hung node manager.
LAG_LIMIT_S = 10.0
# From a plain request's send to its place in its engine's gauges (the engine's front end takes and
# tokenizes it, then hands it to the engine core): engine gauges read sooner may not count it yet.
GAUGES_SEE_AFTER_S = 0.05


@dataclass
class NodeView:
    """Mutable state of one node: written by its poller and by dispatch (inflight), read by routing."""

    address: str
    node_id: str
    engine_state: int = node_pb2.ENGINE_STATE_UNSPECIFIED
    engine_url: str = ""
    served_model: str = ""
    model_fingerprint: bytes = b""  # the served model's identity: KV moves only between equal ones
    secret_check: bytes = b""  # which cluster secret keys its salts (symphony.tenancy.secret_check)
    # It reports a secret, not this scheduler's: its engine refuses this scheduler's engine key
    # (node_manager.engine_auth), so nothing is sent to it.
    foreign_secret: bool = False
    max_model_len: int = 0
    block_size: int = 0  # tokens per KV block, as the node keys them (0: not reported)
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    kv_tokens: int = 0  # tokens the engine's KV cache holds (0: not reported)
    max_running: int = 0  # requests its engine runs at once, as the cluster's [engine] says (0: not known)
    engine_restarts: int = 0
    last_engine_error: str = ""
    last_status_at: float = float("-inf")  # monotonic time of the last successful Status
    last_poll_error: str = ""
    refused: bool = False  # the last Status failed for want of a listening node manager (it is gone)
    unreachable_until: float = float("-inf")  # set when dispatch could not connect to the engine
    inflight: int = 0
    # Routed here, not yet sent (waiting for a pull of their KV): counted in the snapshot's
    # `inflight`, so that the room they will take is not offered to another request meanwhile.
    reserved: int = 0
    # Of `inflight`: streamed requests whose first token has not come back, and plain ones the
    # engine's gauges may not count yet (`count_until_gauged`).
    prefilling: int = 0
    prefilling_work: PrefillWork = NO_WORK  # their prefills' size, as estimated when each was sent
    # Plain requests counted in `prefilling` until gauged: id -> (sent at, monotonic s; what ends
    # the count). At most one entry per request in flight: each leaves when gauged or when it ends.
    _ungauged: dict[int, tuple[float, Callable[[], None]]] = field(default_factory=dict)
    kv: kv_pb2_grpc.KVStoreStub | None = None  # the node manager's KV store (same channel as Status)

    @property
    def reported(self) -> bool:
        """The node manager answered Status at least once (so node_id is its own name)."""
        return self.last_status_at != float("-inf")

    def _serving(self, now: float) -> bool:
        """Its engine was ready when the node last answered, and dispatch can reach it."""
        return (
            self.engine_state == READY
            and now >= self.unreachable_until
            and bool(self.engine_url)
            and not self.foreign_secret
        )

    def available(self, now: float, down_after_s: float) -> bool:
        return self._serving(now) and now - self.last_status_at <= down_after_s

    def lagging(self, now: float, lag_limit_s: float) -> bool:
        """Late with its status but not known to be gone: its manager still listens (its calls
        time out rather than being refused)."""
        return self._serving(now) and not self.refused and now - self.last_status_at <= lag_limit_s

    def snapshot(self, now: float, down_after_s: float, announced: int = 0, high_sessions: int = 0) -> NodeSnapshot:
        return NodeSnapshot(
            self.node_id,
            self.available(now, down_after_s),
            self.running,
            self.waiting,
            self.inflight + self.reserved,
            self.kv_usage,
            announced,
            high_sessions,
            self.prefilling,
            self.prefilling_work,
            self.kv_tokens,
            self.max_running,
        )

    @contextlib.contextmanager
    def reserving(self) -> Iterator[None]:
        """`reserved` counts one more request while the block runs."""
        self.reserved += 1
        try:
            yield
        finally:
            self.reserved -= 1

    @property
    def ungauged(self) -> int:
        """Plain requests still counted in `prefilling` until the engine's gauges count them."""
        return len(self._ungauged)

    def count_until_gauged(self, sent_at: float, done: Callable[[], None]) -> Callable[[], None]:
        """A plain request sent at `sent_at` (monotonic s) says nothing of its first token: its
        count in `prefilling` ends (`done()`) once a status brings engine gauges read after the
        engine took it, which then count it as waiting or running. Returns what forgets it (call it
        when the request ends first)."""
        key = id(done)  # unique while the entry holds `done`
        self._ungauged[key] = (sent_at, done)

        def forget() -> None:
            self._ungauged.pop(key, None)

        return forget

    def gauged(self, read_at: float) -> None:
        """The engine's gauges were read at `read_at` (monotonic s): the plain requests they count
        leave `prefilling`."""
        seen = [key for key, (sent_at, _) in self._ungauged.items() if sent_at + GAUGES_SEE_AFTER_S <= read_at]
        for key in seen:
            self._ungauged.pop(key)[1]()

    def state_name(self, now: float, down_after_s: float) -> str:
        if now - self.last_status_at > down_after_s:
            return "unreachable"
        if now < self.unreachable_until:
            return "engine_unreachable"
        if self.foreign_secret:
            return "foreign_secret"
        return node_pb2.EngineState.Name(self.engine_state).removeprefix("ENGINE_STATE_").lower()


class NodeMonitor:
    """Owns the node views and one polling task per node."""

    def __init__(
        self,
        addresses: list[str],
        *,
        poll_interval_s: float,
        down_after_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_status: Callable[[], None] | None = None,
        secret_check: bytes = b"",
        tls: ClusterTLS | None = None,
        engine_headers: dict[str, str] | None = None,
        max_nodes: int = 64,
        max_running: int = 0,
    ) -> None:
        """`max_running`: requests each node's engine runs at once (0: not known; see
        `NodeSnapshot.pending`)."""
        # The nodes followed, in the order they came; membership (scheduler.membership_watch) adds
        # and removes them on the event loop (join, leave), nothing else does.
        self.max_running = max_running
        self.nodes = [NodeView(address=a, node_id=a, max_running=max_running) for a in addresses]
        # What every call to a node's engine sends: the cluster's engine key (node_manager.engine_auth).
        self.engine_headers = engine_headers or {}
        self.tls = tls  # the cluster's credentials: node RPCs take members only (symphony.cluster_tls)
        # This scheduler's own (symphony.tenancy.secret_check): a node reporting another keys
        # tenants' engine cache salts by another secret, so its engine's blocks are nobody's to it
        # and warm-ups land under salts requests never carry; and its engine refuses this
        # scheduler's engine key. Such a node is reported ("foreign_secret") and sent nothing.
        self.secret_check = secret_check
        self.poll_interval_s = poll_interval_s
        self.down_after_s = down_after_s
        self.lag_limit_s = max(down_after_s, LAG_LIMIT_S)
        self._clock = clock
        self.on_status = on_status  # called after each status applied: room may have opened on a node
        self.max_nodes = max_nodes  # nodes followed at once: join refuses more
        # address -> the node's channel and polling task, from start (or its join) to stop (or leave)
        self._polls: dict[str, tuple[grpc.aio.Channel, asyncio.Task[None]]] = {}
        self._started = False

    def by_id(self, node_id: str) -> NodeView | None:
        return next((n for n in self.nodes if n.node_id == node_id), None)

    def kv_stub(self, node_id: str) -> kv_pb2_grpc.KVStoreStub | None:
        """The node's KV store (None: no such node, or not connected)."""
        node = self.by_id(node_id)
        return node.kv if node is not None else None

    def fingerprint(self, node_id: str) -> bytes | None:
        """The model the node serves (None: no such node)."""
        node = self.by_id(node_id)
        return node.model_fingerprint if node is not None else None

    def address_of(self, node_id: str) -> str | None:
        """The address of the node's manager, where peers pull its KV from (None: no such node)."""
        node = self.by_id(node_id)
        return node.address if node is not None else None

    def snapshot(
        self, model: str, announced: Mapping[str, int] | None = None, high_sessions: Mapping[str, int] | None = None
    ) -> list[NodeSnapshot]:
        now = self._clock()
        announced = announced or {}
        high_sessions = high_sessions or {}
        nodes = [n for n in self.nodes if n.served_model == model]
        views = [
            n.snapshot(now, self.down_after_s, announced.get(n.node_id, 0), high_sessions.get(n.node_id, 0))
            for n in nodes
        ]
        if views and not any(v.available for v in views):
            # Every node late, none gone: on a host saturated by its engines, status replies can
            # miss the 1 s window while the engines serve fine. Refusing every request then helps
            # no one; the nodes that still listen are tried (a dead one fails fast and is retried
            # elsewhere), for `lag_limit_s` at most.
            views = [replace(v, available=n.lagging(now, self.lag_limit_s)) for n, v in zip(nodes, views, strict=True)]
        return views

    def served_models(self) -> dict[str, int]:
        """model -> smallest max_model_len among nodes that reported serving it, up or not: a model
        whose nodes are all restarting is unavailable (503), not unknown (404)."""
        served: dict[str, int] = {}
        for n in self.nodes:
            if n.served_model:
                served[n.served_model] = min(served.get(n.served_model, n.max_model_len), n.max_model_len)
        return served

    def least_busy_engine(self, model: str) -> NodeView | None:
        """An available node serving `model`, the one with the fewest requests in flight (for the
        scheduler's own calls to an engine, such as /tokenize)."""
        now = self._clock()
        nodes = [n for n in self.nodes if n.served_model == model and n.available(now, self.down_after_s)]
        return min(nodes, key=lambda n: n.inflight, default=None)

    def available_snapshots(self) -> list[NodeSnapshot]:
        """The nodes a request may go to now (up, engine ready), whatever model they serve."""
        now = self._clock()
        return [n.snapshot(now, self.down_after_s) for n in self.nodes if n.available(now, self.down_after_s)]

    def states(self) -> dict[str, str]:
        now = self._clock()
        return {n.node_id: n.state_name(now, self.down_after_s) for n in self.nodes}

    def describe(self) -> dict[str, dict[str, object]]:
        """Per-node detail for /readyz and `symphony status`."""
        now = self._clock()
        return {
            n.node_id: {
                "state": n.state_name(now, self.down_after_s),
                "address": n.address,
                "engine_url": n.engine_url,
                "model": n.served_model,
                "model_fingerprint": n.model_fingerprint.hex()[:12],
                "same_secret": n.secret_check == self.secret_check if n.reported else None,
                "running": n.running,
                "waiting": n.waiting,
                "inflight": n.inflight,
                "prefilling": n.prefilling,
                "kv_cache_usage": round(n.kv_usage, 4),
                "kv_cache_tokens": n.kv_tokens,
                "engine_restarts": n.engine_restarts,
                "last_engine_error": n.last_engine_error,
            }
            for n in self.nodes
        }

    def mark_engine_unreachable(self, node: NodeView, for_s: float) -> None:
        """Dispatch saw a connection failure: keep routing away from the node for `for_s`."""
        node.unreachable_until = self._clock() + for_s

    def _connect(self, node: NodeView) -> None:
        channel = grpc_channel(node.address, self.tls)
        stub = node_pb2_grpc.NodeManagerStub(channel)
        node.kv = kv_pb2_grpc.KVStoreStub(channel)
        self._polls[node.address] = (channel, asyncio.create_task(self._poll(node, stub), name=f"poll-{node.address}"))

    async def _disconnect(self, address: str) -> None:
        polled = self._polls.pop(address, None)
        if polled is None:
            return
        channel, task = polled
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await channel.close()

    async def start(self) -> None:
        self._started = True
        for node in self.nodes:
            self._connect(node)

    async def stop(self) -> None:
        self._started = False
        for address in list(self._polls):
            await self._disconnect(address)

    def at(self, address: str) -> NodeView | None:
        return next((n for n in self.nodes if n.address == address), None)

    def join(self, address: str) -> NodeView | None:
        """Follow the node manager at `address` from now on (polled at once if the monitor runs).
        None when one is followed there already, or `max_nodes` are (logged)."""
        if self.at(address) is not None:
            return None
        if len(self.nodes) >= self.max_nodes:
            log.error(
                "node not followed: the scheduler follows at most max_nodes", address=address, max_nodes=self.max_nodes
            )
            return None
        node = NodeView(address=address, node_id=address, max_running=self.max_running)
        self.nodes.append(node)
        if self._started:
            self._connect(node)
        log.info("node joined", address=address)
        return node

    async def leave(self, node: NodeView) -> None:
        """Stop following `node`: no request goes to it from now on. Whoever holds its view (a
        request under way) keeps a view frozen as it was, with no channel."""
        if node not in self.nodes:
            return
        self.nodes.remove(node)
        await self._disconnect(node.address)
        node.kv = None
        log.info("node left", node=node.node_id, address=node.address)

    async def poll_once(self, node: NodeView, stub: node_pb2_grpc.NodeManagerStub) -> None:
        # The deadline stays under the down threshold so one hung call cannot hide a dead node.
        timeout = max(min(self.down_after_s / 2, 1.0), 0.05)
        try:
            status = await stub.Status(node_pb2.StatusRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            self.poll_failed(node, exc.code(), exc.details() or "")
            return
        self.apply_status(node, status)

    def poll_failed(self, node: NodeView, code: grpc.StatusCode, details: str) -> None:
        message = f"{code.name}: {details}"
        if message != node.last_poll_error:
            log.info("node status failed", node=node.node_id, address=node.address, error=message)
        node.last_poll_error = message
        # UNAVAILABLE: nothing listens (connection refused or reset): the manager is gone, not slow.
        node.refused = code == grpc.StatusCode.UNAVAILABLE

    def apply_status(self, node: NodeView, status: node_pb2.NodeStatus) -> None:
        was_ready = node.engine_state == READY
        node_id = status.node_id or node.address
        if any(other is not node and other.node_id == node_id for other in self.nodes):
            # Two managers claiming one name (say, two hosts both started with --index 0): keep
            # them apart, or the second would never get traffic.
            node_id = f"{node_id}@{node.address}"
        if node_id != node.node_id and node.reported:
            log.warning("node renamed", old=node.node_id, new=node_id, address=node.address)
        node.node_id = node_id
        node.engine_state = status.engine_state
        node.engine_url = status.engine_url
        node.served_model = status.served_model
        if node.model_fingerprint and status.model_fingerprint != node.model_fingerprint:
            log.info(
                "node serves another model now",
                node=node_id,
                old=node.model_fingerprint.hex()[:12],
                new=status.model_fingerprint.hex()[:12],
            )
        node.model_fingerprint = status.model_fingerprint
        if status.secret_check != self.secret_check and (not node.reported or status.secret_check != node.secret_check):
            log.error(
                "node keys tenants' cache salts with another cluster secret than this scheduler: give every "
                "process of the cluster the same cluster.secret",
                node=node_id,
            )
        node.secret_check = status.secret_check
        # A node without a secret runs its engine unguarded: it still serves (its salts differ).
        node.foreign_secret = bool(status.secret_check) and status.secret_check != self.secret_check
        node.max_model_len = status.max_model_len
        node.block_size = status.block_size
        node.kv_tokens = status.engine_kv_tokens
        if status.metrics_age_ms <= self.down_after_s * 1000:
            node.running = status.num_requests_running
            node.waiting = status.num_requests_waiting
            node.kv_usage = status.kv_cache_usage
            node.gauged(self._clock() - status.metrics_age_ms / 1000)
        else:
            # The engine serves but its load figures are stale: route on what this scheduler
            # knows (its own in-flight count) rather than on a frozen reading.
            node.running = node.waiting = 0
        node.engine_restarts = status.engine_restarts
        node.last_engine_error = status.last_engine_error
        node.last_status_at = self._clock()
        node.last_poll_error = ""
        node.refused = False
        if was_ready != (status.engine_state == READY):
            log.info(
                "node engine state",
                node=node.node_id,
                state=node_pb2.EngineState.Name(status.engine_state),
                restarts=status.engine_restarts,
            )
        if self.on_status is not None:
            self.on_status()

    async def _poll(self, node: NodeView, stub: node_pb2_grpc.NodeManagerStub) -> None:
        while True:
            started = self._clock()
            try:
                await self.poll_once(node, stub)
            except Exception:
                # A malformed status must not end this node's polling for good (the node would
                # silently age into "unreachable"); log it and keep polling.
                log.exception("node status could not be applied", node=node.node_id)
            await asyncio.sleep(max(0.0, self.poll_interval_s - (self._clock() - started)))
