"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    error_type = _TYPE_BY_STATUS.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


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


async def http_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    messages = {404: "no such endpoint", 405: "method not allowed for this endpoint"}
    message = messages.get(exc.status_code, str(exc.detail))
    return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))
