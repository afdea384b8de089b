"""A completions prompt read in C straight into packed int64 (router.native.prompt_ids)
against the generic decode it short-cuts: the same body, the same ids, the same errors,
and the same keys, fingerprints and findings downstream.

The scan is not a JSON validator: where it answers, the rest of the body is decoded
generically, and every body it does not recognise takes the generic path. So the
property checked here is that the fast path never answers differently from the slow one,
on bodies built to confuse a scan (a "prompt" inside strings, nested objects, escaped
keys, duplicates, odd whitespace) as well as on plain ones.
"""

from __future__ import annotations

import json
import random
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router import native
from router.config import LimitsConfig, TenantsConfig
from router.hashing import BlockChain, HashConfig, plain_chain_keys
from router.hygiene import PromptHygiene
from router.request import (
    ClientError,
    _check_prompt,
    decode_body,
    decode_completion,
    parse_request,
    upstream_payload,
)
from router.routing import ChainCache
from router.tenants import TenantRegistry

REGISTRY = TenantRegistry.from_config(TenantsConfig(allow_anonymous=True))


def _generic(raw: bytes) -> tuple[dict[str, Any] | None, list[int] | None, str | None]:
    """What the generic path makes of a body: (body, ids, error message)."""
    try:
        body = decode_body(raw)
        ids = _check_prompt(body)
    except ClientError as exc:
        return None, None, exc.message
    return body, None if ids is None else list(ids), None


def _fast(raw: bytes) -> tuple[dict[str, Any] | None, list[int] | None, str | None]:
    """What decode_completion, then the same check where it gave no ids, makes of it;
    the prompt's Raw decoded back for the comparison."""
    try:
        body, ids = decode_completion(raw)
        if ids is None:
            ids = _check_prompt(body)
    except ClientError as exc:
        return None, None, exc.message
    if isinstance(body.get("prompt"), msgspec.Raw):
        body = {**body, "prompt": msgspec.json.decode(body["prompt"])}
    return body, None if ids is None else list(ids), None


def test_the_c_path_is_built_here() -> None:
    assert native.AVAILABLE  # else every comparison below would be the slow path twice


def test_a_plain_prompt_is_read_packed_and_the_rest_decoded() -> None:
    raw = b'{"model": "m", "prompt": [5, 0, 70000, 9223372036854775807], "max_tokens": 3}'
    body, ids = decode_completion(raw)
    assert isinstance(ids, memoryview) and ids.format == "q"
    assert list(ids) == [5, 0, 70000, 2**63 - 1]
    assert body["model"] == "m" and body["max_tokens"] == 3
    assert isinstance(body["prompt"], msgspec.Raw)
    assert bytes(body["prompt"]) == b"[5, 0, 70000, 9223372036854775807]"


@pytest.mark.parametrize("raw", [
    b'{"prompt": []}',
    b'{"prompt": [-1]}',
    b'{"prompt": [1.0]}',
    b'{"prompt": [1e3]}',
    b'{"prompt": [01]}',
    b'{"prompt": [true]}',
    b'{"prompt": [9223372036854775808]}',
    b'{"prompt": [[1, 2], [3]]}',
    b'{"prompt": [1, "a"]}',
    b'{"prompt": "text"}',
    b'{"prompt": [1], "prompt": [2]}',
    b'{"pr\\u006fmpt": [1]}',
    b'{"prompt": [1]} trailing',
    b'{"prompt": [1,]}',
    b'{"prompt": [1 2]}',
    b'{"prompt": [1], "x": }',
    b'{"prompt": [1], "x": NaN}',
    b'[1, 2]',
    b'{"model": "m"}',
    b'{"a": {"prompt": [1]}, "prompt": "outer"}',
    b'{"a": "\\"prompt\\": [1]", "prompt": [2]}',
])
def test_every_unusual_body_answers_as_the_generic_path(raw: bytes) -> None:
    assert _fast(raw) == _generic(raw)


_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                     st.floats(allow_nan=False, allow_infinity=False),
                     st.text(alphabet='ab"\\{}[],: prompt\n', max_size=12))
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.sampled_from(["prompt", "a", "p\"rompt", "x"]), inner, max_size=3)),
    max_leaves=12)
_PROMPTS = st.one_of(
    st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=40),
    st.lists(st.integers(-5, 2**64), max_size=6),
    _VALUES)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(["model", "a", "x", "max_tokens", "stream"]), _VALUES,
                       max_size=4),
       _PROMPTS, st.integers(0, 4), st.sampled_from(["", " ", "\n\t ", "\r\n"]))
def test_any_body_answers_as_the_generic_path(others: dict[str, Any], prompt: Any, at: int,
                                              space: str) -> None:
    items = list(others.items())
    items.insert(min(at, len(items)), ("prompt", prompt))
    sep = "," + space
    text = "{" + space + sep.join(f"{json.dumps(k)}{space}:{space}{json.dumps(v)}"
                                  for k, v in items) + space + "}"
    raw = text.encode()
    assert _fast(raw) == _generic(raw)


def test_the_request_edge_takes_packed_ids_and_refuses_as_before() -> None:
    def parse(raw: bytes) -> Any:
        return parse_request(raw, "completions", served_models=(), limits=LimitsConfig(),
                             tenant=REGISTRY.identify(None), registry=REGISTRY)

    parsed = parse(b'{"model": "m", "prompt": [3, 4, 5], "max_tokens": 2}')
    assert isinstance(parsed.token_ids, memoryview) and list(parsed.token_ids) == [3, 4, 5]
    with pytest.raises(ClientError) as info:
        parse(b'{"model": "m", "prompt": [3, -4]}')
    assert info.value.param == "prompt"
    with pytest.raises(ClientError) as info:
        parse(b'{"model": "m", "prompt": [3, 4], "max_tokens": "two"}')
    assert info.value.param == "max_tokens"


def test_a_re_encoded_body_carries_the_prompt_as_sent() -> None:
    # A client that sets a field the gateway adds (here stream_options) makes the body
    # encoded again: the packed prompt's Raw must come back as the same JSON array.
    raw = (b'{"model": "m", "prompt": [1, 2, 3], "stream": true, '
           b'"stream_options": {"continuous_usage_stats": false}}')
    parsed = parse_request(raw, "completions", served_models=(), limits=LimitsConfig(),
                           tenant=REGISTRY.identify(None), registry=REGISTRY)
    payload, _ = upstream_payload(parsed, want_token_ids=False)
    sent = json.loads(payload)
    assert sent["prompt"] == [1, 2, 3]
    assert sent["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_packed_ids_key_as_a_list(algo: str) -> None:
    rng = random.Random(algo)
    ids = [rng.randrange(200_000) for _ in range(16 * 40 + 5)]
    packed = memoryview(native.pack_ids(ids, len(ids))).cast("q")
    parent = rng.randbytes(32)
    assert native.chain_keys(algo, parent, packed, 32, 16 * 40, 16) == \
        native.chain_keys(algo, parent, ids, 32, 16 * 40, 16)
    negative = memoryview(native.pack_ids([1] * 15 + [0], 16)).cast("q").tobytes()
    bad = bytearray(negative)
    bad[-1] = 0xFF  # the last id's sign bit: -72057594037927936
    assert native.chain_keys(algo, parent, memoryview(bytes(bad)).cast("q"), 0, 16, 16) is None


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_a_packed_prompt_gets_the_keys_fingerprints_and_findings_of_its_list(
        algo: str, salt: str | None) -> None:
    config = HashConfig(block_size=16, algo=algo, seed="0")
    rng = random.Random(7)
    history = [rng.randrange(100_000) for _ in range(16 * 30 + 3)]
    packed = memoryview(native.pack_ids(history, len(history))).cast("q")
    assert plain_chain_keys(config, packed, len(packed), salt) == \
        BlockChain(config, cache_salt=salt).extend(history)
    as_list, as_packed = ChainCache(), ChainCache()
    turns = [history[:16 * 10], history[:16 * 20 + 3], history]
    for turn in turns:
        view = memoryview(native.pack_ids(turn, len(turn))).cast("q")
        assert as_packed.event_keys(config, view, salt, probe=4) == \
            as_list.event_keys(config, turn, salt, probe=4)
        assert as_packed.event_keys(config, view, salt) == as_list.event_keys(config, turn, salt)
    # A list and its packed copy share every fingerprint: one finds what the other keyed.
    fresh = ChainCache()
    fresh.event_keys(config, history, salt)
    fresh.event_keys(config, packed, salt)
    assert fresh.hashed_blocks == len(history) // 16
    hygiene_list, hygiene_packed = PromptHygiene(), PromptHygiene()
    for turn in turns:
        view = memoryview(native.pack_ids(turn, len(turn))).cast("q")
        assert hygiene_packed.observe("t", view) == hygiene_list.observe("t", turn)
