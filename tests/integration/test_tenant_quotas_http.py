"""Each tenant's own quotas ([quotas]) on a real scheduler: a tenant over its rate of requests or
advisories, at its cap of requests in flight, or at its share of the hold-back queue gets a 429 with
an OpenAI-style body (and Retry-After for a rate), while another tenant is served; held-back
requests of two tenants take turns; an admin changes a tenant's quotas while it runs."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import openai
import pytest

from client_sdk import AsyncAdminClient
from symphony.cli import main
from tests.helpers import async_wait_until
from tests.integration.conftest import CHAT, MakeNode, StartScheduler, ready
from tests.integration.fakes import FakeEngine

KEYS = ["acme:key-acme", "rival:key-rival"]
ACME = {"Authorization": "Bearer key-acme"}
OPS = {"Authorization": "Bearer ops-token"}  # the admin token: /metrics needs it once keys are set
RIVAL = {"Authorization": "Bearer key-rival"}
SLOW = {**CHAT, "messages": [{"role": "user", "content": "slow"}]}


async def test_a_tenant_over_its_request_rate_gets_429_with_retry_after(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    # One token every 100 s: after its burst of 2, acme waits; rival has a bucket of its own.
    quotas = {"requests_per_s": 0.01, "request_burst": 2}
    url, _ = await start_scheduler([await make_node(engine.url)], quotas, api_keys=KEYS, admin_token="ops-token")
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        for _ in range(2):
            assert (await client.post("/v1/chat/completions", json=CHAT, headers=ACME)).status_code == 200
        refused = await client.post("/v1/chat/completions", json=CHAT, headers=ACME)
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert 90 <= int(refused.headers["retry-after"]) <= 100
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=RIVAL)).status_code == 200
        assert len(engine.requests) == 3  # the refused one never reached an engine
        metrics = (await client.get("/metrics", headers=OPS)).text
        assert 'symphony_quota_refused_total{reason="requests_rate",tenant="acme"} 1.0' in metrics
        assert 'symphony_requests_total{endpoint="chat",status="429"} 1.0' in metrics

    # The official client reads it as a rate limit.
    sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="key-acme", max_retries=0)
    try:
        await sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        raise AssertionError("acme's bucket is empty")
    except openai.RateLimitError as exc:
        assert exc.status_code == 429
    finally:
        await sdk.close()


async def test_a_tenant_over_its_advisory_rate_gets_429(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    url, _ = await start_scheduler(
        [await make_node(engine.url)], {"advisories_per_s": 0.01, "advisory_burst": 1}, api_keys=KEYS
    )
    advisory = {"session_id": "s", "kind": "typing"}
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        assert (await client.post("/v1/advisories", json=advisory, headers=ACME)).status_code == 202
        refused = await client.post("/v1/advisories", json=advisory, headers=ACME)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(refused.headers["retry-after"]) >= 90
        assert (await client.post("/v1/advisories", json=advisory, headers=RIVAL)).status_code == 202
        # Advisories and requests have buckets of their own: acme's requests still go.
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=ACME)).status_code == 200


async def test_a_tenant_at_its_inflight_cap_gets_429_until_one_ends(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    url, state = await start_scheduler(
        [await make_node(engine.url)], {"tenants": ["acme:max_inflight=1"]}, api_keys=KEYS
    )
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        await ready(client)
        first = asyncio.create_task(client.post("/v1/chat/completions", json=SLOW, headers=ACME))
        await async_wait_until(lambda: len(engine.requests) == 1, 10, "acme's first request to reach the engine")
        refused = await client.post("/v1/chat/completions", json=CHAT, headers=ACME)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "tenant_too_many_requests"
        assert "acme" in refused.json()["error"]["message"]
        # rival has no cap of its own (the default: none).
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=RIVAL)).status_code == 200
        engine.slow_done.set()
        assert (await first).status_code == 200
        await async_wait_until(lambda: state.quotas.inflight("acme") == 0, 10, "acme's request to be counted out")
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=ACME)).status_code == 200
        assert state.quotas.inflight("acme") == 0 and state.quotas.inflight("rival") == 0

        # A stream counts until its end: here, until its client hangs up mid-stream.
        stalled = {**CHAT, "stream": True, "messages": [{"role": "user", "content": "stall"}]}
        async with client.stream("POST", "/v1/chat/completions", json=stalled, headers=ACME) as stream:
            assert stream.status_code == 200
            await anext(stream.aiter_bytes())  # the first chunk is through
            assert state.quotas.inflight("acme") == 1
            refused = await client.post("/v1/chat/completions", json=CHAT, headers=ACME)
            assert refused.status_code == 429
        await async_wait_until(lambda: state.quotas.inflight("acme") == 0, 10, "the stream to be counted out")


async def test_held_back_requests_take_turns_by_tenant_and_a_tenant_has_a_share(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    node = await make_node(engine.url, running=4, waiting=2)  # every node has requests waiting
    url, state = await start_scheduler(
        [node], {"max_queued": 3}, api_keys=KEYS, queue_timeout_s=30, admin_token="ops-token"
    )
    queue = state.dispatcher.queue
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        await ready(client)

        def chat(tenant: str, headers: dict[str, str], n: int) -> asyncio.Task[httpx.Response]:
            body = {**CHAT, "messages": [{"role": "user", "content": f"{tenant}-{n}"}]}
            return asyncio.create_task(client.post("/v1/chat/completions", json=body, headers=headers))

        acme = []
        for n in range(3):  # acme floods first
            acme.append(chat("acme", ACME, n))
            await async_wait_until(lambda n=n: queue.waiting_of("acme") == n + 1, 10, "acme's request to wait")
        refused = await client.post("/v1/chat/completions", json=CHAT, headers=ACME)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "tenant_queue_full"
        rival = chat("rival", RIVAL, 0)  # still has its own share
        await async_wait_until(lambda: queue.waiting_of("rival") == 1, 10, "rival's request to wait")

        node.status.num_requests_waiting = 0  # room: the held requests go, one turn each
        replies = await asyncio.gather(*acme, rival)
        assert [r.status_code for r in replies] == [200] * 4
        order = [r["messages"][0]["content"] for r in engine.requests]
        assert order.index("rival-0") <= 1, order  # not behind all of acme's earlier requests
        assert [o for o in order if o.startswith("acme")] == ["acme-0", "acme-1", "acme-2"]
        metrics = (await client.get("/metrics", headers=OPS)).text
        assert 'symphony_quota_refused_total{reason="queued",tenant="acme"} 1.0' in metrics


async def test_an_admin_changes_a_tenants_quotas_while_it_runs(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    """Through the SDK: a rate set on acme refuses its next request but one; rival is untouched;
    clearing it serves acme again. Bad updates are 400/404 and change nothing; a tenant's key is
    not the admin's."""
    url, _ = await start_scheduler([await make_node(engine.url)], api_keys=KEYS, admin_token="ops-token")
    admin = AsyncAdminClient(url, token="ops-token")
    async with contextlib.AsyncExitStack() as cleanup, httpx.AsyncClient(base_url=url) as client:
        cleanup.push_async_callback(admin.close)
        await ready(client)
        assert (await admin.quotas())["tenants"] == {}
        # One token every 100 s, a bucket of one: acme's next request goes, the one after waits.
        applied = await admin.set_quotas("acme", {"requests_per_s": 0.01, "request_burst": 1, "weight": 2})
        assert applied["limits"]["requests_per_s"] == 0.01 and applied["limits"]["weight"] == 2
        assert applied["limits"]["max_inflight"] == 0  # the keys not given keep the defaults
        statuses = [(await client.post("/v1/chat/completions", json=CHAT, headers=ACME)).status_code for _ in range(2)]
        assert statuses == [200, 429]
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=RIVAL)).status_code == 200
        listed = await admin.quotas()
        assert set(listed["tenants"]) == {"acme"} and listed["default"]["requests_per_s"] == 0
        for tenant, limits, status in (
            ("acme", {"requests_per_s": -1}, 400),  # out of range
            ("acme", {"max_inflight": 1.5}, 400),  # not a whole number
            ("acme", {"weight": True}, 400),  # a bool is no number here
            ("acme", {"bursts": 3}, 400),  # no such key
            ("nobody", {"max_inflight": 1}, 404),  # no API key: it would never apply
        ):
            with pytest.raises(openai.APIStatusError) as refused:
                await admin.set_quotas(tenant, limits)
            assert refused.value.status_code == status, (tenant, limits)
        assert (await admin.quotas())["tenants"]["acme"]["requests_per_s"] == 0.01  # nothing changed
        by_tenant = await client.put("/admin/v1/quotas", json={"tenant": "acme", "limits": None}, headers=ACME)
        assert by_tenant.status_code == 403
        await admin.set_quotas("acme", None)  # back to the defaults: no rate
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=ACME)).status_code == 200
        assert (await admin.quotas())["tenants"] == {}


async def test_the_admin_cli_sets_lists_and_clears_a_tenants_quotas(
    make_node: MakeNode,
    engine: FakeEngine,
    start_scheduler: StartScheduler,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url, state = await start_scheduler([await make_node(engine.url)], api_keys=KEYS, admin_token="ops-token")
    monkeypatch.setenv("SYMPHONY_ADMIN_TOKEN", "ops-token")

    async def cli(*args: str) -> int:
        return await asyncio.to_thread(main, ["admin", "quotas", *args, "--url", url])

    assert await cli("set", "--tenant", "acme", "max_inflight=3", "weight=2") == 0
    assert state.quotas.limits("acme").max_inflight == 3 and state.quotas.limits("acme").weight == 2
    assert await cli("set", "--tenant", "acme", "max_inflite=3") == 2  # named before anything is sent
    assert "max_inflite" in capsys.readouterr().err
    assert await cli("set", "--tenant", "nobody", "max_inflight=1") == 2
    assert "404" in capsys.readouterr().err
    assert await cli("list") == 0
    assert '"max_inflight": 3' in capsys.readouterr().out
    assert await cli("clear", "--tenant", "acme") == 0
    assert state.quotas.limits("acme") == state.quotas.default
