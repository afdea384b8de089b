"""Request validation: OpenAI-shaped errors naming the bad parameter."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.config import LimitsConfig, TenantKeyConfig, TenantsConfig
from router.tenants import TenantRegistry, derive_salt
from router.validate import (
    RequestError,
    RequestLimits,
    parse_json_body,
    validate_chat,
    validate_completion,
    validate_request,
)

SECRET = b"0123456789abcdef0123456789abcdef"
SERVED = {"tiny"}
CHAT: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION: dict[str, Any] = {"model": "tiny", "prompt": "once upon a time"}


def chat_error(body: object, **kw: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        validate_chat(body, served_models=SERVED, **kw)
    return info.value


def completion_error(body: object, **kw: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        validate_completion(body, served_models=SERVED, **kw)
    return info.value


def test_valid_requests() -> None:
    v = validate_chat({**CHAT, "stream": True, "max_tokens": 5, "n": 2}, served_models=SERVED)
    assert (v.kind, v.model, v.stream, v.max_tokens, v.n, v.cache_salt) == (
        "chat",
        "tiny",
        True,
        5,
        2,
        None,
    )
    v = validate_completion({**COMPLETION, "prompt": [1, 2, 3]}, served_models=SERVED)
    assert (v.kind, v.stream, v.n, v.max_tokens) == ("completion", False, 1, None)
    v = validate_chat({**CHAT, "max_completion_tokens": 7, "max_tokens": 3}, served_models=SERVED)
    assert v.max_tokens == 7
    assert validate_chat({**CHAT, "model": "anything"}).model == "anything"  # no served set


@pytest.mark.parametrize(
    ("body", "param", "code", "message"),
    [
        ([1, 2], None, "invalid_type", "Request body must be a JSON object, got array"),
        (
            {"messages": CHAT["messages"]},
            "model",
            "missing_required_parameter",
            "'model' is required",
        ),
        (
            {**CHAT, "model": 3},
            "model",
            "invalid_type",
            "'model' must be a non-empty string, got integer",
        ),
        ({"model": "tiny"}, "messages", "missing_required_parameter", "'messages' is required"),
        (
            {**CHAT, "messages": "hi"},
            "messages",
            "invalid_type",
            "'messages' must be an array, got string",
        ),
        (
            {**CHAT, "messages": []},
            "messages",
            "invalid_value",
            "'messages' must contain at least one",
        ),
        (
            {**CHAT, "messages": ["hi"]},
            "messages[0]",
            "invalid_type",
            "'messages[0]' must be an object",
        ),
        (
            {**CHAT, "messages": [{"content": "x"}]},
            "messages[0].role",
            "invalid_type",
            "'messages[0].role'",
        ),
        (
            {**CHAT, "messages": [{"role": "user", "content": 5}]},
            "messages[0].content",
            "invalid_type",
            "'messages[0].content' must be a string or an array of parts, got integer",
        ),
        (
            {**CHAT, "max_tokens": 0},
            "max_tokens",
            "invalid_value",
            "'max_tokens' must be at least 1, got 0",
        ),
        (
            {**CHAT, "max_tokens": "5"},
            "max_tokens",
            "invalid_type",
            "'max_tokens' must be an integer, got string",
        ),
        (
            {**CHAT, "max_tokens": True},
            "max_tokens",
            "invalid_type",
            "'max_tokens' must be an integer, got boolean",
        ),
        (
            {**CHAT, "max_tokens": 10**9},
            "max_tokens",
            "invalid_value",
            "'max_tokens' must be at most 131072",
        ),
        (
            {**CHAT, "max_completion_tokens": -1},
            "max_completion_tokens",
            "invalid_value",
            "'max_completion_tokens'",
        ),
        ({**CHAT, "n": 1000}, "n", "invalid_value", "'n' must be at most 16, got 1000"),
        ({**CHAT, "n": 1.5}, "n", "invalid_type", "'n' must be an integer, got number"),
        (
            {**CHAT, "stream": "yes"},
            "stream",
            "invalid_type",
            "'stream' must be a boolean, got string",
        ),
        (
            {**CHAT, "cache_salt": "a/b"},
            "cache_salt",
            "invalid_cache_salt",
            "cache_salt must not contain '/'",
        ),
        (
            {**CHAT, "cache_salt": "x" * 129},
            "cache_salt",
            "invalid_cache_salt",
            "cache_salt must be at most 128 characters, got 129",
        ),
        (
            {**CHAT, "cache_salt": ""},
            "cache_salt",
            "invalid_cache_salt",
            "cache_salt must be a non-empty string, got an empty string",
        ),
    ],
)
def test_chat_errors(body: object, param: str | None, code: str, message: str) -> None:
    err = chat_error(body)
    assert (err.param, err.code, err.status, err.type) == (
        param,
        code,
        400,
        "invalid_request_error",
    )
    assert err.message.startswith(message)
    assert err.to_dict() == {
        "error": {
            "message": err.message,
            "type": "invalid_request_error",
            "param": param,
            "code": code,
        }
    }


def test_unknown_model_is_404_and_names_the_served_models() -> None:
    err = chat_error({**CHAT, "model": "gpt-5"})
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")
    assert "'gpt-5'" in err.message and "tiny" in err.message


@pytest.mark.parametrize(
    ("prompt", "code"),
    [
        (None, "missing_required_parameter"),
        (5, "invalid_type"),
        ([], "invalid_value"),
        (["a", "b"], "invalid_type"),
        ([[1, 2]], "invalid_type"),
        ([1, -2], "invalid_type"),
        ([1, True], "invalid_type"),
        ({"text": "x"}, "invalid_type"),
    ],
)
def test_completion_prompt_errors(prompt: object, code: str) -> None:
    body = {**COMPLETION, "prompt": prompt}
    if prompt is None:
        del body["prompt"]
    err = completion_error(body)
    assert err.param == "prompt" and err.code == code


def test_limits_come_from_config() -> None:
    limits = LimitsConfig(max_n=2, max_tokens_limit=100)
    assert chat_error({**CHAT, "n": 3}, limits=limits).message == "'n' must be at most 2, got 3"
    assert chat_error({**CHAT, "max_tokens": 101}, limits=limits).param == "max_tokens"
    assert validate_chat({**CHAT, "n": 2, "max_tokens": 100}, limits=RequestLimits(2, 100)).n == 2


def registry() -> TenantRegistry:
    return TenantRegistry.from_config(
        TenantsConfig(
            keys=(
                TenantKeyConfig(key="k1", tenant="acme"),
                TenantKeyConfig(key="k2", tenant="globex", allow_client_salt="namespace"),
            )
        ),
        SECRET,
    )


def test_cache_salt_is_the_tenants_and_client_salts_follow_its_policy() -> None:
    reg = registry()
    acme, globex = reg.authenticate("k1"), reg.authenticate("k2")
    assert acme is not None and globex is not None
    v = validate_chat(CHAT, tenant=acme, registry=reg)
    assert v.cache_salt == derive_salt(SECRET, "acme") and v.client_cache_salt is None
    err = chat_error({**CHAT, "cache_salt": "mine"}, tenant=acme, registry=reg)
    assert (err.param, err.code, err.status) == ("cache_salt", "cache_salt_not_allowed", 400)
    v = validate_chat({**CHAT, "cache_salt": "mine"}, tenant=globex, registry=reg)
    assert v.client_cache_salt == "mine"
    assert v.cache_salt is not None and v.cache_salt not in ("mine", derive_salt(SECRET, "globex"))
    err = chat_error({**CHAT, "cache_salt": "a@b"}, tenant=globex, registry=reg)
    assert err.code == "invalid_cache_salt"


def test_tenant_without_registry_rejects_client_salts() -> None:
    acme = registry().authenticate("k1")
    assert acme is not None
    assert chat_error({**CHAT, "cache_salt": "x"}, tenant=acme).code == "cache_salt_not_allowed"
    assert validate_chat(CHAT, tenant=acme).cache_salt == acme.salt


def test_client_salt_passes_through_without_tenants() -> None:
    assert validate_chat({**CHAT, "cache_salt": "mine"}).cache_salt == "mine"


def test_parse_json_body() -> None:
    assert parse_json_body(b'{"a": 1}') == {"a": 1}
    with pytest.raises(RequestError, match="not valid JSON") as info:
        parse_json_body(b"{")
    assert info.value.code == "invalid_json"
    with pytest.raises(RequestError, match="not valid UTF-8"):
        parse_json_body(b"\xff\xfe{")


@given(st.integers(-5, 200), st.integers(-5, 40))
def test_bounds_property(max_tokens: int, n: int) -> None:
    body = {**CHAT, "max_tokens": max_tokens, "n": n}
    ok = 1 <= max_tokens <= 100 and 1 <= n <= 16
    try:
        v = validate_request("chat", body, limits=RequestLimits(16, 100))
    except RequestError as e:
        assert not ok and e.param in ("max_tokens", "n")
    else:
        assert ok and (v.max_tokens, v.n) == (max_tokens, n)
