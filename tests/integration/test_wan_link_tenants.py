"""symphony.link_tenants on a real `WanLink`: real gRPC (grpc.aio, one multiplexed channel) and real
HTTP/1.1 (aiohttp, one kept-alive connection) through the link, each tenant's bytes counted by
reading the traffic, and the labels summing to what the link carried."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import aiohttp
import grpc
import pytest
from aiohttp import web

from symphony.link_sniff import Sniff
from symphony.link_tenants import NONE, PENDING, UNATTRIBUTED, UNKNOWN_KEY, http_tenant_of
from symphony.rpc import kv_pb2, kv_pb2_grpc
from symphony.tenancy import TenantKeys
from symphony.wan_link import LinkShape, WanLink

SHAPE = LinkShape(rtt_ms=4, bandwidth_mbps=1000)
KEYS = TenantKeys(["acme:key-acme", "globex:key-globex"])
PAGE = 60_000  # bytes of one PageBatch's payload


def _sniffing(port: int) -> WanLink:
    return WanLink(SHAPE, "127.0.0.1", port, attributor=lambda: Sniff(http_tenant_of(KEYS)))


def _lanes(link: WanLink) -> dict[str, dict[str, int]]:
    return {d: link.counters.tenants.snapshot(d) for d in ("forward", "reverse")}


def _assert_labels_sum_to_bytes(link: WanLink) -> None:
    for direction, counts in _lanes(link).items():
        assert sum(counts.values()) == link.counters.bytes[direction], (direction, counts)


class Pages(kv_pb2_grpc.KVStoreServicer):
    """Answers FetchPages with `num_blocks` batches of PAGE bytes; GetStoreInfo with nothing."""

    async def GetStoreInfo(self, request, context):
        return kv_pb2.StoreInfo()

    async def FetchPages(self, request, context):
        for i in range(request.num_blocks):
            await asyncio.sleep(0)  # interleave the streams of concurrent calls
            yield kv_pb2.PageBatch(session=request.session, first_block=i, data=bytes(PAGE))


@pytest.fixture
async def grpc_port() -> AsyncIterator[int]:
    server = grpc.aio.server()
    kv_pb2_grpc.add_KVStoreServicer_to_server(Pages(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield port
    await server.stop(grace=None)


async def _fetch(stub: kv_pb2_grpc.KVStoreStub, tenant: str, blocks: int) -> int:
    ref = kv_pb2.SessionRef(tenant=tenant, session_id=f"{tenant}-s")
    received = 0
    async for batch in stub.FetchPages(kv_pb2.FetchPagesRequest(session=ref, num_blocks=blocks), timeout=30):
        received += len(batch.data)
    return received


async def test_tenants_multiplexed_on_one_grpc_channel_are_told_apart(grpc_port: int) -> None:
    link = _sniffing(grpc_port)
    await link.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{link.port}") as channel:
            stub = kv_pb2_grpc.KVStoreStub(channel)
            await stub.GetStoreInfo(kv_pb2.StoreInfoRequest(), timeout=10)
            acme, globex = await asyncio.gather(_fetch(stub, "acme", 30), _fetch(stub, "globex", 10))
        assert (acme, globex) == (30 * PAGE, 10 * PAGE)
    finally:
        await link.close()
    lanes = _lanes(link)
    back = lanes["reverse"]
    # Each tenant's answers carried its pages and little else (frame and message headers), and
    # nothing of the other's: 30 against 10 pages, on one connection.
    assert 30 * PAGE <= back["acme"] <= 30 * PAGE * 1.02, back
    assert 10 * PAGE <= back["globex"] <= 10 * PAGE * 1.02, back
    assert lanes["forward"]["acme"] > 0 and lanes["forward"]["globex"] > 0
    assert lanes["forward"][NONE] >= 24  # the connection preface, settings, GetStoreInfo
    for counts in lanes.values():
        assert UNATTRIBUTED not in counts and PENDING not in counts, lanes
    assert link.counters.tenants.sniff_errors == 0
    _assert_labels_sum_to_bytes(link)


@pytest.fixture
async def http_port() -> AsyncIterator[int]:
    async def echo(request: web.Request) -> web.StreamResponse:
        return web.Response(body=await request.read())

    async def chunks(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(0 if request.method == "HEAD" else int(request.query["n"])):
            await response.write(bytes(10_000))  # chunked transfer encoding
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_get("/chunks", chunks)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    await runner.cleanup()


def _as(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def test_each_http_request_and_its_answer_are_its_keys_tenants(http_port: int) -> None:
    link = _sniffing(http_port)
    await link.start()
    url = f"http://127.0.0.1:{link.port}"
    try:
        connector = aiohttp.TCPConnector(limit=1)  # every request on one kept-alive connection
        async with aiohttp.ClientSession(connector=connector) as http:
            plan = [("key-acme", 200_000), ("key-globex", 50_000), ("key-wrong", 2_000)]
            for key, size in plan:
                async with http.post(f"{url}/echo", data=bytes(size), headers=_as(key)) as answer:
                    assert len(await answer.read()) == size
            async with http.get(f"{url}/chunks", params={"n": "30"}, headers=_as("key-globex")) as answer:
                assert len(await answer.read()) == 300_000
            async with http.get(f"{url}/chunks", params={"n": "1"}) as answer:  # no key, no body: NONE
                assert len(await answer.read()) == 10_000
            async with http.head(f"{url}/chunks", params={"n": "1"}, headers=_as("key-acme")) as answer:
                assert answer.status == 200
        assert link.counters.connections == 1
    finally:
        await link.close()
    lanes = _lanes(link)
    sent, back = lanes["forward"], lanes["reverse"]
    overhead = 2_000  # request and response heads, chunk framing
    assert 200_000 <= sent["acme"] <= 200_000 + overhead, sent
    assert 200_000 <= back["acme"] <= 200_000 + overhead, back
    assert 50_000 <= sent["globex"] <= 50_000 + overhead, sent
    assert 350_000 <= back["globex"] <= 350_000 + overhead, back
    assert 10_000 <= back[NONE] <= 10_000 + overhead and 2_000 <= back[UNKNOWN_KEY] <= 2_000 + overhead, back
    for counts in lanes.values():
        assert UNATTRIBUTED not in counts and PENDING not in counts, lanes
    assert link.counters.tenants.sniff_errors == 0
    _assert_labels_sum_to_bytes(link)


@pytest.fixture
async def echo_port() -> AsyncIterator[int]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


async def test_bytes_of_no_known_protocol_pass_intact_and_count_as_unattributed(echo_port: int) -> None:
    link = _sniffing(echo_port)
    await link.start()
    payload = b"\x16\x03\x01" + random.Random(7).randbytes(5_000)  # a TLS-like start: neither h2c nor HTTP/1
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        writer.write(payload)
        await writer.drain()
        assert await asyncio.wait_for(reader.readexactly(len(payload)), 10) == payload
        writer.close()
    finally:
        await link.close()
    lanes = _lanes(link)
    assert lanes == {"forward": {UNATTRIBUTED: len(payload)}, "reverse": {UNATTRIBUTED: len(payload)}}
