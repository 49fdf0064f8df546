"""A chat request's messages as vLLM 0.32 hands them to the chat template, for text-only input
(vllm/renderers/chat_utils.py, `parse_chat_messages` and `_postprocess_messages`; vllm/renderers/hf.py
for the developer role). Built from copies: the request body is never changed.

- Content: a string is one text part; text parts ("text", "input_text", "output_text", "refusal",
  "thinking") give their text, a "text" or "refusal" part without one is skipped; a "string"
  template gets the non-empty texts joined by newlines, an "openai" one a list of
  `{"type": "text", ...}` parts, empty ones too (`scheduler.chat_format` decides which). Claude
  Code's attribution line is dropped from system text. Media parts raise NoTokenIds("unsupported"):
  only the engine's processor expands them.
- Assistant messages keep `tool_calls` (their `arguments` parsed from JSON; anything but an object
  becomes {}; an empty list is dropped) and `reasoning` (also as `reasoning_content`); tool
  messages keep `tool_call_id` and get list content joined; `name` and `task` are kept when they
  are strings; developer messages keep `tools`.
- For a template that never mentions "developer", developer messages become system ones, and all
  system messages are merged into the first.

What vLLM's pydantic validation of the messages drops first (keys unknown inside `tool_calls`, extra
keys of content parts) is passed on here: a template that prints those could differ.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from scheduler.chat_format import ContentFormat
from scheduler.prompts import NoTokenIds

# Content part types vLLM reads as text, and the key each keeps its text under.
_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_SKIP_WHEN_NONE = ("text", "refusal")
# Media parts (and the keys that make an untyped part one): vLLM turns them into placeholder tokens
# its multimodal processor expands, which only the engine can do.
_MEDIA_PARTS = (
    "input_image",
    "image_url",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "image_pil",
    "audio_url",
    "input_audio",
    "video_url",
)
_BILLING_HEADER = "x-anthropic-billing-header"


def conversation_of(messages: list[Mapping[str, Any]], content_format: ContentFormat) -> list[dict[str, Any]]:
    """The messages as vLLM hands them to the chat template (vllm/renderers/chat_utils.py,
    `parse_chat_messages` for text-only input and `_postprocess_messages`), built from copies."""
    conversation: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        content = message.get("content")
        parts: list[Any] = (
            [] if content is None else [{"type": "text", "text": content}] if isinstance(content, str) else content
        )
        if role == "system":
            parts = _strip_billing_header(parts)
        pieces = [piece for piece in (_part(part) for part in parts) if piece is not None]
        out: dict[str, Any] = {"role": role}
        if content_format == "openai":
            out["content"] = [p if isinstance(p, dict) else {"type": "text", "text": p} for p in pieces]
        else:  # as text; vLLM drops empty pieces before joining them
            texts = (p if isinstance(p, str) else p["name"] for p in pieces)
            out["content"] = "\n".join(t for t in texts if t)
        if role == "assistant":
            if message.get("tool_calls") is not None:
                out["tool_calls"] = copy.deepcopy(list(message["tool_calls"]))
            if message.get("reasoning") is not None:
                out["reasoning"] = out["reasoning_content"] = message["reasoning"]
        elif role == "tool":
            if "tool_call_id" in message:
                out["tool_call_id"] = message["tool_call_id"]
            listed = out["content"]
            if isinstance(listed, list) and all(isinstance(i, dict) and i.get("type") == "text" for i in listed):
                out["content"] = "\n".join(i.get("text", "") for i in listed)
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
        if isinstance(message.get("task"), str):
            out["task"] = message["task"]
        if role == "developer":
            out["tools"] = copy.deepcopy(message.get("tools"))
        conversation.append(out)
    _parse_tool_arguments(conversation)
    return conversation


def _part(part: Any) -> str | dict[str, str] | None:
    """One content part's text (None: skipped), or a tool reference."""
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise NoTokenIds("invalid_input", f"a content part must be an object, got {type(part).__name__}")
    kind = part.get("type")
    if kind is None or part.get("uuid") is not None:
        if any(key in part for key in _MEDIA_PARTS):
            raise NoTokenIds("unsupported", "media content parts (images, audio, video, embeddings)")
        if "tool_reference" in part:
            return _tool_reference(part.get("name"))
        raise NoTokenIds("invalid_input", "Missing 'type' field in multimodal part.")
    if not isinstance(kind, str):
        raise NoTokenIds("invalid_input", "Invalid 'type' field in multimodal part.")
    if kind in _TEXT_PARTS:
        text = part.get(_TEXT_PARTS[kind])
        if text is None and kind in _SKIP_WHEN_NONE:
            return None
        if not isinstance(text, str):
            raise NoTokenIds("invalid_input", f"a {kind!r} content part needs a string {_TEXT_PARTS[kind]!r}")
        return text
    if kind == "tool_reference":
        return _tool_reference(part.get("name"))
    if kind in _MEDIA_PARTS:
        raise NoTokenIds("unsupported", "media content parts (images, audio, video, embeddings)")
    raise NoTokenIds("invalid_input", f"Unsupported chat content part type: {kind!r}.")


def _tool_reference(name: Any) -> dict[str, str]:
    if not isinstance(name, str):
        raise NoTokenIds("invalid_input", "a tool_reference content part needs a string 'name'")
    return {"type": "tool_reference", "name": name}


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    """vLLM drops Claude Code's per-request attribution line from system text parts."""
    out: list[Any] = []
    for part in parts:
        text = part if isinstance(part, str) else part.get("text") if isinstance(part, dict) else None
        is_text = isinstance(part, str) or (isinstance(part, dict) and part.get("type") == "text")
        if not (is_text and isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _parse_tool_arguments(conversation: list[dict[str, Any]]) -> None:
    """Tool calls' `arguments` as objects (templates expect mappings): JSON strings parsed, anything
    that is not an object becomes {}; an empty tool call list is dropped."""
    for message in conversation:
        calls = message.get("tool_calls")
        if message["role"] != "assistant" or not isinstance(calls, list):
            continue
        if not calls:
            message.pop("tool_calls")
            continue
        for call in calls:
            if not isinstance(call, dict):
                raise NoTokenIds("invalid_input", "assistant tool_calls entries must be objects.")
            function = call.get("function")
            if call.get("type", "function") != "function" or not isinstance(function, dict):
                raise NoTokenIds("invalid_input", "only assistant tool_calls of type 'function' are supported.")
            arguments = function.get("arguments")
            if not arguments:
                function["arguments"] = {}
            elif not isinstance(arguments, dict):
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments)
                    except json.JSONDecodeError:
                        arguments = None
                function["arguments"] = arguments if isinstance(arguments, dict) else {}


def developer_as_system(conversation: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """`conversation` for `template`: developer messages as system ones where it knows no developer."""
    if not any(m["role"] == "developer" for m in conversation) or _knows_developer(template):
        return conversation
    return _consolidate_system(_developer_to_system(conversation))


def _knows_developer(template: str) -> bool:
    return '"developer"' in template or "'developer'" in template


def _developer_to_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in conversation:
        if message["role"] == "developer":
            message = {**message, "role": "system"}
            message.pop("tools", None)
        out.append(message)
    return out


def _consolidate_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every system message merged into one at the front, when one is not already alone there."""
    contents: list[str] = []
    others: list[dict[str, Any]] = []
    needed = False
    for i, message in enumerate(conversation):
        if message["role"] != "system":
            others.append(message)
            continue
        if i > 0 or contents:
            needed = True
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                p["text"] if isinstance(p, dict) else p
                for p in content
                if (isinstance(p, dict) and "text" in p) or isinstance(p, str)
            )
        if content:
            contents.append(content)
    return [{"role": "system", "content": "\n\n".join(contents)}, *others] if needed else conversation
