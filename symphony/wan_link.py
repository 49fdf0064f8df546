"""A WAN link emulated in user space: a TCP relay that gives the connections through it a link's
round-trip time, jitter, bandwidth and loss, in each direction, and can be broken on purpose.

`tc netem` is not available on the hosts this runs on; a relay on loopback is. Each connection
accepted on the link's port is relayed to its target, and each direction runs through a model of
one side of the link:

- bandwidth: the link sends one segment (at most `SEGMENT_BYTES`) at a time, at `bandwidth_mbps`,
  in the order they were read; every connection through the link shares it (per direction, like a
  full-duplex link), and so does every listener given the same `LinkPipe` (a region pair's link
  carries all the traffic between the two regions, whatever it is addressed to);
- delay: a segment arrives `rtt_ms / 2` after it left, plus a uniform draw in
  [-`jitter_ms`, +`jitter_ms`], but never before the segment ahead of it on its connection (TCP
  delivers in order);
- loss: a segment is lost with probability `loss` and arrives one round trip later, as TCP's fast
  retransmit would deliver it; the segments behind it wait for it (head-of-line blocking). TCP's
  congestion window is not modelled: a lossy link keeps its bandwidth.

What a segment is depends on how the sender writes (one read of the relay's socket, at most
`SEGMENT_BYTES`); the link's counters (`LinkCounters`) say how many there were and how many were
lost. Faults (`LinkFault`): a blackhole stops the link (nothing is read or delivered, so senders
block as TCP's would) until it heals, when what was held goes on; a partition refuses new
connections and resets the open ones; added latency delays every segment further.

A connection ends cleanly once both directions have delivered their end of stream. Anything else
(an error on either side, a partition, `close`, `idle_timeout_s` with nothing read or delivered)
resets both sides: no peer mistakes a cut-off stream for a complete one.

Bounded: at most `max_connections` at once (more are refused), and at most `queue_bytes` in flight
per direction of a connection (the reader waits: the sender sees back-pressure); by default twice
the link's bandwidth-delay product, at least `MIN_QUEUE_BYTES`, so one connection can fill the
link. At most `max_connections` x 2 x `queue_bytes` of memory in all.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import math
import random
import signal
import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from symphony.link_tenants import Attributor, ConnectionTally, TenantTally

SEGMENT_BYTES = 64 * 1024
MIN_QUEUE_BYTES = 1 << 20
_MBPS = 1e6 / 8  # bytes per second in one Mb/s
_DIRECTIONS = ("forward", "reverse")


@dataclass(frozen=True, slots=True)
class LinkShape:
    """One link's figures, the same in both directions."""

    rtt_ms: float
    bandwidth_mbps: float
    jitter_ms: float = 0.0
    loss: float = 0.0  # fraction of segments lost (each arrives one round trip late)

    def __post_init__(self) -> None:
        if not 0 <= self.rtt_ms < math.inf:
            raise ValueError(f"rtt_ms must be finite and >= 0, got {self.rtt_ms}")
        if not self.bandwidth_mbps > 0:
            raise ValueError(f"bandwidth_mbps must be > 0, got {self.bandwidth_mbps}")
        if not 0 <= self.jitter_ms <= self.rtt_ms / 2:
            raise ValueError(f"jitter_ms must be within [0, rtt_ms / 2], got {self.jitter_ms}")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss must be within [0, 1), got {self.loss}")

    @property
    def one_way_s(self) -> float:
        return self.rtt_ms / 2000

    @property
    def bdp_bytes(self) -> float:
        """Bandwidth-delay product: the bytes one direction carries in one round trip."""
        return self.bandwidth_mbps * _MBPS * self.rtt_ms / 1000


class LinkFault(enum.Enum):
    NONE = "none"
    BLACKHOLE = "blackhole"  # connections stay open; nothing moves until it heals
    PARTITION = "partition"  # new connections refused, open ones reset


@dataclass(slots=True)
class LinkCounters:
    """Per direction ("forward": from the connecting side to the target; "reverse": back)."""

    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_DIRECTIONS, 0))
    segments: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_DIRECTIONS, 0))
    lost: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_DIRECTIONS, 0))
    connections: int = 0
    refused: int = 0
    # Whose the bytes were (symphony.link_tenants), when the link is given an attributor.
    tenants: TenantTally = field(default_factory=lambda: TenantTally(_DIRECTIONS))


class _Direction:
    """One direction of one connection: its segments by arrival time, bounded in bytes. One task
    reads into it, one delivers from it."""

    def __init__(self, link: WanLink, name: str) -> None:
        self.link = link
        self.name = name
        self.last_arrival = 0.0
        self.segments: deque[tuple[float, bytes]] = deque()
        self.queued_bytes = 0
        self.arrived = asyncio.Event()  # a segment was queued (the delivering task waits on it)
        self.room = asyncio.Event()  # a segment left the queue (the reading task waits on it)

    def admit(self, data: bytes, now: float) -> None:
        """Queue `data` (b"": the end of stream, which takes no link time and is never lost)."""
        pipe, shape, counters = self.link.pipe, self.link.shape, self.link.counters
        lane = self.link.lanes[self.name]
        arrival = now
        if data:
            leaves = max(pipe.free_at[lane], now) + len(data) / (shape.bandwidth_mbps * _MBPS)
            pipe.free_at[lane] = leaves  # the lane's, shared by every connection on the pipe
            arrival = leaves + shape.one_way_s + pipe.extra_latency_ms / 1000
            if shape.jitter_ms:
                arrival += pipe.rng.uniform(-shape.jitter_ms, shape.jitter_ms) / 1000
            if shape.loss and pipe.rng.random() < shape.loss:
                arrival += shape.rtt_ms / 1000
                counters.lost[self.name] += 1
            counters.segments[self.name] += 1
            counters.bytes[self.name] += len(data)
        arrival = max(arrival, self.last_arrival)  # in order, as TCP delivers
        self.last_arrival = arrival
        self.segments.append((arrival, data))
        self.queued_bytes += len(data)
        self.arrived.set()


class LinkPipe:
    """What the listeners of one link share (a region pair's link, whoever connects through it):
    its shape, when each of its two lanes is next free to send, its fault, and its jitter and loss
    draws. A listener maps its own "forward" and "reverse" onto the pipe's lanes, so traffic from
    region a to region b shares one lane whichever listener carries it. One event loop."""

    def __init__(self, shape: LinkShape, seed: int = 0) -> None:
        self.shape = shape
        self.rng = random.Random(seed)
        self.fault = LinkFault.NONE
        self.extra_latency_ms = 0.0
        self.free_at: dict[str, float] = {}  # lane -> when it has sent all it was given (monotonic s)
        self.flowing = asyncio.Event()  # clear while blackholed
        self.flowing.set()
        self.members: list[WanLink] = []  # listeners a partition resets

    def set_fault(self, fault: LinkFault, extra_latency_ms: float = 0.0) -> None:
        """Break the link (or heal it: `LinkFault.NONE`), and add `extra_latency_ms` one way."""
        if not 0 <= extra_latency_ms < math.inf:
            raise ValueError(f"extra_latency_ms must be finite and >= 0, got {extra_latency_ms}")
        self.fault = fault
        self.extra_latency_ms = extra_latency_ms
        if fault is LinkFault.BLACKHOLE:
            self.flowing.clear()
        else:
            self.flowing.set()
        if fault is LinkFault.PARTITION:
            for member in self.members:
                member.abort_all()


class WanLink:
    """Listens on `host`:`port` (0: any free port, `port` once started) and relays each connection
    to `target_host`:`target_port` through `shape`. `seed` makes the jitter and loss draws
    repeatable for the same sequence of segments. Given a `pipe` (of the same shape), it shares
    that pipe's bandwidth, draws and faults with its other listeners, its forward direction on lane
    `lanes[0]` and its reverse on `lanes[1]`. Given an `attributor` factory, each connection's
    bytes are read by one of its attributors and counted by owner in `counters.tenants`
    (`symphony.link_tenants`). Runs on one event loop; not thread-safe."""

    def __init__(
        self,
        shape: LinkShape,
        target_host: str,
        target_port: int,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        seed: int = 0,
        max_connections: int = 256,
        queue_bytes: int | None = None,
        idle_timeout_s: float = 300.0,
        connect_timeout_s: float = 5.0,
        pipe: LinkPipe | None = None,
        lanes: tuple[str, str] = _DIRECTIONS,
        attributor: Callable[[], Attributor] | None = None,
    ) -> None:
        self.shape = shape
        self.target = (target_host, target_port)
        self.host = host
        self.port = port
        self.pipe = pipe or LinkPipe(shape, seed)
        if self.pipe.shape != shape:
            raise ValueError("a listener's shape must be its pipe's")
        self.pipe.members.append(self)
        self.lanes = dict(zip(_DIRECTIONS, lanes, strict=True))
        for lane in lanes:
            self.pipe.free_at.setdefault(lane, 0.0)
        self.max_connections = max_connections
        self.queue_bytes = queue_bytes or max(MIN_QUEUE_BYTES, math.ceil(2 * shape.bdp_bytes))
        self.idle_timeout_s = idle_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.counters = LinkCounters()
        self.attributor = attributor
        self._server: asyncio.Server | None = None
        self._closing = False
        # Open connections: each one's task, and the event that resets it (a partition, `close`).
        self._open: dict[asyncio.Task[None], asyncio.Event] = {}

    @property
    def fault(self) -> LinkFault:
        return self.pipe.fault

    @property
    def open_connections(self) -> int:
        return len(self._open)

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        """Stop accepting, reset every open connection, and return once they have ended."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for abort in self._open.values():
            abort.set()
        await asyncio.gather(*self._open, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()  # from Python 3.12, waits for the connections too

    def set_fault(self, fault: LinkFault, extra_latency_ms: float = 0.0) -> None:
        """Break the link this listener is on (its pipe: every listener sharing it), or heal it."""
        self.pipe.set_fault(fault, extra_latency_ms)

    def abort_all(self) -> None:
        """Reset every open connection (a partition)."""
        for abort in self._open.values():
            abort.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closing or self.fault is LinkFault.PARTITION or len(self._open) >= self.max_connections:
            self.counters.refused += 1
            _reset(writer)
            return
        task = asyncio.current_task()
        assert task is not None
        abort = self._open[task] = asyncio.Event()
        try:
            try:
                up_reader, up_writer = await asyncio.wait_for(
                    asyncio.open_connection(*self.target), self.connect_timeout_s
                )
            except (OSError, TimeoutError):
                self.counters.refused += 1
                _reset(writer)
                return
            self.counters.connections += 1
            await self._relay(reader, writer, up_reader, up_writer, abort)
        finally:
            del self._open[task]

    async def _relay(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
        abort: asyncio.Event,
    ) -> None:
        forward, reverse = _Direction(self, "forward"), _Direction(self, "reverse")
        last_activity = [time.monotonic()]
        tally = None
        if self.attributor is not None:
            tally = ConnectionTally(self.attributor(), self.counters.tenants, f"{self.port}>{self.target[1]}")
        pumps = [
            asyncio.create_task(self._pump(reader, forward, last_activity, tally)),
            asyncio.create_task(self._pump(up_reader, reverse, last_activity, tally)),
        ]
        deliveries = [
            asyncio.create_task(self._deliver(forward, up_writer, last_activity)),
            asyncio.create_task(self._deliver(reverse, writer, last_activity)),
        ]
        idle = asyncio.create_task(self._watch_idle(last_activity, (forward, reverse)))
        aborted = asyncio.create_task(abort.wait())
        pending: set[asyncio.Task[Any]] = {*pumps, *deliveries, idle, aborted}
        clean = False
        try:
            # Ends once both directions have delivered their end (a half-closed one keeps the other
            # going); at an error on either side, when idle, or when aborted, with a reset.
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if aborted in done or idle in done:
                    break
                if any(not t.cancelled() and t.exception() is not None for t in done):
                    break
                if all(t.done() for t in deliveries):
                    clean = True
                    break
        finally:
            tasks = (*pumps, *deliveries, idle, aborted)
            for task in tasks:
                task.cancel()
            try:
                await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                if tally is not None:  # after the pumps: nothing is fed once it has closed
                    tally.close()
            for w in (writer, up_writer):
                if clean:
                    w.close()
                else:
                    _reset(w)

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        direction: _Direction,
        last_activity: list[float],
        tally: ConnectionTally | None,
    ) -> None:
        """Read what the sender writes, segment by segment, into the link (waiting while the link
        holds `queue_bytes` of it, or is blackholed), each segment told to `tally` before it is
        queued; an empty segment marks the end."""
        while True:
            while direction.queued_bytes >= self.queue_bytes:
                direction.room.clear()
                await direction.room.wait()
            await self.pipe.flowing.wait()
            data = await reader.read(SEGMENT_BYTES)  # the idle watch bounds how long this waits
            last_activity[0] = time.monotonic()
            if tally is not None:
                tally.feed(direction.name, data)
            direction.admit(data, time.monotonic())
            if not data:
                return

    async def _deliver(self, direction: _Direction, writer: asyncio.StreamWriter, last_activity: list[float]) -> None:
        """Write each segment when it arrives (held while blackholed); the end-of-stream segment
        closes the write side."""
        while True:
            if not direction.segments:
                direction.arrived.clear()
                await direction.arrived.wait()
                continue
            arrival, data = direction.segments[0]
            wait = arrival - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            if not self.pipe.flowing.is_set():
                await self.pipe.flowing.wait()
                continue
            direction.segments.popleft()
            direction.queued_bytes -= len(data)
            direction.room.set()
            if not data:
                with contextlib.suppress(OSError):
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()
            last_activity[0] = time.monotonic()

    async def _watch_idle(self, last_activity: list[float], directions: tuple[_Direction, ...]) -> None:
        """Return once nothing was read or delivered for `idle_timeout_s` while nothing is queued
        (a slow link's queue is not idleness) or the link is blackholed (a healed link goes on)."""
        while True:
            left = last_activity[0] + self.idle_timeout_s - time.monotonic()
            if left <= 0:
                if any(d.segments for d in directions) or not self.pipe.flowing.is_set():
                    last_activity[0] = time.monotonic()
                    continue
                return
            await asyncio.sleep(left)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a reset (SO_LINGER 0, nothing buffered sent), as a broken path shows itself to TCP."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def endpoint(text: str) -> tuple[str, int]:
    """ "host:port" (an IPv6 host in brackets) as (host, port); ValueError naming what is wrong."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port with a port from 1 to 65535, got {text!r}")
    return host, int(port)


async def run_link(shape: LinkShape, listen: tuple[str, int], target: tuple[str, int], seed: int = 0) -> None:
    """`symphony link`: serve one link until SIGINT or SIGTERM; says on stdout when it listens."""
    link = WanLink(shape, *target, host=listen[0], port=listen[1], seed=seed)
    await link.start()
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopped.set)
    print(
        f"link up: {listen[0]}:{link.port} -> {target[0]}:{target[1]}, rtt {shape.rtt_ms:g} ms, "
        f"{shape.bandwidth_mbps:g} Mb/s each way, jitter {shape.jitter_ms:g} ms, loss {shape.loss:g}",
        flush=True,
    )
    try:
        await stopped.wait()
    finally:
        await link.close()
