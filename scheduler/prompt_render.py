"""A request's prompt as vLLM 0.32's OpenAI server builds it, up to the text it tokenizes.

For a chat request (`/v1/chat/completions`, or `/tokenize` with `messages`) that is the output of the
model's chat template, rendered by transformers' `apply_chat_template` with the conversation vLLM
builds (`scheduler.chat_messages`) and the keyword arguments vLLM passes it: merged as
vllm/renderers/params.py merges them (the request's `chat_template_kwargs` under its own
`add_generation_prompt`, `continue_final_message`, `documents`, `reasoning_effort`, over the
defaults `tools` and `tokenize=False`; None and "auto" mean not given), then filtered to those the
template reads or `apply_chat_template` names (vllm/renderers/hf.py, `safe_apply_chat_template`).
The template is the tokenizer's (its "tool_use" one when tools are given and it has one). The text
is then tokenized with `add_special_tokens` (default false for chats, true for completions). For a
completion the prompt is its text, or the token ids the client sent.

What vLLM would refuse raises `NoTokenIds("invalid_input")`; what it would serve but the scheduler
cannot reproduce (images and other media, prompt embeddings, fill-in-the-middle suffixes, several
prompts in one request, a template tokenizing by itself, truncation to the context length, a
template only a processor or a `--chat-template` flag provides) raises `NoTokenIds("unsupported")`.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from functools import lru_cache
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from scheduler.chat_format import detect_content_format
from scheduler.chat_messages import conversation_of, developer_as_system
from scheduler.prompts import IdsPrompt, NoTokenIds, TextPrompt, Truncation

_UNSET = (None, "auto")  # values vLLM's merge_kwargs treats as not given


# -- the request fields that shape the prompt, typed as vLLM's protocol classes type them (lax) ------
class _Function(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class _Tool(BaseModel):
    type: Literal["function"] = "function"
    function: _Function
    defer_loading: bool | None = None

    def dump(self) -> dict[str, Any]:
        """As vLLM's ChatCompletionToolsParam.model_dump(): None `strict`/`defer_loading` left out, a
        tool's `defer_loading` copied into its function."""
        f = self.function
        function: dict[str, Any] = {"name": f.name, "description": f.description, "parameters": f.parameters}
        if f.strict is not None:
            function["strict"] = f.strict
        defer = f.defer_loading if f.defer_loading is not None else self.defer_loading
        if defer is not None:
            function["defer_loading"] = defer
        tool: dict[str, Any] = {"type": self.type, "function": function}
        if self.defer_loading is not None:
            tool["defer_loading"] = self.defer_loading
        return tool


_Truncate = Annotated[int, Field(ge=-1, le=2**63 - 1)] | None


class _ChatFields(BaseModel):
    model_config = ConfigDict(extra="ignore")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[_Tool] | None = None
    # Chat completions only (not /tokenize):
    documents: list[dict[str, str]] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    truncate_prompt_tokens: _Truncate = None
    truncation_side: Literal["left", "right"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _exclusive(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("continue_final_message") and data.get("add_generation_prompt"):
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return data


class _CompletionFields(BaseModel):
    model_config = ConfigDict(extra="ignore")
    add_special_tokens: bool = True
    suffix: str | None = None
    prompt_embeds: Any = None
    truncate_prompt_tokens: _Truncate = None
    truncation_side: Literal["left", "right"] | None = None


def _fields(schema: type[BaseModel], body: Mapping[str, Any], names: tuple[str, ...] | None = None) -> Any:
    picked = {k: v for k, v in body.items() if names is None or k in names}
    try:
        return schema.model_validate(picked)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in error["loc"])
        raise NoTokenIds("invalid_input", f"{where}: {error['msg']}" if where else error["msg"]) from None


# The fields of a chat body that shape its prompt and that `/tokenize` takes too.
TOKENIZE_CHAT_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)


# -- chat ------------------------------------------------------------------------------------------
def chat_prompt(tokenizer: Any, body: Mapping[str, Any], *, tokenize_endpoint: bool = False) -> TextPrompt:
    """The text vLLM tokenizes for a chat body (`/v1/chat/completions`, or `/tokenize` when
    `tokenize_endpoint`: no documents, reasoning effort or truncation there). `tokenizer` is the
    transformers fast tokenizer of the served model."""
    fields: _ChatFields = _fields(_ChatFields, body, TOKENIZE_CHAT_FIELDS if tokenize_endpoint else None)
    user_kwargs = fields.chat_template_kwargs or {}
    if not tokenize_endpoint and fields.tools == []:
        raise NoTokenIds("invalid_input", "`tools` must not be an empty array.")
    if fields.chat_template is not None or user_kwargs.get("chat_template") is not None:
        raise NoTokenIds(
            "invalid_input",
            "Chat template is passed with request, but --trust-request-chat-template is not set. "
            "Refused request with untrusted chat template.",
        )
    explicit: dict[str, Any] = {
        "add_generation_prompt": fields.add_generation_prompt,
        "continue_final_message": fields.continue_final_message,
    }
    if not tokenize_endpoint:
        explicit |= {"documents": fields.documents, "reasoning_effort": fields.reasoning_effort}
        if fields.reasoning_effort is not None and "enable_thinking" not in user_kwargs:
            explicit["enable_thinking"] = fields.reasoning_effort != "none"
    tool_dicts = [tool.dump() for tool in fields.tools] if fields.tools is not None else None
    # vLLM's order: the request's kwargs under its explicit fields, over the server's defaults.
    defaults = _merge({}, {"tools": tool_dicts, "tokenize": False})
    kwargs = _merge(_merge(defaults, _merge(user_kwargs, explicit)), {"return_dict": False})
    tools = kwargs.pop("tools", None)
    if kwargs.pop("tokenize", False):
        raise NoTokenIds("unsupported", "chat_template_kwargs.tokenize: the template tokenizes by itself")
    template = _template(tokenizer, tools)
    conversation = developer_as_system(conversation_of(body["messages"], detect_content_format(template)), template)
    accepted = _accepted_kwargs(tokenizer, template)
    try:
        text = tokenizer.apply_chat_template(
            conversation=conversation,
            tools=tools,
            chat_template=template,
            tokenize=False,
            **{k: v for k, v in kwargs.items() if k in accepted},
        )
    except Exception as exc:  # the template refused the input (vLLM answers 400 with its reason)
        raise NoTokenIds("invalid_input", f"the chat template rejected the request: {_reason(exc)}") from None
    if not isinstance(text, str):
        raise NoTokenIds("unsupported", f"the chat template returned {type(text).__name__}, not text")
    truncation = None if tokenize_endpoint else _truncation(fields, tokenizer)
    return TextPrompt(text, fields.add_special_tokens, truncation)


def _merge(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """vllm.renderers.params.merge_kwargs: `overrides` win, except their None and "auto" values."""
    return {**defaults, **{k: v for k, v in overrides.items() if not _unset(v)}}


def _unset(value: Any) -> bool:
    return any(value is u or (isinstance(value, str) and value == u) for u in _UNSET)


def _template(tokenizer: Any, tools: Any) -> str:
    try:
        template = tokenizer.get_chat_template(None, tools=tools)
    except Exception as exc:
        raise NoTokenIds("unsupported", f"the model's tokenizer has no chat template: {_reason(exc)}") from None
    if not isinstance(template, str):
        raise NoTokenIds("unsupported", "the model's tokenizer has no chat template")
    return template


@lru_cache(maxsize=32)
def _template_variables(template: str) -> frozenset[str]:
    import jinja2.meta
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        compiled = _compile_jinja_template(template)
        return frozenset(jinja2.meta.find_undeclared_variables(compiled.environment.parse(template)))
    except Exception:
        return frozenset()


def _accepted_kwargs(tokenizer: Any, template: str) -> frozenset[str]:
    """vllm.renderers.hf.resolve_chat_template_kwargs: what the template reads, and what
    `apply_chat_template` takes by name."""
    return _template_variables(template) | _named_parameters(type(tokenizer))


_NAMED_PARAMETERS: dict[type, frozenset[str]] = {}


def _named_parameters(tokenizer_class: type) -> frozenset[str]:
    """The parameters `apply_chat_template` takes by name, the tokenizer's own and transformers' base
    class's (vLLM accepts both)."""
    named = _NAMED_PARAMETERS.get(tokenizer_class)
    if named is None:
        from transformers import PythonBackend

        names: set[str] = set()
        for cls in (tokenizer_class, PythonBackend):
            parameters = inspect.signature(cls.apply_chat_template).parameters.values()  # type: ignore[attr-defined]
            names |= {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        named = _NAMED_PARAMETERS[tokenizer_class] = frozenset(names - {"self", "chat_template", "tokenize"})
    return named


def _reason(exc: BaseException) -> str:
    """The most specific message of an exception chain: a Jinja error's own, where there is one."""
    import jinja2

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, jinja2.TemplateError):
            return str(current)
        current = current.__cause__ or current.__context__
    return str(exc)


# -- completions -----------------------------------------------------------------------------------
def completion_prompt(tokenizer: Any, body: Mapping[str, Any]) -> TextPrompt | IdsPrompt:
    """The prompt of a `/v1/completions` body: its text and `add_special_tokens`, or its token ids."""
    fields: _CompletionFields = _fields(_CompletionFields, body)
    if fields.prompt_embeds is not None:
        raise NoTokenIds("unsupported", "prompt_embeds")
    if fields.suffix is not None:
        raise NoTokenIds("unsupported", "suffix (fill-in-the-middle rendering)")
    prompt = body["prompt"]
    if prompt == "":
        raise NoTokenIds("invalid_input", "Either prompt or prompt_embeds must be provided and non-empty.")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise NoTokenIds("unsupported", f"{len(prompt)} prompts in one request (one token sequence each)")
        prompt = prompt[0]
    truncation = _truncation(fields, tokenizer)
    if isinstance(prompt, str):
        return TextPrompt(prompt, fields.add_special_tokens, truncation)
    if not isinstance(prompt, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        raise NoTokenIds("invalid_input", "prompt must be a string, a list of strings or token ids")
    return IdsPrompt(list(prompt), truncation)


def _truncation(fields: _ChatFields | _CompletionFields, tokenizer: Any) -> Truncation | None:
    keep = fields.truncate_prompt_tokens
    if keep is None:
        return None
    if keep < 0:  # vLLM cuts to the context length less one: the scheduler does not decide that here
        raise NoTokenIds("unsupported", "truncate_prompt_tokens=-1 (to the context length)")
    side = fields.truncation_side or getattr(tokenizer, "truncation_side", "left")
    return Truncation(keep, "right" if side == "right" else "left", fields.truncation_side is not None)
