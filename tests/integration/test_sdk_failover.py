"""The SDK fails over between scheduler replicas (client_sdk.failover): two real schedulers in
front of the same fake node; a replica that cannot be reached (nothing listens, or it stopped) is
skipped before the caller sees an error; an answer, even an error, is never sent again."""

from __future__ import annotations

import httpx
import openai
import pytest

from client_sdk import AsyncAdminClient, AsyncSymphonyClient
from tests.helpers import free_port
from tests.integration.conftest import MakeNode, Servers, StartScheduler, ready, stop_scheduler
from tests.integration.fakes import FakeEngine

TURN = [{"role": "user", "content": "hi"}]


async def test_a_client_goes_on_to_the_next_replica_when_one_cannot_be_reached(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler, scheduler_servers: Servers
) -> None:
    node = await make_node(engine.url)
    first, first_state = await start_scheduler([node])
    second, second_state = await start_scheduler([node])
    for url in (first, second):
        async with httpx.AsyncClient(base_url=url) as probe:
            await ready(probe)
    nothing = f"http://127.0.0.1:{free_port()}"  # a replica that is down: nothing listens
    client = AsyncSymphonyClient([nothing, first, second], model="m", max_retries=1)
    try:
        advisory = await client.typing("chat-1")
        assert advisory is not None and advisory.node == "node-0"
        assert client.replicas.index == 1  # the first that answered, kept for what follows
        assert (len(first_state.advisories), len(second_state.advisories)) == (1, 0)
        reply = await client.chat("chat-1", TURN, max_tokens=4)
        assert reply.choices[0].message.content
        assert first_state.metrics.registry.get_sample_value(
            "symphony_requests_total", {"endpoint": "chat", "status": "200"}
        ) == 1 and second_state.metrics.registry.get_sample_value(
            "symphony_requests_total", {"endpoint": "chat", "status": "200"}
        ) in (None, 0)
        await stop_scheduler(scheduler_servers, first)  # the replica in use goes away
        reply = await client.chat("chat-1", TURN, max_tokens=4, stream=True)
        assert "".join([chunk.choices[0].delta.content or "" async for chunk in reply if chunk.choices])
        assert client.replicas.index == 2
    finally:
        await client.close()
    # Every replica down: the last connection error, after max_retries + 1 rounds.
    await stop_scheduler(scheduler_servers, second)
    down = AsyncSymphonyClient([nothing, second], model="m", max_retries=1)
    try:
        with pytest.raises(openai.APIConnectionError):
            await down.chat("chat-1", TURN, max_tokens=4)
    finally:
        await down.close()


async def test_an_answer_is_the_replicas_even_an_error(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    node = await make_node(engine.url)
    strict, _ = await start_scheduler([node], api_keys=["acme:key-acme"], admin_token="ops")
    lenient, lenient_state = await start_scheduler([node], admin_token="ops")
    client = AsyncSymphonyClient([strict, lenient], api_key="wrong", model="m")
    try:
        with pytest.raises(openai.AuthenticationError):  # the first replica's 401, not a retry elsewhere
            await client.chat("chat-1", TURN, max_tokens=4)
    finally:
        await client.close()
    assert lenient_state.metrics.registry.get_sample_value(
        "symphony_requests_total", {"endpoint": "chat", "status": "200"}
    ) in (None, 0)
    admin = AsyncAdminClient(f"http://127.0.0.1:{free_port()},{lenient}", token="ops")
    try:
        assert (await admin.set_priority("default", "low"))["priority"] == "low"
    finally:
        await admin.close()
    assert lenient_state.priorities.of("default", None).value == "low"
