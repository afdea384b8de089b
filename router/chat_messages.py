"""Chat messages and tools as vLLM 0.32 hands them to a chat template.

Ported from vLLM's renderer (vllm/renderers/chat_utils.py): text parts joined with "\\n"
(vLLM's "string" content format) or kept as a list of text parts ("openai"), tool-call
`arguments` parsed from JSON into a mapping, tools in pydantic's model_dump form, and
developer -> system for templates without a developer role. Any body a replica would
refuse raises `ClientError` naming the bad field.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from router.request import ClientError

_TEXT_PART_FIELDS = {
    "text": "text", "input_text": "text", "output_text": "text",
    "refusal": "refusal", "thinking": "thinking",
}
# vLLM drops this first line of Claude Code's system prompt (its value changes on
# every request and would break the prefix cache); we must drop it too.
_CLAUDE_CODE_BILLING_HEADER = "x-anthropic-billing-header"


def _require_str(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise ClientError(f"{param} must be a string, got {type(value).__name__}", param)
    return value


def _content_texts(content: Any, param: str) -> list[str]:
    """The text pieces of a message's content (a string or a list of parts)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise ClientError(
            f"{param} must be a string or a list of content parts, got {type(content).__name__}",
            param,
        )
    texts: list[str] = []
    for i, part in enumerate(content):
        where = f"{param}[{i}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise ClientError(f"{where} must be an object, got {type(part).__name__}", where)
        part_type = part.get("type")
        field_name = _TEXT_PART_FIELDS.get(part_type) if isinstance(part_type, str) else None
        if field_name is None:
            raise ClientError(
                f"{where} has type {part_type!r}; only text parts are supported "
                f"({', '.join(sorted(_TEXT_PART_FIELDS))})",
                where,
            )
        text = part.get(field_name)
        if text is None:
            continue  # vLLM skips a text part without text
        texts.append(_require_str(text, f"{where}.{field_name}"))
    return texts


def _strip_billing_header(texts: list[str]) -> list[str]:
    out = []
    for text in texts:
        if text.startswith(_CLAUDE_CODE_BILLING_HEADER):
            text = text.partition("\n")[2]
            if not text:
                continue
        out.append(text)
    return out


def _parse_arguments(arguments: Any) -> dict[str, Any]:
    """Tool-call arguments as vLLM hands them to templates: always a mapping.

    vLLM coerces malformed or non-object JSON to {} rather than failing the request,
    since the bad string lives in the history and would fail every later turn too.
    """
    if not arguments:
        return {}
    if isinstance(arguments, dict):
        return arguments
    parsed: Any = arguments
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return {}
    return parsed if isinstance(parsed, dict) else {}


def _normalise_tool_calls(calls: Any, param: str) -> list[Any] | None:
    if not isinstance(calls, list):
        raise ClientError(f"{param} must be a list, got {type(calls).__name__}", param)
    if not calls:
        return None  # vLLM drops an empty list to keep templates on the plain path
    out = []
    for i, call in enumerate(calls):
        where = f"{param}[{i}]"
        if not isinstance(call, dict):
            raise ClientError("assistant tool_calls entries must be objects.", "tool_calls")
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, dict):
            raise ClientError(
                "chat completions only support assistant tool_calls of type 'function'.",
                "tool_calls",
            )
        call = copy.deepcopy(call)
        call["function"]["arguments"] = _parse_arguments(function.get("arguments"))
        if not isinstance(call["function"].get("name", ""), str):
            raise ClientError(f"{where}.function.name must be a string", where)
        out.append(call)
    return out


def normalise_messages(
    messages: Any, *, content_format: str = "string"
) -> list[dict[str, Any]]:
    """Chat messages as vLLM passes them to the template (its 'string' or 'openai' form)."""
    if not isinstance(messages, list) or not messages:
        raise ClientError("messages must be a non-empty list of message objects", "messages")
    conversation: list[dict[str, Any]] = []
    string_format = content_format != "openai"
    for i, message in enumerate(messages):
        if string_format and _plain(message):
            # Most of a long conversation: what normalise_message makes of it, without
            # its per-message strings and lists (0.1-0.2 ms a request at 8k tokens of
            # history, on every turn).
            conversation.append({"role": message["role"], "content": message["content"]})
        else:
            conversation.append(normalise_message(i, message, content_format))
    return conversation


def _plain(message: Any) -> bool:
    """A user's text or a plain answer in text, with nothing else to carry over."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), str):
        return False
    role = message.get("role")
    return (role == "user" or (role == "assistant" and message.get("tool_calls") is None
                               and message.get("reasoning") is None)) \
        and "name" not in message and "task" not in message


def normalise_message(i: int, message: Any, content_format: str) -> dict[str, Any]:
    """messages[i] as vLLM passes it to the template."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise ClientError(f"{where} must be an object, got {type(message).__name__}", where)
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ClientError(f"{where}.role must be a non-empty string, got {role!r}", where)
    texts = _content_texts(message.get("content"), f"{where}.content")
    if role == "system":
        texts = _strip_billing_header(texts)
    content: Any
    if content_format == "openai":
        content = [{"type": "text", "text": t} for t in texts]
    else:
        content = "\n".join(texts)
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        if message.get("tool_calls") is not None:
            calls = _normalise_tool_calls(message["tool_calls"], f"{where}.tool_calls")
            if calls is not None:
                out["tool_calls"] = calls
        reasoning = message.get("reasoning")
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        if content_format == "openai":
            out["content"] = "\n".join(texts)
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    if isinstance(message.get("task"), str):
        out["task"] = message["task"]
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


def developer_to_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's rewrite for templates without a developer role: one merged system message."""
    converted = []
    for msg in conversation:
        if msg["role"] == "developer":
            msg = {k: v for k, v in msg.items() if k != "tools"}
            msg["role"] = "system"
        converted.append(msg)
    system_texts: list[str] = []
    others: list[dict[str, Any]] = []
    merge = False
    for i, msg in enumerate(converted):
        if msg["role"] != "system":
            others.append(msg)
            continue
        merge = merge or i > 0 or bool(system_texts)
        content = msg.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                p["text"] if isinstance(p, dict) else p
                for p in content
                if isinstance(p, str) or (isinstance(p, dict) and "text" in p)
            )
        if content:
            system_texts.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(system_texts)}, *others]


def normalise_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Tool definitions in the shape vLLM's pydantic model_dump gives the template."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ClientError(f"tools must be a list, got {type(tools).__name__}", "tools")
    if not tools:
        raise ClientError(
            "`tools` must not be an empty array. "
            "Either provide at least one tool or omit the field entirely.",
            "tools",
        )
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise ClientError(f"{where} must be an object with a 'function' object", where)
        if tool.get("type", "function") != "function":
            raise ClientError(f"{where}.type must be 'function', got {tool.get('type')!r}", where)
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str):
            raise ClientError(f"{where}.function.name must be a string, got {name!r}", where)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ClientError(f"{where}.function.parameters must be an object", where)
        function: dict[str, Any] = {
            "name": name, "description": fn.get("description"), "parameters": params,
        }
        for optional in ("strict", "defer_loading"):
            if fn.get(optional) is not None:
                function[optional] = fn[optional]
        if tool.get("defer_loading") is not None and "defer_loading" not in function:
            function["defer_loading"] = tool["defer_loading"]
        dumped: dict[str, Any] = {"type": "function", "function": function}
        if tool.get("defer_loading") is not None:
            dumped["defer_loading"] = tool["defer_loading"]
        out.append(dumped)
    return out

