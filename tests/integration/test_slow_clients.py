"""Slow clients (slowloris) against the scheduler as `symphony scheduler` serves it: a connection
that does not send a whole request within `scheduler.request_read_timeout_s` is closed, whether it
sends nothing, part of its headers or part of its body; requests sent in time, and answers that
take longer than the deadline once the request is in, are not touched."""

from __future__ import annotations

import asyncio
import json

import httpx
from openai._constants import DEFAULT_CONNECTION_LIMITS

from tests.helpers import async_wait_until, idle_connection_reused
from tests.integration.conftest import CHAT, MakeNode, StartScheduler, ready
from tests.integration.fakes import FakeEngine

DEADLINE_S = 0.5
SLOW = 30  # slow connections of each kind


async def _open(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def _closed(reader: asyncio.StreamReader) -> bool:
    """True once the server closed the connection (what it sent first, if anything, read away)."""
    try:
        while await asyncio.wait_for(reader.read(4096), 0.05):
            pass
        return True
    except TimeoutError:
        return False


async def test_slow_requests_are_closed_at_their_deadline_and_others_are_served(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    url, state = await start_scheduler([await make_node(engine.url)], request_read_timeout_s=DEADLINE_S)
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        await ready(client, 1)
    body = json.dumps(CHAT).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
    )
    silent = [await _open(url) for _ in range(SLOW)]
    part_headers = [await _open(url) for _ in range(SLOW)]
    part_body = [await _open(url) for _ in range(SLOW)]
    for _, writer in part_headers:
        writer.write(head[:20])
    for _, writer in part_body:
        writer.write(head + body[:1])
    slow = silent + part_headers + part_body
    await asyncio.gather(*(writer.drain() for _, writer in slow))
    # An answer that takes longer than the deadline once its request is in is not cut.
    asyncio.get_running_loop().call_later(3 * DEADLINE_S, engine.slow_done.set)
    slow_answer = {**CHAT, "messages": [{"role": "user", "content": "slow"}]}
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        started = asyncio.get_running_loop().time()
        answered = await client.post("/v1/chat/completions", json=slow_answer)
        took = asyncio.get_running_loop().time() - started
    assert answered.status_code == 200 and took > 2 * DEADLINE_S, (answered.text, took)

    open_ = {id(reader): reader for reader, _ in slow}

    async def all_closed() -> bool:
        for key, reader in list(open_.items()):
            if await _closed(reader):
                del open_[key]
        return not open_

    await async_wait_until(all_closed, 10, "every slow connection to be closed")
    assert state.metrics.read_timeouts._value.get() == 3 * SLOW
    for _, writer in slow:
        writer.close()


async def test_an_idle_connection_outlives_the_openai_clients_pool(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    """A connection the `openai` client's pool still holds is still open on the server: were the
    server to close idle connections when the pool stops reusing them (uvicorn's default, 5 s, is
    httpx's), a request sent at that moment would break (seen in `bench faults`)."""
    url, _ = await start_scheduler([await make_node(engine.url)])
    idle_s = DEFAULT_CONNECTION_LIMITS.keepalive_expiry + 0.5
    assert await idle_connection_reused(url, "/healthz", idle_s) == [b"HTTP/1.1 200 OK"] * 2
