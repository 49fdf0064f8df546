"""scheduler.errors: OpenAI-style error bodies and the in-stream SSE error frame."""

from __future__ import annotations

import json

import pytest

from scheduler.errors import ApiError, error_body, sse_error_event


@pytest.mark.parametrize(
    ("status", "error_type"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "invalid_request_error"),
        (413, "invalid_request_error"),
        (418, "invalid_request_error"),  # unlisted 4xx
        (429, "rate_limit_error"),
        (500, "server_error"),
        (502, "server_error"),
        (503, "server_error"),
        (504, "server_error"),
    ],
)
def test_error_type_follows_status(status: int, error_type: str) -> None:
    assert error_body(status, "msg")["error"]["type"] == error_type


def test_error_body_has_openai_shape() -> None:
    body = error_body(400, "bad thing", param="max_tokens", code="too_big")
    assert body == {
        "error": {"message": "bad thing", "type": "invalid_request_error", "param": "max_tokens", "code": "too_big"}
    }


def test_error_body_defaults_param_and_code_to_null() -> None:
    error = error_body(500, "boom")["error"]
    assert error["param"] is None
    assert error["code"] is None


def test_api_error_carries_its_fields_and_renders_the_same_body() -> None:
    exc = ApiError(404, "no such model", param="model", code="model_not_found")
    assert str(exc) == "no such model"
    assert (exc.status, exc.param, exc.code) == (404, "model", "model_not_found")
    assert exc.body() == error_body(404, "no such model", param="model", code="model_not_found")


def test_sse_error_event_is_a_data_frame_then_done() -> None:
    frame = sse_error_event(502, 'engine "node-0" died', "engine_error").decode()
    assert frame.startswith("data: ")
    assert frame.endswith("\n\ndata: [DONE]\n\n")
    events = frame.split("\n\n")
    assert events[1:] == ["data: [DONE]", ""]
    payload = json.loads(events[0].removeprefix("data: "))
    assert payload == error_body(502, 'engine "node-0" died', code="engine_error")
    assert payload["error"]["type"] == "server_error"


def test_sse_error_event_escapes_newlines_inside_the_message() -> None:
    frame = sse_error_event(500, "line one\n\nline two", "x").decode()
    assert frame.count("\n\n") == 2  # the message's blank line must not split the event
