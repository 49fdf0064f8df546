"""Whether the scheduler's tokenizer for a model is its engines': checked once per model, as soon as
an engine serving it is available. The engine's `/tokenize` answers to a few probe requests must
equal the scheduler's; if they do not, the scheduler drops that tokenizer (the model's requests get
no token ids, counted as "no_tokenizer") and says why in its log. A tokenizer of another revision,
or engines given another chat template (`--chat-template`), would otherwise give wrong ids without
a sign. An engine that cannot be asked (no answer, an error) is asked again next round, at most
`MAX_ATTEMPTS` times; then the tokenizer is kept, unchecked, and the log says so.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from scheduler.node_monitor import NodeMonitor
from scheduler.prompts import NoTokenIds
from scheduler.tokens import TokenService
from symphony.logs import get_logger

log = get_logger(__name__)
ROUND_S = 1.0
MAX_ATTEMPTS = 60
_TIMEOUT = aiohttp.ClientTimeout(total=10)
# Special-token text, unicode, whitespace runs and both content forms: where tokenizers differ.
PROBES: list[dict[str, Any]] = [
    {
        "messages": [
            {"role": "system", "content": "Probe: caf\u00e9 \u6771\u4eac \U0001f600 \t  <|im_end|> </s> [INST]"},
            {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": " two\n\n"}]},
            {"role": "assistant", "content": "  Three."},
            {"role": "user", "content": "Four?"},
        ]
    },
    {"prompt": "Probe:\tcaf\u00e9 \u6771\u4eac \U0001f600 <|endoftext|> <s>  x"},
]


async def check_tokenizers(tokens: TokenService, cluster: NodeMonitor) -> None:
    """Check each model's tokenizer once (runs until every model is checked or has none)."""
    attempts = dict.fromkeys(tokens.dirs, 0)
    async with aiohttp.ClientSession(timeout=_TIMEOUT) as http:
        while attempts:
            for model in sorted(attempts):
                status = tokens.status(model)
                node = cluster.least_busy_engine(model) if status == "ready" else None
                if status == "none" or attempts[model] >= MAX_ATTEMPTS:
                    if status != "none":
                        log.warning("tokenizer kept unchecked: no engine answered /tokenize", model=model)
                    del attempts[model]
                    continue
                if node is None:
                    continue
                attempts[model] += 1
                try:
                    problem = await _compare(tokens, http, node.engine_url, model, cluster.engine_headers)
                except (aiohttp.ClientError, TimeoutError, NoTokenIds, ValueError, KeyError) as exc:
                    log.debug("tokenizer check: will ask again", model=model, node=node.node_id, error=repr(exc))
                    continue
                del attempts[model]
                if problem:
                    tokens.disable(model)
                    log.warning("tokenizer dropped: not the engines'", model=model, node=node.node_id, detail=problem)
                else:
                    log.info("tokenizer matches the engines'", model=model, node=node.node_id)
            if attempts:
                await asyncio.sleep(ROUND_S)


async def _compare(
    tokens: TokenService, http: aiohttp.ClientSession, engine_url: str, model: str, headers: dict[str, str]
) -> str:
    """Empty when the engine tokenizes every probe as the scheduler does, else what differs."""
    for probe in PROBES:
        body = {"model": model, **probe}
        async with http.post(engine_url + "/tokenize", data=json.dumps(body), headers={**_JSON, **headers}) as reply:
            if reply.status != 200:
                raise ValueError(f"/tokenize answered {reply.status}")
            theirs = (await reply.json())["tokens"]
        ours, _ = await tokens.tokenize(model, body)
        if ours != theirs:
            kind = "chat" if "messages" in probe else "prompt"
            return f"the {kind} probe: {len(ours)} ids here, {len(theirs)} from the engine"
    return ""


_JSON = {"content-type": "application/json"}
