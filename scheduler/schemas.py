"""The shapes of the request bodies the scheduler accepts, as pydantic models (as vLLM's own protocol
classes are), checked strictly: a field of the wrong type is a 400 naming it, never a 500 from code
that trusted it (`{"role": {}}` once reached a set lookup and raised "unhashable type").

Only types and the bounds the scheduler itself depends on are checked here; finer sampling-parameter
rules stay with vLLM, whose 400s pass through. Unknown fields pass through to vLLM untouched
(`extra="allow"`), so newer OpenAI parameters keep working.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from scheduler.errors import ApiError

MAX_MESSAGES = 10_000
MAX_CACHE_SALT_CHARS = 256
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
ADVISORY_KINDS = ("typing", "predecessor")

Number = StrictInt | StrictFloat  # JSON numbers; never booleans or numeric strings
TokenIds = Annotated[list[StrictInt], Field(min_length=1)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class ChatMessage(_Body):
    role: Literal[MESSAGE_ROLES]  # type: ignore[valid-type]
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None


class _Sampling(_Body):
    """Fields both endpoints share. `model` and `session_id` are resolved by the caller (a 404 for an
    unknown model; the session header wins over an invalid body value)."""

    stream: StrictBool | None = None
    stream_options: dict[str, Any] | None = None
    max_tokens: StrictInt | None = None
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
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None


class CompletionBody(_Sampling):
    prompt: StrictStr | Annotated[list[StrictStr], Field(min_length=1)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1)]
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


class AdvisoryBody(_Body):
    kind: Literal[ADVISORY_KINDS]  # type: ignore[valid-type]
    expected_arrival_ms: Number | None = None


def check(schema: type[_Body], body: dict[str, Any]) -> None:
    """Raise a 400 ApiError naming the first field of `body` that does not fit `schema`."""
    try:
        schema.model_validate(body)
    except ValidationError as exc:
        raise _api_error(exc, body) from None


def _api_error(exc: ValidationError, body: dict[str, Any]) -> ApiError:
    error = exc.errors(include_url=False)[0]
    loc = [part for part in error["loc"] if not _is_union_branch(part)]
    param = str(loc[0]) if loc else None
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    message = error["msg"]
    if error["type"] == "missing":
        message = "is required"
    elif param is not None and param in body:
        got = error.get("input")
        message = f"{message}, got {_shown(got)}"
    return ApiError(400, f"{where}: {message}" if where else message, param=param)


def _is_union_branch(part: str | int) -> bool:
    """pydantic names the union member it tried in the location ("str", "list[int]", ...)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list", "none")
                                      or part.startswith(("list[", "dict[", "constrained-", "literal[")))


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
