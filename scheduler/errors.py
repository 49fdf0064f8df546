"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status."""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from symphony.api_errors import error_body

__all__ = [
    "ApiError",
    "error_body",
    "error_response",
    "http_error_handler",
    "no_engine_error",
    "overloaded_error",
    "queue_timeout_error",
    "rate_limited_error",
    "sse_error_event",
    "tenant_inflight_error",
    "too_many_inflight_error",
]


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers  # sent with the error (Retry-After on a rate limit)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def queue_timeout_error(timeout_s: float) -> ApiError:
    return ApiError(
        503, f"every node has requests waiting and none freed up in {timeout_s:g} s; retry later", code="queue_timeout"
    )


def overloaded_error(wait_s: float, max_wait_s: float, retry_after_s: int) -> ApiError:
    """Refused by admission (scheduler.admission): it would wait past `max_wait_s` for a node."""
    return ApiError(
        503,
        f"every node is busy: this request would wait about {wait_s:.0f} s for one, over the"
        f" {max_wait_s:g} s allowed (scheduler.max_queue_wait_s); retry in {retry_after_s} s",
        code="overloaded",
        headers={"retry-after": str(retry_after_s)},
    )


def no_engine_error(model: str, states: dict[str, str]) -> ApiError:
    shown = ", ".join(f"{k}={v}" for k, v in states.items())
    return ApiError(
        503, f"no engine is available to serve {model!r} ({shown}); retry shortly", code="no_engine_available"
    )


def too_many_inflight_error(inflight: int, limit: int) -> ApiError:
    return ApiError(
        429, f"the scheduler has {inflight} requests in flight (limit {limit}); retry later", code="too_many_requests"
    )


def rate_limited_error(tenant: str, what: str, retry_after_s: float) -> ApiError:
    """A tenant over its rate (`what`: "requests", "advisories"): 429 with Retry-After in whole
    seconds, rounded up (RFC 9110 allows no fraction)."""
    wait = max(1, math.ceil(min(retry_after_s, 86_400.0)))
    return ApiError(
        429,
        f"tenant {tenant!r} is over its rate of {what}; retry in {wait} s",
        code="rate_limit_exceeded",
        headers={"retry-after": str(wait)},
    )


def tenant_inflight_error(tenant: str, limit: int) -> ApiError:
    return ApiError(
        429,
        f"tenant {tenant!r} has {limit} requests in flight (its limit); retry later",
        code="tenant_too_many_requests",
    )


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param=param, code=code), status_code=status, headers=headers)


def sse_error_event(status: int, message: str, code: str) -> bytes:
    """An error delivered inside an already-started event stream (the status line is gone by then)."""
    return f"data: {json.dumps(error_body(status, message, code=code))}\n\ndata: [DONE]\n\n".encode()


async def validation_error_handler(_: Request, exc: Exception) -> JSONResponse:
    """A query or path parameter FastAPI could not parse: a 400 with an OpenAI-style body naming
    it (FastAPI's own answer is a 422 in a shape no OpenAI client reads)."""
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    location = [str(part) for part in first.get("loc", ()) if part not in ("query", "path", "body")]
    param = location[0] if location else None
    message = f"{'.'.join(location) or 'request'}: {first.get('msg', 'invalid')}, got {str(first.get('input'))[:100]!r}"
    return error_response(400, message, param=param)


async def http_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    messages = {404: "no such endpoint", 405: "method not allowed for this endpoint"}
    message = messages.get(exc.status_code, str(exc.detail))
    return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))
