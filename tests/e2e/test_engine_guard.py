"""A node's vLLM engine serves its cluster only (`node_manager.engine_auth`): a direct call without
the engine key is refused on every path, vLLM's unguarded ones included, while the scheduler, which
holds the key, serves as before, token for token."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.conftest import LiveCluster

pytestmark = pytest.mark.e2e
QUESTION = [{"role": "user", "content": "Name three rivers of France."}]


def test_a_direct_engine_call_without_the_key_is_refused_everywhere(live_cluster: LiveCluster) -> None:
    engine = f"http://127.0.0.1:{live_cluster.engine_ports[0]}"
    chat = {"model": live_cluster.model, "messages": QUESTION, "max_tokens": 4}
    calls = [
        ("/v1/chat/completions", chat),
        ("/invocations", chat),  # SageMaker's entry to chat: vLLM's own --api-key leaves it open
        ("/tokenize", {"model": live_cluster.model, "prompt": "hello"}),
        ("/reset_prefix_cache", None),  # a dev endpoint (VLLM_SERVER_DEV_MODE in the tests' clusters)
    ]
    with httpx.Client(timeout=60) as http:
        for path, body in calls:
            for headers in ({}, {"Authorization": "Bearer unused"}, live_cluster.internal_headers):
                refused = http.post(engine + path, json=body, headers=headers)
                assert refused.status_code == 401, (path, headers, refused.text)
                assert refused.json()["error"]["code"] == "engine_key_required"
        assert http.get(engine + "/metrics").status_code == 401
        assert http.get(engine + "/health").status_code == 200  # liveness stays open
        keyed = http.post(engine + "/tokenize", json=calls[2][1], headers=live_cluster.engine_headers)
        assert keyed.status_code == 200 and keyed.json()["tokens"], keyed.text


def test_the_scheduler_serves_what_the_keyed_engine_computes(live_cluster: LiveCluster) -> None:
    """Temperature 0 through the scheduler and straight to the engine with its key: the same tokens."""
    common = {"model": live_cluster.model, "messages": QUESTION, "max_tokens": 24, "temperature": 0.0}
    through = openai.OpenAI(base_url=live_cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    answer = through.chat.completions.create(**common, extra_headers={"X-Session-ID": "e2e-guard"})  # type: ignore[call-overload]
    reference = httpx.post(
        f"http://127.0.0.1:{live_cluster.engine_ports[0]}/v1/chat/completions",
        json={**common, "cache_salt": live_cluster.cache_salt("default")},
        headers=live_cluster.engine_headers,
        timeout=120,
    )
    assert reference.status_code == 200, reference.text
    assert answer.choices[0].message.content == reference.json()["choices"][0]["message"]["content"]
