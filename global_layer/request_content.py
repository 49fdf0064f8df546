"""What an entry reads of a request's body to route it: its session id, leading text and size. The
body is not validated here (the region's scheduler does that, and answers a bad one with a 4xx);
whatever shape it has, this never fails, it just finds less."""

from __future__ import annotations

import json
from dataclasses import dataclass

from symphony.prompt_text import estimated_tokens, routing_text


@dataclass(frozen=True, slots=True)
class RequestContent:
    session_id: str | None = None
    text: str = ""  # symphony.prompt_text.routing_text
    tokens: int = 0  # symphony.prompt_text.estimated_tokens


def request_content(body: bytes, endpoint: str) -> RequestContent:
    """`endpoint`: "chat", "completions" or "advisories" (only the session)."""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return RequestContent()
    if not isinstance(parsed, dict):
        return RequestContent()
    session = parsed.get("session_id")
    session_id = session if isinstance(session, str) and session else None
    if endpoint not in ("chat", "completions"):
        return RequestContent(session_id)
    return RequestContent(session_id, routing_text(parsed, endpoint), estimated_tokens(parsed, endpoint))
