"""Checks on client input, done before anything reaches an engine. Each failure is an ApiError (4xx).

The body's shape and field types are checked against the pydantic models in `scheduler.schemas`;
what depends on the cluster (the model served, its context length) and on headers (the session)
is checked here. Finer sampling-parameter checks stay with vLLM, whose 400s pass through.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from scheduler.errors import ApiError
from scheduler.schemas import AdvisoryBody, ChatBody, CompletionBody, check
from symphony.kv_transfer import SESSION_PARAM, TENANT_PARAM, TIERS_PARAM, params_key, sign_params
from symphony.prompt_text import estimated_tokens, routing_text
from symphony.tenancy import engine_cache_salt


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    endpoint: str  # "chat" | "completions"
    model: str
    stream: bool
    session_id: str | None
    body: dict[str, Any]  # the parsed request, as the engine will get it (plus Symphony's parameters)
    history_tokens: int  # estimated prompt tokens
    salt_key: bytes = b""  # the cluster's secret, which keys the tenant's cache salt (none: b"")

    def engine_body(self, tenant: str, uses_tiers: bool, now_s: float | None = None) -> bytes:
        """The request as the engine gets it: with the tenant and session that key its KV in the
        node's tiers (none when the policy does not use them: `uses_tiers`), signed for the
        connector (`symphony.kv_transfer`; `now_s`: unix seconds, default now), and the tenant's
        cache salt for the engine's prefix cache. Whatever the client put in kv_transfer_params is
        replaced: a client must not name another tenant's KV."""
        params: dict[str, object] = {TENANT_PARAM: tenant}
        if self.session_id is not None:
            params[SESSION_PARAM] = self.session_id
        if not uses_tiers:
            params[TIERS_PARAM] = False
        signed = sign_params(params, self.model, params_key(self.salt_key), time.time() if now_s is None else now_s)
        salt = engine_cache_salt(tenant, self.body.get("cache_salt"), self.salt_key)
        return json.dumps({**self.body, "kv_transfer_params": signed, "cache_salt": salt}).encode()

    def routing_text(self) -> str:
        return routing_text(self.body, self.endpoint)


@dataclass(frozen=True, slots=True)
class AdvisoryRequest:
    session_id: str
    kind: str
    expected_arrival_ms: int | None
    model: str


def parse_json_object(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise ApiError(400, "request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, huge integers, absurd nesting
        raise ApiError(400, f"request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


def check_session_id(value: Any, max_len: int) -> str:
    if not isinstance(value, str):
        raise ApiError(400, "session_id must be a string", param="session_id")
    if not value:
        raise ApiError(400, "session_id must not be empty", param="session_id")
    if len(value) > max_len:
        raise ApiError(400, f"session_id is {len(value)} characters long; the limit is {max_len}", param="session_id")
    # Visible ASCII only: the id travels in HTTP headers, logs and metrics labels.
    if not all("\x21" <= ch <= "\x7e" for ch in value):
        raise ApiError(
            400,
            "session_id must contain only visible ASCII characters (no spaces or control characters)",
            param="session_id",
        )
    return value


def resolve_session_id(header_value: str | None, body: Mapping[str, Any], max_len: int) -> str | None:
    """The X-Session-ID header wins over the body's session_id; both absent means no session."""
    if header_value is not None:
        return check_session_id(header_value, max_len)
    if body.get("session_id") is not None:
        return check_session_id(body["session_id"], max_len)
    return None


def resolve_model(body: Mapping[str, Any], served: Mapping[str, int]) -> str:
    """The model to serve; absent means the cluster's only model. `served` maps name -> max_model_len."""
    if not served:
        raise ApiError(503, "no engine is ready yet; retry shortly", code="no_engine_ready")
    model = body.get("model")
    if model is None:
        if len(served) == 1:
            return next(iter(served))
        raise ApiError(400, f"model is required (served: {', '.join(sorted(served))})", param="model")
    if not isinstance(model, str):
        raise ApiError(400, "model must be a string", param="model")
    if model not in served:
        raise ApiError(
            404,
            f"the model {model!r} does not exist; served: {', '.join(sorted(served))}",
            param="model",
            code="model_not_found",
        )
    return model


def _check_max_tokens(body: Mapping[str, Any], max_model_len: int) -> None:
    """The token limits' bounds; their type (an integer) was checked by the body's schema."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if value < 1:
            raise ApiError(400, f"{name} must be at least 1, got {value}", param=name)
        if value > max_model_len:
            raise ApiError(
                400, f"{name}={value} exceeds the model's context length of {max_model_len} tokens", param=name
            )


def validate_inference(
    endpoint: str,
    raw: bytes,
    session_header: str | None,
    served: Mapping[str, int],
    max_session_id_len: int,
    salt_key: bytes = b"",
) -> InferenceRequest:
    body = parse_json_object(raw)
    check(ChatBody if endpoint == "chat" else CompletionBody, body)
    stream = bool(body.get("stream"))
    session_id = resolve_session_id(session_header, body, max_session_id_len)
    model = resolve_model(body, served)
    _check_max_tokens(body, served[model])
    body["model"] = model  # vLLM needs it when the client left it to us
    return InferenceRequest(endpoint, model, stream, session_id, body, estimated_tokens(body, endpoint), salt_key)


def validate_advisory(
    raw: bytes,
    session_header: str | None,
    served: Mapping[str, int],
    max_session_id_len: int,
    max_expected_arrival_ms: int,
) -> AdvisoryRequest:
    body = parse_json_object(raw)
    session_id = resolve_session_id(session_header, body, max_session_id_len)
    if session_id is None:
        raise ApiError(400, "session_id is required", param="session_id")
    check(AdvisoryBody, body)
    kind = str(body["kind"])
    expected = body.get("expected_arrival_ms")
    if expected is not None:
        if not 0 <= expected <= max_expected_arrival_ms:  # NaN fails this too
            raise ApiError(
                400,
                f"expected_arrival_ms must be between 0 and {max_expected_arrival_ms}, got {expected}",
                param="expected_arrival_ms",
            )
        expected = int(expected)
    model = resolve_model(body, served)
    return AdvisoryRequest(session_id, kind, expected, model)
