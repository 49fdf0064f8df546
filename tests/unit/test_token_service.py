"""scheduler.tokens.TokenService: requests' token ids, per session, and every way of having none
(which never fails a request: None, counted by reason)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from scheduler import tokens as tokens_module
from scheduler.metrics import SchedulerMetrics
from scheduler.prompts import NoTokenIds
from scheduler.tokenizer_load import ModelTokenizer, load_model_tokenizer, tokenizer_dirs
from scheduler.tokens import TokenService
from symphony.config import ConfigError, load_config
from tests.helpers import async_wait_until
from tests.tokenizer_support import make_tokenizer

IMAGE = {"type": "image_url", "image_url": {"url": "http://example.com/x.png"}}
CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi caf\u00e9"}]}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def reference(tokenizer_dir: Path) -> ModelTokenizer:
    return load_model_tokenizer("m", tokenizer_dir)


@pytest.fixture
async def service(tokenizer_dir: Path) -> AsyncIterator[TokenService]:
    svc = TokenService({"m": tokenizer_dir}, SchedulerMetrics(), cache_sessions=10, cache_tokens=10_000, timeout_s=30)
    svc.start()
    await svc.loaded()
    yield svc
    svc.stop()


def missing(svc: TokenService, reason: str) -> float:
    return svc._metrics.registry.get_sample_value("symphony_token_ids_missing_total", {"reason": reason}) or 0.0


def modes(svc: TokenService, mode: str) -> float:
    return svc._metrics.registry.get_sample_value("symphony_tokenize_seconds_count", {"mode": mode}) or 0.0


async def test_a_sessions_turns_get_the_ids_of_their_whole_prompts(
    service: TokenService, reference: ModelTokenizer
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    for turn in range(3):
        ids = await service.request_token_ids("t", "s", "m", {"messages": messages})
        text = reference.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ids is not None and ids.tolist() == reference.encode(text, False)
        messages = [*messages, {"role": "assistant", "content": f"answer {turn}"}, {"role": "user", "content": "more"}]
    assert (modes(service, "full"), modes(service, "incremental")) == (1, 2)
    assert service.cached_sessions == 1 and service.cached_tokens == len(ids)
    # Another tenant's session of the same name starts from nothing; so does a request without a session.
    await service.request_token_ids("other", "s", "m", {"messages": messages})
    await service.request_token_ids("t", None, "m", {"messages": messages})
    assert modes(service, "full") == 3 and service.cached_sessions == 2


async def test_completions_text_ids_and_truncation(service: TokenService, reference: ModelTokenizer) -> None:
    ids = await service.request_token_ids("t", "c", "m", {"prompt": "hello world"})
    assert ids is not None and ids.tolist() == reference.encode("hello world", True)
    ids = await service.request_token_ids("t", "c", "m", {"prompt": [3, 4, 5], "truncate_prompt_tokens": 2})
    assert ids is not None and ids.tolist() == [4, 5]  # the tokenizer's side, as vLLM loads it: left
    body = {"prompt": [3, 4, 5], "truncate_prompt_tokens": 2, "truncation_side": "right"}
    assert (await service.request_token_ids("t", "c", "m", body)).tolist() == [3, 4]  # type: ignore[union-attr]
    assert modes(service, "ids") == 2


@pytest.mark.parametrize(
    ("model", "body", "reason"),
    [
        ("unknown", CHAT, "no_tokenizer"),
        ("m", {**CHAT, "add_generation_prompt": "sometimes"}, "invalid_input"),
        ("m", {"prompt": [0, 10**9]}, "invalid_input"),
        ("m", {"messages": [{"role": "user", "content": [IMAGE]}]}, "unsupported"),
    ],
)
async def test_requests_without_ids_get_none_and_are_counted(
    service: TokenService, model: str, body: dict[str, Any], reason: str
) -> None:
    assert await service.request_token_ids("t", "s", model, body) is None
    assert missing(service, reason) == 1


async def test_an_unexpected_error_is_counted_not_raised(
    service: TokenService, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: Any) -> Any:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    monkeypatch.setattr(tokens_module, "chat_prompt", broken)
    assert await service.request_token_ids("t", "s", "m", CHAT) is None
    assert missing(service, "error") == 1
    with pytest.raises(NoTokenIds) as caught:
        await service.tokenize("m", CHAT)
    assert caught.value.reason == "error"


async def test_requests_while_loading_get_none(tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def slow_load(name: str, path: Path) -> ModelTokenizer:
        release.wait(30)
        return load_model_tokenizer(name, path)

    monkeypatch.setattr(tokens_module, "load_model_tokenizer", slow_load)
    svc = TokenService({"m": tokenizer_dir}, SchedulerMetrics(), cache_sessions=1, cache_tokens=100, timeout_s=30)
    svc.start()
    try:
        assert svc.status("m") == "loading" and svc.status("x") == "none"
        assert await svc.request_token_ids("t", "s", "m", CHAT) is None
        assert missing(svc, "loading") == 1
        release.set()
        await svc.loaded()
        assert svc.status("m") == "ready" and await svc.request_token_ids("t", "s", "m", CHAT) is not None
    finally:
        release.set()
        svc.stop()


async def test_a_directory_without_a_tokenizer_leaves_the_model_without_ids(tmp_path: Path) -> None:
    svc = TokenService(
        {"m": tmp_path / "missing", "n": tmp_path}, SchedulerMetrics(), cache_sessions=1, cache_tokens=1, timeout_s=1
    )
    svc.start()
    await svc.loaded()
    try:
        assert svc.status("m") == svc.status("n") == "none"
        assert await svc.request_token_ids("t", "s", "n", CHAT) is None and missing(svc, "no_tokenizer") == 1
    finally:
        svc.stop()


async def test_slow_tokenizing_times_out_and_a_full_queue_is_busy(
    service: TokenService, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    started = threading.Event()
    tokenizer = service._models["m"]
    real_encode = tokenizer.encode

    def blocked(text: str, special: bool) -> list[int]:
        started.set()
        release.wait(30)
        return real_encode(text, special)

    monkeypatch.setattr(tokenizer, "encode", blocked)
    monkeypatch.setattr(tokens_module, "MAX_WAITING", 2)
    service._timeout_s = 0.05
    try:
        assert await service.request_token_ids("t", "a", "m", CHAT) is None  # runs, blocked: times out
        assert missing(service, "timeout") == 1 and started.is_set()
        service._timeout_s = 30
        waiting = asyncio.ensure_future(service.request_token_ids("t", "b", "m", CHAT))  # queued behind it
        await async_wait_until(lambda: service._asked - service._finished - service._dropped == 2, 10, "2 waiting")
        assert await service.request_token_ids("t", "c", "m", CHAT) is None
        assert missing(service, "busy") == 1
        release.set()
        assert (await waiting) is not None
    finally:
        release.set()


async def test_tokenize_and_detokenize(service: TokenService, reference: ModelTokenizer) -> None:
    ids, strings = await service.tokenize("m", {"prompt": "hello world", "return_token_strs": True})
    assert ids == reference.encode("hello world", True)
    assert strings == reference.tokenizer.convert_ids_to_tokens(ids)
    ids, strings = await service.tokenize("m", {**CHAT, "add_generation_prompt": False})
    text = reference.tokenizer.apply_chat_template(CHAT["messages"], tokenize=False)
    assert ids == reference.encode(text, False) and strings is None
    assert await service.detokenize("m", ids) == text
    with pytest.raises(NoTokenIds) as caught:
        await service.tokenize("m", {**CHAT, "chat_template": "x"})
    assert caught.value.reason == "invalid_input"
    with pytest.raises(NoTokenIds) as caught:
        await service.detokenize("other", [1])
    assert caught.value.reason == "no_tokenizer"


def test_which_tokenizer_each_served_model_gets(tmp_path: Path) -> None:
    def dirs(**scheduler: Any) -> dict[str, Path]:
        engine = {"model": str(tmp_path / "my-model")}
        return tokenizer_dirs(load_config(env={}, overrides={"scheduler": scheduler, "engine": engine}))

    assert dirs() == {"my-model": tmp_path / "my-model"}  # auto, on the local cluster
    assert dirs(node_addresses=["h:1"]) == {}  # auto elsewhere: the engines' directory is not known here
    assert dirs(tokenizer="") == {}
    assert dirs(tokenizer=str(tmp_path / "tok")) == {"my-model": tmp_path / "tok"}
    assert dirs(tokenizer="", tokenizers=[f"other={tmp_path}/o"]) == {"other": tmp_path / "o"}
    served = load_config(env={}, overrides={"engine": {"served_model_name": "chat"}})
    assert list(tokenizer_dirs(served)) == ["chat"]
    for bad in (["nopath"], ["=x"], ["a=x", "a=y"]):
        with pytest.raises(ConfigError, match=r"scheduler\.tokenizers"):
            load_config(env={}, overrides={"scheduler": {"tokenizers": bad}})
