"""StreamState.process: the typed view of a streamed chunk answers as a whole parse does.

Every event before a stream's first content is read on the way to the first token, and a
client that asked for return_token_ids gets the whole prompt's ids in the first chunk.
The gateway reads such chunks through a typed view that skips what it does not use; a
chunk it must change, or that the view does not fit, is parsed whole. These tests hold
the view to the whole parse on every chunk shape vLLM streams (and some it should not),
under every combination of what the client and the gateway asked for.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from router.upstream import ProxyOutcome, StreamState, UpstreamRequest

PROMPT_IDS = list(range(1000, 1000 + 8192))

CHUNKS: dict[str, Any] = {
    "chat role, prompt ids at the top": {
        "id": "c", "object": "chat.completion.chunk", "prompt_token_ids": PROMPT_IDS,
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None, "token_ids": []}]},
    "chat content": {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None,
                                  "token_ids": [5]}]},
    "chat content, second prompt of a batch": {
        "choices": [{"index": 1, "delta": {"content": "Hi"}, "token_ids": [6, 7]}]},
    "completion first, prompt ids in the choice": {
        "choices": [{"index": 0, "text": "", "prompt_token_ids": PROMPT_IDS, "token_ids": [],
                     "finish_reason": None}]},
    "completion text": {"choices": [{"index": 0, "text": "x", "token_ids": [9]}]},
    "finish only": {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    "finish null, no content": {"choices": [{"index": 0, "delta": {"content": None},
                                             "finish_reason": None}]},
    "usage only (the chunk include_usage adds)": {
        "choices": [], "usage": {"prompt_tokens": 8192, "completion_tokens": 2,
                                 "prompt_tokens_details": {"cached_tokens": 4096}}},
    "usage null": {"choices": [{"index": 0, "delta": {"content": "a"}}], "usage": None},
    "usage beside content": {"choices": [{"index": 0, "text": "y"}],
                             "usage": {"prompt_tokens": 3, "completion_tokens": 1}},
    "tool call": {"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"name": "f", "arguments": ""}}]}}]},
    "empty tool calls": {"choices": [{"index": 0, "delta": {"tool_calls": []}}]},
    "reasoning": {"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]},
    "reasoning (new name)": {"choices": [{"index": 0, "delta": {"reasoning": "hmm"}}]},
    "choices null": {"choices": None, "usage": {"prompt_tokens": 1}},
    "error": {"error": {"message": "boom", "code": 500}},
    # Shapes the view does not fit: parsed whole instead.
    "content as a list": {"choices": [{"index": 0, "delta": {"content": [{"type": "text"}]}}]},
    "index as a string": {"choices": [{"index": "0", "text": "z", "token_ids": [1]}]},
    "token ids not ints": {"choices": [{"index": 0, "text": "z", "token_ids": ["a"]}]},
    "usage a list": {"choices": [], "usage": [1]},
    # The view reads a chunk with its prompt ids cut out (without_prompt_ids); these keep
    # the cut from changing what it reads, or make it fall back to the whole parse.
    "prompt ids nested (the cut leaves bad JSON)": {
        "prompt_token_ids": [[1, 2], [3]], "choices": [{"index": 0, "text": "q", "token_ids": [4]}]},
    "prompt ids null": {"prompt_token_ids": None, "choices": [{"index": 0, "text": "q"}]},
    "prompt ids key inside a text": {
        "choices": [{"index": 0, "text": '"prompt_token_ids": [1, 2] ]', "token_ids": [3]}]},
    "prompt ids in every choice, usage after": {
        "choices": [{"index": 0, "text": "", "prompt_token_ids": [1, 2], "token_ids": [3]},
                    {"index": 1, "text": "b", "prompt_token_ids": [4], "token_ids": [5]}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1,
                  "prompt_tokens_details": {"cached_tokens": 0}}},
    "error beside choices": {"choices": [], "error": {"message": "engine dead", "code": 503}},
}
RAW_EVENTS = {
    "done": b"data: [DONE]\n\n",
    "not json": b"data: {choices\n\n",
    "a list": b'data: [{"choices": []}]\n\n',
    "comment": b": keep-alive\n\n",
    # vLLM's own serializer writes compact JSON; json.dumps above puts in spaces.
    "compact first chunk": b"data: " + json.dumps(
        CHUNKS["completion first, prompt ids in the choice"], separators=(",", ":")).encode()
        + b"\n\n",
    "compact chat role chunk, CRLF": b"data: " + json.dumps(
        CHUNKS["chat role, prompt ids at the top"], separators=(",", ":")).encode() + b"\r\n\r\n",
    "error only, 5xx": b'data: {"error": {"message": "boom", "code": 500}}\n\n',
    "error only, 4xx": b'data: {"error": {"message": "bad", "code": 400}}\n\n',
    "error only, code a string": b'data: {"error": {"message": "x", "code": "503"}}\n\n',
    "error not an object": b'data: {"error": "boom"}\n\n',
}
SETTINGS = list(itertools.product([True, False], repeat=3))  # wants_usage, strip, collect


def _state(wants_usage: bool, strip: bool, collect: bool) -> StreamState:
    up = UpstreamRequest(path="/v1/chat/completions", body={}, headers={}, stream=True,
                         client_wants_usage=wants_usage, strip_token_ids=strip,
                         collect_token_ids=collect)
    return StreamState(up, ProxyOutcome())


def _event(chunk: Any) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _observed(state: StreamState) -> tuple[Any, ...]:
    o = state.outcome
    return state.token_ids, state.saw_token_ids, o.prompt_tokens, o.cached_tokens


@pytest.mark.parametrize(("wants_usage", "strip", "collect"), SETTINGS)
@pytest.mark.parametrize("event", [pytest.param(_event(c), id=n) for n, c in CHUNKS.items()]
                         + [pytest.param(e, id=n) for n, e in RAW_EVENTS.items()])
def test_the_typed_view_answers_as_the_whole_parse(event: bytes, wants_usage: bool, strip: bool,
                                                   collect: bool) -> None:
    fast, whole = _state(wants_usage, strip, collect), _state(wants_usage, strip, collect)
    data = event[len(b"data: "):].rstrip(b"\r\n") if event.startswith(b"data: ") else b""
    # Chunks that name neither usage nor choices pass unread (errors are caught apart).
    read = data.startswith(b"{") and (b'"usage"' in data or b'"choices"' in data)
    expected = whole._process_whole(event, data) if read else (event, False)
    assert fast.process(event) == expected
    assert _observed(fast) == _observed(whole)


def _error_status(event: bytes) -> int | None:
    """What the proxy read before StreamState.error_code: a 5xx error event's code."""
    data = b"\n".join(line[5:].lstrip(b" ") for line in event.splitlines()
                      if line.startswith(b"data:"))
    if b'"error"' not in data:
        return None
    try:
        err = json.loads(data).get("error")
        code = int(err.get("code") or 0) if isinstance(err, dict) else 0
    except (ValueError, TypeError, AttributeError):
        return None
    return code if code >= 500 else None


@pytest.mark.parametrize(("wants_usage", "strip"), [(True, False), (False, True)])
@pytest.mark.parametrize("event", [pytest.param(_event(c), id=n) for n, c in CHUNKS.items()]
                         + [pytest.param(e, id=n) for n, e in RAW_EVENTS.items()])
def test_an_error_events_code_is_read_as_the_proxy_read_it(event: bytes, wants_usage: bool,
                                                           strip: bool) -> None:
    state = _state(wants_usage, strip, collect=False)
    state.error_code = 599  # left from an earlier event: process must not keep it
    state.process(event)
    assert state.error_code == _error_status(event)


def test_a_chunk_the_client_asked_ids_for_passes_byte_for_byte() -> None:
    event = _event(CHUNKS["chat role, prompt ids at the top"])
    state = _state(wants_usage=True, strip=False, collect=False)
    assert state.process(event) == (event, False)
    content = _event(CHUNKS["chat content"])
    assert state.process(content) == (content, True)
    assert state.token_ids == [] and not state.saw_token_ids  # not collecting


def test_ids_the_gateway_asked_for_are_collected_and_hidden() -> None:
    state = _state(wants_usage=False, strip=True, collect=True)
    out, content = state.process(_event(CHUNKS["completion first, prompt ids in the choice"]))
    assert out is not None and not content
    choice = json.loads(out[len(b"data: "):])["choices"][0]
    assert "prompt_token_ids" not in choice and "token_ids" not in choice
    out, content = state.process(_event(CHUNKS["completion text"]))
    assert out is not None and content and b"token_ids" not in out
    assert state.token_ids == [9] and state.saw_token_ids
    # The usage-only chunk the gateway added for itself is read, then dropped.
    assert state.process(_event(CHUNKS["usage only (the chunk include_usage adds)"])) == (None, False)
    assert (state.outcome.prompt_tokens, state.outcome.cached_tokens) == (8192, 4096)


def test_usage_the_client_asked_for_is_read_and_passed_on() -> None:
    state = _state(wants_usage=True, strip=False, collect=False)
    event = _event(CHUNKS["usage only (the chunk include_usage adds)"])
    assert state.process(event) == (event, False)
    assert (state.outcome.prompt_tokens, state.outcome.cached_tokens) == (8192, 4096)


@pytest.mark.parametrize(("wants_usage", "strip", "collect"), SETTINGS)
@pytest.mark.parametrize("body", [pytest.param(json.dumps(c).encode(), id=n)
                                  for n, c in CHUNKS.items()]
                         + [pytest.param(b"{not json", id="not json"),
                            pytest.param(b"[1, 2]", id="a list")])
def test_a_whole_answer_is_read_as_absorb_reads_it(body: bytes, wants_usage: bool, strip: bool,
                                                   collect: bool) -> None:
    fast, whole = _state(wants_usage, strip, collect), _state(wants_usage, strip, collect)
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    changed = isinstance(data, dict) and whole.absorb(data)
    out = fast.absorb_body(body)
    if changed:
        assert json.loads(out) == data  # the ids the gateway asked for, stripped
    else:
        assert out is body  # passed on as it came, not re-encoded
    assert _observed(fast) == _observed(whole)
