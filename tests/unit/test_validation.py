"""scheduler.validation: client input checks before anything reaches an engine."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.errors import ApiError
from scheduler.validation import (
    AdvisoryRequest,
    InferenceRequest,
    parse_json_object,
    validate_advisory,
    validate_inference,
)
from symphony.kv_transfer import AUTH_PARAM, PARAMS_TTL_S, params_key, params_refusal
from symphony.tenancy import engine_cache_salt

SERVED = {"m": 4096}
MAX_SESSION = 128
MAX_ARRIVAL = 3_600_000
CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION: dict[str, Any] = {"model": "m", "prompt": "hi"}


def encode(body: Any) -> bytes:
    return json.dumps(body).encode()


def chat(**fields: Any) -> bytes:
    return encode({**CHAT, **fields})


def completion(**fields: Any) -> bytes:
    return encode({**COMPLETION, **fields})


def inference(
    endpoint: str, raw: bytes, header: str | None = None, served: dict[str, int] | None = None
) -> InferenceRequest:
    return validate_inference(endpoint, raw, header, SERVED if served is None else served, MAX_SESSION)


def advisory(raw: bytes, header: str | None = None, served: dict[str, int] | None = None) -> AdvisoryRequest:
    return validate_advisory(raw, header, SERVED if served is None else served, MAX_SESSION, MAX_ARRIVAL)


def rejected(call: Any, *args: Any, **kwargs: Any) -> ApiError:
    with pytest.raises(ApiError) as excinfo:
        call(*args, **kwargs)
    return excinfo.value


# -- body shape -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw",
    [b"{not json", b"", b"   \n", b"[1, 2]", b'"text"', b"null", b"\xff\xfe{}"],
    ids=["malformed", "empty", "whitespace", "array", "string", "null", "bad-utf8"],
)
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_non_object_bodies_are_400(endpoint: str, raw: bytes) -> None:
    error = rejected(inference, endpoint, raw)
    assert error.status == 400
    assert error.param is None


def test_advisory_with_array_body_is_400() -> None:
    assert rejected(advisory, b"[]").status == 400


# -- chat messages ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body",
    [
        {"model": "m"},
        {"model": "m", "messages": None},
        {"model": "m", "messages": []},
        {"model": "m", "messages": "hi"},
        {"model": "m", "messages": ["hi"]},
        {"model": "m", "messages": [{"content": "hi"}]},
        {"model": "m", "messages": [{"role": "robot", "content": "hi"}]},
        {"model": "m", "messages": [{"role": "user", "content": 42}]},
        {"model": "m", "messages": [{"role": "user", "content": {"text": "hi"}}]},
    ],
    ids=["missing", "null", "empty", "string", "non-object", "no-role", "bad-role", "int-content", "dict-content"],
)
def test_bad_messages_are_400_on_messages(body: dict[str, Any]) -> None:
    error = rejected(inference, "chat", encode(body))
    assert (error.status, error.param) == (400, "messages")


def test_bad_role_message_names_the_index() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}
    assert "messages[1]" in rejected(inference, "chat", encode(body)).message


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
        [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        [{"role": "assistant", "content": None, "tool_calls": []}, {"role": "tool", "content": "r"}],
    ],
)
def test_valid_messages_pass(messages: list[dict[str, Any]]) -> None:
    assert inference("chat", encode({"model": "m", "messages": messages})).endpoint == "chat"


# -- completions prompt -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prompt",
    [None, 5, [], [True, False], [1, True], [[1, 2], [True]], [[]], ["a", 1], [1.5], {"text": "x"}],
    ids=[
        "missing",
        "int",
        "empty-list",
        "bools",
        "bool-in-tokens",
        "bool-in-nested",
        "empty-nested",
        "mixed",
        "float-token",
        "object",
    ],
)
def test_bad_prompts_are_400_on_prompt(prompt: Any) -> None:
    body = {"model": "m"} if prompt is None else {"model": "m", "prompt": prompt}
    error = rejected(inference, "completions", encode(body))
    assert (error.status, error.param) == (400, "prompt")


@pytest.mark.parametrize("prompt", ["", "hello", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_valid_prompts_pass(prompt: Any) -> None:
    assert inference("completions", completion(prompt=prompt)).endpoint == "completions"


# -- cache_salt -------------------------------------------------------------------------------------
@pytest.mark.parametrize("salt", ["", 7, ["a"], "s" * 257], ids=str)
def test_bad_cache_salt_is_400(salt: Any) -> None:
    error = rejected(inference, "chat", chat(cache_salt=salt))
    assert (error.status, error.param) == (400, "cache_salt")


def test_engine_cache_salt_separates_tenants_and_client_salts() -> None:
    salts = {
        engine_cache_salt("a"),
        engine_cache_salt("b"),
        engine_cache_salt("a", "u1"),
        engine_cache_salt("a", "u2"),
        engine_cache_salt("b", "u1"),
    }
    assert len(salts) == 5
    assert engine_cache_salt("a", "u1") == engine_cache_salt("a", "u1")  # stable: warm-ups must match
    # No tenant/client split collides: "a" + salt "b\0c" is not "a\0b" + salt "c".
    assert engine_cache_salt("a", "b\0c") != engine_cache_salt("a\0b", "c")


def test_a_cluster_secret_keys_the_salt_the_engine_gets() -> None:
    key, other = b"k" * 32, b"o" * 32
    keyed = engine_cache_salt("a", key=key)
    assert keyed not in {engine_cache_salt("a"), engine_cache_salt("a", key=other)}  # not computable without it
    assert keyed == engine_cache_salt("a", key=key) and len(keyed) == 32
    request = validate_inference("chat", chat(), None, SERVED, MAX_SESSION, key)
    body = json.loads(request.engine_body("a", True))
    assert body["cache_salt"] == keyed


def test_the_engine_gets_params_signed_under_the_clusters_secret() -> None:
    """What the connector checks (`symphony.kv_transfer`): the params, for the model the body names."""
    key = b"k" * 32
    request = validate_inference("chat", chat(), "s1", SERVED, MAX_SESSION, key)
    body = json.loads(request.engine_body("a", True, now_s=1_000.0))
    params = body["kv_transfer_params"]
    assert params_refusal(params, body["model"], params_key(key), 1_000.0) is None
    assert params_refusal(params, body["model"], params_key(b"o" * 32), 1_000.0) == "forged"
    assert params_refusal(params, body["model"], params_key(key), 1_000.0 + PARAMS_TTL_S + 1) == "expired"
    assert {name: params[name] for name in params if name != AUTH_PARAM} == {"tenant": "a", "session_id": "s1"}


# -- stream -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", ["true", 1, 0, {}])
def test_non_bool_stream_is_400(stream: Any) -> None:
    error = rejected(inference, "chat", chat(stream=stream))
    assert (error.status, error.param) == (400, "stream")


@pytest.mark.parametrize(("stream", "expected"), [(True, True), (False, False), (None, False)])
def test_stream_flag_is_reported(stream: Any, expected: bool) -> None:
    assert inference("chat", chat(stream=stream)).stream is expected


def test_stream_defaults_to_false() -> None:
    assert inference("chat", chat()).stream is False


# -- model ------------------------------------------------------------------------------------------
def test_unknown_model_is_404_model_not_found() -> None:
    error = rejected(inference, "chat", chat(model="other"))
    assert (error.status, error.param, error.code) == (404, "model", "model_not_found")
    assert "other" in error.message


@pytest.mark.parametrize("model", [1, ["m"], True])
def test_non_string_model_is_400(model: Any) -> None:
    error = rejected(inference, "chat", chat(model=model))
    assert (error.status, error.param) == (400, "model")


def test_no_served_models_is_503() -> None:
    error = rejected(inference, "chat", chat(), served={})
    assert error.status == 503
    assert error.code == "no_engine_ready"


def test_missing_model_with_several_served_is_400_listing_them() -> None:
    body = {"messages": CHAT["messages"]}
    error = rejected(inference, "chat", encode(body), served={"a": 10, "b": 10})
    assert (error.status, error.param) == (400, "model")
    assert "a, b" in error.message


def test_explicit_model_is_chosen_among_several() -> None:
    assert inference("chat", chat(model="b"), served={"a": 10, "b": 10}).model == "b"


# -- max_tokens / max_completion_tokens -------------------------------------------------------------
@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [-1, 0, 1.5, 16.0, True, "16", 4097], ids=str)
def test_bad_token_limits_are_400(name: str, value: Any) -> None:
    error = rejected(inference, "chat", chat(**{name: value}))
    assert (error.status, error.param) == (400, name)


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [1, 4096, None])
def test_token_limits_within_context_pass(name: str, value: Any) -> None:
    assert inference("completions", completion(**{name: value})).model == "m"


def test_token_limit_is_checked_against_the_chosen_models_context() -> None:
    served = {"small": 100, "large": 1000}
    assert inference("chat", chat(model="large", max_tokens=500), served=served).model == "large"
    assert rejected(inference, "chat", chat(model="small", max_tokens=500), served=served).param == "max_tokens"


# -- session id -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "session_id",
    ["x" * 129, "", "has space", "tab\there", "nl\n", "del\x7f", "café", 42, ["s"], True],
    ids=["too-long", "empty", "space", "tab", "newline", "del", "non-ascii", "int", "list", "bool"],
)
def test_bad_body_session_id_is_400(session_id: Any) -> None:
    error = rejected(inference, "chat", chat(session_id=session_id))
    assert (error.status, error.param) == (400, "session_id")


@pytest.mark.parametrize("session_id", ["x" * 129, "", "has space", "ctl\x01", "café"])
def test_bad_header_session_id_is_400(session_id: str) -> None:
    error = rejected(inference, "chat", chat(), session_id)
    assert (error.status, error.param) == (400, "session_id")


def test_session_id_at_length_limit_passes() -> None:
    assert inference("chat", chat(session_id="x" * 128)).session_id == "x" * 128


def test_session_id_from_body_is_used_without_header() -> None:
    assert inference("chat", chat(session_id="conv-1")).session_id == "conv-1"


def test_header_session_id_wins_over_body() -> None:
    assert inference("chat", chat(session_id="from-body"), "from-header").session_id == "from-header"


def test_header_session_id_wins_even_over_an_invalid_body_value() -> None:
    assert inference("chat", chat(session_id=12), "from-header").session_id == "from-header"


def test_no_session_id_anywhere_is_none() -> None:
    assert inference("chat", chat()).session_id is None
    assert inference("chat", chat(session_id=None)).session_id is None


# -- results and forwarded body ---------------------------------------------------------------------
def test_valid_chat_returns_its_fields() -> None:
    result = inference("chat", chat(stream=True, session_id="s-1"))
    assert result == InferenceRequest("chat", "m", True, "s-1", result.body, result.history_tokens)


def test_body_with_model_is_forwarded_as_sent() -> None:
    raw = b'{ "model" : "m",  "prompt": "hi\\u00e9", "temperature": 0.50 }'
    assert inference("completions", raw).body == json.loads(raw)


def test_body_without_model_is_forwarded_with_the_served_model_added() -> None:
    raw = encode({"messages": CHAT["messages"], "temperature": 0.5, "session_id": "s"})
    result = inference("chat", raw)
    assert result.body == {**json.loads(raw), "model": "m"}
    assert result.model == "m"


def test_body_with_null_model_is_forwarded_with_the_served_model() -> None:
    result = inference("completions", completion(model=None))
    assert result.body["model"] == "m"


def test_history_is_estimated_and_routing_text_covers_every_message() -> None:
    messages = [
        {"role": "system", "content": "x" * 400},
        {"role": "user", "content": [{"type": "text", "text": "y" * 40}]},
    ]
    result = inference("chat", encode({"model": "m", "messages": messages}))
    assert result.history_tokens == 100 + 10 + 2 * 4  # text, then each message's template
    assert result.routing_text() == "system: " + "x" * 400 + "\nuser: " + "y" * 40 + "\n"
    tokens = inference("completions", encode({"model": "m", "prompt": list(range(70))}))
    assert tokens.history_tokens == 70
    long = inference("completions", encode({"model": "m", "prompt": "z" * 100_000}))
    assert len(long.routing_text()) == 16_384


# -- advisories -------------------------------------------------------------------------------------
def test_valid_advisory_returns_its_fields() -> None:
    result = advisory(encode({"session_id": "s-1", "kind": "predecessor", "expected_arrival_ms": 1500}))
    assert result == AdvisoryRequest("s-1", "predecessor", 1500, "m")


def test_advisory_session_from_header_and_model_defaulted() -> None:
    result = advisory(encode({"kind": "typing"}), "hdr")
    assert (result.session_id, result.kind, result.expected_arrival_ms, result.model) == ("hdr", "typing", None, "m")


def test_advisory_float_arrival_is_truncated_to_int_ms() -> None:
    result = advisory(encode({"session_id": "s", "kind": "typing", "expected_arrival_ms": 250.9}))
    assert result.expected_arrival_ms == 250
    assert isinstance(result.expected_arrival_ms, int)


@pytest.mark.parametrize("arrival", [0, MAX_ARRIVAL])
def test_advisory_arrival_bounds_are_inclusive(arrival: int) -> None:
    result = advisory(encode({"session_id": "s", "kind": "typing", "expected_arrival_ms": arrival}))
    assert result.expected_arrival_ms == arrival


def test_advisory_without_session_is_400() -> None:
    error = rejected(advisory, encode({"kind": "typing"}))
    assert (error.status, error.param) == (400, "session_id")


def test_advisory_with_bad_session_is_400() -> None:
    error = rejected(advisory, encode({"kind": "typing", "session_id": "a b"}))
    assert (error.status, error.param) == (400, "session_id")


@pytest.mark.parametrize("kind", [None, "", "Typing", "prefetch", 1])
def test_advisory_with_unknown_kind_is_400(kind: Any) -> None:
    body = {"session_id": "s"} if kind is None else {"session_id": "s", "kind": kind}
    error = rejected(advisory, encode(body))
    assert (error.status, error.param) == (400, "kind")


@pytest.mark.parametrize(
    "raw_value",
    ["-1", str(MAX_ARRIVAL + 1), "true", '"100"', "NaN", "Infinity", "[100]"],
    ids=["negative", "too-far", "bool", "string", "nan", "infinity", "list"],
)
def test_advisory_with_bad_expected_arrival_is_400(raw_value: str) -> None:
    raw = b'{"session_id": "s", "kind": "typing", "expected_arrival_ms": ' + raw_value.encode() + b"}"
    error = rejected(advisory, raw)
    assert (error.status, error.param) == (400, "expected_arrival_ms")


def test_advisory_for_unknown_model_is_404() -> None:
    error = rejected(advisory, encode({"session_id": "s", "kind": "typing", "model": "x"}))
    assert (error.status, error.code) == (404, "model_not_found")


def test_advisory_with_no_served_models_is_503() -> None:
    assert rejected(advisory, encode({"session_id": "s", "kind": "typing"}), served={}).status == 503


@pytest.mark.parametrize(
    "raw",
    [b'{"max_tokens": ' + b"9" * 5000 + b"}", b"[" * 100_000 + b"]" * 100_000],
    ids=["huge-integer", "deep-nesting"],
)
def test_pathological_json_is_a_400_not_a_crash(raw: bytes) -> None:
    with pytest.raises(ApiError) as info:
        parse_json_object(raw)
    assert info.value.status == 400


# -- wrong types, field by field --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("messages", [{"role": {}, "content": "hi"}], "messages"),  # was a 500: "unhashable type"
        ("messages", [{"role": ["user"], "content": "hi"}], "messages"),
        ("messages", [{"role": "user", "content": "hi", "name": 7}], "messages"),
        ("messages", [{"role": "user", "content": [1, 2]}], "messages"),
        ("max_tokens", "16", "max_tokens"),
        ("max_tokens", [16], "max_tokens"),
        ("temperature", "hot", "temperature"),
        ("temperature", True, "temperature"),
        ("temperature", {}, "temperature"),
        ("top_p", "0.9", "top_p"),
        ("top_k", 1.5, "top_k"),
        ("n", "2", "n"),
        ("seed", 1.0, "seed"),
        ("stop", 5, "stop"),
        ("stop", ["ok", 5], "stop"),
        ("stop", {"a": 1}, "stop"),
        ("presence_penalty", "0", "presence_penalty"),
        ("frequency_penalty", [], "frequency_penalty"),
        ("logit_bias", {"50256": "x"}, "logit_bias"),
        ("logit_bias", [1], "logit_bias"),
        ("logprobs", 1, "logprobs"),  # a chat's logprobs is true/false
        ("top_logprobs", "2", "top_logprobs"),
        ("user", 12, "user"),
        ("stream_options", "yes", "stream_options"),
        ("session_id", {}, "session_id"),
        ("session_id", 3.5, "session_id"),
    ],
)
def test_a_chat_field_of_the_wrong_type_is_a_400_naming_it(field: str, value: Any, param: str) -> None:
    error = rejected(inference, "chat", chat(**{field: value}))
    assert (error.status, error.param) == (400, param)
    assert error.message.startswith(param)  # the path to the bad value: "messages[0].role: ..."


@pytest.mark.parametrize(
    ("field", "value"), [("logprobs", True), ("echo", "yes"), ("best_of", "2"), ("suffix", 1), ("temperature", "0")]
)
def test_a_completion_field_of_the_wrong_type_is_a_400_naming_it(field: str, value: Any) -> None:
    error = rejected(inference, "completions", completion(**{field: value}))
    assert (error.status, error.param) == (400, field)


def test_the_message_names_the_bad_element_and_what_came() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": {}, "content": "b"}]}
    error = rejected(inference, "chat", encode(body))
    assert error.message.startswith("messages[1].role: ") and "{}" in error.message


@pytest.mark.parametrize(
    "fields",
    [
        {
            "temperature": 0,
            "top_p": 1,
            "n": 1,
            "stop": ["\n"],
            "seed": 7,
            "logprobs": True,
            "top_logprobs": 2,
            "stream_options": {"include_usage": True},
            "user": "u",
            "logit_bias": {"1": -100},
        },
        {"temperature": 0.7, "stop": "END", "presence_penalty": -0.5, "frequency_penalty": 1},
        {"some_future_openai_field": {"any": "thing"}, "tools": [{"type": "function"}]},  # passed through
    ],
)
def test_well_typed_sampling_fields_pass_and_are_forwarded_as_sent(fields: dict[str, Any]) -> None:
    result = inference("chat", chat(**fields))
    assert all(result.body[name] == value for name, value in fields.items())


@pytest.mark.parametrize(
    ("kind", "arrival", "param"),
    [
        ("typing", "soon", "expected_arrival_ms"),
        ("typing", True, "expected_arrival_ms"),
        ("typing", [1], "expected_arrival_ms"),
        ({}, None, "kind"),
        (["typing"], None, "kind"),
    ],
)
def test_an_advisory_field_of_the_wrong_type_is_a_400(kind: Any, arrival: Any, param: str) -> None:
    body: dict[str, Any] = {"session_id": "s", "kind": kind}
    if arrival is not None:
        body["expected_arrival_ms"] = arrival
    error = rejected(advisory, encode(body))
    assert (error.status, error.param) == (400, param)


@pytest.mark.parametrize(
    ("endpoint", "fields", "message"),
    [
        ("completions", {"prompt": [[1, "a"]]}, "prompt[0][1]: Input should be a valid integer, got 'a'"),
        (
            "chat",
            {"messages": [{"role": "user", "content": [1]}]},
            "messages[0].content[0]: Input should be a valid dictionary, got 1",
        ),
        ("chat", {"logit_bias": {"int": "x"}}, "logit_bias.int: Input should be a valid number, got 'x'"),  # a key
        ("chat", {"messages": [{"content": "x"}]}, "messages[0].role: is required"),
    ],
)
def test_the_message_points_at_the_deepest_bad_value(endpoint: str, fields: dict[str, Any], message: str) -> None:
    body = {**(CHAT if endpoint == "chat" else COMPLETION), **fields}
    assert rejected(inference, endpoint, encode(body)).message == message


@pytest.mark.parametrize("raw_value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_a_400(raw_value: str) -> None:
    raw = chat()[:-1] + b', "temperature": ' + raw_value.encode() + b"}"
    error = rejected(inference, "chat", raw)
    assert (error.status, error.param) == (400, "temperature")


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_VALID = {
    "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
    "completions": {"model": "m", "prompt": "hi", "max_tokens": 8},
    "advisory": {"session_id": "s", "kind": "typing", "expected_arrival_ms": 100},
}
# Where one value of a valid body may be replaced: every field the scheduler or a policy reads.
_PLACES = [
    "model",
    "messages",
    "prompt",
    "stream",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "session_id",
    "cache_salt",
    "logprobs",
    "top_logprobs",
    "stream_options",
    "user",
    "logit_bias",
    "kind",
    "expected_arrival_ms",
    "messages.0",
    "messages.0.role",
    "messages.0.content",
    "messages.0.name",
]


def _with(body: dict[str, Any], place: str, value: Any) -> dict[str, Any]:
    body = json.loads(json.dumps(body))
    *parents, last = place.split(".")
    target: Any = body
    for part in parents:
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return body  # that place does not exist in this endpoint's body
    if isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value
    return body


def _answered(endpoint: str, body: dict[str, Any]) -> None:
    """Validation answers a request or an ApiError (4xx), never another exception (a 500)."""
    try:
        if endpoint == "advisory":
            advisory(encode(body))
        else:
            inference(endpoint, encode(body))
    except ApiError as error:
        assert 400 <= error.status < 500 and error.message


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(endpoint=st.sampled_from(sorted(_VALID)), place=st.sampled_from(_PLACES), value=_JSON)
def test_any_value_in_any_field_is_accepted_or_a_4xx_never_a_crash(endpoint: str, place: str, value: Any) -> None:
    _answered(endpoint, _with(_VALID[endpoint], place, value))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(endpoint=st.sampled_from(sorted(_VALID)), body=st.dictionaries(st.sampled_from(_PLACES[:20]), _JSON, max_size=6))
def test_any_json_object_is_accepted_or_a_4xx_never_a_crash(endpoint: str, body: dict[str, Any]) -> None:
    _answered(endpoint, body)
