"""The scheduler calls engines with the cluster's engine key (`node_manager.engine_auth` guards
them), and never hands a client's own credentials on."""

from __future__ import annotations

import httpx

from symphony.tenancy import engine_key
from tests.integration.conftest import MakeNode, StartScheduler, ready
from tests.integration.fakes import FakeEngine

SECRET = "a cluster secret of 32 characters"
TENANT_KEY = "acme-key"


async def test_requests_and_relays_reach_the_engine_with_its_key_and_without_the_clients(
    engine: FakeEngine, make_node: MakeNode, start_scheduler: StartScheduler
) -> None:
    url, _ = await start_scheduler(
        [await make_node(engine.url)], cluster={"secret": SECRET}, api_keys=[f"acme:{TENANT_KEY}"]
    )
    client = {"Authorization": f"Bearer {TENANT_KEY}"}
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        await ready(http)
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        answer = await http.post(url + "/v1/chat/completions", json=chat, headers=client)
        assert answer.status_code == 200, answer.text
        relayed = await http.post(url + "/tokenize", json={"model": "m", "prompt": "hi"}, headers=client)
        assert relayed.status_code == 200, relayed.text  # no tokenizer here: an engine answers
    expected = f"Bearer {engine_key(SECRET.encode())}"
    seen = [*engine.headers, *engine.tokenize_headers]
    assert len(engine.headers) == 1 and engine.tokenize_headers
    assert all(headers.get("Authorization") == expected for headers in seen), seen
    assert not any(TENANT_KEY in str(headers) for headers in seen)


async def test_without_a_secret_the_engine_gets_no_key(
    engine: FakeEngine, make_node: MakeNode, start_scheduler: StartScheduler
) -> None:
    url, _ = await start_scheduler([await make_node(engine.url)])
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        await ready(http)
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        answer = await http.post(url + "/v1/chat/completions", json=chat, headers={"Authorization": "Bearer x"})
        assert answer.status_code == 200, answer.text
    assert engine.headers and "Authorization" not in engine.headers[0]


async def test_an_engine_refusing_the_key_is_the_clusters_fault_not_the_clients(
    engine: FakeEngine, make_node: MakeNode, start_scheduler: StartScheduler
) -> None:
    """A 401 from an engine (a node started under another secret, before its status says so) is a
    502 to the client: its own credentials were fine."""
    url, _ = await start_scheduler([await make_node(engine.url)], cluster={"secret": SECRET})
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        await ready(http)
        chat = {"model": "m", "messages": [{"role": "user", "content": "unkeyed"}], "max_tokens": 2}
        answer = await http.post(url + "/v1/chat/completions", json=chat)
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "engine_error", answer.text
