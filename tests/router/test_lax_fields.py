"""router/lax_fields.py reads each field as vLLM 0.32's own request models do.

vLLM's CompletionRequest and ChatCompletionRequest (installed with the vllm extra) are the
oracle: every probe value is validated by them and by our table, and both must agree on
whether it is served and on the value read. A vLLM upgrade that changes a field's type or
default fails here before it makes the gateway answer differently.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from router import lax_fields
from router.client_error import ClientError
from router.lax_fields import FIELDS, Endpoint

BASE: dict[Endpoint, dict[str, Any]] = {
    "completions": {"model": "m", "prompt": "hello"},
    "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
}
MODELS = {"completions": CompletionRequest, "chat": ChatCompletionRequest}
ABSENT = object()

# Every JSON type, and the strings and numbers pydantic's lax mode reads or refuses.
PROBES: list[Any] = [
    ABSENT, None, True, False, 0, 1, 2, -1, -2, 3, 7, 3.0, 3.5, 1e1, -0.0, "3", " 3 ",
    "3.0", "3.5", "1e1", "-1", "-2", "0", "1", "true", "false", "True", "yes", "no", "on",
    "off", "t", "f", "y", "n", "maybe", "", "2", [], [1], {}, {"a": 1},
]


def _vllm_reads(endpoint: Endpoint, name: str, value: Any) -> tuple[bool, Any]:
    """(served, value vLLM holds) for the base body with `name` set to `value`."""
    body = dict(BASE[endpoint])
    if value is not ABSENT:
        body[name] = value
    try:
        request = MODELS[endpoint].model_validate(body)
    except ValidationError as exc:
        locs = {err["loc"][0] for err in exc.errors() if err["loc"]}
        assert locs == {name}, (name, value, exc)  # refused for this field, nothing else
        return False, None
    return True, getattr(request, name)


def _ours(endpoint: Endpoint, name: str, value: Any) -> tuple[bool, Any]:
    body = dict(BASE[endpoint])
    if value is not ABSENT:
        body[name] = value
    try:
        read = lax_fields.field(body, name, endpoint)
    except ClientError as exc:
        assert exc.param == name and exc.message.startswith(f"'{name}' must be")
        return False, None
    if endpoint == "completions" and name == "max_tokens" and read is None:
        read = 16  # vLLM's mode="before" validator turns null into the default
    return True, read


@pytest.mark.parametrize(("endpoint", "name"),
                         [(e, n) for e, fields in FIELDS.items() for n in fields])
def test_every_field_is_read_as_vllms_model_reads_it(endpoint: Endpoint, name: str) -> None:
    for value in PROBES:
        theirs, ours = _vllm_reads(endpoint, name, value), _ours(endpoint, name, value)
        assert ours == theirs, (endpoint, name, value)
        assert type(ours[1]) is type(theirs[1]), (endpoint, name, value)  # True is not 1


def test_the_probes_cover_what_lax_mode_changes() -> None:
    # Not a tautology over always-refused or always-served values: the table is tested on
    # values vLLM serves only by reading them leniently, and on some it refuses.
    served = [v for v in PROBES if _vllm_reads("completions", "max_tokens", v)[0]]
    assert {"3", " 3 ", "3.0", 3.0, True} <= {v for v in served if v is not ABSENT}
    assert not _vllm_reads("completions", "max_tokens", 3.5)[0]
    assert _vllm_reads("chat", "stream", "yes") == (True, True)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_sampling_numbers_are_read_as_vllm_reads_them(endpoint: Endpoint) -> None:
    for value in PROBES:
        theirs = _vllm_reads(endpoint, "temperature", value)
        try:
            body = {"temperature": value} if value is not ABSENT else {}
            ours = (True, lax_fields.number(body, "temperature"))
        except ClientError:
            ours = (False, None)
        assert ours == theirs, value


_id = st.one_of(st.integers(-3, 2**40), st.floats(-2, 50, allow_nan=False),
                st.sampled_from(["1", "2.0", "x", " 3"]), st.booleans(), st.none())
_prompt = st.one_of(st.text(max_size=5), st.lists(_id, max_size=5),
                    st.lists(st.lists(_id, max_size=3), max_size=3),
                    st.lists(st.text(max_size=3), max_size=3),
                    st.lists(st.one_of(_id, st.text(max_size=2), st.lists(_id, max_size=2)),
                             max_size=3))


@settings(max_examples=400, deadline=None)
@given(_prompt)
def test_a_prompt_is_read_as_vllm_reads_it(value: Any) -> None:
    # An empty prompt is refused by a rule of vLLM's (validate_prompt_and_prompt_embeds),
    # not by its type: the request edge says so itself (test_request.py).
    assume(value != "" and value != [])
    served, theirs = _vllm_reads("completions", "prompt", value)
    ours = lax_fields.prompt(value)
    if not served:
        assert ours is None, value
    else:
        assert ours == theirs and type(ours) is type(theirs), value


def test_a_stream_option_is_read_as_vllm_reads_it() -> None:
    for value in PROBES:
        body = {**BASE["chat"], "stream": True}
        if value is not ABSENT:
            body["stream_options"] = {"include_usage": value}
        try:
            request = ChatCompletionRequest.model_validate(body)
            theirs: tuple[bool, Any] = (True, bool(request.stream_options
                                                  and request.stream_options.include_usage))
        except ValidationError:
            theirs = (False, None)
        try:
            ours: tuple[bool, Any] = (True, lax_fields.stream_option(
                body.get("stream_options"), "include_usage"))
        except ClientError:
            ours = (False, None)
        assert ours == theirs, value
