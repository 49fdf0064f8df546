"""The endpoints of vLLM's OpenAI server besides inference, answered by the scheduler as vLLM answers
them: `GET /health` (200, empty, while the scheduler serves), `GET /version`, `GET /v1/models`,
`POST /tokenize` and `POST /detokenize` (vllm/entrypoints/serve/tokenize, .../instrumentator,
.../openai/models).

`/tokenize` and `/detokenize` authenticate as the inference endpoints do and are answered with the
scheduler's own tokenizer (`scheduler.tokens`); where it has none for the model (or the input needs
what only an engine can do, such as images) they are relayed to an engine serving the model. Bad
input gets an OpenAI-style 4xx, never a 500.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import aiohttp
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from scheduler.errors import ApiError
from scheduler.hot_path import read_body
from scheduler.prompts import NoTokenIds
from scheduler.schemas import DetokenizeBody, TokenizeChatBody, TokenizeCompletionBody, check
from scheduler.state import SchedulerState
from scheduler.validation import parse_json_object, resolve_model
from symphony import __version__

RELAY_TIMEOUT_S = 30.0
_JSON = {"content-type": "application/json"}
_MAX_TOKEN_ID = 2**32 - 1  # beyond, the tokenizer cannot even look an id up


def engine_routes(state: SchedulerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @router.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @router.get("/v1/models")
    async def models() -> JSONResponse:
        created = int(time.time())
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "symphony",
                "root": name,
                "parent": None,
                "max_model_len": max_len,
                "permission": [_permission(created)],
            }
            for name, max_len in sorted(state.cluster.served_models().items())
        ]
        return JSONResponse({"object": "list", "data": data})

    @router.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body, model, max_model_len = await _request(state, request, "tokenize")
        try:
            ids, strings = await state.tokens.tokenize(model, body)
        except NoTokenIds as exc:
            if exc.reason == "invalid_input":
                raise ApiError(400, exc.message) from None
            return await _relay(state, model, "/tokenize", body)
        return JSONResponse({"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strings})

    @router.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body, model, _ = await _request(state, request, "detokenize")
        ids = body["tokens"]
        too_large = next((i for i in ids if i > _MAX_TOKEN_ID), None)
        if too_large is not None:
            raise ApiError(400, f"token id {too_large} is out of range", param="tokens")
        try:
            text = await state.tokens.detokenize(model, ids)
        except NoTokenIds as exc:
            if exc.reason == "invalid_input":
                raise ApiError(400, exc.message, param="tokens") from None
            return await _relay(state, model, "/detokenize", body)
        return JSONResponse({"prompt": text})

    return router


async def _request(state: SchedulerState, request: Request, endpoint: str) -> tuple[dict[str, Any], str, int]:
    """The authenticated, validated body, its model and the model's context length."""
    state.auth.tenant(request.headers.get("authorization"))
    body = parse_json_object(await read_body(request.scope, request.receive, state.config.scheduler.max_body_bytes))
    if endpoint == "detokenize":
        check(DetokenizeBody, body)
    else:
        check(TokenizeChatBody if "messages" in body else TokenizeCompletionBody, body)
    served = state.cluster.served_models()
    model = resolve_model(body, served)
    body["model"] = model
    return body, model, served[model]


async def _relay(state: SchedulerState, model: str, path: str, body: dict[str, Any]) -> Response:
    """`body` answered by an engine serving `model` (the least busy one that is available)."""
    node = state.cluster.least_busy_engine(model)
    if node is None:
        raise ApiError(503, f"no engine is available to serve {model!r}; retry shortly", code="no_engine_available")
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=RELAY_TIMEOUT_S)) as session,
            session.post(
                node.engine_url + path, data=json.dumps(body), headers={**_JSON, **state.cluster.engine_headers}
            ) as reply,
        ):
            content = await reply.read()
            if reply.status == 401:  # it refused this scheduler's engine key: the cluster's fault
                raise ApiError(502, f"{node.node_id}'s engine refused the cluster's key", code="engine_error")
            return Response(content, status_code=reply.status, media_type=reply.content_type)
    except (aiohttp.ClientError, TimeoutError) as exc:
        message = f"{node.node_id}'s engine did not answer: {type(exc).__name__}"
        raise ApiError(502, message, code="engine_error") from None


def _permission(created: int) -> dict[str, Any]:
    """vLLM's ModelPermission, with its defaults."""
    return {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
