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

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from router.config import LimitsConfig
from router.tenants import ClientSaltError, Tenant, TenantRegistry

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


class ClientError(Exception):
    """A mistake in the client's request: an OpenAI-style 4xx error naming the bad param."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 type: str = "invalid_request_error",
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.headers = dict(headers or {})

    def payload(self) -> dict[str, Any]:
        """The JSON body clients get."""
        return error_payload(self.message, self.type, param=self.param, code=self.status)


def error_payload(message: str, err_type: str, *, param: str | None = None,
                  code: int | None = None) -> dict[str, Any]:
    """OpenAI's error object; `code` is the HTTP status, as vLLM sends it."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


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


def parse_request(raw: bytes, endpoint: str, *, served_models: Collection[str],
                  limits: LimitsConfig, tenant: Tenant, registry: TenantRegistry,
                  ) -> ParsedRequest:
    """Decode and validate a body for `endpoint` ("chat" | "completions")."""
    body = _decode(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ClientError("'model' is required and must be a string", "model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ClientError("'stream' must be a boolean", "stream")
    if served_models and model not in served_models:
        raise ClientError(f"The model '{model}' does not exist; this gateway serves "
                          f"{', '.join(sorted(served_models))}", "model", status=404)
    if endpoint == "chat":
        _check_messages(body)
    else:
        _check_prompt(body)
    max_tokens = _bounded_int(body, "max_tokens", limits.max_tokens_limit)
    if endpoint == "chat":
        # vLLM's chat request: max_completion_tokens wins over the deprecated max_tokens.
        completion_tokens = _bounded_int(body, "max_completion_tokens", limits.max_tokens_limit)
        max_tokens = completion_tokens if completion_tokens is not None else max_tokens
    _bounded_int(body, "n", limits.max_n)
    salt = _cache_salt(body, tenant, registry)
    options = body.get("stream_options")
    wants_usage = not stream or (isinstance(options, dict) and options.get("include_usage") is True)
    return ParsedRequest(endpoint=endpoint, body=body, model=model, stream=stream,
                         client_wants_usage=wants_usage, max_tokens=max_tokens, cache_salt=salt)


def _decode(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ClientError(f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ClientError(f"request body is not valid JSON: {exc.msg} at line {exc.lineno} "
                          f"column {exc.colno}") from None
    if not isinstance(body, dict):
        raise ClientError("request body must be a JSON object")
    return body


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
             dict: "object"}
    return names.get(type(value), type(value).__name__)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bounded_int(body: Mapping[str, Any], param: str, limit: int) -> int | None:
    value = body.get(param)
    if value is None:
        return None
    if not _is_int(value):
        raise ClientError(f"'{param}' must be an integer, got {_type_name(value)}", param)
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


def _check_prompt(body: Mapping[str, Any]) -> None:
    prompt = body.get("prompt")
    if prompt is None:
        raise ClientError("'prompt' is required", "prompt")
    if isinstance(prompt, str):
        return
    # One prompt per request: the gateway routes a request by its prompt's blocks, and a
    # batch of prompts would have to be split across replicas to route well.
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return
    if isinstance(prompt, list) and not prompt:
        raise ClientError("'prompt' must not be empty", "prompt")
    raise ClientError("'prompt' must be a string or an array of token ids (non-negative "
                      "integers); batched prompts are not supported, send one request per "
                      "prompt", "prompt")


def _cache_salt(body: Mapping[str, Any], tenant: Tenant, registry: TenantRegistry) -> str | None:
    try:
        return registry.effective_salt(tenant, body.get("cache_salt"))
    except ClientSaltError as exc:  # rejected by the tenant's policy, or invalid for vLLM
        raise ClientError(str(exc), "cache_salt") from None


def upstream_body(parsed: ParsedRequest, want_token_ids: bool) -> tuple[dict[str, Any], bool]:
    """The body to forward: the tenant's salt injected, usage always requested.

    Returns (body, strip_token_ids): whether the gateway asked for the generated token
    ids itself (to record a replica's cache without KV events) and must hide them.
    """
    body = dict(parsed.body)
    if parsed.cache_salt is not None:
        body["cache_salt"] = parsed.cache_salt
    if parsed.stream:
        options = dict(body.get("stream_options") or {})
        options["include_usage"] = True  # the actual cached tokens ride in the usage chunk
        body["stream_options"] = options
    strip = False
    if want_token_ids and not body.get("return_token_ids"):
        body["return_token_ids"] = True
        strip = True
    return body, strip
