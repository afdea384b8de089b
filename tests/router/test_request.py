"""The request edge: what a client gets for a body, through `parse_request` (the function
the gateway calls) and through the gateway's HTTP surface (OpenAI's error shape)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st
from servers import free_port

from router.app import build_app, running_gateway
from router.config import LimitsConfig, TenantKeyConfig, TenantsConfig, build_config
from router.request import ClientError, ParsedRequest, parse_request
from router.tenants import Tenant, TenantRegistry, derive_salt

SECRET = b"0123456789abcdef0123456789abcdef"
SERVED = {"tiny"}
CHAT: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION: dict[str, Any] = {"model": "tiny", "prompt": "once upon a time"}
REGISTRY = TenantRegistry.from_config(
    TenantsConfig(keys=(TenantKeyConfig(key="k1", tenant="acme"),
                        TenantKeyConfig(key="k2", tenant="globex", allow_client_salt="namespace")),
                  allow_anonymous=True),
    SECRET)
ANONYMOUS = REGISTRY.identify(None)


def parse(body: object, endpoint: str = "chat", *, limits: LimitsConfig | None = None,
          tenant: Tenant = ANONYMOUS, raw: bytes | None = None) -> ParsedRequest:
    return parse_request(json.dumps(body).encode() if raw is None else raw, endpoint,
                         served_models=SERVED, limits=limits or LimitsConfig(), tenant=tenant,
                         registry=REGISTRY)


def error(body: object, endpoint: str = "chat", **kw: Any) -> ClientError:
    with pytest.raises(ClientError) as info:
        parse(body, endpoint, **kw)
    return info.value


def test_valid_requests() -> None:
    p = parse({**CHAT, "stream": True, "max_tokens": 5, "n": 2})
    assert (p.endpoint, p.model, p.stream, p.max_tokens, p.cache_salt) == (
        "chat", "tiny", True, 5, None)
    assert not p.client_wants_usage  # streamed without stream_options.include_usage
    p = parse({**COMPLETION, "prompt": [1, 2, 3]}, "completions")
    assert p.token_ids is not None
    assert (p.endpoint, p.stream, p.max_tokens, p.client_wants_usage, list(p.token_ids)) == (
        "completions", False, None, True, [1, 2, 3])
    assert parse(COMPLETION, "completions").token_ids is None
    assert parse({**CHAT, "max_completion_tokens": 7, "max_tokens": 3}).max_tokens == 7
    assert parse({**CHAT, "max_completion_tokens": None, "max_tokens": 3}).max_tokens == 3
    wants = parse({**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert wants.client_wants_usage


def test_values_vllm_reads_leniently_are_served_as_it_reads_them() -> None:
    # vLLM's pydantic models read these in lax mode and serve them: so does the gateway,
    # reading the same values (tests/router/test_lax_fields.py holds it to vLLM's models).
    p = parse({**CHAT, "stream": "true", "max_tokens": "5", "n": 2.0})
    assert (p.stream, p.max_tokens, p.client_wants_usage) == (True, 5, False)
    p = parse({**CHAT, "stream": 1, "stream_options": {"include_usage": "yes"}})
    assert (p.stream, p.client_wants_usage) == (True, True)
    assert parse({**CHAT, "max_completion_tokens": 7.0, "max_tokens": True}).max_tokens == 7
    assert parse({**CHAT, "stream": None}).stream is False
    assert parse({**COMPLETION, "max_tokens": " 9 "}, "completions").max_tokens == 9
    for written in ([1.0, 2, "3"], [True, 2, 3], [[1.0, 2, 3], [4]]):
        ids = parse({**COMPLETION, "prompt": written}, "completions").token_ids
        assert ids is not None and [int(t) for t in ids] == [1, 2, 3]
    texts = parse({**COMPLETION, "prompt": ["1", "2"]}, "completions")  # text, as for vLLM
    assert texts.token_ids is None


def test_a_body_without_a_model_is_served_as_the_one_model_there_is() -> None:
    assert parse({"messages": CHAT["messages"]}).model == "tiny"
    assert parse({**COMPLETION, "model": None}, "completions").model == "tiny"
    with pytest.raises(ClientError) as info:
        parse_request(json.dumps({"messages": CHAT["messages"]}).encode(), "chat",
                      served_models={"tiny", "big"}, limits=LimitsConfig(), tenant=ANONYMOUS,
                      registry=REGISTRY)
    assert (info.value.param, info.value.message) == (
        "model", "'model' is required: this gateway serves big, tiny")


@pytest.mark.parametrize(("raw", "message"), [
    (b"\xff\xfe{}", "request body is not valid JSON: invalid character (byte 0)"),
    (b'{"model": "tiny", "prompt": "\xff\xfe"}', "request body is not valid JSON: Invalid UTF-8"),
    (b"{not json", "request body is not valid JSON"),
    (b"[1, 2]", "request body must be a JSON object"),
    # Not JSON, though Python's json module reads them; forwarded, a replica hangs on them.
    (b'{"model": "tiny", "prompt": "x", "temperature": NaN}',
     "request body is not valid JSON: invalid character (byte 48); NaN and Infinity are "
     "not JSON numbers"),
    (b'{"model": "tiny", "prompt": "x", "temperature": -Infinity}', "request body is not valid"),
    (b'{"model": "tiny", "prompt": "x", "temperature": 1e999}',
     "request body is not valid JSON: a number is out of range"),
    (b"[" * 100_000 + b"]" * 100_000, "request body is nested too deeply"),
    (b'{"model": "tiny", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     "request body is nested too deeply"),
])
def test_bodies_that_are_not_a_json_object(raw: bytes, message: str) -> None:
    err = error(None, raw=raw)
    assert (err.status, err.param, err.type) == (400, None, "invalid_request_error")
    assert err.message.startswith(message)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({**CHAT, "model": 3}, "model", "'model' must be a non-empty string, got integer"),
        ({**CHAT, "model": ""}, "model", "'model' must be a non-empty string, got string"),
        ({"model": "tiny"}, "messages", "'messages' is required"),
        ({**CHAT, "messages": "hi"}, "messages", "'messages' must be an array, got string"),
        ({**CHAT, "messages": []}, "messages", "'messages' must contain at least one"),
        ({**CHAT, "messages": ["hi"]}, "messages[0]", "'messages[0]' must be an object"),
        ({**CHAT, "messages": [{"content": "x"}]}, "messages[0].role", "'messages[0].role'"),
        ({**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages[0].content",
         "'messages[0].content' must be a string or an array of parts, got integer"),
        ({**CHAT, "max_tokens": 0}, "max_tokens", "'max_tokens' must be at least 1, got 0"),
        ({**CHAT, "max_tokens": "five"}, "max_tokens",
         "'max_tokens' must be an integer or null, got \"five\" (Input should be a valid "
         "integer, unable to parse string as an integer)"),
        ({**CHAT, "max_tokens": 2.5}, "max_tokens",
         "'max_tokens' must be an integer or null, got 2.5"),
        ({**CHAT, "max_tokens": "0"}, "max_tokens", "'max_tokens' must be at least 1, got 0"),
        ({**CHAT, "max_tokens": 10**9}, "max_tokens", "'max_tokens' must be at most 131072"),
        ({**CHAT, "max_completion_tokens": -1}, "max_completion_tokens",
         "'max_completion_tokens'"),
        ({**CHAT, "n": 1000}, "n", "'n' must be at most 16, got 1000"),
        ({**CHAT, "n": 1.5}, "n", "'n' must be an integer or null, got 1.5"),
        ({**CHAT, "stream": "maybe"}, "stream", "'stream' must be a boolean or null, got "
         "\"maybe\" (Input should be a valid boolean, unable to interpret input)"),
        ({**CHAT, "echo": None}, "echo", "'echo' must be a boolean, got null"),
        ({**CHAT, "stream": True, "stream_options": {"include_usage": 2}},
         "stream_options.include_usage", "'stream_options.include_usage' must be a boolean"),
    ],
)
def test_chat_errors(body: object, param: str, message: str) -> None:
    err = error(body)
    assert (err.param, err.status, err.type) == (param, 400, "invalid_request_error")
    assert err.message.startswith(message)
    assert err.payload() == {"error": {"message": err.message, "type": "invalid_request_error",
                                       "param": param, "code": 400}}


def test_unknown_model_is_404_and_names_the_served_models() -> None:
    err = error({**CHAT, "model": "gpt-5"})
    assert (err.status, err.param, err.payload()["error"]["code"]) == (404, "model", 404)
    assert "'gpt-5'" in err.message and "tiny" in err.message


@pytest.mark.parametrize("prompt", [None, 5, [], ["a", 1], [[1, -2]], [1, -2], [1, 2.5],
                                    [[1, 2], "Hi"], [1, 2**64], {"text": "x"}])
def test_completion_prompt_errors(prompt: object) -> None:
    body = {**COMPLETION, "prompt": prompt}
    if prompt is None:
        del body["prompt"]
    err = error(body, "completions")
    assert err.param == "prompt" and err.status == 400


def test_limits_come_from_config() -> None:
    limits = LimitsConfig(max_n=2, max_tokens_limit=100)
    assert error({**CHAT, "n": 3}, limits=limits).message == "'n' must be at most 2, got 3"
    assert error({**CHAT, "max_tokens": 101}, limits=limits).param == "max_tokens"
    assert parse({**CHAT, "n": 2, "max_tokens": 100}, limits=limits).max_tokens == 100


def test_cache_salt_is_the_tenants_and_client_salts_follow_its_policy() -> None:
    acme, globex = REGISTRY.authenticate("k1"), REGISTRY.authenticate("k2")
    assert acme is not None and globex is not None
    assert parse(CHAT, tenant=acme).cache_salt == derive_salt(SECRET, "acme")
    err = error({**CHAT, "cache_salt": "mine"}, tenant=acme)
    assert (err.param, err.status) == ("cache_salt", 400)
    assert "remove it from the request" in err.message
    salt = parse({**CHAT, "cache_salt": "mine"}, tenant=globex).cache_salt
    assert salt is not None and salt not in ("mine", derive_salt(SECRET, "globex"))
    assert error({**CHAT, "cache_salt": "a@b"}, tenant=globex).param == "cache_salt"
    # Anonymous requests go to the public pool and may not pick a pool of their own.
    assert parse(CHAT).cache_salt is None
    assert error({**CHAT, "cache_salt": "x"}).param == "cache_salt"


@pytest.mark.parametrize(("salt", "message"), [
    ("a/b", "cache_salt must not contain '/'"),
    ("x" * 129, "cache_salt must be at most 128 characters, got 129"),
    ("", "cache_salt must be a non-empty string, got an empty string"),
])
def test_invalid_client_salts_name_the_problem(salt: str, message: str) -> None:
    globex = REGISTRY.authenticate("k2")
    assert globex is not None
    err = error({**CHAT, "cache_salt": salt}, tenant=globex)
    assert (err.param, err.message) == ("cache_salt", message)


@given(st.integers(-5, 200), st.integers(-5, 40))
def test_bounds_property(max_tokens: int, n: int) -> None:
    body = {**CHAT, "max_tokens": max_tokens, "n": n}
    ok = 1 <= max_tokens <= 100 and 1 <= n <= 16
    try:
        p = parse(body, limits=LimitsConfig(max_n=16, max_tokens_limit=100))
    except ClientError as e:
        assert not ok and e.param in ("max_tokens", "n")
    else:
        assert ok and p.max_tokens == max_tokens


# ------------------------------------------------------------- through the HTTP surface


@pytest.fixture
async def gateway() -> AsyncIterator[str]:
    """The whole app, key k1 only (one replica nobody listens on: every request here is
    refused before it would be forwarded)."""
    port = free_port()
    config = build_config({
        "listen": {"host": "127.0.0.1", "port": port},
        "replicas": [{"url": f"http://127.0.0.1:{free_port()}", "models": ["tiny"]}],
        "proxy": {"max_body_bytes": 4096},
        "health": {"interval_s": 60},
    })
    keyed = TenantRegistry.from_config(TenantsConfig(keys=(TenantKeyConfig(key="k1", tenant="acme"),)),
                                       SECRET)
    async with running_gateway(build_app(config, tenants=keyed), "127.0.0.1", port):
        yield f"http://127.0.0.1:{port}"


async def test_every_client_error_has_openai_shape_with_the_status_as_code(gateway: str) -> None:
    cases: list[tuple[str, dict[str, str], bytes, int, str | None, str]] = [
        ("/v1/chat/completions", {}, b"{", 400, None, "request body is not valid JSON"),
        ("/v1/chat/completions", {}, b"[1]", 400, None, "request body must be a JSON object"),
        ("/v1/chat/completions", {}, b'{"model": "tiny", "temperature": NaN}', 400, None,
         "request body is not valid JSON"),
        ("/v1/chat/completions", {}, b"[" * 2000 + b"]" * 2000, 400, None,
         "request body is nested too deeply"),
        ("/v1/completions", {}, json.dumps({**COMPLETION, "prompt": [1, -2]}).encode(), 400,
         "prompt", "'prompt' must be a string or an array of token ids"),
        ("/v1/chat/completions", {}, json.dumps({**CHAT, "model": "gpt-5"}).encode(), 404,
         "model", "The model 'gpt-5' does not exist"),
        ("/v1/chat/completions", {"Authorization": "Bearer k1"},
         json.dumps({**CHAT, "cache_salt": "x"}).encode(), 400, "cache_salt",
         "cache_salt is set by the gateway"),
        ("/v1/chat/completions", {"Authorization": "Bearer nope"}, json.dumps(CHAT).encode(),
         401, None, "invalid API key"),
        ("/v1/chat/completions", {}, b" " * 5000, 413, None, "request body exceeds 4096 bytes"),
    ]
    async with aiohttp.ClientSession() as session:
        for path, headers, body, status, param, message in cases:
            async with session.post(gateway + path, data=body,
                                    headers={"Content-Type": "application/json",
                                             "Authorization": "Bearer k1", **headers}) as r:
                got = await r.json()
                assert r.status == status, (path, body[:40], got)
                assert set(got) == {"error"} and set(got["error"]) == {
                    "message", "type", "param", "code"}
                err = got["error"]
                assert (err["code"], err["param"]) == (status, param)
                assert err["message"].startswith(message), err
                assert r.headers["x-request-id"]
        async with session.get(gateway + "/v1/models",
                               headers={"Authorization": "Bearer nope"}) as r:
            got = await r.json()
            assert r.status == 401
            assert got["error"]["type"] == "authentication_error"
            assert got["error"]["code"] == 401
