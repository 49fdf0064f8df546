"""The scheduler's OpenAPI document (`GET /openapi.json`): FastAPI's for the routes it serves, and
the hot path's (`scheduler.hot_path`: chat and text completions, advisories), which bypasses
FastAPI, written from the same pydantic models that validate those bodies (`scheduler.schemas`).
A test holds the document to every path the hot path routes, and a fuzzer (schemathesis) sends
what it describes, and more, to a live scheduler (tests/integration/test_api_fuzz.py)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from scheduler.hot_path import ADVISORY_PATH, INFERENCE_PATHS
from scheduler.schemas import (
    AdvisoryBody,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    QuotaUpdateBody,
    TokenizeChatBody,
    TokenizeCompletionBody,
)

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_SESSION_HEADER = {
    "name": "X-Session-ID",
    "in": "header",
    "required": False,
    "description": "the conversation this request continues (its KV's key, with the tenant)",
    "schema": {"type": "string"},
}


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """The whole document (made once, then kept on the app as FastAPI keeps its own)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    document = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas: dict[str, Any] = document.setdefault("components", {}).setdefault("schemas", {})
    schemas["Error"] = _ERROR
    bodies: dict[str, tuple[type[BaseModel], dict[str, Any]]] = {
        path: (ChatBody if endpoint == "chat" else CompletionBody, {"model": {"type": "string"}})
        for path, endpoint in INFERENCE_PATHS.items()
    }
    bodies[ADVISORY_PATH] = (AdvisoryBody, {"session_id": {"type": "string"}})
    for path, (model, required) in bodies.items():
        document.setdefault("paths", {})[path] = {"post": _operation(model, required, schemas)}
    # Routes FastAPI serves but whose bodies their handlers read themselves: their schemas too.
    for path, method, models in (
        ("/tokenize", "post", (TokenizeCompletionBody, TokenizeChatBody)),
        ("/detokenize", "post", (DetokenizeBody,)),
        ("/admin/v1/quotas", "put", (QuotaUpdateBody,)),
    ):
        bodies_of = [_schema(model, schemas) for model in models]
        body = bodies_of[0] if len(bodies_of) == 1 else {"oneOf": bodies_of}
        operation = document["paths"][path][method]
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    app.openapi_schema = document
    return document


def _schema(model: type[BaseModel], schemas: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(schema.pop("$defs", {}))
    return schema


def _operation(model: type[BaseModel], required: dict[str, Any], schemas: dict[str, Any]) -> dict[str, Any]:
    """A hot-path POST: the body's schema (with the fields its handler resolves itself, `required`)
    and the answers it may give, an OpenAI-style error body for every 4xx and 5xx."""
    schema = _schema(model, schemas)
    schema.setdefault("properties", {}).update(required)
    schema["required"] = sorted({*schema.get("required", []), *required})
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return {
        "summary": model.__doc__.splitlines()[0] if model.__doc__ else model.__name__,
        "parameters": [_SESSION_HEADER],
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {
            "200": {"description": "the answer (a JSON body, or server-sent events when it streams)"},
            "202": {"description": "an advisory taken"},
            **{code: {"description": meaning, **error} for code, meaning in _ERRORS.items()},
        },
    }


_ERRORS = {
    "400": "bad input",
    "401": "no or an unknown API key",
    "403": "a tenant this region may not serve",
    "404": "a model no node serves",
    "413": "a body over scheduler.max_body_bytes",
    "429": "over a bound or a tenant's quota",
    "503": "no node can serve it now",
}
