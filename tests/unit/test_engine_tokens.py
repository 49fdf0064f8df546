"""Token ids from an engine's /tokenize while the scheduler's tokenizer loads: which bodies are sent
and how, and that every failure (refusal, malformed answer, no answer in time) is None, never an
exception. The engine is a small aiohttp server standing in for vLLM's /tokenize, to inject faults."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from scheduler.engine_tokens import engine_token_ids, tokenize_body

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_a_chat_is_sent_with_the_fields_that_shape_its_prompt_only() -> None:
    body = {"model": "x", "messages": MESSAGES, "temperature": 0.5, "add_generation_prompt": False, "tools": None}
    assert tokenize_body("m", body) == {"model": "m", "messages": MESSAGES, "add_generation_prompt": False}
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}, "continue_final_message": True}
    assert tokenize_body("m", {"messages": MESSAGES, **kwargs}) == {"model": "m", "messages": MESSAGES, **kwargs}


@pytest.mark.parametrize(
    "extra",
    [
        {"documents": [{"title": "a", "text": "b"}]},
        {"reasoning_effort": "low"},
        {"truncate_prompt_tokens": 10},
        {"chat_template": "{{ messages }}"},
    ],
)
def test_a_chat_whose_prompt_tokenize_would_not_reproduce_is_not_sent(extra: dict[str, Any]) -> None:
    assert tokenize_body("m", {"messages": MESSAGES, **extra}) is None


def test_completions_send_one_text_prompt_and_give_token_prompts_as_they_are() -> None:
    assert tokenize_body("m", {"prompt": "abc"}) == {"model": "m", "prompt": "abc", "add_special_tokens": True}
    assert tokenize_body("m", {"prompt": ["abc"], "add_special_tokens": False}) == {
        "model": "m",
        "prompt": "abc",
        "add_special_tokens": False,
    }
    assert tokenize_body("m", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    for body in ({"prompt": ["a", "b"]}, {"prompt": ""}, {"prompt": "a", "suffix": "b"}, {"prompt": [1, True]}):
        assert tokenize_body("m", body) is None, body


Handler = Callable[[web.Request], Any]


@pytest.fixture
async def engine() -> AsyncIterator[Callable[[Handler], Any]]:
    runners: list[web.AppRunner] = []

    async def start(handler: Handler) -> str:
        app = web.Application()
        app.router.add_post("/tokenize", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_the_engines_ids_are_returned_read_only(engine: Callable[[Handler], Any]) -> None:
    seen: list[dict[str, Any]] = []

    async def tokenize(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({"count": 3, "max_model_len": 8192, "tokens": [1, 2, 70000]})

    url = await engine(tokenize)
    ids = await engine_token_ids(url, "m", {"messages": MESSAGES, "max_tokens": 4}, 2.0)
    assert ids is not None and ids.dtype == np.dtype("<u4") and ids.tolist() == [1, 2, 70000]
    assert not ids.flags.writeable
    assert seen == [{"model": "m", "messages": MESSAGES}]


@pytest.mark.parametrize(
    "answer",
    [
        web.json_response({"error": {"message": "bad"}}, status=400),
        web.Response(text="not json", content_type="application/json"),
        web.json_response({"tokens": []}),
        web.json_response({"tokens": [1, -2]}),
        web.json_response({"tokens": "1 2"}),
        web.json_response([1, 2]),
    ],
)
async def test_a_refusal_or_a_malformed_answer_is_none(engine: Callable[[Handler], Any], answer: web.Response) -> None:
    async def tokenize(request: web.Request) -> web.Response:
        return answer

    url = await engine(tokenize)
    assert await engine_token_ids(url, "m", {"prompt": "abc"}, 2.0) is None


async def test_no_answer_within_the_deadline_and_no_engine_are_none(engine: Callable[[Handler], Any]) -> None:
    released = asyncio.Event()

    async def tokenize(request: web.Request) -> web.Response:
        await released.wait()
        return web.json_response({"tokens": [1]})

    url = await engine(tokenize)
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await engine_token_ids(url, "m", {"prompt": "abc"}, 0.2) is None
    assert loop.time() - started < 5.0
    released.set()
    assert await engine_token_ids("http://127.0.0.1:9", "m", {"prompt": json.dumps("abc")}, 1.0) is None
