"""Fuzzing the gateway's HTTP surface: no input a client sends may cause a 5xx.

One gateway process in front of two sims serves the whole module. Inputs come from
schemathesis (cases generated from router/openapi.py's description, valid and invalid)
and from hypothesis (bodies with every field of every type, raw bytes, odd headers);
a table of known-bad requests checks that each is refused with a 4xx whose OpenAI-style
error names the problem; raw-socket requests check the HTTP framing limits. Bounded:
a few hundred requests in all, each small (generations are capped at a few tokens).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servers import free_port

from replica.fleet import SimFleet
from router.openapi import openapi_spec

from .conftest import ProcessGroup, gateway_config, tenant_salt

MODEL = "sim"
AUTH = {"Authorization": "Bearer sk-alpha"}
MAX_BODY = 256 * 1024  # room for a 100,000-deep nesting (200 KB)
MAX_MODEL_LEN = 8192  # the tiny model's

FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path) -> Iterator[str]:
    """A gateway process (tokenizer loaded: chat templates run) over two sims."""
    with SimFleet(2, block_size=16, model_dir=tiny_model_dir, served_model_name=MODEL) as fleet:
        group = ProcessGroup()
        try:
            raw = gateway_config(fleet.replicas, model=MODEL, port=free_port(),
                                 model_dir=tiny_model_dir,
                                 proxy={"max_body_bytes": MAX_BODY},
                                 limits={"max_tokens_limit": 64, "max_n": 4})
            url = group.gateway(raw, "fuzz")
            yield url
            proc = group.procs[0][0]
            log = group.log(proc)
            # Nothing the fuzzers sent made the gateway log an unhandled error.
            assert "Traceback" not in log and "unhandled error" not in log, log
        finally:
            group.stop()


@pytest.fixture(scope="module")
def http() -> Iterator[requests.Session]:
    with requests.Session() as session:
        yield session


def assert_handled(resp: requests.Response) -> None:
    """A 2xx, or a 4xx with an OpenAI-style error body and no internals in it."""
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    assert "Traceback" not in resp.text and 'File "' not in resp.text
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str)


# --------------------------------------------------------------------- schemathesis

SCHEMA = schemathesis.openapi.from_dict(openapi_spec())
_PROBES = ("/health", "/ready", "/metrics", "/openapi.json")  # no key, no body: always 200


@SCHEMA.parametrize()
@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_openapi_described_surface_never_answers_5xx(case: Any, gateway: str) -> None:
    resp = case.call(base_url=gateway, headers=AUTH, timeout=30)
    if case.path in _PROBES and case.method == "GET":
        # /ready may say 503 only when no replica is available, and here both are.
        assert resp.status_code == 200, (case.path, resp.status_code)
    else:
        assert_handled(resp)  # negative cases include other methods: a JSON 405


# ------------------------------------------------------------------------ hypothesis

# JSON has no NaN or Infinity: a client library refuses to send them.
json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | \
    st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4) |
                           st.dictionaries(st.text(max_size=10), inner, max_size=4),
                           max_leaves=12)

valid_prompt = st.lists(st.integers(10, 3000), min_size=1, max_size=40) | st.text(max_size=200)
valid_messages = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant"]),
    "content": st.text(max_size=100)}), min_size=1, max_size=3)

# Each field either plausible or anything at all; a body draws any subset of them.
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "prompt": valid_prompt | json_values,
    "messages": valid_messages | json_values,
    "max_tokens": st.integers(-5, 100) | st.just(10**12) | json_values,
    "max_completion_tokens": st.integers(1, 8) | json_values,
    "n": st.integers(-1, 6) | st.just(10**6) | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "temperature": st.floats(0, 2) | json_values,
    "cache_salt": st.text(max_size=200) | json_values,
    "user": st.text(max_size=20) | json_values,
    "return_token_ids": st.booleans() | json_values,
    "echo": st.booleans() | json_values,
    "stop": st.text(max_size=5) | json_values,
}


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {"model": draw(st.sampled_from([MODEL, MODEL, "nope", ""]) |
                                         json_values)}
    if draw(st.booleans()):
        del body["model"]
    for name in draw(st.sets(st.sampled_from(sorted(FIELDS)), max_size=6)):
        body[name] = draw(FIELDS[name])
    return body


@FUZZ
@given(body=bodies(), path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_generated_bodies_are_served_or_refused_cleanly(
        gateway: str, http: requests.Session, body: dict[str, Any], path: str) -> None:
    resp = http.post(gateway + path, json=body, headers=AUTH, timeout=30)
    assert_handled(resp)


@FUZZ
@given(raw=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_arbitrary_bytes_are_refused_with_a_4xx(
        gateway: str, http: requests.Session, raw: bytes) -> None:
    resp = http.post(gateway + "/v1/completions", data=raw,
                     headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
    assert_handled(resp)
    assert 400 <= resp.status_code < 500


header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=300)


@FUZZ
@given(auth=header_text, request_id=header_text, traceparent=header_text,
       content_type=header_text, session=header_text)
def test_arbitrary_header_values_never_cause_a_5xx(
        gateway: str, http: requests.Session, auth: str, request_id: str, traceparent: str,
        content_type: str, session: str) -> None:
    headers = {"Authorization": auth, "x-request-id": request_id, "traceparent": traceparent,
               "Content-Type": content_type, "x-session-id": session}
    body = {"model": MODEL, "prompt": [11, 12, 13], "max_tokens": 2}
    resp = http.post(gateway + "/v1/completions", data=json.dumps(body), headers=headers,
                     timeout=30)
    assert_handled(resp)
    if auth != AUTH["Authorization"]:
        assert resp.status_code == 401


# -------------------------------------------------------------- named bad inputs


def _post_raw(http: requests.Session, gateway: str, data: bytes,
              path: str = "/v1/completions", key: str = "sk-alpha") -> requests.Response:
    return http.post(gateway + path, data=data, timeout=30,
                     headers={"Authorization": f"Bearer {key}",
                              "Content-Type": "application/json"})


def _j(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def _completion(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": [11, 12, 13], "max_tokens": 2, **extra}


def _raw_completion(field: bytes) -> bytes:
    """A completion body with `field` spliced in as written (for what json.dumps won't)."""
    return b'{"model": "sim", "prompt": [11, 12, 13], "max_tokens": 2, ' + field + b"}"


BAD_INPUTS: list[tuple[str, bytes, int, str]] = [
    # (case, body, status, what the error must name: its param, or a word of its message)
    ("malformed JSON", b'{"model": "sim", "prompt": [1, 2', 400, "JSON"),
    ("not an object", b"[1, 2, 3]", 400, "object"),
    ("invalid UTF-8", b'{"model": "sim", "prompt": "\xff\xfe"}', 400, "UTF-8"),
    ("wrong type", _j(_completion(max_tokens="ten")), 400, "max_tokens"),
    # pydantic's lax mode (vLLM's reading) takes "yes" for true, but nothing takes "maybe".
    ("wrong type: stream", _j(_completion(stream="maybe")), 400, "stream"),
    ("model not a string", _j({"model": 5, "prompt": [1, 2]}), 400, "model"),
    ("unknown model", _j({**_completion(), "model": "gpt-17"}), 404, "model"),
    ("absurd max_tokens", _j(_completion(max_tokens=10**12)), 400, "max_tokens"),
    ("negative max_tokens", _j(_completion(max_tokens=-1)), 400, "max_tokens"),
    ("absurd n", _j(_completion(n=100_000)), 400, "n"),
    ("client cache_salt", _j(_completion(cache_salt="mine")), 400, "cache_salt"),
    ("another tenant's salt", _j(_completion(cache_salt=tenant_salt("beta"))), 400,
     "cache_salt"),
    ("prompt beyond the model's length",
     _j({"model": MODEL, "prompt": [11] * (MAX_MODEL_LEN + 10), "max_tokens": 2}), 400,
     "prompt"),
    ("oversized body", _j(_completion(prompt="x" * (MAX_BODY + 1))), 413, "bytes"),
    # Python's json accepts NaN and Infinity and other clients send them; vLLM would hang
    # on a NaN temperature, so the gateway refuses them as not JSON.
    ("NaN temperature", _raw_completion(b'"temperature": NaN'), 400, "NaN"),
    ("Infinity top_p", _raw_completion(b'"top_p": Infinity'), 400, "Infinity"),
    ("-Infinity temperature", _raw_completion(b'"temperature": -Infinity'), 400, "Infinity"),
    ("number beyond a double", _raw_completion(b'"temperature": 1e400'), 400, "out of range"),
    ("100,000-deep nesting",
     b'{"model": "sim", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nested"),
    ("50,000-deep objects",
     b'{"model": "sim", "x": ' + b'{"":' * 50_000 + b"1" + b"}" * 50_000 + b"}", 400, "nested"),
]


@pytest.mark.parametrize(("case", "data", "status", "names"), BAD_INPUTS,
                         ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_refused_naming_the_problem(
        gateway: str, http: requests.Session, case: str, data: bytes, status: int,
        names: str) -> None:
    resp = _post_raw(http, gateway, data)
    assert resp.status_code == status, (case, resp.status_code, resp.text[:300])
    assert_handled(resp)
    error = resp.json()["error"]
    assert error["param"] == names or names in error["message"], (case, error)


non_finite = st.sampled_from([float("nan"), float("inf"), float("-inf")])


@FUZZ
@given(field=st.sampled_from([*sorted(FIELDS), "seed", "top_p", "presence_penalty"]),
       value=non_finite | st.lists(non_finite, min_size=1, max_size=3) |
       st.dictionaries(st.text(max_size=5), non_finite, min_size=1, max_size=2),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_non_finite_numbers_anywhere_are_a_400_never_a_hang(
        gateway: str, http: requests.Session, field: str, value: Any, path: str) -> None:
    body = {"model": MODEL, "max_tokens": 2, "prompt": [11, 12, 13],
            "messages": [{"role": "user", "content": "hi"}], field: value}
    # json.dumps writes NaN and Infinity as Python's json (and many clients) do.
    resp = http.post(gateway + path, data=json.dumps(body), timeout=10,
                     headers={**AUTH, "Content-Type": "application/json"})
    assert resp.status_code == 400, (field, value, resp.text[:300])
    assert_handled(resp)
    assert "NaN and Infinity" in resp.json()["error"]["message"]


def test_max_tokens_beyond_the_context_left_is_capped_as_vllm_does(
        gateway: str, http: requests.Session) -> None:
    # vLLM 0.32 caps max_tokens to the context the prompt leaves rather than refusing.
    resp = _post_raw(http, gateway, _j({"model": MODEL, "prompt": [11] * (MAX_MODEL_LEN - 10),
                                        "max_tokens": 40}))
    assert resp.status_code == 200, resp.text[:300]
    assert resp.json()["usage"]["completion_tokens"] <= 10


def test_good_requests_still_pass_between_bad_ones(gateway: str, http: requests.Session) -> None:
    resp = _post_raw(http, gateway, _j(_completion()))
    assert resp.status_code == 200 and resp.json()["choices"]
    chat = _post_raw(http, gateway, _j({"model": MODEL, "max_tokens": 2,
                                        "messages": [{"role": "user", "content": "hi"}]}),
                     path="/v1/chat/completions")
    assert chat.status_code == 200 and chat.json()["choices"]


# ------------------------------------------------------------------ HTTP framing


def _raw_exchange(gateway: str, request: bytes) -> bytes:
    """Send `request` bytes as they are on a fresh connection; the answer's first bytes."""
    host, port = gateway.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while not data.endswith(b"\r\n\r\n") and b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.") else 0


def test_content_length_with_transfer_encoding_is_refused(gateway: str) -> None:
    body = _j(_completion())
    smuggle = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-alpha\r\n"
               b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() +
               b"\r\nTransfer-Encoding: chunked\r\n\r\n" + hex(len(body))[2:].encode() +
               b"\r\n" + body + b"\r\n0\r\n\r\n")
    assert _status(_raw_exchange(gateway, smuggle)) == 400


def test_oversized_headers_are_refused(gateway: str) -> None:
    big = b"x" * 20_000
    request = (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-alpha\r\n"
               b"X-Padding: " + big + b"\r\n\r\n")
    assert _status(_raw_exchange(gateway, request)) in (400, 431)
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(2000))
    request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n"
    assert _status(_raw_exchange(gateway, request)) in (400, 431)
    # A sane request on a fresh connection still works.
    ok = _raw_exchange(gateway, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert _status(ok) == 200
