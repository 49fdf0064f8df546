"""A request's prompt as routing sees it, before any tokenizer: its leading text and an estimate of
its tokens. Shared by the scheduler (on validated requests) and the global layer's entries (on
requests nobody validated yet: every shape is tolerated, a wrong one just adds nothing)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_ROUTING_TEXT = 16_384  # characters of a prompt that prefix-aware routing looks at
CHARS_PER_TOKEN = 4  # for estimates only (routing costs); the engine counts the real tokens
MESSAGE_TEMPLATE_TOKENS = 4  # a few tokens of chat template around every message


def text_of(content: Any) -> str:
    """A message's text: a string, or the text of its content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def _messages(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    messages = body.get("messages")
    return [m for m in messages if isinstance(m, Mapping)] if isinstance(messages, list) else []


def routing_text(body: Mapping[str, Any], endpoint: str) -> str:
    """The prompt's leading text: the conversation so far for a chat (every message, not just the
    first: sglang #26263), the prompt for a completion; at most MAX_ROUTING_TEXT characters."""
    if endpoint == "chat":
        parts: list[str] = []
        size = 0
        for message in _messages(body):
            part = f"{message.get('role')}: {text_of(message.get('content'))}\n"
            parts.append(part)
            size += len(part)
            if size >= MAX_ROUTING_TEXT:
                break
        return "".join(parts)[:MAX_ROUTING_TEXT]
    prompt = body.get("prompt", "")
    return (prompt if isinstance(prompt, str) else str(prompt))[:MAX_ROUTING_TEXT]


def estimated_tokens(body: Mapping[str, Any], endpoint: str) -> int:
    """The prompt's tokens, estimated from its characters (token ids, when given, counted)."""
    if endpoint == "chat":
        return sum(
            -(-len(text_of(m.get("content"))) // CHARS_PER_TOKEN) + MESSAGE_TEMPLATE_TOKENS for m in _messages(body)
        )
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        return -(-len(prompt) // CHARS_PER_TOKEN)
    if not isinstance(prompt, list) or not prompt:
        return 0
    if isinstance(prompt[0], int):
        return len(prompt)  # token ids
    return sum(
        len(p) if isinstance(p, list) else -(-len(p) // CHARS_PER_TOKEN) if isinstance(p, str) else 0 for p in prompt
    )
