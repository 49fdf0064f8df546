"""The scheduler's token ids equal vLLM 0.32's own, on random requests: vLLM's OpenAI-server
preprocessing (its OnlineRenderer, what the chat and completion endpoints and /tokenize call before
the engine) runs in this process, without an engine, as the oracle. Two models: SmolLM2 (where
`symphony model fetch` prepared it), and a small SentencePiece-style tokenizer trained here whose
template reads message content as parts (vLLM's "openai" content format).

Sessions' turns go through the scheduler's incremental path; a request vLLM refuses must get no ids
from the scheduler; one the scheduler declines ("unsupported") must be of a kind it says it does not
reproduce. Needs vLLM installed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.errors import ApiError
from scheduler.metrics import SchedulerMetrics
from scheduler.tokens import TokenService
from scheduler.validation import validate_inference
from tests.tokenizer_support import PARTS_TEMPLATE, TEXT, conversations, make_tokenizer, smollm2_dir

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # vLLM's own, by the thousand
MODEL = "model"
# A model directory vLLM's configuration accepts around a tokenizer: no weights are read.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "num_key_value_heads": 2,
    "vocab_size": 600,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
}
PROPERTY = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class Oracle:
    """vLLM's preprocessing of chat, completion and /tokenize requests: ids, or the error it answers."""

    def __init__(self, path: Path) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.renderers import renderer_from_config
        from vllm.renderers.online_renderer import OnlineRenderer
        from vllm.usage.usage_lib import UsageContext

        args = AsyncEngineArgs(model=str(path), max_model_len=8192, served_model_name=[MODEL], enforce_eager=True)
        config = args.create_engine_config(UsageContext.OPENAI_API_SERVER)
        self.renderer = OnlineRenderer(
            model_config=config.model_config,
            renderer=renderer_from_config(config),
            request_logger=None,
            chat_template=None,
            chat_template_content_format="auto",
            # As an engine started with --enable-auto-tool-choice: requests with tools (tool_choice
            # "auto", their default) are rendered, not refused. Which of them an engine refuses
            # depends on its flags, which the scheduler does not read; it renders them all.
            enable_auto_tools=True,
        )

    async def ids(self, body: dict[str, Any]) -> list[int] | str:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        try:
            if "messages" in body:
                result: Any = await self.renderer.render_chat(ChatCompletionRequest.model_validate(body))
                inputs = result[1] if isinstance(result, tuple) else result
            else:
                inputs = await self.renderer.render_completion(CompletionRequest.model_validate(body))
        except Exception as exc:
            return f"refused: {exc}"
        if not isinstance(inputs, list):
            return f"refused: {inputs}"
        if len(inputs) != 1:
            return f"several prompts: {len(inputs)}"
        ids = list(inputs[0]["prompt_token_ids"])
        # What the engine's input processor checks next (vllm/v1/engine/input_processor.py).
        if not ids:
            return "refused: The decoder prompt cannot be empty"
        try:
            self.renderer.renderer.validate_token_ids(ids)
        except Exception as exc:
            return f"refused: {exc}"
        return ids

    async def tokenize(self, body: dict[str, Any]) -> list[int] | str:
        from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest, TokenizeCompletionRequest

        try:
            if "messages" in body:
                request: Any = TokenizeChatRequest.model_validate(body)
                error = self.renderer.validate_chat_template(request.chat_template, request.chat_template_kwargs, False)
                if error is not None:
                    return f"refused: {error}"
                tools = None if request.tools is None else [tool.model_dump() for tool in request.tools]
                _, inputs = await self.renderer.preprocess_chat(
                    request, request.messages, None, "auto", None, tool_dicts=tools, skip_mm_cache=True
                )
            else:
                request = TokenizeCompletionRequest.model_validate(body)
                inputs = await self.renderer.preprocess_completion(request, request.prompt, None, skip_mm_cache=True)
        except Exception as exc:
            return f"refused: {exc}"
        return list(inputs[0]["prompt_token_ids"])


@pytest.fixture(scope="module", params=["smollm2", "parts"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("vllm")
    if request.param == "smollm2":
        path = smollm2_dir()
        if path is None:
            pytest.skip("SmolLM2 is not prepared (symphony model fetch)")
        return path
    path = make_tokenizer(tmp_path_factory.mktemp("parts"), kind="metaspace", template=PARTS_TEMPLATE)
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return path


@pytest.fixture(scope="module")
def oracle(model_dir: Path) -> Oracle:
    return Oracle(model_dir)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One loop for the module: hypothesis runs each example synchronously on it."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def service(model_dir: Path, loop: asyncio.AbstractEventLoop) -> Iterator[TokenService]:
    svc = TokenService({MODEL: model_dir}, SchedulerMetrics(), cache_sessions=100, cache_tokens=10**6, timeout_s=30)
    svc.start()
    loop.run_until_complete(svc.loaded())
    assert svc.status(MODEL) == "ready"
    yield svc
    svc.stop()


def missing(svc: TokenService, reason: str) -> float:
    return svc._metrics.registry.get_sample_value("symphony_token_ids_missing_total", {"reason": reason}) or 0.0


# -- requests ---------------------------------------------------------------------------------------
_CALL = st.builds(
    lambda name, args: {"id": "call-1", "type": "function", "function": {"name": name, "arguments": args}},
    st.sampled_from(["lookup", "f"]),
    st.sampled_from(['{"q": "x"}', "", "not json", "[1]"]),
)
_EXTRA_MESSAGES = st.lists(
    st.one_of(
        st.builds(lambda c: {"role": "developer", "content": c}, TEXT),
        st.builds(lambda c, n: {"role": "user", "content": c, "name": n}, TEXT, st.sampled_from(["ann", "bo"])),
        st.builds(lambda calls: {"role": "assistant", "content": None, "tool_calls": calls}, st.lists(_CALL)),
        st.builds(lambda c: {"role": "tool", "tool_call_id": "call-1", "content": c}, TEXT),
        st.builds(lambda c: {"role": "user", "content": [{"type": "refusal", "refusal": c}]}, TEXT),
    ),
    max_size=2,
)
_CHAT_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "add_generation_prompt": st.booleans(),
        "continue_final_message": st.booleans(),
        "add_special_tokens": st.booleans(),
        "chat_template_kwargs": st.sampled_from([{"custom": 1}, {"add_generation_prompt": False}, {"x": None}]),
        "documents": st.just([{"title": "t", "text": "d"}]),
        "reasoning_effort": st.sampled_from(["none", "low"]),
        "truncate_prompt_tokens": st.integers(0, 40),
        "truncation_side": st.sampled_from(["left", "right"]),
        "tools": st.just([{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]),
        "tool_choice": st.just("none"),
        "max_tokens": st.integers(1, 8),
    },
)
_COMPLETION = st.fixed_dictionaries(
    {
        "prompt": st.one_of(
            TEXT,
            st.lists(TEXT, min_size=1, max_size=2),
            st.lists(st.integers(0, 700), min_size=1, max_size=20),
            st.lists(st.lists(st.integers(0, 700), min_size=1, max_size=5), min_size=1, max_size=2),
        )
    },
    optional={
        "add_special_tokens": st.booleans(),
        "truncate_prompt_tokens": st.integers(0, 10),
        "truncation_side": st.sampled_from(["left", "right"]),
        "echo": st.booleans(),
    },
)
# What the scheduler declines to reproduce, though vLLM serves it.
UNSUPPORTED = ("prompts in one request",)


def accepted_by_scheduler(body: dict[str, Any]) -> bool:
    """The bodies that reach the tokenizer: those the scheduler's own validation lets through."""
    endpoint = "chat" if "messages" in body else "completions"
    try:
        validate_inference(endpoint, json.dumps(body).encode(), "s", {MODEL: 8192}, 128)
    except ApiError:
        return False
    return True


async def check(service: TokenService, oracle: Oracle, session: str, body: dict[str, Any]) -> None:
    declined_before = missing(service, "unsupported")
    mine = await service.request_token_ids("tenant", session, MODEL, body)
    theirs = await oracle.ids(body)
    if isinstance(theirs, list):
        if mine is None:  # only what the scheduler says it does not reproduce
            assert missing(service, "unsupported") == declined_before + 1, (body, theirs)
            assert isinstance(body.get("prompt"), list) and len(body["prompt"]) > 1, body
        else:
            assert mine.tolist() == theirs, body
    else:
        assert mine is None, (body, theirs)


@PROPERTY
@given(turns=conversations(), extras=_EXTRA_MESSAGES, fields=_CHAT_FIELDS, data=st.data())
def test_chat_turns_get_vllms_ids(
    service: TokenService,
    oracle: Oracle,
    loop: asyncio.AbstractEventLoop,
    turns: list[list[dict[str, Any]]],
    extras: list[dict[str, Any]],
    fields: dict[str, Any],
    data: st.DataObject,
) -> None:
    session = f"chat-{data.draw(st.integers(0, 10**9))}"
    for i, messages in enumerate(turns):
        body = {"model": MODEL, "messages": messages + (extras if i == len(turns) - 1 else []), **fields}
        if accepted_by_scheduler(body):
            loop.run_until_complete(check(service, oracle, session, body))


@PROPERTY
@given(bodies=st.lists(_COMPLETION, min_size=1, max_size=3), data=st.data())
def test_completions_get_vllms_ids(
    service: TokenService,
    oracle: Oracle,
    loop: asyncio.AbstractEventLoop,
    bodies: list[dict[str, Any]],
    data: st.DataObject,
) -> None:
    session = f"cmpl-{data.draw(st.integers(0, 10**9))}"
    for body in bodies:
        body = {"model": MODEL, **body}
        if accepted_by_scheduler(body):
            loop.run_until_complete(check(service, oracle, session, body))


@PROPERTY
@given(
    body=st.one_of(
        st.builds(
            lambda turns, fields: {"messages": turns[-1], **fields},
            conversations(max_turns=2),
            st.fixed_dictionaries(
                {},
                optional={
                    "add_generation_prompt": st.booleans(),
                    "continue_final_message": st.booleans(),
                    "add_special_tokens": st.booleans(),
                    "return_token_strs": st.booleans(),
                },
            ),
        ),
        st.builds(lambda prompt, special: {"prompt": prompt, "add_special_tokens": special}, TEXT, st.booleans()),
    )
)
def test_tokenize_gets_vllms_ids(
    service: TokenService, oracle: Oracle, loop: asyncio.AbstractEventLoop, body: dict[str, Any]
) -> None:
    async def compare() -> None:
        theirs = await oracle.tokenize({"model": MODEL, **body})
        try:
            mine, _ = await service.tokenize(MODEL, {"model": MODEL, **body})
        except Exception as exc:
            assert not isinstance(theirs, list), (body, theirs, exc)
        else:
            assert mine == theirs, body

    loop.run_until_complete(compare())
