"""The scheduler's token ids against a real vLLM engine's (issue 36): for chat and completion
requests, the ids the scheduler computes (`TokenService.request_token_ids`, a session's turns
incrementally) equal the engine's own /tokenize answer and the prompt_tokens of a real completion;
the scheduler's /tokenize, /detokenize, /health, /version and /v1/models answer as the engine's do.
Engine time: a few /tokenize calls (no forward pass) and three one-token completions."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from scheduler.metrics import SchedulerMetrics
from scheduler.tokens import TokenService
from symphony.config import default_home
from symphony.models import fetch_default_model
from tests.e2e.conftest import LiveCluster
from tests.helpers import wait_until

pytestmark = pytest.mark.e2e
TOKENIZE_CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "add_special_tokens", "tools")
HISTORY = [
    {"role": "system", "content": "You are terse. \u00c7a va? \u6771\u4eac \U0001f600"},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": [{"type": "text", "text": "And its tower?"}, {"type": "text", "text": "Height?"}]},
    {"role": "assistant", "content": "The Eiffel Tower, 330 m."},
    {"role": "developer", "content": "Answer in one word."},
    {"role": "user", "content": "  Spaces,\ttabs\n\nand <|im_end|> in text  "},
]
CHATS: list[dict[str, Any]] = [
    *({"messages": HISTORY[:n]} for n in (2, 4, 5, 7)),  # one session's growing turns
    {"messages": HISTORY[1:3], "add_generation_prompt": False, "continue_final_message": True},
    {"messages": HISTORY[1:2], "add_special_tokens": True},
    {"messages": HISTORY[1:2], "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"},
]
COMPLETIONS: list[dict[str, Any]] = [
    {"prompt": "The capital of France is"},
    {"prompt": "<|im_start|>user\nHi<|im_end|>\n", "add_special_tokens": False},
    {"prompt": [1, 4093, 198, 6004, 2]},
]


@pytest.fixture(scope="module")
def service() -> Iterator[TokenService]:
    """The scheduler's tokenizer, in this process, on the model directory the cluster serves."""
    path = fetch_default_model(default_home(), progress=lambda _: None)
    svc = TokenService({"m": path}, SchedulerMetrics(), cache_sessions=10, cache_tokens=10**6, timeout_s=30)
    svc.start()
    asyncio.run(svc.loaded())
    yield svc
    svc.stop()


def _ids(service: TokenService, cluster: LiveCluster, session: str, body: dict[str, Any]) -> list[int]:
    ids = asyncio.run(service.request_token_ids("tenant", session, "m", {"model": cluster.model, **body}))
    assert ids is not None, body
    return ids.tolist()


def _tokenize_form(cluster: LiveCluster, body: dict[str, Any]) -> dict[str, Any]:
    if "messages" in body:
        return {"model": cluster.model, **{k: v for k, v in body.items() if k in TOKENIZE_CHAT_FIELDS}}
    return {"model": cluster.model, **body}


def _scheduler_tokenizer_checked(cluster: LiveCluster) -> bool:
    """The scheduler loaded its tokenizer and found it tokenizes as the engines do
    (scheduler.tokenizer_check): its /tokenize is then answered by itself, not relayed."""
    log = cluster.home / "logs" / "scheduler.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    assert "tokenizer dropped" not in text and "no tokenizer" not in text, text[-3000:]
    return "tokenizer matches the engines'" in text


def test_the_schedulers_ids_are_the_engines(live_cluster: LiveCluster, service: TokenService) -> None:
    engine = f"http://127.0.0.1:{live_cluster.engine_ports[0]}"
    wait_until(lambda: _scheduler_tokenizer_checked(live_cluster), 60, "the scheduler's tokenizer check")
    with httpx.Client(timeout=60) as client:
        for i, body in enumerate(CHATS + COMPLETIONS):
            session = "e2e-tokens-conversation" if i < 4 else f"e2e-tokens-{i}"
            mine = _ids(service, live_cluster, session, body)
            if isinstance(body.get("prompt"), list):
                assert mine == body["prompt"]
                continue
            form = _tokenize_form(live_cluster, {**body, "return_token_strs": True})
            theirs = client.post(engine + "/tokenize", json=form, headers=live_cluster.engine_headers)
            assert theirs.status_code == 200, theirs.text
            assert mine == theirs.json()["tokens"], body
            ours = client.post(live_cluster.url + "/tokenize", json=form)
            assert ours.status_code == 200 and ours.json() == theirs.json(), body
    incremental = service._metrics.registry.get_sample_value("symphony_tokenize_seconds_count", {"mode": "incremental"})
    assert incremental == 3  # the conversation's turns after the first


@pytest.mark.parametrize("body", [CHATS[3], COMPLETIONS[0], COMPLETIONS[2]], ids=["chat", "text", "ids"])
def test_the_schedulers_ids_count_as_a_real_completions_prompt(
    live_cluster: LiveCluster, service: TokenService, body: dict[str, Any]
) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    request = {"model": live_cluster.model, **body, "max_tokens": 1, "temperature": 0.0}
    answer = httpx.post(live_cluster.url + path, json=request, headers={"X-Session-ID": "e2e-usage"}, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == len(_ids(service, live_cluster, "e2e-usage", body))


def test_detokenize_health_version_and_models_answer_as_the_engines(live_cluster: LiveCluster) -> None:
    engine = f"http://127.0.0.1:{live_cluster.engine_ports[0]}"
    with httpx.Client(timeout=30) as client:
        for tokens in ([1, 4093, 198, 6004, 2], [28120, 905, 17, 49151], [28120, 60000], []):
            body = {"model": live_cluster.model, "tokens": tokens}
            theirs = client.post(engine + "/detokenize", json=body, headers=live_cluster.engine_headers)
            ours = client.post(live_cluster.url + "/detokenize", json=body)
            assert (ours.status_code, ours.json()) == (theirs.status_code, theirs.json()), tokens
        for path in ("/health", "/version"):
            theirs = client.get(engine + path, headers=live_cluster.engine_headers)
            ours = client.get(live_cluster.url + path)
            assert ours.status_code == theirs.status_code == 200
            if path == "/health":
                assert ours.content == theirs.content == b""
            else:
                assert set(ours.json()) == set(theirs.json()) == {"version"}
        (theirs_card,) = client.get(engine + "/v1/models", headers=live_cluster.engine_headers).json()["data"]
        (ours_card,) = client.get(live_cluster.url + "/v1/models").json()["data"]
        assert set(ours_card) == set(theirs_card)
        for key in ("id", "object", "max_model_len", "parent"):
            assert ours_card[key] == theirs_card[key], key
        assert set(ours_card["permission"][0]) == set(theirs_card["permission"][0])
