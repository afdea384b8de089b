"""The request edge: a raw body -> a validated `ParsedRequest`, or one `ClientError`.

Every problem a client can cause, on every endpoint, is a `ClientError`; the app turns
it into OpenAI's error body {"error": {"message", "type", "param", "code"}} with `code`
the HTTP status, as vLLM's ErrorResponse does (so a client sees one shape whether the
gateway or a replica refused it).

The checks are the ones the gateway needs before routing (it reads the model, renders
or reads the prompt, and sets cache_salt itself) or that protect the fleet (absurd n or
max_tokens); everything else is left to the replica, which knows its own limits.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from router import lax_fields
from router.client_error import ClientError as ClientError
from router.client_error import error_payload as error_payload
from router.config import LimitsConfig
from router.lax_fields import Endpoint
from router.native import checked_ids, prompt_ids
from router.tenants import ClientSaltError, Tenant, TenantRegistry

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


@dataclass(frozen=True)
class ParsedRequest:
    """A decoded, validated body and the fields routing and proxying read from it.

    `cache_salt` is the salt to forward (the tenant's, or the client's namespaced under
    the tenant); None sends the request to the public pool.
    """

    endpoint: str  # "chat" | "completions"
    body: dict[str, Any]
    model: str
    stream: bool
    client_wants_usage: bool
    max_tokens: int | None
    cache_salt: str | None = None
    raw: bytes = b""  # the body as it came: forwarded with only the gateway's fields added
    # A completions prompt given as (checked) token ids: a list, or a memoryview of int64
    # where router.native.prompt_ids read it (body["prompt"] is then its msgspec.Raw).
    token_ids: Sequence[int] | None = None


def parse_request(raw: bytes, endpoint: str, *, served_models: Collection[str],
                  limits: LimitsConfig, tenant: Tenant, registry: TenantRegistry,
                  ) -> ParsedRequest:
    """Decode and validate a body for `endpoint` ("chat" | "completions")."""
    if endpoint == "completions":
        body, ids = decode_completion(raw)
    else:
        body, ids = decode_body(raw), None
    return validate_body(body, raw, endpoint, served_models=served_models,
                         limits=limits, tenant=tenant, registry=registry, token_ids=ids)


def decode_completion(raw: bytes) -> tuple[dict[str, Any], Sequence[int] | None]:
    """A completions body, and its prompt's ids where C read them (router.native.
    prompt_ids: a flat array of plain non-negative integers, the common shape).

    Decoding 8k ids as Python ints cost ~0.2 ms here, most of a request's parse (and
    the ids were checked, packed and copied again after); the C scan reads body and ids
    in ~0.09 ms, and the rest of the body (the prompt's place held by null) is decoded
    as usual. The body then carries the prompt as msgspec.Raw: the same JSON
    when re-encoded. Any other shape, or a body the generic decoder refuses, takes the
    generic path, so every error reads as before.
    """
    found = prompt_ids(raw)
    if found is None:
        return decode_body(raw), None
    start, stop, ids = found
    try:
        body = _DECODER.decode(raw[:start] + b"null" + raw[stop:])
    except (RecursionError, msgspec.DecodeError, msgspec.ValidationError):
        return decode_body(raw), None  # its error, worded on the body as sent
    if not isinstance(body, dict) or "prompt" not in body or body["prompt"] is not None:
        return decode_body(raw), None  # not where the scan put it: decide generically
    body["prompt"] = msgspec.Raw(memoryview(raw)[start:stop])
    return body, ids


def decode_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a ClientError saying why it is not one.

    msgspec decodes in C (about 2.5x faster than the json module on a long token-id
    prompt) and refuses what vLLM's own parser refuses: NaN and Infinity (not JSON; the
    json module would accept them and forward them), numbers out of a double's range,
    and nesting deep enough to exhaust the stack.
    """
    try:
        body = _DECODER.decode(raw)
    except RecursionError:
        raise ClientError("request body is nested too deeply") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ClientError(f"request body is not valid JSON: {_decode_problem(exc, raw)}") from None
    if not isinstance(body, dict):
        raise ClientError("request body must be a JSON object")
    return body


_DECODER = msgspec.json.Decoder()


def _decode_problem(exc: Exception, raw: bytes) -> str:
    text = str(exc).removeprefix("JSON is malformed: ")
    if text.startswith("Number out of range"):
        return "a number is out of range"
    if text.startswith("invalid character") and (b"NaN" in raw or b"Infinity" in raw):
        return f"{text}; NaN and Infinity are not JSON numbers"
    return text


def validate_body(body: dict[str, Any], raw: bytes, endpoint: str, *,
                  served_models: Collection[str], limits: LimitsConfig, tenant: Tenant,
                  registry: TenantRegistry,
                  token_ids: Sequence[int] | None = None) -> ParsedRequest:
    """Validate a decoded body for `endpoint` ("chat" | "completions"); `token_ids`: the
    prompt's ids where decode_completion read them already."""
    kind: Endpoint = "chat" if endpoint == "chat" else "completions"
    model = requested_model(body, served_models)
    lax_fields.check(body, kind)
    stream = bool(lax_fields.field(body, "stream", kind))  # vLLM reads null as False
    if served_models and model not in served_models:
        raise ClientError(f"The model '{model}' does not exist; this gateway serves "
                          f"{', '.join(sorted(served_models))}", "model", status=404)
    if endpoint == "chat":
        _check_messages(body)
    elif token_ids is None:
        token_ids = _check_prompt(body)
    max_tokens = _bounded_int(body, "max_tokens", limits.max_tokens_limit, kind)
    if endpoint == "chat":
        # vLLM's chat request: max_completion_tokens wins over the deprecated max_tokens.
        completion_tokens = _bounded_int(body, "max_completion_tokens",
                                         limits.max_tokens_limit, kind)
        max_tokens = completion_tokens if completion_tokens is not None else max_tokens
    _bounded_int(body, "n", limits.max_n, kind)
    salt = _cache_salt(body, tenant, registry)
    wants_usage = not stream or lax_fields.stream_option(body.get("stream_options"),
                                                         "include_usage")
    return ParsedRequest(endpoint=endpoint, body=body, model=model, stream=stream,
                         client_wants_usage=wants_usage, max_tokens=max_tokens, cache_salt=salt,
                         raw=raw, token_ids=token_ids)


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
             dict: "object"}
    return names.get(type(value), type(value).__name__)


def requested_model(body: Mapping[str, Any], served_models: Collection[str]) -> str:
    """The model asked for. vLLM serves a body without one (or with null) as its own
    model, so a gateway serving one model does too; with several it must be named."""
    model = body.get("model")
    if model is None and len(served_models) == 1:
        return next(iter(served_models))
    if model is None:
        served = f": this gateway serves {', '.join(sorted(served_models))}" if served_models else ""
        raise ClientError(f"'model' is required{served}", "model")
    if not isinstance(model, str) or not model:
        raise ClientError(f"'model' must be a non-empty string, got {_type_name(model)}", "model")
    return model


def _bounded_int(body: Mapping[str, Any], param: str, limit: int, kind: Endpoint) -> int | None:
    value = lax_fields.field(body, param, kind) if param in body else None
    if value is None:
        return None
    if value < 1:
        raise ClientError(f"'{param}' must be at least 1, got {value}", param)
    if value > limit:
        raise ClientError(f"'{param}' must be at most {limit}, got {value}", param)
    return int(value)


def _check_messages(body: Mapping[str, Any]) -> None:
    messages = body.get("messages")
    if messages is None:
        raise ClientError("'messages' is required", "messages")
    if not isinstance(messages, list):
        raise ClientError(f"'messages' must be an array, got {_type_name(messages)}", "messages")
    if not messages:
        raise ClientError("'messages' must contain at least one message", "messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ClientError(f"'{where}' must be an object, got {_type_name(message)}", where)
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ClientError(f"'{where}.role' must be a non-empty string", f"{where}.role")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise ClientError(f"'{where}.content' must be a string or an array of parts, got "
                              f"{_type_name(content)}", f"{where}.content")


def _check_prompt(body: Mapping[str, Any]) -> list[int] | None:
    """A token-id prompt's ids (checked in C, one pass), None for a text prompt."""
    prompt = body.get("prompt")
    if prompt is None:
        raise ClientError("'prompt' is required", "prompt")
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, list) and not prompt:
        raise ClientError("'prompt' must not be empty", "prompt")
    if isinstance(prompt, list):
        if checked_ids(prompt):  # in C where built: the common case, one pass, no copy
            return prompt
        try:
            return msgspec.convert(prompt, _TokenIds)  # bools and negatives refused
        except msgspec.ValidationError:
            pass
        # A batch, forwarded whole (vLLM answers one choice per prompt) and routed by its
        # first prompt's blocks: the one prompt whose ids the gateway keys.
        if all(isinstance(p, str) for p in prompt):
            return None
        try:
            return msgspec.convert(prompt, list[_TokenIds])[0]
        except msgspec.ValidationError:
            pass
        # What only pydantic's lax reading takes, as vLLM does: ids written 1.0 or "7".
        read = lax_fields.prompt(prompt)
        if isinstance(read, list) and read and not isinstance(read[0], str):
            first = read[0] if isinstance(read[0], list) else read
            try:
                return msgspec.convert(first, _TokenIds)
            except msgspec.ValidationError:
                pass  # beyond int64: no token of any vocabulary
        elif read is not None:
            return None
    raise ClientError("'prompt' must be a string or an array of token ids (non-negative "
                      "integers), or a batch: a non-empty array of either", "prompt")


# Ids beyond int64 are no token of any vocabulary (and would not pack for hashing).
_TokenIds = list[Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]]


def _cache_salt(body: Mapping[str, Any], tenant: Tenant, registry: TenantRegistry) -> str | None:
    try:
        return registry.effective_salt(tenant, body.get("cache_salt"))
    except ClientSaltError as exc:  # rejected by the tenant's policy, or invalid for vLLM
        raise ClientError(str(exc), "cache_salt") from None


def upstream_payload(parsed: ParsedRequest, want_token_ids: bool) -> tuple[bytes, bool]:
    """The bytes to forward: the client's body with the tenant's salt, usage always
    requested, and (for the gateway's own recording) the generated token ids.

    The body is not re-serialised: the fields the gateway adds are spliced in before the
    closing brace of the raw bytes, which costs nothing per prompt token. Only where the
    client sent one of those fields itself (so a spliced copy would duplicate a key) is
    the body encoded again, once, by msgspec. Returns (payload, strip_token_ids): whether
    the gateway asked for token ids the client did not, which the proxy must hide.
    """
    body = parsed.body
    extra: dict[str, Any] = {}
    if parsed.cache_salt is not None:
        extra["cache_salt"] = parsed.cache_salt
    if parsed.stream and not parsed.client_wants_usage:
        options = body.get("stream_options")
        # The actual cached tokens ride in the usage chunk.
        extra["stream_options"] = {**(options if isinstance(options, dict) else {}),
                                   "include_usage": True}
    kind: Endpoint = "chat" if parsed.endpoint == "chat" else "completions"
    strip = want_token_ids and not lax_fields.field(body, "return_token_ids", kind)
    if strip:
        extra["return_token_ids"] = True
    if not extra:
        return parsed.raw, strip
    if any(key in body for key in extra):
        return _ENCODER.encode({**body, **extra}), strip
    head = parsed.raw.rstrip()  # a JSON object (decode_body checked): it ends with "}"
    return head[:-1] + b"," + _ENCODER.encode(extra)[1:], strip


_ENCODER = msgspec.json.Encoder()
