"""The shapes of the request bodies the scheduler accepts, as pydantic models (as vLLM's own protocol
classes are), checked strictly: a field of the wrong type is a 400 naming it, never a 500 from code
that trusted it (docs/model-identity.md#request-validation).

Only types and the bounds the scheduler itself depends on are checked here; finer sampling-parameter
rules stay with vLLM, whose 400s pass through. Unknown fields pass through to vLLM untouched
(`extra="allow"`), so newer OpenAI parameters keep working.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, StrictBool, StrictInt, StrictStr, ValidationError

from scheduler.errors import ApiError

MAX_MESSAGES = 10_000
MAX_CACHE_SALT_CHARS = 256
MessageRole = Literal["system", "developer", "user", "assistant", "tool", "function"]
AdvisoryKind = Literal["typing", "predecessor"]

# JSON numbers, integers included (strict floats take ints): never booleans, numeric strings, NaN or
# infinities (which Python's json accepts). Only checked: the body goes on as the client sent it.
Number = FiniteFloat
TokenIds = Annotated[list[StrictInt], Field(min_length=1)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class ChatMessage(_Body):
    role: MessageRole
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None


class _Sampling(_Body):
    """Fields both endpoints share. `model` and `session_id` are resolved by the caller (a 404 for an
    unknown model; the session header wins over an invalid body value)."""

    stream: StrictBool | None = None
    stream_options: dict[str, Any] | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    n: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    user: StrictStr | None = None
    # A client's own salt (splitting its tenant's engine cache further) must be what vLLM accepts:
    # the scheduler hashes it into the salt the engine sees, which would hide vLLM's own check.
    cache_salt: Annotated[StrictStr, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None


class ChatBody(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None


class CompletionBody(_Sampling):
    prompt: (
        StrictStr
        | Annotated[list[StrictStr], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


class TokenizeCompletionBody(_Body):
    """`POST /tokenize` with a prompt (vLLM's TokenizeCompletionRequest)."""

    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool | None = None


class TokenizeChatBody(_Body):
    """`POST /tokenize` with messages (vLLM's TokenizeChatRequest)."""

    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)]
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool | None = None
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class DetokenizeBody(_Body):
    """`POST /detokenize` (vLLM's DetokenizeRequest)."""

    tokens: list[Annotated[StrictInt, Field(ge=0, le=2**63 - 1)]]


class AdvisoryBody(_Body):
    kind: AdvisoryKind
    expected_arrival_ms: Number | None = None


class QuotaLimitsBody(BaseModel):
    """A tenant's limits as `PUT /admin/v1/quotas` takes them (symphony.tenant_quotas.TenantLimits);
    a key left out keeps its value. Ranges are the limits' own check."""

    model_config = ConfigDict(strict=True, extra="forbid")
    requests_per_s: Number | None = None
    request_burst: StrictInt | None = None
    advisories_per_s: Number | None = None
    advisory_burst: StrictInt | None = None
    max_inflight: StrictInt | None = None
    max_queued: StrictInt | None = None
    weight: Number | None = None


class QuotaUpdateBody(_Body):
    """`PUT /admin/v1/quotas`: `limits` null clears the tenant's own (back to `[quotas]`' defaults)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    tenant: StrictStr
    limits: QuotaLimitsBody | None


def check(schema: type[_Body], body: dict[str, Any]) -> None:
    """Raise a 400 ApiError naming the first field of `body` that does not fit `schema`."""
    try:
        schema.model_validate(body)
    except ValidationError as exc:
        raise _api_error(exc, body) from None


def _api_error(exc: ValidationError, body: dict[str, Any]) -> ApiError:
    """The most specific of pydantic's errors, as an OpenAI-style 400: `param` the top-level field,
    the message the path to the bad value (`messages[1].role: ...`) and what came there. A value
    that fits no form of a union gets one error per form; the one that got deepest into the value
    says the most (`prompt[0][1]: Input should be a valid integer, got 'a'`)."""
    located = [(_path(body, error["loc"]), error) for error in exc.errors(include_url=False)]
    path, error = max(located, key=lambda item: len(item[0]))  # the first of the deepest
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path).lstrip(".")
    message = "is required" if error["type"] == "missing" else f"{error['msg']}, got {_shown(error.get('input'))}"
    return ApiError(400, f"{where}: {message}" if where else message, param=str(path[0]) if path else None)


def _path(body: Any, loc: tuple[str | int, ...]) -> list[str | int]:
    """The parts of pydantic's error location that step into the client's value. The others name the
    union member tried ("str", "list[int]", ...); a dict key a client chose is never mistaken for one,
    since it is found in the value. A missing field is the last part, named though absent."""
    path: list[str | int] = []
    value = body
    for i, part in enumerate(loc):
        inside = (isinstance(value, dict) and part in value) or (
            isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value)
        )
        if inside:
            value = value[part]
        elif not (i == len(loc) - 1 and isinstance(value, dict) and isinstance(part, str) and not _names_a_form(part)):
            continue  # a union member's name, not a step into the value
        # (else: a required field the client left out, named though absent)
        path.append(part)
    return path


def _names_a_form(part: str) -> bool:
    return part in ("str", "int", "float", "bool", "dict", "list", "none") or part.startswith(
        ("list[", "dict[", "constrained-", "literal[", "function-")
    )


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
