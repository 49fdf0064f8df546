"""Top-tier prefetches ending in the engine's prefix cache: the prefetch queue's hook, and the
warmer's gate and request (the engine's answers injected here;
tests/e2e/test_prefetch_to_engine_cache.py runs the real thing against vLLM)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
import pytest

from node_manager.engine_metrics import EngineLoad
from node_manager.engine_warmup import EngineWarmer
from node_manager.kv.ipc_wire import WARMUP_PARAM, WARMUP_PRIORITY_PARAM
from node_manager.kv.metrics import KVMetrics
from node_manager.kv.pages import Priority, Tier
from node_manager.kv.prefetch import DONE, PrefetchJob, PrefetchQueue, WarmOutcome
from symphony.kv_transfer import AUTH_PARAM, params_key, params_refusal
from symphony.rpc import node_pb2
from tests.unit.kv_store_support import TIMEOUT, MakeStore, save_session

KEY = params_key(b"the node's cluster secret")


@dataclass
class _EngineState:
    """The two readings the warmer gates on, as the node's Engine keeps them."""

    url: str = "http://engine.invalid"
    headers: dict[str, str] = field(default_factory=lambda: {"Authorization": "Bearer engine-key"})
    state: int = node_pb2.ENGINE_STATE_READY
    load: EngineLoad | None = None


def _warmer(
    engine: _EngineState, handler: httpx.MockTransport | None = None, max_kv_usage: float = 0.8
) -> tuple[EngineWarmer, KVMetrics]:
    metrics = KVMetrics()
    return EngineWarmer(
        engine, "smol", metrics, max_kv_usage=max_kv_usage, timeout_s=TIMEOUT, transport=handler, params_key=KEY
    ), metrics


def _count(metrics: KVMetrics, outcome: str) -> float:
    return metrics.registry.get_sample_value("symphony_engine_warmups_total", {"outcome": outcome}) or 0.0


async def test_a_warm_up_sends_the_history_for_one_token_under_the_salt() -> None:
    sent: list[dict] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        assert request.url.path == "/v1/completions"
        assert request.headers["authorization"] == "Bearer engine-key"  # the engine's key (engine_auth)
        usage = {"prompt_tokens": 70, "prompt_tokens_details": {"cached_tokens": 64}}
        return httpx.Response(200, json={"usage": usage})

    warmer, metrics = _warmer(_EngineState(load=EngineLoad(1, 0, 0.3)), httpx.MockTransport(answer))
    outcome = await warmer.warm("acme", "chat", list(range(70)), "tenant-salt", Priority.HIGH)
    await warmer.aclose()
    assert outcome == WarmOutcome(64)
    # Signed as the scheduler signs its requests' params: the connector takes the warm-up onto the tiers.
    assert params_refusal(sent[0]["kv_transfer_params"], "smol", KEY, time.time()) is None
    del sent[0]["kv_transfer_params"][AUTH_PARAM]
    assert sent == [
        {
            "model": "smol",
            "prompt": [*range(70), 69],
            "max_tokens": 1,
            "temperature": 0,
            "kv_transfer_params": {
                "tenant": "acme",
                "session_id": "chat",
                WARMUP_PARAM: True,
                WARMUP_PRIORITY_PARAM: int(Priority.HIGH),
            },
            "cache_salt": "tenant-salt",
        }
    ]
    assert _count(metrics, "cached") == 1
    assert metrics.registry.get_sample_value("symphony_engine_warmup_cached_tokens_total") == 64


@pytest.mark.parametrize(
    ("engine", "max_kv_usage", "reason"),
    [
        (_EngineState(state=node_pb2.ENGINE_STATE_STARTING, load=EngineLoad(0, 0, 0.0)), 0.8, "not ready"),
        (_EngineState(load=None), 0.8, "not known"),
        (_EngineState(load=EngineLoad(2, 1, 0.1)), 0.8, "1 requests are waiting"),
        (_EngineState(load=EngineLoad(4, 0, 0.85)), 0.8, "85% used"),
        (_EngineState(load=EngineLoad(0, 0, 0.0)), 0.0, "off"),
    ],
)
async def test_a_busy_or_absent_engine_gets_no_warm_up(engine: _EngineState, max_kv_usage: float, reason: str) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise AssertionError("no request may reach a busy engine")

    warmer, metrics = _warmer(engine, httpx.MockTransport(refuse), max_kv_usage)
    outcome = await warmer.warm("acme", "chat", [1, 2, 3], "")
    await warmer.aclose()
    assert outcome.cached_tokens == 0 and reason in outcome.note
    assert _count(metrics, "skipped") == 1


@pytest.mark.parametrize(
    "answer",
    [
        lambda request: httpx.Response(400, json={"error": {"message": "prompt too long"}}),
        lambda request: httpx.Response(200, content=b"not json"),
        lambda request: (_ for _ in ()).throw(httpx.ConnectError("engine gone")),
    ],
)
async def test_a_failed_warm_up_is_reported_not_raised(answer: object) -> None:
    warmer, metrics = _warmer(_EngineState(load=EngineLoad(0, 0, 0.0)), httpx.MockTransport(answer))  # type: ignore[arg-type]
    outcome = await warmer.warm("acme", "chat", [1, 2, 3], "")
    await warmer.aclose()
    assert outcome.cached_tokens == 0 and "warm-up request failed" in outcome.note
    assert _count(metrics, "failed") == 1


async def test_only_a_top_tier_prefetch_ends_in_the_engine(make_store: MakeStore) -> None:
    store = make_store()
    save_session(store, "top", 3, seed=1)
    save_session(store, "mid", 3, seed=2)
    calls: list[tuple[str, str, list[int], str]] = []

    async def warm(tenant: str, session_id: str, token_ids: list[int], salt: str, priority: Priority) -> WarmOutcome:
        calls.append((tenant, session_id, token_ids, salt))
        return WarmOutcome(len(token_ids) - 1)

    queue = PrefetchQueue(store, store.metrics, None, max_pending=4, concurrency=1, warm=warm)
    try:
        top = queue.submit(("acme", "top"), Tier.HBM, 5.0, Priority.NORMAL, engine_salt="next-turn")
        mid = queue.submit(("acme", "mid"), Tier.DRAM, 5.0, Priority.NORMAL)
        for job in (top, mid):
            await _finished(job)
    finally:
        await queue.close()
    assert calls == [("acme", "top", store.sessions.get("acme", "top").token_ids.tolist(), "next-turn")]
    assert (top.state, top.engine_cached_tokens, top.engine_note) == (DONE, len(calls[0][2]) - 1, "")
    assert (mid.state, mid.engine_cached_tokens) == (DONE, 0)


async def test_without_an_engine_the_top_tier_is_the_stores_own(make_store: MakeStore) -> None:
    store = make_store()
    save_session(store, "top", 2, seed=3)
    queue = PrefetchQueue(store, store.metrics, None, max_pending=4, concurrency=1)
    try:
        job = queue.submit(("acme", "top"), Tier.HBM, 5.0, Priority.NORMAL)
        await _finished(job)
    finally:
        await queue.close()
    assert job.state == DONE and job.engine_cached_tokens == 0 and "serves no model" in job.engine_note
    assert store.residency("acme", "top")[Tier.HBM] == [[True, True]] * store.geometry.num_layers


async def _finished(job: PrefetchJob) -> None:
    await asyncio.wait_for(job.finished.wait(), TIMEOUT)
