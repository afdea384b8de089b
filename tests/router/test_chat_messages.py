"""normalise_messages' shortcut for plain messages against the general per-message path
(normalise_message, ported from vLLM's renderer and checked against real vLLM in
tests/router/test_tokenize.py): the same conversation for every message shape."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from router.chat_messages import normalise_message, normalise_messages
from router.request import ClientError

_CONTENT = st.one_of(st.none(), st.text(max_size=8), st.integers(),
                     st.lists(st.one_of(st.text(max_size=4),
                                        st.fixed_dictionaries({"type": st.just("text"),
                                                               "text": st.text(max_size=4)})),
                              max_size=2))
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "developer", "", 3]),
     "content": _CONTENT},
    optional={"tool_calls": st.sampled_from([None, [], [{"type": "function", "function": {
                  "name": "f", "arguments": '{"a": 1}'}}]]),
              "reasoning": st.sampled_from([None, "because"]),
              "name": st.sampled_from(["bob", 7]),
              "task": st.sampled_from(["t", None]),
              "tool_call_id": st.just("c1")})


def _general(messages: list[Any], content_format: str) -> list[dict[str, Any]] | str:
    try:
        return [normalise_message(i, m, content_format) for i, m in enumerate(messages)]
    except ClientError as exc:
        return exc.message


def _shortcut(messages: list[Any], content_format: str) -> list[dict[str, Any]] | str:
    try:
        return normalise_messages(messages, content_format=content_format)
    except ClientError as exc:
        return exc.message


@settings(max_examples=400, deadline=None)
@example([{"role": "user", "content": "a", "name": "bob"}], "string")
@example([{"role": "user", "content": "a", "task": "t"}], "string")
@example([{"role": "assistant", "content": "a", "reasoning": "r"}], "string")
@example([{"role": "assistant", "content": "a", "tool_calls": []}], "string")
@example([{"role": "system", "content": "x-anthropic-billing-header: 1\nhi"}], "string")
@example([{"role": "tool", "content": "a", "tool_call_id": "c"}], "string")
@example([{"role": "user", "content": "a"}], "openai")
@given(st.lists(st.one_of(_MESSAGE, st.just("not an object")), min_size=1, max_size=5),
       st.sampled_from(["string", "openai"]))
def test_every_message_normalises_as_the_general_path(messages: list[Any],
                                                      content_format: str) -> None:
    assert _shortcut(messages, content_format) == _general(messages, content_format)


@pytest.mark.parametrize("message", [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yes", "tool_calls": None},
])
def test_a_plain_message_takes_the_shortcut_and_is_a_fresh_dict(message: dict[str, Any]) -> None:
    out = normalise_messages([message])
    assert out == [{"role": message["role"], "content": message["content"]}]
    assert out[0] is not message  # templates may read it; the client's body stays as sent
