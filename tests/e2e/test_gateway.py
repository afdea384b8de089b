"""The gateway end to end: real sims as processes, real Redis, real HTTP on loopback."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from loadgen import compare
from loadgen.driver import server_timing_stages
from loadgen.harness import MODEL_NAME
from loadgen.workload_flags import build_workload
from replica.fleet import AsyncSimFleet, free_port
from router.index import RedisIndex
from router.replicas import parse_prometheus_gauges

from .conftest import (
    GatewayClient,
    ProcessGroup,
    Reply,
    chain_keys,
    gateway_config,
    tenant_salt,
    wait_indexed,
    wait_until,
)

MODEL = "sim"


def tokens(seed: int, n: int, vocab: int = 3000) -> list[int]:
    """Random token ids within the tiny model's vocabulary (3,389 ids)."""
    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(n)]


def completion(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, "return_token_ids": True, **extra}


def output_ids(reply: Reply) -> list[int]:
    return [int(t) for t in reply.body["choices"][0]["token_ids"]]


async def settle(gw: GatewayClient, reply: Reply, prompt: list[int], key: str = "sk-alpha",
                 tenant: str = "alpha") -> None:
    """Wait until the gateway's index has the KV events for what `reply` cached.

    vLLM caches every full block of prompt + generated tokens except the last token's
    (its KV is never computed); events reach the index asynchronously.
    """
    assert gw.app_gateway is not None and gw.app_gateway.index is not None
    held = [*prompt, *output_ids(reply)][:-1]
    await wait_indexed(gw.app_gateway.index, MODEL, reply.replica, held, tenant_salt(tenant))


async def sim_gauge(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(f"{url}/metrics") as resp:
        return parse_prometheus_gauges(await resp.text(), [name]).get(name, 0.0)


# ----------------------------------------------------------------------------- routing


@pytest.mark.parametrize("tokenize_mode", ["local", "remote"])
async def test_multi_turn_chat_stays_on_the_replica_holding_its_history(
        start_gateway: Any, tiny_model_dir: Path, tokenize_mode: str) -> None:
    async with AsyncSimFleet(2, block_size=16, model_dir=tiny_model_dir,
                             served_model_name=MODEL) as fleet:
        # remote: the gateway has no tokenizer and asks a replica's /tokenize instead.
        gw = await start_gateway(gateway_config(
            fleet.replicas, model=MODEL, port=free_port(),
            model_dir=tiny_model_dir if tokenize_mode == "local" else None,
            proxy={"tokenize_mode": tokenize_mode}))
        messages: list[dict[str, str]] = [
            {"role": "system", "content": "You are a careful assistant. " * 30}]
        seen: list[Reply] = []
        for turn in range(5):
            messages.append({"role": "user", "content": f"Question {turn}: " + "why? " * 20})
            reply = await gw.post("/v1/chat/completions", {
                "model": MODEL, "messages": messages, "max_tokens": 8, "return_token_ids": True})
            assert reply.status == 200, reply.body
            assert reply.predicted == reply.cached, (turn, reply.predicted, reply.cached)
            seen.append(reply)
            await settle(gw, reply, reply.body["prompt_token_ids"])
            messages.append({"role": "assistant",
                             "content": reply.body["choices"][0]["message"]["content"]})
        assert len({r.replica for r in seen}) == 1
        assert all(r.cached > 0 for r in seen[1:])
        # The next turn resends the history: most of it is served from cache.
        last = seen[-1].body["usage"]
        assert last["prompt_tokens_details"]["cached_tokens"] > last["prompt_tokens"] // 2


async def test_shared_system_prompt_spreads_while_each_user_keeps_its_replica(
        start_gateway: Any) -> None:
    users = 64
    system = tokens(0, 4096)
    async with AsyncSimFleet(4, block_size=16, num_blocks=40000, prefill_profile="unit",
                             time_scale=50.0) as fleet:
        gw = await start_gateway(gateway_config(fleet.replicas, model=MODEL, port=free_port()))
        histories = {u: [*system, *tokens(1000 + u, 2048)] for u in range(users)}
        placed: dict[int, list[str]] = {u: [] for u in range(users)}
        for turn in range(3):
            replies = await asyncio.gather(*(
                gw.post("/v1/completions", completion(histories[u])) for u in range(users)))
            for u, reply in enumerate(replies):
                assert reply.status == 200, reply.body
                placed[u].append(reply.replica)
                histories[u] = [*histories[u], *output_ids(reply), *tokens(turn * 100 + u, 32)]
        per_replica = Counter(r for rs in placed.values() for r in rs)
        assert len(per_replica) == 4
        mean = sum(per_replica.values()) / 4
        assert max(per_replica.values()) / mean <= 1.3, per_replica
        stuck = sum(1 for rs in placed.values() if len(set(rs)) == 1)
        assert stuck == users, {u: rs for u, rs in placed.items() if len(set(rs)) > 1}


def server_timing(header: str) -> dict[str, float]:
    """`parse;dur=0.51, route;dur=0.67` -> {"parse": 0.51, "route": 0.67} (ms)."""
    return {name: s * 1000 for name, s in server_timing_stages(header).items()}


async def test_server_timing_says_where_the_gateways_time_went(start_gateway: Any) -> None:
    # The unit profile prefills at 1 ms a token: a cold 96-token prompt's first token is
    # at least 96 ms upstream, and the stages before it are the gateway's own.
    async with AsyncSimFleet(1, block_size=16, num_blocks=4000, prefill_profile="unit") as fleet:
        gw = await start_gateway(gateway_config(fleet.replicas, model=MODEL, port=free_port()))
        for seed, stream in ((61, False), (62, True)):
            started = time.perf_counter()
            async with gw.session.post(gw.url + "/v1/completions",
                                       json=completion(tokens(seed, 96), stream=stream),
                                       headers={"Authorization": "Bearer sk-alpha"}) as resp:
                assert resp.status == 200
                stages = server_timing(resp.headers["Server-Timing"])
                await resp.read()
            wall_ms = (time.perf_counter() - started) * 1000
            assert list(stages) == ["parse", "route", "hold", "gate", "admit", "upstream"]
            assert min(stages.values()) >= 0
            # Alone on an idle replica: nothing to wait for.
            assert stages["hold"] == 0 and stages["gate"] == 0
            assert stages["upstream"] >= 96, stages
            assert sum(stages.values()) <= wall_ms, (stages, wall_ms)


async def test_server_timing_tells_the_step_gate_from_the_hold(start_gateway: Any) -> None:
    # The unit profile (1 ms a token) and a gateway profile that predicts it: a 600-token
    # prompt decided while a 1,000-token one prefills on the only replica waits at the
    # step gate for that one's first token (policy.step_gate), after its decision. The
    # queue ahead is under a step (hold_step_tokens: ~2 s here), so nothing is held before
    # the decision: the wait is the gate's stage, and not part of route.
    async with AsyncSimFleet(1, block_size=16, num_blocks=4000, prefill_profile="unit") as fleet:
        gw = await start_gateway(gateway_config(
            fleet.replicas, model=MODEL, port=free_port(),
            policy={"prefill": {"base_s": 0.001, "per_token_s": 0.001}},
            proxy={"expose_routing_headers": True, "early_head": True}))
        auth = {"Authorization": "Bearer sk-alpha"}
        async with gw.session.post(gw.url + "/v1/completions", headers=auth,
                                   json=completion(tokens(71, 1000), stream=True)) as ahead:
            # Its head is out (early_head): it is upstream, prefilling for about a second.
            assert ahead.status == 200
            assert server_timing(ahead.headers["Server-Timing"])["gate"] == 0
            async with gw.session.post(gw.url + "/v1/completions", headers=auth,
                                       json=completion(tokens(72, 600), stream=True)) as resp:
                assert resp.status == 200
                stages = server_timing(resp.headers["Server-Timing"])
                await resp.read()
            await ahead.read()
        assert stages["hold"] == 0, stages
        assert stages["gate"] >= 200, stages  # most of the 1 s prefill ahead
        assert stages["route"] < stages["gate"], stages


async def test_predicted_cached_tokens_equal_reported_with_kv_events(start_gateway: Any) -> None:
    async with AsyncSimFleet(2, block_size=16, num_blocks=4000) as fleet:
        gw = await start_gateway(gateway_config(fleet.replicas, model=MODEL, port=free_port()))
        shared = tokens(5, 200)
        prompts = [shared, [*shared, *tokens(6, 50)], tokens(7, 100), [*shared[:100], 1, 2, 3],
                   [*tokens(7, 100), *tokens(8, 77)], shared]
        for prompt in prompts:
            reply = await gw.post("/v1/completions", completion(prompt))
            assert reply.status == 200, reply.body
            assert reply.predicted == reply.cached, (len(prompt), reply.predicted, reply.cached)
            # cache_aware's TTFT prediction for the replica that served it, in ms.
            assert float(reply.headers["x-cacheroute-predicted-ttft-ms"]) > 0
            # Every candidate, the one that served it first, with what the policy saw.
            ranked = [dict(kv.split("=") for kv in part.split(";")[1:]) | {
                "id": part.split(";")[0]}
                for part in reply.headers["x-cacheroute-candidates"].split(", ")]
            assert len({c["id"] for c in ranked}) == len(ranked) == len(fleet.replicas)
            assert ranked[0]["id"] == reply.replica
            assert int(ranked[0]["cached"]) == reply.predicted
            assert ranked[0]["ttft_ms"] == reply.headers["x-cacheroute-predicted-ttft-ms"]
            assert float(ranked[0]["score"]) >= max(float(c["score"]) for c in ranked)
            await settle(gw, reply, prompt)
        assert sum(r.cached for r in gw.replies) > 0
        _, text = await gw.get("/metrics")
        assert "cacheroute_cached_tokens_total" in text
        assert "cacheroute_prediction_mismatches_total{" not in text
        # What holds the gateway's memory is visible: the chain cache remembers one
        # fingerprint per distinct block prefix hashed (12 + 3 + 6 + 5: prompts 4 and 6
        # are prefixes of chains it already holds), the index at least those blocks.
        bounded = {line.split("}")[0].split('"')[1]: float(line.split()[-1])
                   for line in text.splitlines() if line.startswith("cacheroute_bounded_")
                   and line.split("{")[0] == "cacheroute_bounded_entries"}
        assert bounded["chain_cache"] == 26
        assert bounded["index"] >= 26
        assert 'cacheroute_bounded_capacity{structure="chain_cache"} 500000.0' in text
        assert set(bounded) == {"chain_cache", "pending", "index", "suspects"}


async def test_a_first_token_timed_on_a_cache_the_replica_no_longer_held_teaches_nothing(
        start_gateway: Any) -> None:
    """The learned TTFT bias reads a replica's speed from its first tokens: one timed on
    a prefix the index credited but the replica no longer held measured the index's
    error, and is dropped once the answer's usage shows it. Here the replica's cache is
    reset while it is idle, which vLLM announces only with its next step."""
    prompt = tokens(7, 160)
    async with AsyncSimFleet(1, block_size=16, num_blocks=4000) as fleet:
        gw = await start_gateway(gateway_config(fleet.replicas, model=MODEL, port=free_port()))
        assert gw.app_gateway is not None and gw.app_gateway.fleet is not None
        replica = gw.app_gateway.fleet.all()[0]

        async def streamed() -> tuple[int, int]:
            """(predicted, reported) cached tokens of one streamed request."""
            async with gw.session.post(
                    f"{gw.url}/v1/completions",
                    json={**completion(prompt), "stream": True,
                          "stream_options": {"include_usage": True}},
                    headers={"Authorization": "Bearer sk-alpha"}) as resp:
                assert resp.status == 200, await resp.text()
                predicted = int(resp.headers["x-cacheroute-predicted-cached-tokens"])
                chunks = [json.loads(line[6:]) for line in (await resp.text()).splitlines()
                          if line.startswith("data: {")]
            usage = next(c["usage"] for c in chunks if c.get("usage"))
            return predicted, usage["prompt_tokens_details"]["cached_tokens"]

        async def ended(samples: int) -> bool:
            view = replica.work.view(time.monotonic())
            return view.pending == view.decoding == 0 and view.samples >= samples

        assert await streamed() == (0, 0)
        await wait_until(lambda: ended(1), 10, "the first reading")
        await wait_indexed(gw.app_gateway.index, MODEL, replica.replica_id, prompt[:144],
                           tenant_salt("alpha"))
        async with gw.session.post(f"{fleet.urls[0]}/reset_prefix_cache") as resp:
            assert resp.status == 200
        assert await streamed() == (144, 0)  # the index did not know: a miss
        assert await streamed() == (144, 144)  # the reset announced since: a hit
        await wait_until(lambda: ended(2), 10, "the third reading")
        assert replica.work.view(time.monotonic()).samples == 2


async def bounded_entries(gw: GatewayClient, structure: str) -> float:
    """The gateway's cacheroute_bounded_entries for `structure`, from /metrics."""
    _, text = await gw.get("/metrics")
    prefix = f'cacheroute_bounded_entries{{structure="{structure}"}} '
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith(prefix))


async def test_a_gateway_serves_once_the_replicas_earlier_cache_is_in_its_index(
        start_gateway: Any) -> None:
    """What a replica announced before the gateway started is in the memory index when
    the gateway serves (the replay of its KV events, applied during start-up), not a
    moment later: the replay applies the replica's history oldest batch first, and a
    request routed meanwhile would follow prefixes it has since evicted or cleared."""
    history = 300  # batches to replay before the one that matters: not applied at once
    prompt = tokens(99, 160)
    async with AsyncSimFleet(2, block_size=16, num_blocks=8000) as fleet:
        holder = fleet.replicas[1]
        async with aiohttp.ClientSession() as http:
            for i in range(history):
                async with http.post(f"{holder.url}/v1/completions", json={
                        "model": MODEL, "prompt": tokens(i, 48), "max_tokens": 1}) as resp:
                    assert resp.status == 200, await resp.text()
            async with http.post(f"{holder.url}/v1/completions", json={
                    "model": MODEL, "prompt": prompt, "max_tokens": 1}) as resp:
                assert resp.status == 200, await resp.text()
        gw = await start_gateway(gateway_config(fleet.replicas, model=MODEL, port=free_port()))
        assert gw.app_gateway is not None and gw.app_gateway.index is not None
        keys = chain_keys(prompt, None)
        assert len(keys) == 10
        matches = await gw.app_gateway.index.lookup(MODEL, keys)
        assert len(matches) == 1 and list(matches.values()) == [len(keys)], matches


@pytest.mark.parametrize("refusal", ["over_context", "not_served"])
async def test_a_request_not_served_leaves_no_pending_prefix(
        start_gateway: Any, tiny_model_dir: Path, refusal: str) -> None:
    """A routed prefix is pending on its replica until the KV events say it is held; a
    request refused after routing (the gateway's context check: 400) or answered with an
    error (the sim does not serve /v1/responses: 404) is cached nowhere, so its prefix
    must not stay pending, or the next request with it is sent after a cache that is not
    there."""
    async with AsyncSimFleet(2, block_size=16, model_dir=tiny_model_dir,
                             served_model_name=MODEL) as fleet:
        gw = await start_gateway(gateway_config(fleet.replicas, model=MODEL, port=free_port(),
                                                model_dir=tiny_model_dir))
        prompt = tokens(21, 200)
        if refusal == "over_context":
            refused = await gw.post("/v1/completions", {**completion(prompt),
                                                        "max_tokens": 100_000})
            assert refused.status == 400, refused.body
            assert "max_model_len" in refused.body["error"]["message"]
        else:
            text = "You are a careful assistant. " * 40
            async with gw.session.post(gw.url + "/v1/responses",
                                       json={"model": MODEL, "instructions": text,
                                             "input": "why?"},
                                       headers={"Authorization": "Bearer sk-alpha"}) as r:
                assert r.status == 404, await r.text()  # the sim's own answer
                # It was routed, by the prefix's blocks.
                assert r.headers["x-cacheroute-replica"]
        assert await bounded_entries(gw, "pending") == 0
        if refusal == "over_context":
            reply = await gw.post("/v1/completions", completion(prompt))
            assert reply.status == 200, reply.body
            assert (reply.predicted, reply.cached) == (0, 0)


async def test_a_long_cold_prompt_ends_pending_whole_on_the_replica_it_went_to(
        start_gateway: Any, tiny_model_dir: Path) -> None:
    """A prompt of many blocks the gateway has never hashed is decided on a probe of
    them and keyed whole once it is on its way (router/routing.py, `defer_keys`): the
    whole chain ends up pending on the replica that took it, and a follower of the
    prefix goes there."""
    async with AsyncSimFleet(2, block_size=16, model_dir=tiny_model_dir,
                             served_model_name=MODEL) as fleet:
        gw = await start_gateway(gateway_config(fleet.replicas, model=MODEL, port=free_port(),
                                                model_dir=tiny_model_dir))
        assert gw.app_gateway is not None and gw.app_gateway.pipeline is not None
        prompt = tokens(23, 16 * 100)
        reply = await gw.post("/v1/completions", completion(prompt))
        assert reply.status == 200, reply.body
        assert (reply.predicted, reply.cached) == (0, 0)
        assert await bounded_entries(gw, "pending") == 100
        assert gw.app_gateway.pipeline.chains.hashed_blocks == 100
        follower = await gw.post("/v1/completions", completion([*prompt, *tokens(24, 40)]))
        assert follower.status == 200, follower.body
        assert follower.headers["x-cacheroute-replica"] == reply.headers["x-cacheroute-replica"]
        # (What the index predicts depends on whether the replica's events came yet; the
        # pending chain took the follower there either way.)
        assert follower.cached == 100 * 16


async def test_a_chats_new_question_is_encoded_after_it_is_sent_and_its_count_stays_exact(
        start_gateway: Any, tiny_model_dir: Path) -> None:
    """A chat whose newest text no gateway has seen is decided on the ids before that text
    and finished once sent (router/routing.py DEFER_NEW_TEXT_CHARS): it goes where its
    system prompt is, ends up pending whole there, and the context check stays exact:
    served where the bound would refuse but the count does not, refused in vLLM's words
    where the count does too."""
    from router.routing import DEFER_NEW_TEXT_CHARS

    rng = random.Random(5)

    def question(words: int) -> dict[str, str]:
        return {"role": "user", "content": " ".join(
            rng.choice(["delta", "epsilon", "zeta", "theta"]) + str(rng.randrange(50))
            for _ in range(words))}

    async with AsyncSimFleet(2, block_size=16, model_dir=tiny_model_dir,
                             served_model_name=MODEL) as fleet:
        gw = await start_gateway(gateway_config(
            fleet.replicas, model=MODEL, port=free_port(),
            models={MODEL: {"tokenizer": str(tiny_model_dir), "max_model_len": 2048}}))
        assert gw.app_gateway is not None
        tokenizer = gw.app_gateway.tokenizers[MODEL]
        system = {"role": "system", "content": "You answer questions about old wells. " * 40}
        first = await gw.post("/v1/chat/completions", {
            "model": MODEL, "messages": [system, {"role": "user", "content": "hi"}],
            "max_tokens": 2})
        assert first.status == 200, first.body
        home = first.headers["x-cacheroute-replica"]
        ask = {"model": MODEL, "messages": [system, question(250)], "max_tokens": 2}
        text = tokenizer.render_chat(ask)
        assert DEFER_NEW_TEXT_CHARS <= tokenizer.uncached_chars(text)
        ids = tokenizer.chat_tokens({**ask, "messages": ask["messages"][:1]})
        # The bound (a token per UTF-8 byte of the question) is over the limit, the count
        # is not.
        assert len(ids) + len(ask["messages"][1]["content"]) > 2048 - 2
        reply = await gw.post("/v1/chat/completions", ask)
        assert reply.status == 200, reply.body
        assert reply.headers["x-cacheroute-replica"] == home
        whole = tokenizer.chat_tokens(ask)
        assert reply.body["usage"]["prompt_tokens"] == len(whole) < 2048
        # Then a question that fits its bound: decided before it is encoded.
        short = {"model": MODEL, "messages": [system, question(120)], "max_tokens": 2}
        pending = await bounded_entries(gw, "pending")
        reply = await gw.post("/v1/chat/completions", short)
        assert reply.status == 200, reply.body
        assert reply.headers["x-cacheroute-replica"] == home
        whole = tokenizer.chat_tokens(short)
        # Its whole chain went pending (past the system prompt's blocks, held already),
        # the question's blocks included.
        assert await bounded_entries(gw, "pending") >= pending + \
            (len(whole) - len(ids)) // 16 - 1
        # A follower resending it goes there, and finds it all cached.
        follow = {**short, "messages": [*short["messages"], {"role": "assistant", "content": "ok"},
                                        {"role": "user", "content": "and?"}]}
        reply = await gw.post("/v1/chat/completions", follow)
        assert reply.status == 200, reply.body
        assert reply.headers["x-cacheroute-replica"] == home
        assert reply.cached >= len(whole) // 16 * 16 - 16
        # The prompt tokens it counts as forwarded are the replicas' own (the deferred
        # ones counted once whole, not as estimated).
        _, text = await gw.get("/metrics")
        counted = sum(float(line.split()[-1]) for line in text.splitlines()
                      if line.startswith("cacheroute_prompt_tokens_total{"))
        assert counted == sum(r.body["usage"]["prompt_tokens"] for r in gw.replies
                              if r.status == 200 and "usage" in r.body)
        # Over the limit by its count: refused by the gateway as vLLM would, exactly.
        served = [await sim_gauge(gw.session, r.url, "vllm:time_to_first_token_seconds_count")
                  for r in fleet.replicas]
        long = {"model": MODEL, "messages": [system, question(700)], "max_tokens": 2}
        reply = await gw.post("/v1/chat/completions", long)
        assert reply.status == 400, reply.body
        assert "maximum context length is 2048 tokens" in reply.body["error"]["message"]
        assert [await sim_gauge(gw.session, r.url, "vllm:time_to_first_token_seconds_count")
                for r in fleet.replicas] == served


async def test_the_harness_warms_a_gateways_tokenizer_with_shared_prefixes_only(
        start_gateway: Any, http: aiohttp.ClientSession, tiny_model_dir: Path) -> None:
    """loadgen compare's --warm-shared-prefixes: what an agent's sessions share (system
    prompt, tools) is tokenized once by the gateway, which refuses the request (context
    check), so no replica sees it and nothing is left pending."""
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    args = parser.parse_args([
        "--api", "chat", "--workload", "agent", "--conversations", "3", "--turns", "2",
        "--instruction-tokens", "200", "--tools", "3", "--tool-tokens", "120",
        "--question-tokens", "8",
        "--max-model-len", "2048", "--out", "unused"])
    bodies = compare.shared_prefix_bodies(args)
    assert len(bodies) == 1  # three sessions, one shared prefix
    assert bodies[0]["messages"][-1] == {"role": "user", "content": "hi"}
    assert len(bodies[0]["tools"]) == 3 and bodies[0]["max_tokens"] == 2049
    assert compare.shared_prefix_bodies(parser.parse_args(
        ["--api", "tokens", "--workload", "agent", "--out", "unused"])) == []
    model = MODEL_NAME
    async with AsyncSimFleet(2, block_size=16, model_dir=tiny_model_dir,
                             served_model_name=model) as fleet:
        gw = await start_gateway(gateway_config(
            fleet.replicas, model=model, port=free_port(),
            models={model: {"tokenizer": str(tiny_model_dir), "max_model_len": 2048}},
            tenants={"allow_anonymous": True}))  # as compare configures its gateways
        assert gw.app_gateway is not None
        tokenizer = gw.app_gateway.tokenizers[model]
        workload = build_workload(args)
        first = workload.render(workload.plan()[0])
        assert first.messages is not None
        turn = {"model": model, "tools": list(first.tools),
                "messages": [{"role": m.role, "content": m.content} for m in first.messages]}
        text = tokenizer.render_chat(turn)
        question = first.messages[-1].content
        unseen = tokenizer.uncached_chars(text)
        assert unseen > 2000 + len(question)  # the system prompt and tools, never seen

        async def served() -> float:
            return sum([await sim_gauge(http, r.url, "vllm:time_to_first_token_seconds_count")
                        for r in fleet.replicas])

        before = await served()
        await compare.warm_shared_prefixes(gw.url, bodies)
        assert await served() == before  # refused by the gateway: no replica saw it
        assert await bounded_entries(gw, "pending") == 0
        # What is left to encode of the first real turn: its question (and the line
        # breaks around it), not the shared system prompt and tools.
        assert tokenizer.uncached_chars(text) <= len(question) + 8


async def test_tenants_with_different_salts_never_share(start_gateway: Any) -> None:
    async with AsyncSimFleet(1, block_size=16) as fleet:
        gw = await start_gateway(gateway_config(fleet.replicas, model=MODEL, port=free_port()))
        prompt = tokens(9, 300)
        first = await gw.post("/v1/completions", completion(prompt), key="sk-alpha")
        await settle(gw, first, prompt)
        beta = await gw.post("/v1/completions", completion(prompt), key="sk-beta")
        assert beta.status == 200
        assert beta.replica == first.replica  # one replica: same place, different salt
        assert (beta.predicted, beta.cached) == (0, 0)
        alpha = await gw.post("/v1/completions", completion(prompt), key="sk-alpha")
        assert alpha.cached == alpha.predicted == 288
        # A client may not pick another tenant's salt (or any salt) itself.
        forged = await gw.post("/v1/completions",
                               completion(prompt, cache_salt=tenant_salt("alpha")), key="sk-beta")
        assert forged.status == 400 and forged.body["error"]["param"] == "cache_salt"


async def test_replicas_without_events_are_recorded_from_what_was_sent(
        start_gateway: Any) -> None:
    async with AsyncSimFleet(3, block_size=16, kv_events=False) as fleet:
        gw = await start_gateway(gateway_config(fleet.replicas, model=MODEL, port=free_port(),
                                                events=False))
        history = tokens(11, 150)
        seen = []
        for turn in range(4):
            reply = await gw.post("/v1/completions", completion(history))
            assert reply.status == 200
            assert "token_ids" in reply.body["choices"][0]  # the client asked: not stripped
            seen.append(reply)
            history = [*history, *output_ids(reply), *tokens(20 + turn, 40)]
        assert len({r.replica for r in seen}) == 1
        # Prompt + generated blocks were recorded, so predictions match what vLLM reports.
        assert [r.predicted for r in seen[1:]] == [r.cached for r in seen[1:]]
        assert all(r.cached > 0 for r in seen[1:])
        plain = await gw.post("/v1/completions", {"model": MODEL, "prompt": history,
                                                  "max_tokens": 2})
        assert "token_ids" not in plain.body["choices"][0]  # the gateway's own ask is hidden


async def test_a_redis_gateway_looks_up_in_its_event_mirror_even_with_redis_down(
        start_gateway: Any, redis_server: Any) -> None:
    # No indexer writes this Redis: every hit predicted below comes from the mirror of
    # the replicas' events this gateway keeps itself (index.mirror_events, the default).
    async with AsyncSimFleet(3, block_size=16, num_blocks=4000) as fleet:
        gw = await start_gateway(gateway_config(fleet.replicas, model=MODEL, port=free_port(),
                                                index=redis_server.url))
        assert gw.app_gateway is not None
        history = tokens(41, 600)
        seen: list[Reply] = []
        for turn in range(4):
            if turn == 2:
                redis_server.stop()  # the shared index goes away for real
            reply = await gw.post("/v1/completions", completion(history))
            assert reply.status == 200, reply.body
            assert reply.predicted == reply.cached, (turn, reply.predicted, reply.cached)
            seen.append(reply)
            await settle(gw, reply, history)
            history = [*history, *output_ids(reply), *tokens(60 + turn, 40)]
        assert len({r.replica for r in seen}) == 1
        assert all(r.cached > 0 for r in seen[1:])
        # Still ready (its replicas are), and it says the shared index is down.
        status, ready = await gw.get("/ready")
        assert status == 200 and ready["index"]["status"].startswith("down"), ready["index"]


async def test_a_missed_health_check_leaves_the_event_mirror_whole(
        start_gateway: Any, redis_server: Any) -> None:
    # A replica too busy to answer /health within its deadline (here: stopped with
    # SIGSTOP, then resumed) is unhealthy for a while with its cache intact. The mirror
    # answers for the indexer's Redis view, which keeps a replica's entries until its
    # event stream shows a restart: it must keep them too, so the next turn is
    # predicted exactly. (Cleared on the failed check, it predicted 0 of the 384 cached
    # tokens in one CI run of the vLLM end-to-end tests.)
    async with AsyncSimFleet(2, block_size=16, num_blocks=4000) as fleet:
        gw = await start_gateway(gateway_config(fleet.replicas, model=MODEL, port=free_port(),
                                                index=redis_server.url))
        history = tokens(57, 600)
        first = await gw.post("/v1/completions", completion(history))
        assert first.status == 200, first.body
        await settle(gw, first, history)
        i = next(n for n, url in enumerate(fleet.urls) if url.split("//", 1)[1] == first.replica)

        async def state_is(state: str) -> bool:
            _, ready = await gw.get("/ready")
            return any(r["id"] == first.replica and r["state"] == state
                       for r in ready["replicas"])

        held = [*history, *output_ids(first)][:-1]
        keys = chain_keys(held, tenant_salt("alpha"))
        assert gw.app_gateway is not None and gw.app_gateway.index is not None
        fleet.pause(i)
        try:
            await wait_until(lambda: state_is("unhealthy"), 15.0, "the health check to fail")
            mirrored = await gw.app_gateway.index.lookup(MODEL, keys)
            assert mirrored.get(first.replica) == len(held) // 16, mirrored
        finally:
            fleet.resume(i)
        await wait_until(lambda: state_is("healthy"), 15.0, "the replica to be healthy again")
        again = await gw.post("/v1/completions", completion([*held, *tokens(58, 40)]))
        assert again.status == 200, again.body
        assert again.replica == first.replica
        assert again.predicted == again.cached >= 600 // 16 * 16, (again.predicted, again.cached)


@pytest.mark.parametrize("index", ["memory", "redis"])
async def test_the_gateways_own_event_streams_rekey_a_replica_keyed_otherwise(
        start_gateway: Any, redis_server: Any, index: str) -> None:
    # The sims hash with PYTHONHASHSEED "1", the gateway with "0": only a stream that
    # re-keys their blocks (`rekey: always`, as the standalone indexer would) gives the
    # gateway's own index (memory, or the mirror of a Redis index) keys it can match.
    async with AsyncSimFleet(2, block_size=16, num_blocks=4000, seed="1") as fleet:
        raw = gateway_config(fleet.replicas, model=MODEL, port=free_port(),
                             index="memory" if index == "memory" else redis_server.url)
        for replica in raw["replicas"]:
            replica["rekey"] = "always"
        gw = await start_gateway(raw)
        history = tokens(91, 400)
        reply = await gw.post("/v1/completions", completion(history))
        assert reply.status == 200, reply.body
        await settle(gw, reply, history)
        held = [*history, *output_ids(reply)][:-1]
        again = await gw.post("/v1/completions", completion([*held, *tokens(92, 40)]))
        assert again.replica == reply.replica
        assert again.predicted == again.cached >= 400 // 16 * 16


async def test_a_gateway_started_late_seeds_its_mirror_from_the_index(
        start_gateway: Any, redis_server: Any, processes: ProcessGroup) -> None:
    # vLLM announces a block once, when stored: a gateway started later learns the
    # history from the index's snapshot and follows the stream after the indexer's
    # position, not by replaying the replica's buffer from 0 (bounded in vLLM: 10,000
    # batches; the sims keep all of them, so the replay count shows which it did).
    async with AsyncSimFleet(3, block_size=16, num_blocks=4000) as fleet:
        raw = gateway_config(fleet.replicas, model=MODEL, port=free_port(),
                             index=redis_server.url)
        config_path = processes.write_config(raw, "indexer")
        indexer = processes.spawn(["indexer", "--config", str(config_path), "--lease",
                                   "--log-level", "INFO"], "indexer")

        async def subscribed() -> bool:  # before any event it should see is sent
            return "indexing " in processes.log(indexer)

        await wait_until(subscribed, 30, "the indexer to subscribe")
        first = await start_gateway(raw)
        history = tokens(77, 800)
        replies = [await first.post("/v1/completions", completion(history))]
        # More history on the same replica (each turn one more KV-event batch).
        for turn in range(5):
            held = [*history, *output_ids(replies[-1])][:-1]
            history = [*held, *tokens(100 + turn, 32)]
            replies.append(await first.post("/v1/completions", completion(history)))
        reply = replies[-1]
        assert all(r.status == 200 and r.replica == reply.replica for r in replies)
        # A fence token only lets this reader see the positions the indexer stores.
        index = RedisIndex.from_url(redis_server.url, fence_token=0)
        try:
            held = [*history, *output_ids(reply)][:-1]
            await wait_indexed(index, MODEL, reply.replica, held, tenant_salt("alpha"))
            position = await index.stream_position(reply.replica)
        finally:
            await index.close()
        assert position is not None and position.seq >= len(replies)
        late = await start_gateway(gateway_config(fleet.replicas, model=MODEL,
                                                  port=free_port(), index=redis_server.url))
        assert late.app_gateway is not None and late.app_gateway.index is not None
        assert late.app_gateway.indexer is not None
        # Seeded before serving: the mirror holds the whole run at once.
        seeded = await late.app_gateway.index.lookup(MODEL, chain_keys(held, tenant_salt("alpha")))
        assert seeded.get(reply.replica) == len(held) // 16, seeded
        again = await late.post("/v1/completions", completion([*held, *tokens(78, 40)]))
        assert again.status == 200, again.body
        assert again.replica == reply.replica
        assert again.predicted == again.cached >= len(held) // 16 * 16
        # It applied only batches after the indexer's position, none of the history.
        applied = late.app_gateway.indexer.stats()[reply.replica].batches
        assert applied < position.seq + 1, (applied, position)


async def wait_mirrored(gateways: list[GatewayClient], index: RedisIndex, replica: str) -> None:
    """Wait until every gateway's own event mirror has applied the replica's batches up
    to the one the indexer last wrote to Redis (each gateway looks up in its mirror).
    `index` must be built with a fence token: only then does it read stored positions."""
    position = await index.stream_position(replica)
    assert position is not None  # the leased indexer keeps its place in each stream

    async def applied() -> bool:
        for gw in gateways:
            _, ready = await gw.get("/ready")
            stream = ready.get("events", {}).get(replica)
            if stream is None or stream["last_seq"] is None or \
                    stream["last_seq"] < position.seq:
                return False
        return True

    await wait_until(applied, what=f"every gateway mirrors {replica} to seq {position.seq}")


async def test_two_gateway_processes_on_one_redis_index_choose_as_one(
        redis_server: Any, processes: ProcessGroup, http: aiohttp.ClientSession) -> None:
    async with AsyncSimFleet(3, block_size=16, num_blocks=4000) as fleet:
        raws = [gateway_config(fleet.replicas, model=MODEL, port=free_port(),
                               index=redis_server.url) for _ in range(2)]
        config_path = processes.write_config(raws[0], "indexer")
        # Leased, as the chart runs it: it then keeps its place in each stream in Redis.
        processes.spawn(["indexer", "--config", str(config_path), "--lease",
                         "--log-level", "WARNING"], "indexer")
        urls = [await processes.start_gateway(raw, f"gateway-{i}") for i, raw in enumerate(raws)]
        gateways = [GatewayClient(url, http) for url in urls]
        # A fence token only lets this reader see the positions the indexer stores; it
        # writes nothing.
        index = RedisIndex.from_url(redis_server.url, fence_token=0)
        try:
            conversations = {c: tokens(300 + c, 1000) for c in range(6)}
            homes: dict[int, set[str]] = {c: set() for c in conversations}
            for turn in range(4):
                for c, history in conversations.items():
                    gw = gateways[(turn + c) % 2]  # alternate gateways turn by turn
                    reply = await gw.post("/v1/completions", completion(history))
                    assert reply.status == 200, reply.body
                    assert reply.predicted == reply.cached, (c, turn)
                    homes[c].add(reply.replica)
                    held = [*history, *output_ids(reply)][:-1]
                    await wait_indexed(index, MODEL, reply.replica, held, tenant_salt("alpha"))
                    await wait_mirrored(gateways, index, reply.replica)
                    conversations[c] = [*history, *output_ids(reply), *tokens(turn, 24)]
            assert all(len(h) == 1 for h in homes.values()), homes
            assert len({next(iter(h)) for h in homes.values()}) > 1  # and they spread
        finally:
            await index.close()


# -------------------------------------------------------------------------- streaming


async def test_streaming_passes_chunks_and_client_disconnect_cancels_upstream(
        start_gateway: Any, http: aiohttp.ClientSession, tiny_model_dir: Path) -> None:
    # The tiny model's tokenizer gives the sim's tokens text, so chunks carry content.
    async with AsyncSimFleet(1, block_size=16, prefill_profile="unit", time_scale=0.5,
                             model_dir=tiny_model_dir, served_model_name=MODEL) as fleet:
        gw = await start_gateway(gateway_config(fleet.replicas, model=MODEL, port=free_port()))
        headers = {"Authorization": "Bearer sk-alpha", "x-request-id": "req-42",
                   "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
        body = {"model": MODEL, "prompt": tokens(1, 40), "max_tokens": 3, "stream": True}
        async with http.post(gw.url + "/v1/completions", json=body, headers=headers) as resp:
            assert resp.status == 200
            assert resp.headers["x-request-id"] == "req-42"
            text = await resp.text()
        chunks = [c[6:] for c in text.split("\n\n") if c.startswith("data: ")]
        assert chunks[-1] == "[DONE]"
        parsed = [json.loads(c) for c in chunks[:-1]]
        assert all("usage" not in c or c["usage"] is None for c in parsed)  # not asked for
        assert sum(1 for c in parsed if c["choices"] and c["choices"][0]["finish_reason"]) == 1

        # A long generation the client abandons after its first chunk.
        body = {**body, "max_tokens": 5000}
        async with http.post(gw.url + "/v1/completions", json=body, headers=headers) as resp:
            await resp.content.readuntil(b"\n\n")
            assert await sim_gauge(http, fleet.urls[0], "vllm:num_requests_running") == 1
            resp.close()

        async def upstream_stopped() -> bool:
            return await sim_gauge(http, fleet.urls[0], "vllm:num_requests_running") == 0

        await wait_until(upstream_stopped, 5.0, "the sim to abort the abandoned request")
        assert gw.app_gateway is not None
        assert gw.app_gateway.fleet is not None
        assert gw.app_gateway.fleet.all()[0].inflight == 0


@pytest.mark.parametrize("on_redis", [False, True])
async def test_a_burst_in_arrival_order_is_served_whole_through_a_queue(
        start_gateway: Any, redis_server: Any, on_redis: bool) -> None:
    # proxy.route_in_arrival_order: each request lets go of its turn around the lookup
    # and the admission queue; a turn lost or never handed on would hang the burst.
    async with AsyncSimFleet(2, block_size=16, num_blocks=4000) as fleet:
        raw = gateway_config(fleet.replicas, model=MODEL, port=free_port(),
                             index=redis_server.url if on_redis else "memory",
                             proxy={"route_in_arrival_order": True},
                             limits={"global_concurrency": 2, "queue_size": 32})
        gw = await start_gateway(raw)
        assert gw.app_gateway is not None and gw.app_gateway.arrival is not None
        shared = tokens(11, 160)
        bodies = [completion([*shared, *tokens(100 + i, 20 + i)])
                  for i in range(12)]
        replies = await asyncio.wait_for(
            asyncio.gather(*(gw.post("/v1/completions", b) for b in bodies)), timeout=60)
        assert [r.status for r in replies] == [200] * 12
        assert not gw.app_gateway.arrival.held and gw.app_gateway.arrival.waiting == 0


async def test_overload_answers_429_with_retry_after(
        start_gateway: Any, http: aiohttp.ClientSession, tiny_model_dir: Path) -> None:
    async with AsyncSimFleet(1, block_size=16, prefill_profile="unit", time_scale=0.5,
                             model_dir=tiny_model_dir, served_model_name=MODEL) as fleet:
        raw = gateway_config(fleet.replicas, model=MODEL, port=free_port(),
                             limits={"global_concurrency": 1, "queue_size": 0})
        gw = await start_gateway(raw)
        body = {"model": MODEL, "prompt": tokens(1, 40), "max_tokens": 5000, "stream": True}
        async with http.post(gw.url + "/v1/completions", json=body,
                             headers={"Authorization": "Bearer sk-alpha"}) as held:
            await held.content.readuntil(b"\n\n")
            second = await gw.post("/v1/completions", completion(tokens(2, 40)))
            assert second.status == 429
            assert int(second.headers["retry-after"]) >= 1
            assert second.body["error"]["type"] == "rate_limit_error"
            held.close()


# ------------------------------------------------------------------- the HTTP surface


async def test_http_surface_errors_and_status(start_gateway: Any,
                                              http: aiohttp.ClientSession) -> None:
    async with AsyncSimFleet(2, block_size=16) as fleet:
        raw = gateway_config(fleet.replicas, model=MODEL, port=free_port(),
                             proxy={"max_body_bytes": 4096, "expose_routing_headers": False})
        gw = await start_gateway(raw)
        anonymous = await gw.post("/v1/completions", completion([1, 2, 3]), key="")
        assert anonymous.status == 401
        assert anonymous.body["error"]["type"] == "authentication_error"
        wrong = await gw.post("/v1/completions", completion([1, 2, 3]), key="sk-nope")
        assert wrong.status == 401

        auth = {"Authorization": "Bearer sk-alpha", "Content-Type": "application/json"}
        for raw_body, status in ((b"{broken", 400), (b"\xff\xfe", 400),
                                 (json.dumps(completion(list(range(3000)))).encode(), 413)):
            async with http.post(gw.url + "/v1/completions", data=raw_body, headers=auth) as r:
                assert r.status == status
                assert "message" in (await r.json())["error"]

        unknown = await gw.post("/v1/completions", {**completion([1, 2]), "model": "nope"})
        assert unknown.status == 404

        ok = await gw.post("/v1/completions", completion(tokens(3, 40)))
        assert ok.status == 200
        assert "x-cacheroute-replica" not in ok.headers  # off by default: it tells what's cached
        assert "x-request-id" in ok.headers

        async with http.get(gw.url + "/v1/models", headers=auth) as r:
            assert [m["id"] for m in (await r.json())["data"]] == [MODEL]
        status, health = await gw.get("/health")
        assert status == 200 and health == {"status": "ok"}
        status, ready = await gw.get("/ready")
        assert status == 200 and ready["ready"] is True
        assert ready["index"]["status"] == "ok"
        assert {r["state"] for r in ready["replicas"]} == {"healthy"}
        assert {r["mode"] for r in ready["replicas"]} == {"events"}
        status, metrics = await gw.get("/metrics")
        assert "cacheroute_routed_requests_total" in metrics
        assert "cacheroute_routing_decision_seconds_bucket" in metrics
        assert "cacheroute_index_lookup_seconds_count" in metrics
        for replica in fleet.replicas:
            rid = replica.url.split("//")[1]
            assert f'cacheroute_replica_available{{replica="{rid}"}} 1.0' in metrics
            assert f'cacheroute_event_gaps_total{{replica="{rid}"}} 0.0' in metrics
        assert "vllm:" not in metrics
        status, spec = await gw.get("/openapi.json")
        assert set(spec["paths"]) >= {"/v1/chat/completions", "/v1/completions", "/v1/models",
                                      "/health", "/ready", "/metrics"}

        fleet.kill(0)
        fleet.kill(1)

        async def unready() -> bool:
            return (await gw.get("/ready"))[0] == 503

        await wait_until(unready, 10.0, "/ready to report no healthy replica")


@pytest.mark.parametrize("stream", [False, True])
async def test_replica_dying_is_retried_on_another(start_gateway: Any, stream: bool) -> None:
    async with AsyncSimFleet(2, block_size=16) as fleet:
        gw = await start_gateway(gateway_config(fleet.replicas, model=MODEL, port=free_port(),
                                                health={"interval_s": 60}))
        prompt = tokens(4, 100)
        first = await gw.post("/v1/completions", completion(prompt))
        await settle(gw, first, prompt)
        home = fleet.urls.index(f"http://{first.replica}")
        fleet.kill(home)  # health checks are slow here: only the proxy can notice
        async with gw.session.post(gw.url + "/v1/completions",
                                   json=completion(prompt, stream=stream),
                                   headers={"Authorization": "Bearer sk-alpha"}) as resp:
            assert resp.status == 200
            assert resp.headers["x-cacheroute-replica"] != first.replica
            text = await resp.text()
        if stream:
            assert text.endswith("data: [DONE]\n\n")
        else:
            assert json.loads(text)["usage"]["prompt_tokens"] == len(prompt)
        _, metrics = await gw.get("/metrics")
        assert f'cacheroute_retries_total{{reason="connect",replica="{first.replica}"}} 1.0' \
            in metrics


async def test_handshake_flags_a_replica_whose_keys_differ(start_gateway: Any) -> None:
    async with AsyncSimFleet(2, block_size=16) as fleet:
        raw = gateway_config(fleet.replicas, model=MODEL, port=free_port())
        raw["replicas"][1]["hash_seed"] = "not-the-replicas-seed"
        gw = await start_gateway(raw)

        async def verdicts() -> dict[str, str]:
            _, ready = await gw.get("/ready")
            return {r["id"]: r["verification"] for r in ready["replicas"]}

        async def decided() -> bool:
            return set((await verdicts()).values()) <= {"handshake", "mismatch"}

        await wait_until(decided, 20.0, "both handshakes to finish")
        by_url = {f"http://{rid}": v for rid, v in (await verdicts()).items()}
        assert by_url == {fleet.urls[0]: "handshake", fleet.urls[1]: "mismatch"}
        _, ready = await gw.get("/ready")
        flagged = [r for r in ready["replicas"] if r["verification"] == "mismatch"]
        assert [r["verified"] for r in flagged] == [False]
        assert "PYTHONHASHSEED" in flagged[0]["verification_detail"]  # the culprit, named
