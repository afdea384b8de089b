"""The official `openai` client through the gateway answers as the same replica does directly.

Each request goes through the gateway first (a fresh prompt, so nothing is cached under
the tenant's salt), then the same request straight to the sim; the two answers must be
equal field by field, ids and timestamps aside. Sims are real processes; the gateway
runs in-process on loopback with the tiny model's tokenizer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from replica.fleet import AsyncSimFleet, free_port

from .conftest import GatewayClient, gateway_config, tenant_salt, wait_indexed

MODEL = "sim"
_VOLATILE = frozenset({"id", "created", "system_fingerprint"})


def comparable(value: Any) -> Any:
    """A response (pydantic model, dict or list) without its ids and timestamps."""
    if hasattr(value, "model_dump"):
        value = value.model_dump()
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items() if k not in _VOLATILE}
    if isinstance(value, list):
        return [comparable(v) for v in value]
    return value


@pytest.fixture
async def surface(start_gateway: Any, tiny_model_dir: Path,
                  ) -> AsyncIterator[tuple[GatewayClient, str, openai.AsyncOpenAI,
                                           openai.AsyncOpenAI]]:
    """A gateway over one sim (4,000 blocks of 16: max_model_len 8192, the model's own),
    and an openai client for each."""
    async with AsyncSimFleet(1, block_size=16, num_blocks=4000, model_dir=tiny_model_dir,
                             served_model_name=MODEL) as fleet:
        gw = await start_gateway(gateway_config(fleet.replicas, model=MODEL, port=free_port(),
                                                model_dir=tiny_model_dir))
        sim_url = fleet.replicas[0].url
        via = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-alpha", max_retries=0)
        direct = openai.AsyncOpenAI(base_url=sim_url + "/v1", api_key="unused", max_retries=0)
        try:
            yield gw, sim_url, via, direct
        finally:
            await via.close()
            await direct.close()


def _chat(turn: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You answer tersely. " * 20},
            {"role": "user", "content": turn}]


async def test_chat_streaming_tools_completions_and_batches_match_the_replica(
        surface: tuple[GatewayClient, str, openai.AsyncOpenAI, openai.AsyncOpenAI]) -> None:
    _, _, via, direct = surface
    calls: list[tuple[str, dict[str, Any]]] = [
        ("chat", {"messages": _chat("What is a prefix cache?"), "max_tokens": 12}),
        ("chat", {"messages": _chat("Weather in Oslo?"), "max_tokens": 10, "tools": [{
            "type": "function", "function": {
                "name": "weather", "description": "Current weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]}}}]}),
        ("completion", {"prompt": "The quick brown fox " * 12, "max_tokens": 9}),
        ("completion", {"prompt": ["First of a batch. " * 8, "Second of a batch. " * 8],
                        "max_tokens": 7}),
        ("completion", {"prompt": [[11, 12, 13] * 20, [14, 15, 16] * 20], "max_tokens": 5}),
    ]
    for kind, params in calls:
        create = (lambda c: c.chat.completions.create) if kind == "chat" else \
            (lambda c: c.completions.create)
        through = await create(via)(model=MODEL, **params)
        straight = await create(direct)(model=MODEL, **params)
        assert comparable(through) == comparable(straight), params
        if isinstance(params.get("prompt"), list):
            # One choice per prompt, in prompt order, from one forwarded request.
            assert [c.index for c in through.choices] == [0, 1]


async def test_streamed_chat_with_include_usage_matches_the_replica_chunk_by_chunk(
        surface: tuple[GatewayClient, str, openai.AsyncOpenAI, openai.AsyncOpenAI]) -> None:
    _, _, via, direct = surface
    params: dict[str, Any] = {"model": MODEL, "messages": _chat("Stream me a reply."),
                              "max_tokens": 8, "stream": True,
                              "stream_options": {"include_usage": True}}
    streams = []
    for client in (via, direct):
        chunks = [comparable(c) async for c in await client.chat.completions.create(**params)]
        streams.append(chunks)
    assert streams[0] == streams[1]
    assert streams[0][-1]["usage"]["completion_tokens"] == 8


async def test_context_length_follows_vllm_capped_budget_and_refusals(
        surface: tuple[GatewayClient, str, openai.AsyncOpenAI, openai.AsyncOpenAI],
        http: aiohttp.ClientSession) -> None:
    _, sim_url, via, direct = surface
    messages = _chat("Summarise: " + "cache blocks are reused " * 850)
    async with http.post(sim_url + "/tokenize", json={"model": MODEL,
                                                      "messages": messages}) as r:
        prompt_len = (await r.json())["count"]
    assert 6200 < prompt_len < 8192  # the case: a long chat, max_tokens 2000
    answers = [await c.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                               max_tokens=2000) for c in (via, direct)]
    assert comparable(answers[0]) == comparable(answers[1])
    assert answers[0].choices[0].finish_reason == "length"
    assert answers[0].usage is not None
    assert answers[0].usage.completion_tokens == 8192 - prompt_len
    # Refusals: the gateway's status, message and param equal the replica's.
    refused: list[dict[str, Any]] = [
        {"messages": messages, "max_tokens": 9000},
        {"messages": _chat("x " * 9000), "max_tokens": 5},
    ]
    for params in refused:
        errors = []
        for client in (via, direct):
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model=MODEL, **params)
            errors.append((caught.value.status_code, caught.value.body))
        assert errors[0] == errors[1], params


async def test_small_endpoints_and_responses_pass_through_as_the_replica_answers(
        surface: tuple[GatewayClient, str, openai.AsyncOpenAI, openai.AsyncOpenAI],
        http: aiohttp.ClientSession) -> None:
    gw, sim_url, via, direct = surface
    auth = {"Authorization": "Bearer sk-alpha"}
    probes: list[tuple[str, str, dict[str, Any] | None]] = [
        ("GET", "/version", None),
        ("POST", "/tokenize", {"model": MODEL, "prompt": "hello there"}),
        ("POST", "/tokenize", {"model": MODEL, "messages": _chat("hi")}),
        ("POST", "/detokenize", {"model": MODEL, "tokens": [11, 12, 13, 14]}),
    ]
    for method, path, body in probes:
        answers = []
        for base in (gw.url, sim_url):
            async with http.request(method, base + path, json=body, headers=auth) as r:
                answers.append((r.status, await r.json(content_type=None)))
        assert answers[0] == answers[1] and answers[0][0] == 200, (path, answers)
    # /v1/models: vLLM's fields, as the replica reports them.
    listed = (await via.models.list()).data
    straight = (await direct.models.list()).data
    assert [comparable(m) for m in listed] == [comparable(m) for m in straight]
    card = listed[0].model_dump()
    assert (card["id"], card["max_model_len"], card["parent"]) == (MODEL, 8192, None)
    assert card["root"]
    # The Responses API goes to the replica, routed by its conversation; the sim does not
    # serve it, and the client sees exactly the replica's answer.
    outcomes = []
    for client in (via, direct):
        with pytest.raises(openai.NotFoundError) as caught:
            await client.responses.create(model=MODEL, input="Say hi.", instructions="Be brief.")
        outcomes.append(caught.value.status_code)
    assert outcomes == [404, 404]
    # Embeddings of a model nobody serves: the gateway's 404 names what it serves.
    with pytest.raises(openai.NotFoundError) as missing:
        await via.embeddings.create(model="e5-large", input="hello")
    assert "'e5-large' does not exist" in str(missing.value) and "sim" in str(missing.value)


async def test_prompt_logprobs_get_no_cache_credit(
        surface: tuple[GatewayClient, str, openai.AsyncOpenAI, openai.AsyncOpenAI]) -> None:
    gw, _, _, _ = surface
    body: dict[str, Any] = {"model": MODEL, "prompt": list(range(20, 120)), "max_tokens": 2}
    first = await gw.post("/v1/completions", body)
    assert first.status == 200, first.body
    assert gw.app_gateway is not None and gw.app_gateway.index is not None
    await wait_indexed(gw.app_gateway.index, MODEL, first.replica, body["prompt"][:96],
                       tenant_salt("alpha"))  # its KV events have reached the index
    warmed = await gw.post("/v1/completions", body)
    assert warmed.predicted == warmed.cached > 0  # the prompt is cached and credited
    skipped = await gw.post("/v1/completions", {**body, "prompt_logprobs": 1})
    assert skipped.status == 200, skipped.body
    # vLLM reads no cache for prompt logprobs: nothing predicted, nothing reported.
    assert (skipped.predicted, skipped.cached) == (0, 0)


async def test_messages_and_responses_route_to_the_replica_holding_their_conversation(
        start_gateway: Any, tiny_model_dir: Path, http: aiohttp.ClientSession) -> None:
    async with AsyncSimFleet(2, block_size=16, num_blocks=4000, model_dir=tiny_model_dir,
                             served_model_name=MODEL) as fleet:
        gw = await start_gateway(gateway_config(fleet.replicas, model=MODEL, port=free_port(),
                                                model_dir=tiny_model_dir))
        system, question = "You are a meticulous reviewer. " * 25, "Review this diff. " * 10
        chat = await gw.post("/v1/chat/completions", {
            "model": MODEL, "max_tokens": 2, "return_token_ids": True,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}]})
        assert chat.status == 200, chat.body
        prompt = chat.body["prompt_token_ids"]
        assert gw.app_gateway is not None and gw.app_gateway.index is not None
        await wait_indexed(gw.app_gateway.index, MODEL, chat.replica, prompt[:-1],
                           tenant_salt("alpha"))
        full = (len(prompt) - 1) // 16 * 16  # the blocks a replay of this prompt hits
        anthropic = {"model": MODEL, "max_tokens": 2, "system": system,
                     "messages": [{"role": "user", "content": question}]}
        responses = {"model": MODEL, "instructions": system, "input": question}
        for path, body in (("/v1/messages", anthropic), ("/v1/responses", responses)):
            async with http.post(gw.url + path, json=body,
                                 headers={"Authorization": "Bearer sk-alpha"}) as r:
                routed = (r.headers["x-cacheroute-replica"],
                          int(r.headers["x-cacheroute-predicted-cached-tokens"]))
                through = (r.status, await r.text())
            # Routed to the replica holding the conversation, credited with all of it;
            # the sim serves neither API, and its own answer reaches the client.
            assert routed == (chat.replica, full), path
            async with http.post(fleet.replicas[0].url + path, json=body) as r:
                assert through == (r.status, await r.text()) and r.status == 404


async def test_a_batch_is_predicted_as_vllm_reports_it_its_last_prompts_cached_tokens(
        surface: tuple[GatewayClient, str, openai.AsyncOpenAI, openai.AsyncOpenAI]) -> None:
    gw, _, _, _ = surface
    assert gw.app_gateway is not None and gw.app_gateway.index is not None
    cached, fresh = list(range(100, 180)), list(range(300, 380))
    first = await gw.post("/v1/completions", {"model": MODEL, "prompt": cached, "max_tokens": 1})
    await wait_indexed(gw.app_gateway.index, MODEL, first.replica, cached[:64],
                       tenant_salt("alpha"))
    batches = [
        [fresh, cached],  # the last prompt is held by the replica: 64 of its 80 tokens
        [list(range(500, 580)), list(range(500, 560)) + [7] * 20],  # shares 3 blocks in-batch
        [cached, list(range(700, 780))],  # routed by the cached first, the last is new
    ]
    for prompts in batches:
        reply = await gw.post("/v1/completions", {"model": MODEL, "prompt": prompts,
                                                  "max_tokens": 1})
        assert reply.status == 200, reply.body
        assert len(reply.body["choices"]) == 2
        assert reply.predicted == reply.cached, (prompts[-1][:3], reply.predicted, reply.cached)
    assert [r.cached for r in gw.replies[1:]] == [64, 48, 0]
