"""Which form a chat template wants message content in, decided as vLLM 0.32 decides it.

vLLM's OpenAI server (`--chat-template-content-format auto`, its default) reads the template's Jinja
syntax tree: a template that loops over a message's `content` gets every message's content as a
list of parts (`"openai"`: `[{"type": "text", "text": ...}]`, even content sent as a string); any
other gets one string (`"string"`: text parts joined by newlines). The two render differently, so
the scheduler must decide the same way. This is vLLM's detection (vllm/renderers/hf.py,
`_detect_content_format` and the helpers it calls), ported with its rules unchanged (Apache-2.0).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from functools import lru_cache
from typing import Literal

import jinja2.nodes

ContentFormat = Literal["string", "openai"]


def detect_content_format(template: str) -> ContentFormat:
    """`"openai"` when the template iterates over message content, else `"string"` (also for a
    template that does not parse, as vLLM falls back to)."""
    return _detect(template)


@lru_cache(maxsize=32)
def _detect(template: str) -> ContentFormat:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        compiled = _compile_jinja_template(template)
        root = compiled.environment.parse(template)
    except Exception:
        return "string"
    try:
        next(_content_item_loops(root))
    except StopIteration:
        return "string"
    except Exception:
        return "string"
    return "openai"


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _aliases(root: jinja2.nodes.Node, name: str) -> Iterator[str]:
    """`name` and every variable assigned from it (or a slice or filter of it), transitively."""
    yield name
    pending = deque([name])
    while pending:
        current = pending.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems(assign.node, current):
                assert isinstance(assign.target, jinja2.nodes.Name)
                yield assign.target.name
                if assign.target.name != current:
                    pending.append(assign.target.name)


def _message_names(root: jinja2.nodes.Node) -> Iterator[str]:
    """The loop variables of `{% for message in messages %}` loops (over any alias of messages)."""
    messages = list(_aliases(root, "messages"))
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems(loop.iter, name) for name in messages):
            assert isinstance(loop.target, jinja2.nodes.Name)
            yield loop.target.name


def _content_item_loops(root: jinja2.nodes.Node) -> Iterator[str]:
    """Loops over a message's content: `{% for part in message['content'] %}`, a loop over a macro
    parameter that a call passes message content to, or a top-level `{% for x in content %}`."""
    messages = list(_message_names(root))
    macro_params_by_loop: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        param_names = {arg.name for arg in macro.args}
        content_params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(_is_var_or_elems(arg, m, "content") for m in messages):
                    content_params.add(macro.args[i].name)
            for kwarg in call.kwargs:
                if (
                    isinstance(kwarg, jinja2.nodes.Keyword)
                    and kwarg.key in param_names
                    and any(_is_var_or_elems(kwarg.value, m, "content") for m in messages)
                ):
                    content_params.add(kwarg.key)
        for loop in macro.find_all(jinja2.nodes.For):
            loops_in_macros.add(id(loop))
            if content_params:
                macro_params_by_loop[id(loop)] = content_params
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems(loop.iter, m, "content") for m in messages):
            assert isinstance(loop.target, jinja2.nodes.Name)
            yield loop.target.name
            continue
        params = macro_params_by_loop.get(id(loop))
        if isinstance(loop.iter, jinja2.nodes.Name) and params is not None and loop.iter.name in params:
            assert isinstance(loop.target, jinja2.nodes.Name)
            yield loop.target.name
            continue
        if id(loop) not in loops_in_macros and isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name == "content":
            assert isinstance(loop.target, jinja2.nodes.Name)
            yield loop.target.name
