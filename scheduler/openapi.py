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
_ERROR_BODY = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
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
    model = {"type": "string", "description": "a served model; left out: the one the nodes serve, if one"}
    session = {"type": "string", "description": "the session advised (else the X-Session-ID header)"}
    for path, endpoint in INFERENCE_PATHS.items():
        body = ChatBody if endpoint == "chat" else CompletionBody
        document.setdefault("paths", {})[path] = {"post": _operation(body, {"model": model}, schemas, "200")}
    advisory = _operation(AdvisoryBody, {"model": model, "session_id": session}, schemas, "202")
    document["paths"][ADVISORY_PATH] = {"post": advisory}
    # Routes FastAPI serves but whose bodies their handlers read themselves: their schemas too.
    for path, method, models in (
        ("/tokenize", "post", (TokenizeCompletionBody, TokenizeChatBody)),
        ("/detokenize", "post", (DetokenizeBody,)),
        ("/admin/v1/quotas", "put", (QuotaUpdateBody,)),
    ):
        forms = [_schema(form, schemas) for form in models]
        schema = forms[0] if len(forms) == 1 else {"anyOf": forms}
        operation = document["paths"][path][method]
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    # FastAPI documents a 422 for bad parameters; they get a 400 with an error body (scheduler.errors).
    for operation in (op for item in document["paths"].values() for op in item.values() if isinstance(op, dict)):
        responses = operation.get("responses", {})
        if responses.pop("422", None) is not None:
            responses["400"] = {"description": "bad input", **_ERROR_BODY}
    app.openapi_schema = document
    return document


def _schema(model: type[BaseModel], schemas: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(schema.pop("$defs", {}))
    return schema


def _operation(model: type[BaseModel], fields: dict[str, Any], schemas: dict[str, Any], ok: str) -> dict[str, Any]:
    """A hot-path POST: the body's schema (with the optional fields its handler resolves itself,
    `fields`) and the answers it may give: `ok`, or an OpenAI-style error body."""
    schema = _schema(model, schemas)
    schema.setdefault("properties", {}).update(fields)
    meaning = "the answer (a JSON body, or server-sent events when it streams)" if ok == "200" else "taken"
    return {
        "summary": model.__doc__.splitlines()[0] if model.__doc__ else model.__name__,
        "parameters": [_SESSION_HEADER],
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {
            ok: {"description": meaning},
            **{code: {"description": meaning, **_ERROR_BODY} for code, meaning in _ERRORS.items()},
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
