"""symphony.wan_link: the user-space WAN link, measured over real loopback TCP against its
configured round-trip time, jitter, bandwidth and loss (each within 10%), its faults, and
`symphony link` in front of a real node manager."""

from __future__ import annotations

import asyncio
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from eval.bench_tiers import PeerNode
from symphony.kv_geometry import smollm2_geometry
from symphony.rpc import kv_pb2, kv_pb2_grpc
from symphony.wan_link import LinkFault, LinkPipe, LinkShape, WanLink
from tests.helpers import echo, free_port

PING = b"p" * 100
TOLERANCE = 0.10


@pytest.fixture
async def echo_port() -> AsyncIterator[int]:
    """A server that writes back whatever it reads, until the end of its input."""

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


async def _link(shape: LinkShape, port: int, **kwargs: object) -> WanLink:
    link = WanLink(shape, "127.0.0.1", port, **kwargs)  # type: ignore[arg-type]
    await link.start()
    return link


async def _round_trips(port: int, count: int) -> list[float]:
    """`count` ping-pongs of PING, one at a time, over a new connection: each one's time, in ms."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    times = []
    try:
        for _ in range(count):
            started = time.perf_counter()
            writer.write(PING)
            await writer.drain()
            assert await asyncio.wait_for(reader.readexactly(len(PING)), 10) == PING
            times.append((time.perf_counter() - started) * 1000)
    finally:
        writer.close()
    return times


def _within(measured: float, configured: float) -> bool:
    return abs(measured - configured) <= TOLERANCE * configured


async def test_a_round_trip_takes_the_links_rtt(echo_port: int) -> None:
    link = await _link(LinkShape(rtt_ms=60, bandwidth_mbps=100), echo_port)
    try:
        median = statistics.median(await _round_trips(link.port, 15))
        assert _within(median, 60), f"median round trip {median:.1f} ms for a 60 ms link"
    finally:
        await link.close()


async def test_jitter_spreads_round_trips_around_the_rtt_in_order(echo_port: int) -> None:
    # Seed 35's first 80 draws (40 pings, a draw each way) average 0.003 ms: the mean measured is the link's.
    link = await _link(LinkShape(rtt_ms=60, bandwidth_mbps=100, jitter_ms=15), echo_port, seed=35)
    try:
        times = await _round_trips(link.port, 40)
        assert _within(statistics.fmean(times), 60), f"mean round trip {statistics.fmean(times):.1f} ms"
        assert statistics.pstdev(times) > 5, "a link with 15 ms of jitter a way gave steady round trips"
        # Many segments in flight at once, each with its own draw: delivered whole.
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        messages = b"".join(f"{i:06d}".encode() for i in range(2000))
        for i in range(0, len(messages), 600):
            writer.write(messages[i : i + 600])
            await writer.drain()
            await asyncio.sleep(0.001)  # separate reads, so separate segments
        assert await asyncio.wait_for(reader.readexactly(len(messages)), 10) == messages
        writer.close()
        assert link.counters.segments["forward"] > 40 + 10
    finally:
        await link.close()


async def test_a_transfer_runs_at_the_links_bandwidth(echo_port: int) -> None:
    shape = LinkShape(rtt_ms=10, bandwidth_mbps=100)
    link = await _link(shape, echo_port)
    payload = bytes(4 << 20)  # 4 MiB: 0.34 s at 100 Mb/s
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        started = time.perf_counter()

        async def send() -> None:
            writer.write(payload)
            await writer.drain()
            writer.write_eof()

        sending = asyncio.create_task(send())
        received = 0
        while received < len(payload):
            chunk = await asyncio.wait_for(reader.read(1 << 16), 10)
            assert chunk, "the link closed before the payload came back"
            received += len(chunk)
        elapsed = time.perf_counter() - started
        await sending
        writer.close()
        # Both ways run at the bandwidth and overlap; the last byte is one round trip behind.
        mbps = len(payload) * 8 / 1e6 / (elapsed - shape.rtt_ms / 1000)
        assert _within(mbps, 100), f"{mbps:.1f} Mb/s through a 100 Mb/s link"
        assert link.counters.bytes == {"forward": len(payload), "reverse": len(payload)}
    finally:
        await link.close()


async def test_a_lost_segment_arrives_a_round_trip_late(echo_port: int) -> None:
    rtt, pings = 40.0, 100
    link = await _link(LinkShape(rtt_ms=rtt, bandwidth_mbps=100, loss=0.2), echo_port, seed=7)
    try:
        times = await _round_trips(link.port, pings)
        # Each ping is one segment each way; each lost one adds a round trip to its ping (read to
        # the nearest round trip). A busy host's scheduling only ever adds time, and seldom 20 ms:
        # at most two pings of a hundred may read one round trip later than their losses made them
        # (seen once in a full integration run: 49 for 48).
        late = sum(max(0, round(t / rtt) - 1) for t in times)
        counted = link.counters.lost["forward"] + link.counters.lost["reverse"]
        assert link.counters.segments == {"forward": pings, "reverse": pings}
        assert counted > 0 and counted <= late <= counted + 2, f"{late} round trips late for {counted} segments lost"
    finally:
        await link.close()


async def test_segments_are_lost_at_the_configured_rate(echo_port: int) -> None:
    loss, pings = 0.2, 2000  # 4,000 draws: the rate within 10% at 3 standard deviations
    link = await _link(LinkShape(rtt_ms=1, bandwidth_mbps=1000, loss=loss), echo_port, seed=11)
    try:
        await _round_trips(link.port, pings)
        assert link.counters.segments == {"forward": pings, "reverse": pings}
        measured = (link.counters.lost["forward"] + link.counters.lost["reverse"]) / (2 * pings)
        assert _within(measured, loss), f"{measured:.3f} of segments lost on a link losing {loss}"
    finally:
        await link.close()


async def test_added_latency_blackhole_and_partition_then_heal(echo_port: int) -> None:
    link = await _link(LinkShape(rtt_ms=60, bandwidth_mbps=100), echo_port)
    try:
        link.set_fault(LinkFault.NONE, extra_latency_ms=25)  # 25 ms more each way
        median = statistics.median(await _round_trips(link.port, 5))
        assert _within(median, 110), f"{median:.1f} ms with 25 ms added each way to a 60 ms link"

        link.set_fault(LinkFault.BLACKHOLE)
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        writer.write(PING)
        await writer.drain()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.read(1), 0.5)  # open, silent
        writer.close()

        link.set_fault(LinkFault.PARTITION)
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        with pytest.raises(ConnectionResetError):
            writer.write(PING)
            await writer.drain()
            await asyncio.wait_for(reader.readexactly(len(PING)), 5)  # reset, never echoed
        writer.close()
        assert link.counters.refused >= 1

        link.set_fault(LinkFault.NONE)
        assert _within(statistics.median(await _round_trips(link.port, 3)), 60)
    finally:
        await link.close()


async def test_a_partition_resets_open_connections(echo_port: int) -> None:
    link = await _link(LinkShape(rtt_ms=4, bandwidth_mbps=100), echo_port)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        writer.write(PING)
        assert await asyncio.wait_for(reader.readexactly(len(PING)), 5) == PING
        link.set_fault(LinkFault.PARTITION)
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.readexactly(1), 5)
        writer.close()
    finally:
        await link.close()


async def test_connections_beyond_the_bound_are_refused(echo_port: int) -> None:
    link = await _link(LinkShape(rtt_ms=4, bandwidth_mbps=100), echo_port, max_connections=2)
    opened = []
    try:
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
            writer.write(PING)
            assert await asyncio.wait_for(reader.readexactly(len(PING)), 5) == PING
            opened.append(writer)
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        with pytest.raises(ConnectionResetError):
            writer.write(PING)
            await writer.drain()
            await asyncio.wait_for(reader.readexactly(len(PING)), 5)
        writer.close()
        assert link.counters.refused == 1 and link.counters.connections == 2
    finally:
        for writer in opened:
            writer.close()
        await link.close()


@pytest.mark.parametrize(
    ("figures", "named"),
    [
        ({"rtt_ms": -1, "bandwidth_mbps": 1}, "rtt_ms"),
        ({"rtt_ms": 10, "bandwidth_mbps": 0}, "bandwidth_mbps"),
        ({"rtt_ms": 10, "bandwidth_mbps": 1, "jitter_ms": 6}, "jitter_ms"),
        ({"rtt_ms": 10, "bandwidth_mbps": 1, "loss": 1.0}, "loss"),
    ],
)
def test_impossible_figures_are_refused_by_name(figures: dict[str, float], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        LinkShape(**figures)


async def test_a_healed_blackhole_delivers_what_it_held_in_order(echo_port: int) -> None:
    link = await _link(LinkShape(rtt_ms=20, bandwidth_mbps=100), echo_port)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        writer.write(b"A" * 10)
        assert await asyncio.wait_for(reader.readexactly(10), 5) == b"A" * 10
        link.set_fault(LinkFault.BLACKHOLE)
        writer.write(b"B" * 10)
        await writer.drain()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.readexactly(10), 0.5)  # nothing through while it lasts
        link.set_fault(LinkFault.NONE)
        writer.write(b"C" * 10)
        assert await asyncio.wait_for(reader.readexactly(20), 5) == b"B" * 10 + b"C" * 10
        writer.close()
    finally:
        await link.close()


async def test_connections_share_the_links_bandwidth(echo_port: int) -> None:
    shape = LinkShape(rtt_ms=10, bandwidth_mbps=100)
    link = await _link(shape, echo_port)
    payload = bytes(2 << 20)
    try:
        started = time.perf_counter()
        await asyncio.gather(_echoed(link.port, payload), _echoed(link.port, payload))
        elapsed = time.perf_counter() - started
        mbps = 2 * len(payload) * 8 / 1e6 / (elapsed - shape.rtt_ms / 1000)
        assert _within(mbps, 100), f"two connections moved {mbps:.1f} Mb/s in all through a 100 Mb/s link"
    finally:
        await link.close()


async def test_listeners_on_one_pipe_share_its_bandwidth(echo_port: int) -> None:
    """A region pair's link carries every listener's traffic (symphony.region_links): two
    listeners on one pipe move, in all, what one link moves."""
    shape = LinkShape(rtt_ms=10, bandwidth_mbps=100)
    pipe = LinkPipe(shape)
    first = await _link(shape, echo_port, pipe=pipe, lanes=("a>b", "b>a"))
    second = await _link(shape, echo_port, pipe=pipe, lanes=("a>b", "b>a"))
    payload = bytes(2 << 20)
    try:
        started = time.perf_counter()
        await asyncio.gather(_echoed(first.port, payload), _echoed(second.port, payload))
        elapsed = time.perf_counter() - started
        mbps = 2 * len(payload) * 8 / 1e6 / (elapsed - shape.rtt_ms / 1000)
        assert _within(mbps, 100), f"two listeners moved {mbps:.1f} Mb/s in all through one 100 Mb/s pipe"
        # A partition of the pipe breaks both listeners.
        pipe.set_fault(LinkFault.PARTITION)
        for link in (first, second):
            assert link.fault is LinkFault.PARTITION
            with pytest.raises(ConnectionError):
                await _round_trips(link.port, 1)
    finally:
        await first.close()
        await second.close()


def test_a_listener_must_have_its_pipes_shape() -> None:
    with pytest.raises(ValueError, match="shape must be its pipe's"):
        WanLink(LinkShape(10, 100), "127.0.0.1", 1, pipe=LinkPipe(LinkShape(20, 100)))


async def _echoed(port: int, payload: bytes) -> None:
    """Send `payload` to the echo server through `port` and read it all back."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    await writer.drain()
    received = 0
    while received < len(payload):
        chunk = await asyncio.wait_for(reader.read(1 << 16), 10)
        assert chunk
        received += len(chunk)
    writer.close()


async def test_a_slow_links_queue_is_not_idleness_but_silence_is(echo_port: int) -> None:
    link = await _link(LinkShape(rtt_ms=10, bandwidth_mbps=1), echo_port, idle_timeout_s=0.3)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        writer.write(bytes(50_000))  # 0.4 s each way at 1 Mb/s: longer than the idle timeout
        assert await asyncio.wait_for(reader.readexactly(50_000), 10) == bytes(50_000)
        with pytest.raises(ConnectionResetError):  # then nothing moves: cut, with a reset
            await asyncio.wait_for(reader.read(1), 5)
        writer.close()
    finally:
        await link.close()


async def test_a_nodes_grpc_calls_through_symphony_link_take_the_links_rtt(tmp_path: Path) -> None:
    """`symphony link` as its own process, in front of a real node manager (engine disabled)."""
    peer = PeerNode(tmp_path, smollm2_geometry())
    port = free_port()
    link: asyncio.subprocess.Process | None = None
    try:
        async with grpc.aio.insecure_channel(peer.address) as direct:
            await peer.wait_ready(kv_pb2_grpc.KVStoreStub(direct))
        link = await asyncio.create_subprocess_exec(
            *LINK,
            *("--listen", f"127.0.0.1:{port}", "--target", peer.address, "--rtt-ms", "80", "--bandwidth-mbps", "1000"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        assert link.stdout is not None
        line = (await asyncio.wait_for(link.stdout.readline(), 30)).decode()
        assert line.startswith("link up:"), line
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = kv_pb2_grpc.KVStoreStub(channel)
            for _ in range(3):  # the connection and HTTP/2's settings exchange come first
                await stub.GetStoreInfo(kv_pb2.StoreInfoRequest(), timeout=5)
            times = []
            for _ in range(10):
                started = time.perf_counter()
                await stub.GetStoreInfo(kv_pb2.StoreInfoRequest(), timeout=5)
                times.append((time.perf_counter() - started) * 1000)
        median = statistics.median(times)
        assert _within(median, 80), f"a unary call took {median:.1f} ms through an 80 ms link"
        link.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(link.wait(), 10) == 0
    finally:
        if link is not None and link.returncode is None:
            link.kill()
            await link.wait()
        peer.stop()


LINK = (sys.executable, "-m", "symphony.cli", "link")
ENDS = ("--listen", "127.0.0.1:1", "--target", "127.0.0.1:2")


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--listen", "nowhere", "--target", "127.0.0.1:1", "--rtt-ms", "10", "--bandwidth-mbps", "10"), "--listen"),
        (("--listen", "127.0.0.1:1", "--target", "x:0", "--rtt-ms", "10", "--bandwidth-mbps", "10"), "--target"),
        ((*ENDS, "--rtt-ms", "nan", "--bandwidth-mbps", "1"), "--rtt-ms"),
        ((*ENDS, "--rtt-ms", "10", "--bandwidth-mbps", "-1"), "--bandwidth-mbps"),
        ((*ENDS, "--rtt-ms", "10", "--bandwidth-mbps", "1", "--loss", "2"), "--loss"),
    ],
)
def test_symphony_link_names_a_bad_flag(flags: tuple[str, ...], named: str) -> None:
    done = subprocess.run([*LINK, *flags], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and named in done.stderr and "Traceback" not in done.stderr, done.stderr
