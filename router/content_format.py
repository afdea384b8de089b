"""vLLM's "auto" chat content format, ported from vllm/renderers/hf.py.

vLLM hands a template message content either as one string ("string") or as a list
of {"type": "text", ...} parts ("openai"); it picks "openai" when the template loops
over a message's content. The rendered text differs between the two, so the gateway
must pick the same way.
"""

from __future__ import annotations

from typing import Any


def _is_var(node: Any, name: str) -> bool:
    from jinja2 import nodes

    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: Any, name: str, key: str) -> bool:
    from jinja2 import nodes

    if isinstance(node, nodes.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    if isinstance(node, nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node: Any, name: str, key: str | None = None) -> bool:
    from jinja2 import nodes

    if isinstance(node, nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _aliases(root: Any, name: str) -> list[str]:
    """`name` and every variable assigned from it (or a slice of it), transitively."""
    from jinja2 import nodes

    found = [name]
    queue = [name]
    while queue:
        current = queue.pop(0)
        for assign in root.find_all(nodes.Assign):
            if _is_var_or_elems(assign.node, current) and isinstance(assign.target, nodes.Name):
                found.append(assign.target.name)
                if assign.target.name != current:
                    queue.append(assign.target.name)
    return found


def _loops_over_content(root: Any) -> bool:
    from jinja2 import nodes

    messages = _aliases(root, "messages")
    message_vars = [
        loop.target.name
        for loop in root.find_all(nodes.For)
        if isinstance(loop.target, nodes.Name) and any(_is_var_or_elems(loop.iter, m) for m in messages)
    ]
    # Macro parameters that receive message.content, whatever they are called.
    params_by_loop: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in root.find_all(nodes.Macro):
        names = {arg.name for arg in macro.args}
        params: set[str] = set()
        for call in root.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(_is_var_or_elems(arg, v, "content") for v in message_vars):
                    params.add(macro.args[i].name)
            for kw in call.kwargs:
                if kw.key in names and any(
                    _is_var_or_elems(kw.value, v, "content") for v in message_vars
                ):
                    params.add(kw.key)
        for loop in macro.find_all(nodes.For):
            loops_in_macros.add(id(loop))
            if params:
                params_by_loop[id(loop)] = params
    for loop in root.find_all(nodes.For):
        if any(_is_var_or_elems(loop.iter, v, "content") for v in message_vars):
            return True
        if isinstance(loop.iter, nodes.Name):
            if loop.iter.name in params_by_loop.get(id(loop), set()):
                return True
            if id(loop) not in loops_in_macros and loop.iter.name == "content":
                return True
    return False


def detect_content_format(chat_template: str) -> str:
    """'openai' if the template loops over message content, else 'string' (as vLLM's auto)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        root = _compile_jinja_template(chat_template).environment.parse(chat_template)
    except Exception:  # vLLM falls back to "string" for a template it cannot parse
        return "string"
    try:
        return "openai" if _loops_over_content(root) else "string"
    except Exception:
        return "string"

