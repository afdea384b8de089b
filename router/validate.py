"""Request-body validation for /v1/chat/completions and /v1/completions.

Pure functions over the parsed JSON body. Every problem a client can cause becomes a
`RequestError` carrying OpenAI's error shape (message, type "invalid_request_error",
param, code) and an HTTP status, so the app only serialises it. Checks are the ones the
gateway needs before routing (it tokenizes the prompt and sets cache_salt itself) or
that protect the fleet (absurd n or max_tokens); everything else is left to the replica,
which knows its own limits.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from router.tenants import (
    ClientSaltError,
    ClientSaltRejected,
    Tenant,
    TenantRegistry,
    check_cache_salt,
)

Kind = Literal["chat", "completion"]


class RequestError(ValueError):
    """A client error in OpenAI's shape: message, type, param, code, and the HTTP status."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str = "invalid_value",
        status: int = 400,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status
        self.type = type

    def to_dict(self) -> dict[str, Any]:
        """The JSON body OpenAI clients expect: {"error": {message, type, param, code}}."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass(frozen=True)
class RequestLimits:
    """The bounds validation enforces (LimitsConfig has the same fields)."""

    max_n: int = 16
    max_tokens_limit: int = 131072


@dataclass(frozen=True)
class ValidatedRequest:
    """The fields the gateway routes on, read once from a body that passed validation.

    `cache_salt` is the salt to forward (the tenant's, or the client's namespaced); None
    means the request goes to the public pool. `client_cache_salt` is what the body held.
    """

    kind: Kind
    model: str
    stream: bool
    n: int
    max_tokens: int | None
    client_cache_salt: str | None
    cache_salt: str | None


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }.get(type(value), type(value).__name__)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bounded_int(body: Mapping[str, Any], param: str, limit: int) -> int | None:
    value = body.get(param)
    if value is None:
        return None
    if not _is_int(value):
        raise RequestError(
            f"'{param}' must be an integer, got {_type_name(value)}",
            param=param,
            code="invalid_type",
        )
    if value < 1:
        raise RequestError(f"'{param}' must be at least 1, got {value}", param=param)
    if value > limit:
        raise RequestError(f"'{param}' must be at most {limit}, got {value}", param=param)
    return int(value)


def _model(body: Mapping[str, Any], served_models: Collection[str]) -> str:
    model = body.get("model")
    if model is None:
        raise RequestError("'model' is required", param="model", code="missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise RequestError(
            f"'model' must be a non-empty string, got {_type_name(model)}",
            param="model",
            code="invalid_type",
        )
    if served_models and model not in served_models:
        served = ", ".join(sorted(served_models))
        raise RequestError(
            f"The model '{model}' does not exist; this gateway serves {served}",
            param="model",
            code="model_not_found",
            status=404,
        )
    return model


def _messages(body: Mapping[str, Any]) -> None:
    messages = body.get("messages")
    if messages is None:
        raise RequestError(
            "'messages' is required", param="messages", code="missing_required_parameter"
        )
    if not isinstance(messages, list):
        raise RequestError(
            f"'messages' must be an array, got {_type_name(messages)}",
            param="messages",
            code="invalid_type",
        )
    if not messages:
        raise RequestError("'messages' must contain at least one message", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(
                f"'messages[{i}]' must be an object, got {_type_name(message)}",
                param=f"messages[{i}]",
                code="invalid_type",
            )
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise RequestError(
                f"'messages[{i}].role' must be a non-empty string",
                param=f"messages[{i}].role",
                code="invalid_type",
            )
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise RequestError(
                f"'messages[{i}].content' must be a string or an array of parts, got "
                f"{_type_name(content)}",
                param=f"messages[{i}].content",
                code="invalid_type",
            )


def _prompt(body: Mapping[str, Any]) -> None:
    prompt = body.get("prompt")
    if prompt is None:
        raise RequestError(
            "'prompt' is required", param="prompt", code="missing_required_parameter"
        )
    if isinstance(prompt, str):
        return
    # One prompt per request: the gateway routes a request by its prompt's blocks, and a
    # batch of prompts would have to be split across replicas to route well.
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return
    if isinstance(prompt, list) and not prompt:
        raise RequestError("'prompt' must not be empty", param="prompt")
    raise RequestError(
        "'prompt' must be a string or an array of token ids (non-negative integers); "
        "batched prompts are not supported, send one request per prompt",
        param="prompt",
        code="invalid_type",
    )


def _stream(body: Mapping[str, Any]) -> bool:
    stream = body.get("stream")
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise RequestError(
            f"'stream' must be a boolean, got {_type_name(stream)}",
            param="stream",
            code="invalid_type",
        )
    return stream


def _cache_salt(
    body: Mapping[str, Any], tenant: Tenant | None, registry: TenantRegistry | None
) -> tuple[str | None, str | None]:
    client = body.get("cache_salt")
    try:
        if tenant is not None and registry is not None:
            effective = registry.effective_salt(tenant, client)
        elif tenant is not None:
            if client is not None:
                raise ClientSaltRejected(
                    "cache_salt is set by the gateway; remove it from the request"
                )
            effective = tenant.salt
        else:
            effective = None if client is None else check_cache_salt(client)
    except ClientSaltRejected as e:
        raise RequestError(str(e), param="cache_salt", code="cache_salt_not_allowed") from None
    except ClientSaltError as e:
        raise RequestError(str(e), param="cache_salt", code="invalid_cache_salt") from None
    return (client if isinstance(client, str) else None), effective


def validate_request(
    kind: Kind,
    body: object,
    *,
    served_models: Collection[str] = (),
    limits: RequestLimits | Any = None,
    tenant: Tenant | None = None,
    registry: TenantRegistry | None = None,
) -> ValidatedRequest:
    """Check a parsed body for `kind` and return what routing needs, or raise RequestError.

    `served_models` empty accepts any model; `limits` is a RequestLimits or anything with
    max_n and max_tokens_limit (the config's LimitsConfig). With a tenant and registry,
    the body's cache_salt is checked against the tenant's policy and the salt to forward
    is computed.
    """
    if not isinstance(body, dict):
        raise RequestError(
            f"Request body must be a JSON object, got {_type_name(body)}", code="invalid_type"
        )
    limits = RequestLimits() if limits is None else limits
    model = _model(body, served_models)
    if kind == "chat":
        _messages(body)
    else:
        _prompt(body)
    max_tokens = _bounded_int(body, "max_tokens", limits.max_tokens_limit)
    if kind == "chat":
        completion_tokens = _bounded_int(body, "max_completion_tokens", limits.max_tokens_limit)
        max_tokens = completion_tokens if completion_tokens is not None else max_tokens
    n = _bounded_int(body, "n", limits.max_n) or 1
    stream = _stream(body)
    client_salt, salt = _cache_salt(body, tenant, registry)
    return ValidatedRequest(kind, model, stream, n, max_tokens, client_salt, salt)


def validate_chat(body: object, **kwargs: Any) -> ValidatedRequest:
    """validate_request for /v1/chat/completions."""
    return validate_request("chat", body, **kwargs)


def validate_completion(body: object, **kwargs: Any) -> ValidatedRequest:
    """validate_request for /v1/completions."""
    return validate_request("completion", body, **kwargs)


def parse_json_body(raw: bytes) -> object:
    """Decode a request body as JSON, or raise RequestError naming the problem."""
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise RequestError("Request body is not valid UTF-8", code="invalid_json") from None
    except ValueError as e:
        raise RequestError(f"Request body is not valid JSON: {e}", code="invalid_json") from None
