"""Request fields read as vLLM reads them: pydantic's lax mode, with vLLM's own types.

vLLM 0.32 builds its request objects (CompletionRequest, ChatCompletionRequest) with
pydantic in lax mode, so it serves "max_tokens": "3", 3.0 or true, "stream": "true",
"yes" or 1, and a prompt of token ids written as 1.0; it refuses 3.5, "1e1" and
"stream": "maybe". The gateway reads some of those fields itself (whether to stream,
the output budget, n, the flags that change the rendered prompt, the prompt's token ids)
and the simulated replica reads them all. Each is read here through the type vLLM
declares for it, by pydantic itself, so both serve what vLLM serves, refuse what it
refuses, and key the very tokens vLLM will (tests/router/test_lax_fields.py holds the
table below against vLLM's models).

Only the reading is lax. The body goes upstream as the client sent it: some of vLLM's
checks (its mode="before" validators) look at the raw values, and a body rewritten with
"logprobs": 2 for "2" would pass where vLLM refuses it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError

from router.client_error import ClientError

Endpoint = Literal["chat", "completions"]

_INT64_MAX = 2**63 - 1
_TokenId = Annotated[int, Field(ge=0)]
# vLLM's CompletionRequest.prompt, in its order: pydantic's smart union picks the member
# that fits exactly, then the first that fits in lax mode ([1.0, 2] is ids, ["1", "2"]
# two text prompts).
_PROMPT: TypeAdapter[Any] = TypeAdapter(
    list[_TokenId] | list[list[_TokenId]] | str | list[str])
_STREAM_OPTION: TypeAdapter[Any] = TypeAdapter(bool | None)  # StreamOptions' flags
_NUMBER: TypeAdapter[Any] = TypeAdapter(float | None)


@dataclass(frozen=True)
class _Spec:
    """A field as vLLM declares it: its type, its default, and how to say what it wants."""

    adapter: TypeAdapter[Any]
    default: Any
    plain: type  # a value of exactly this type (or None where allowed) needs no reading
    nullable: bool
    wants: str
    constrained: bool = False  # bounds beyond the type: always read through pydantic


def _spec(kind: type, default: Any, *, nullable: bool, ge: int | None = None) -> _Spec:
    wants = {bool: "a boolean", int: "an integer"}[kind] + ("" if ge is None else f" >= {ge}")
    tp: Any = kind if ge is None else Annotated[kind, Field(ge=ge, le=_INT64_MAX)]
    return _Spec(TypeAdapter(tp | None if nullable else tp), default, kind, nullable,
                 wants + (" or null" if nullable else ""), constrained=ge is not None)


# The fields the gateway or the sim reads, as vLLM 0.32 declares them (name: type = default).
FIELDS: dict[Endpoint, dict[str, _Spec]] = {
    "chat": {
        "stream": _spec(bool, False, nullable=True),
        "max_tokens": _spec(int, None, nullable=True),
        "max_completion_tokens": _spec(int, None, nullable=True),
        "n": _spec(int, 1, nullable=True),
        "echo": _spec(bool, False, nullable=False),
        "add_generation_prompt": _spec(bool, True, nullable=False),
        "continue_final_message": _spec(bool, False, nullable=False),
        "add_special_tokens": _spec(bool, False, nullable=False),
        "return_token_ids": _spec(bool, None, nullable=True),
        "truncate_prompt_tokens": _spec(int, None, nullable=True, ge=-1),
    },
    "completions": {
        "stream": _spec(bool, False, nullable=True),
        "max_tokens": _spec(int, 16, nullable=True),
        "n": _spec(int, 1, nullable=False),
        "echo": _spec(bool, False, nullable=True),
        "add_special_tokens": _spec(bool, True, nullable=False),
        "return_token_ids": _spec(bool, None, nullable=True),
        "truncate_prompt_tokens": _spec(int, None, nullable=True, ge=-1),
    },
}


def field(body: Mapping[str, Any], name: str, endpoint: Endpoint) -> Any:
    """The field's value as vLLM reads it: its default when absent, pydantic's lax reading
    otherwise; a ClientError naming the field where vLLM would refuse it."""
    spec = FIELDS[endpoint][name]
    if name not in body:
        return spec.default
    value = body[name]
    if not spec.constrained and (type(value) is spec.plain or (value is None and spec.nullable)):
        return value  # the common case, without a call into pydantic
    try:
        return spec.adapter.validate_python(value)
    except ValidationError as exc:
        raise ClientError(f"'{name}' must be {spec.wants}, got {_shown(value)} ({_reason(exc)})",
                          name) from None


def check(body: Mapping[str, Any], endpoint: Endpoint) -> None:
    """Read every field of the table once, so a value vLLM refuses is refused at the
    request's edge rather than wherever the gateway first reads it."""
    for name in FIELDS[endpoint].keys() & body.keys():
        field(body, name, endpoint)


def number(body: Mapping[str, Any], name: str) -> float | None:
    """A `float | None` field (the sampling parameters) as vLLM reads it."""
    value = body.get(name)
    if value is None or type(value) is float:
        return value
    try:
        read: float | None = _NUMBER.validate_python(value)
    except ValidationError as exc:
        raise ClientError(f"'{name}' must be a number or null, got {_shown(value)} "
                          f"({_reason(exc)})", name) from None
    return read


def stream_option(options: Any, name: str) -> bool:
    """A flag of stream_options (include_usage, continuous_usage_stats: bool | None =
    False), False where it is absent or not an object."""
    if not isinstance(options, dict) or name not in options:
        return False
    try:
        return bool(_STREAM_OPTION.validate_python(options[name]))
    except ValidationError as exc:
        raise ClientError(f"'stream_options.{name}' must be a boolean, got "
                          f"{_shown(options[name])} ({_reason(exc)})",
                          f"stream_options.{name}") from None


def prompt(value: Any) -> list[int] | list[list[int]] | str | list[str] | None:
    """A completions prompt as vLLM reads it (token ids, a batch of them, text, or a batch
    of text), or None where vLLM would refuse it."""
    try:
        read: list[int] | list[list[int]] | str | list[str] = _PROMPT.validate_python(value)
    except ValidationError:
        return None
    return read


def _shown(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _reason(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False)
    return str(errors[-1]["msg"]) if errors else str(exc)
