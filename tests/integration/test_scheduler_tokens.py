"""vLLM's other endpoints on a real scheduler (uvicorn) in front of fake nodes: /tokenize and
/detokenize answered with the scheduler's own tokenizer (a small one trained here), or relayed to an
engine where it has none; the check that the tokenizer is the engines'; /health, /version and
/v1/models; bad input as OpenAI-style 4xx."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from scheduler.prompt_render import chat_prompt
from scheduler.state import SchedulerState
from scheduler.tokenizer_check import PROBES
from scheduler.tokenizer_load import ModelTokenizer, load_model_tokenizer
from tests.helpers import async_wait_until
from tests.integration.conftest import MakeNode, StartScheduler, ready
from tests.integration.fakes import FakeEngine
from tests.tokenizer_support import make_tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "caf\u00e9?"}]
IMAGE = {"type": "image_url", "image_url": {"url": "http://example.com/x.png"}}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def reference(tokenizer_dir: Path) -> ModelTokenizer:
    return load_model_tokenizer("m", tokenizer_dir)


async def with_tokenizer(
    make_node: MakeNode,
    engine: FakeEngine,
    start_scheduler: StartScheduler,
    tokenizer_dir: Path,
    reference: ModelTokenizer | None,
    **scheduler: Any,
) -> tuple[str, SchedulerState]:
    """A scheduler with the tokenizer of `tokenizer_dir` for model "m", once its check against the
    engine is over; the engine tokenizes with `reference` (None: made-up ids, which fail the check)."""
    if reference is not None:
        engine.tokenize_with = lambda body: tokenize_as(reference, body)
    url, state = await start_scheduler([await make_node(engine.url)], tokenizers=[f"m={tokenizer_dir}"], **scheduler)
    await state.tokens.loaded()
    check = state.tokenizer_check
    assert check is not None
    await async_wait_until(check.done, 20, "the tokenizer check")
    return url, state


def tokenize_as(reference: ModelTokenizer, body: dict[str, Any]) -> list[int]:
    if "messages" in body:
        prompt = chat_prompt(reference.tokenizer, body, tokenize_endpoint=True)
        return reference.encode(prompt.text, prompt.add_special_tokens)
    return reference.encode(body["prompt"], body.get("add_special_tokens", True))


def relayed(engine: FakeEngine) -> list[dict[str, Any]]:
    """The /tokenize and /detokenize bodies the engine got, but the tokenizer check's probes."""
    probes = [{"model": "m", **probe} for probe in PROBES]
    return [body for body in engine.tokenize_requests if body not in probes]


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param


async def test_tokenize_and_detokenize_with_the_schedulers_tokenizer(
    make_node: MakeNode,
    engine: FakeEngine,
    start_scheduler: StartScheduler,
    tokenizer_dir: Path,
    reference: ModelTokenizer,
) -> None:
    url, state = await with_tokenizer(make_node, engine, start_scheduler, tokenizer_dir, reference)
    assert state.tokens.status("m") == "ready"
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        ids = reference.encode("hello world", True)
        answer = await client.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True})
        assert answer.status_code == 200
        assert answer.json() == {
            "count": len(ids),
            "max_model_len": 4096,
            "tokens": ids,
            "token_strs": reference.tokenizer.convert_ids_to_tokens(ids),
        }
        text = reference.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        answer = await client.post("/tokenize", json={"model": "m", "messages": MESSAGES})
        ids = reference.encode(text, False)
        assert answer.json() == {"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": None}
        answer = await client.post("/detokenize", json={"model": "m", "tokens": ids})
        assert answer.status_code == 200 and answer.json() == {"prompt": text}
        assert (await client.post("/tokenize", json={"prompt": ""})).json()["tokens"] == []
    assert relayed(engine) == []  # all answered by the scheduler


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", b"{not json", 400, None),
        ("/tokenize", b"[1, 2]", 400, None),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": None}, 400, "add_special_tokens"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
        ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ 'x' }}"}, 400, None),
        ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True}, 400, None),
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": [2**40]}, 400, "tokens"),
        ("/detokenize", {"tokens": "12"}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
    ],
)
async def test_bad_input_gets_an_openai_style_4xx(
    make_node: MakeNode,
    engine: FakeEngine,
    start_scheduler: StartScheduler,
    tokenizer_dir: Path,
    reference: ModelTokenizer,
    path: str,
    body: Any,
    status: int,
    param: str | None,
) -> None:
    url, _ = await with_tokenizer(make_node, engine, start_scheduler, tokenizer_dir, reference)
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        content = body if isinstance(body, bytes) else None
        answer = await client.post(path, content=content, json=None if content is not None else body)
        assert_openai_error(answer, status, param)
    assert relayed(engine) == []


async def test_without_a_tokenizer_an_engine_answers(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    url, state = await start_scheduler([await make_node(engine.url)])  # remote nodes: no tokenizer
    assert state.tokens.status("m") == "none"
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        answer = await client.post("/tokenize", json={"prompt": "hello"})
        assert answer.json() == {"count": 3, "max_model_len": 4096, "tokens": [7, 8, 9], "token_strs": None}
        assert (await client.post("/detokenize", json={"tokens": [7]})).json() == {"prompt": "engine text"}
    assert relayed(engine) == [{"prompt": "hello", "model": "m"}, {"tokens": [7], "model": "m"}]


async def test_media_the_scheduler_cannot_render_goes_to_an_engine(
    make_node: MakeNode,
    engine: FakeEngine,
    start_scheduler: StartScheduler,
    tokenizer_dir: Path,
    reference: ModelTokenizer,
) -> None:
    url, state = await with_tokenizer(make_node, engine, start_scheduler, tokenizer_dir, reference)
    engine.tokenize_with = None  # made-up ids from now on: they show where the answer came from
    body = {"messages": [{"role": "user", "content": [IMAGE]}]}
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        assert (await client.post("/tokenize", json=body)).json()["tokens"] == [7, 8, 9]
    assert relayed(engine) == [{**body, "model": "m"}] and state.tokens.status("m") == "ready"


async def test_a_tokenizer_that_is_not_the_engines_is_dropped(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler, tokenizer_dir: Path
) -> None:
    url, state = await with_tokenizer(make_node, engine, start_scheduler, tokenizer_dir, None)
    assert state.tokens.status("m") == "none"
    assert await state.tokens.request_token_ids("t", "s", "m", {"prompt": "hello"}) is None
    async with httpx.AsyncClient(base_url=url) as client:
        assert (await client.post("/tokenize", json={"prompt": "hello"})).json()["tokens"] == [7, 8, 9]


async def test_no_ready_engine_and_no_tokenizer_is_a_503(start_scheduler: StartScheduler) -> None:
    url, _ = await start_scheduler([])
    async with httpx.AsyncClient(base_url=url) as client:
        assert_openai_error(await client.post("/tokenize", json={"prompt": "x"}), 503)


async def test_tokenize_takes_a_tenants_key_as_inference_does(
    make_node: MakeNode,
    engine: FakeEngine,
    start_scheduler: StartScheduler,
    tokenizer_dir: Path,
    reference: ModelTokenizer,
) -> None:
    url, _ = await with_tokenizer(make_node, engine, start_scheduler, tokenizer_dir, reference, api_keys=["acme:k1"])
    async with httpx.AsyncClient(base_url=url) as client:
        await ready(client)
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            assert_openai_error(await client.post(path, json=body), 401)
            assert_openai_error(await client.post(path, json=body, headers={"authorization": "Bearer no"}), 401)
            assert (await client.post(path, json=body, headers={"authorization": "Bearer k1"})).status_code == 200
        assert (await client.get("/health")).status_code == 200  # as vLLM: no key for health or version
        assert (await client.get("/version")).status_code == 200


async def test_health_version_and_models_answer_as_vllm(
    make_node: MakeNode, engine: FakeEngine, start_scheduler: StartScheduler
) -> None:
    url, _ = await start_scheduler([await make_node(engine.url)])
    async with httpx.AsyncClient(base_url=url) as client:
        health = await client.get("/health")
        assert health.status_code == 200 and health.content == b""
        version = (await client.get("/version")).json()
        assert list(version) == ["version"] and isinstance(version["version"], str)
        await ready(client)
        models = (await client.get("/v1/models")).json()
        assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["m"]
        (card,) = models["data"]
        assert list(card) == ["id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"]
        assert (card["object"], card["max_model_len"], card["parent"]) == ("model", 4096, None)
        assert card["permission"][0]["object"] == "model_permission"
