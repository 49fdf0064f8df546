"""scheduler.prompt_render and scheduler.chat_format: the prompt text vLLM 0.32 builds for a request.

(Its equality with vLLM's own renderer on random requests is tests/integration/test_tokens_vllm_parity.py.)"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from scheduler.chat_format import detect_content_format
from scheduler.chat_messages import conversation_of
from scheduler.prompt_render import chat_prompt, completion_prompt
from scheduler.prompts import IdsPrompt, NoTokenIds, TextPrompt
from tests.tokenizer_support import CHATML, PARTS_TEMPLATE, make_tokenizer

USER = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import AutoTokenizer

    out = {}
    for name, template in (("string", CHATML), ("openai", PARTS_TEMPLATE), ("raises", RAISES), ("kwargs", KWARGS)):
        path = make_tokenizer(tmp_path_factory.mktemp(name), template=template)
        out[name] = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return out


RAISES = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message must come first') }}{% endif %}x"
KWARGS = (
    "{{ messages | length }}|{{ add_generation_prompt }}|{{ custom | default('-') }}|"
    "{{ enable_thinking | default('-') }}|{{ reasoning_effort | default('-') }}|{{ documents | default('-') }}|"
    "{% if tools %}{{ tools | tojson }}{% endif %}"
)


def test_templates_that_loop_over_content_take_parts() -> None:
    assert detect_content_format(CHATML) == "string"
    assert detect_content_format(PARTS_TEMPLATE) == "openai"
    macro = (
        "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ show(m['content']) }}{% endfor %}"
    )
    assert detect_content_format(macro) == "openai"
    assert detect_content_format("{% for m in messages %}{{ m.content }}") == "string"  # does not parse


def test_parts_are_joined_for_string_templates_and_kept_for_openai_ones() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}, {"type": "text", "text": None}]
    messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": "c"}]
    assert conversation_of(messages, "string") == [
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "c"},
    ]
    assert conversation_of(messages, "openai") == [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "c"}]},
    ]


def test_the_conversation_is_built_from_copies_with_tool_arguments_parsed() -> None:
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    messages = [
        {"role": "system", "content": "x-anthropic-billing-header: cch=123\nBe brief."},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning": "because", "name": "bot"},
        {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": t} for t in ("r1", "r2")]},
        {"role": "assistant", "content": "", "tool_calls": []},
    ]
    before = copy.deepcopy(messages)
    conversation = conversation_of(messages, "openai")
    assert messages == before  # the body the engine gets is untouched
    assert conversation[0]["content"] == [{"type": "text", "text": "Be brief."}]
    assert conversation[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert conversation[1]["reasoning"] == conversation[1]["reasoning_content"] == "because"
    assert conversation[1]["name"] == "bot"
    assert conversation[2] == {"role": "tool", "content": "r1\nr2", "tool_call_id": "1"}
    assert "tool_calls" not in conversation[3]


@pytest.mark.parametrize(
    ("part", "reason"),
    [
        ({"type": "image_url", "image_url": {"url": "http://x/y.png"}}, "unsupported"),
        ({"image_url": "http://x/y.png"}, "unsupported"),
        ({"type": "no_such_part", "text": "x"}, "invalid_input"),
        ({"text": "x"}, "invalid_input"),
        ({"type": "thinking"}, "invalid_input"),
    ],
)
def test_parts_vllm_cannot_render_as_text(tokenizers: dict[str, Any], part: dict[str, Any], reason: str) -> None:
    with pytest.raises(NoTokenIds) as caught:
        chat_prompt(tokenizers["string"], {"messages": [{"role": "user", "content": [part]}]})
    assert caught.value.reason == reason


def test_developer_messages_become_one_system_message_for_templates_without_them(tokenizers: dict[str, Any]) -> None:
    body = {"messages": [{"role": "developer", "content": "d1"}, USER, {"role": "developer", "content": "d2"}]}
    text = chat_prompt(tokenizers["string"], body).text
    assert text == "<|im_start|>system\nd1\n\nd2<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_the_kwargs_reach_the_template_as_vllm_merges_them(tokenizers: dict[str, Any]) -> None:
    kwargs = tokenizers["kwargs"]

    def render(**fields: Any) -> str:
        return chat_prompt(kwargs, {"messages": [USER], **fields}).text

    assert render() == "1|True|-|-|-|None|"  # apply_chat_template passes documents=None itself
    assert render(add_generation_prompt=False) == "1|False|-|-|-|None|"
    # The request's own kwargs, under its fields; None and "auto" are not given.
    assert render(chat_template_kwargs={"custom": "c", "add_generation_prompt": False}) == "1|True|c|-|-|None|"
    assert render(chat_template_kwargs={"custom": None}) == "1|True|-|-|-|None|"
    assert render(reasoning_effort="none") == "1|True|-|False|none|None|"
    assert render(reasoning_effort="low", chat_template_kwargs={"enable_thinking": 0}) == "1|True|-|0|low|None|"
    assert render(documents=[{"title": "t"}]) == "1|True|-|-|-|[{'title': 't'}]|"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}, "extra": 1}]
    assert render(tools=tools).endswith(
        '|[{"type": "function", "function": {"name": "f", "description": null, "parameters": {"type": "object"}}}]'
    )
    # /tokenize takes no documents or reasoning effort.
    assert chat_prompt(kwargs, {"messages": [USER], "documents": [{"a": "b"}]}, tokenize_endpoint=True).text == (
        "1|True|-|-|-|None|"
    )


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"add_generation_prompt": True, "continue_final_message": True}, "invalid_input"),
        ({"continue_final_message": True}, "invalid_input"),  # add_generation_prompt defaults to true
        ({"chat_template": "{{ 'x' }}"}, "invalid_input"),
        ({"chat_template_kwargs": {"chat_template": "x"}}, "invalid_input"),
        ({"chat_template_kwargs": {"tokenize": True}}, "unsupported"),
        ({"chat_template_kwargs": "not a dict"}, "invalid_input"),
        ({"add_generation_prompt": [1]}, "invalid_input"),
        ({"tools": []}, "invalid_input"),
        ({"truncate_prompt_tokens": -1}, "unsupported"),
        ({"truncate_prompt_tokens": -2}, "invalid_input"),
    ],
)
def test_chat_requests_without_ids(tokenizers: dict[str, Any], fields: dict[str, Any], reason: str) -> None:
    with pytest.raises(NoTokenIds) as caught:
        chat_prompt(tokenizers["string"], {"messages": [USER], **fields})
    assert caught.value.reason == reason


def test_a_template_that_refuses_its_input_says_why(tokenizers: dict[str, Any]) -> None:
    assert chat_prompt(tokenizers["raises"], {"messages": [{"role": "system", "content": "s"}]}).text == "x"
    with pytest.raises(NoTokenIds) as caught:
        chat_prompt(tokenizers["raises"], {"messages": [USER]})
    assert caught.value.reason == "invalid_input" and "a system message must come first" in caught.value.message


def test_a_tokenizer_without_a_chat_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = make_tokenizer(tmp_path, template="")
    (path / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    with pytest.raises(NoTokenIds) as caught:
        chat_prompt(tokenizer, {"messages": [USER]})
    assert caught.value.reason == "unsupported"


def test_completion_prompts(tokenizers: dict[str, Any]) -> None:
    tok = tokenizers["string"]
    assert completion_prompt(tok, {"prompt": "a"}) == TextPrompt("a", True)
    assert completion_prompt(tok, {"prompt": ["a"], "add_special_tokens": False}) == TextPrompt("a", False)
    assert completion_prompt(tok, {"prompt": [5, 6]}) == IdsPrompt([5, 6])
    assert completion_prompt(tok, {"prompt": [[5, 6]]}) == IdsPrompt([5, 6])
    cut = completion_prompt(tok, {"prompt": "a", "truncate_prompt_tokens": 3})
    assert cut.truncation is not None and (cut.truncation.keep, cut.truncation.side) == (3, "right")
    for body, reason in (
        ({"prompt": ["a", "b"]}, "unsupported"),
        ({"prompt": [[1], [2]]}, "unsupported"),
        ({"prompt": "a", "suffix": "b"}, "unsupported"),
        ({"prompt": "a", "prompt_embeds": "AAAA"}, "unsupported"),
        ({"prompt": "a", "add_special_tokens": "maybe"}, "invalid_input"),
        ({"prompt": "a", "truncation_side": "middle"}, "invalid_input"),
    ):
        with pytest.raises(NoTokenIds) as caught:
            completion_prompt(tok, body)
        assert caught.value.reason == reason, body
