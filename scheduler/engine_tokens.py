"""A request's token ids from an engine, while the scheduler's own tokenizer is still loading.

A restarted scheduler knows where KV is within a fraction of a second (its index is rebuilt from
the nodes' snapshots), but loading its tokenizer takes seconds (transformers imports torch: ~5 s on
the development host). Meanwhile a request's ids come from an engine serving its model: vLLM's own
`/tokenize`, given exactly the fields of the body that shape the prompt, so the ids are the ones
the engine will compute the request from. One HTTP round trip to a local engine per request, and
only until the tokenizer is ready.

Only bodies whose `/tokenize` ids are the request's are sent: chats without `documents`,
`reasoning_effort` or truncation (which `/tokenize` does not take), and completions with one text
prompt (a prompt of token ids is its own ids). Anything else, an engine error, a malformed answer
or no answer within the deadline gives None: the caller falls back to the session table's hints.
Never raises.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import aiohttp
import numpy as np

from scheduler.incremental import read_only
from scheduler.prompt_render import TOKENIZE_CHAT_FIELDS
from symphony.logs import get_logger

log = get_logger(__name__)
_JSON = {"Content-Type": "application/json"}
_CHAT_ONLY = ("documents", "reasoning_effort", "truncate_prompt_tokens", "chat_template")
_COMPLETION_UNSUPPORTED = ("suffix", "prompt_embeds", "truncate_prompt_tokens")
MAX_TOKEN_ID = 2**32 - 1  # ids travel as '<u4'


def tokenize_body(model: str, body: Mapping[str, Any]) -> dict[str, Any] | list[int] | None:
    """The `/tokenize` body giving `body`'s prompt ids, or the ids themselves (a completion of token
    ids), or None when `/tokenize` cannot give exactly them."""
    if "messages" in body:
        if any(body.get(name) is not None for name in _CHAT_ONLY):
            return None
        picked = {k: v for k, v in body.items() if k in TOKENIZE_CHAT_FIELDS and v is not None}
        return {"model": model, "messages": body["messages"], **picked}
    if any(body.get(name) is not None for name in _COMPLETION_UNSUPPORTED):
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return {"model": model, "prompt": prompt, "add_special_tokens": body.get("add_special_tokens", True)}
    if isinstance(prompt, list) and prompt and all(_is_id(i) for i in prompt):
        return list(prompt)
    return None


async def engine_token_ids(
    engine_url: str, model: str, body: Mapping[str, Any], timeout_s: float, headers: Mapping[str, str] | None = None
) -> np.ndarray | None:
    """`body`'s prompt ids as the engine at `engine_url` tokenizes them (read-only '<u4'), or None.
    `headers`: the engine's key (`NodeMonitor.engine_headers`)."""
    request = tokenize_body(model, body)
    if request is None:
        return None
    if isinstance(request, list):
        return read_only(request)
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http,
            http.post(
                engine_url + "/tokenize", data=json.dumps(request), headers={**_JSON, **(headers or {})}
            ) as reply,
        ):
            if reply.status != 200:
                log.debug("engine /tokenize refused", engine=engine_url, status=reply.status)
                return None
            answer = await reply.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        log.debug("engine /tokenize failed", engine=engine_url, error=repr(exc))
        return None
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list) or not tokens or not all(_is_id(i) for i in tokens):
        return None
    return read_only(tokens)


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_ID
