"""The routing pipeline as plain functions: parse -> tokens -> chain -> lookup -> decide."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from router.config import LimitsConfig, TenantsConfig
from router.hashing import HashConfig, chain_hashes, event_key
from router.index import MemoryIndex, RedisIndex
from router.pending import PendingChains
from router.policy.pipeline import build_policy
from router.policy.types import PolicyConfig
from router.replicas import Replica, ReplicaSource
from router.request import ParsedRequest, parse_request, upstream_payload
from router.routing import (
    PRINT_STRIDE,
    ChainCache,
    RoutingPipeline,
    _event_keys,
    predicted_cached_tokens,
    prepare_prompt,
    tokens_off_the_loop_when_long,
)
from router.tenants import TenantRegistry
from router.tokenize import DeferredIds, PromptTokenizer

CONFIG = HashConfig(block_size=16)


def replicas(n: int, config: HashConfig = CONFIG) -> list[Replica]:
    out = []
    for i in range(n):
        source = ReplicaSource(name=f"r{i}", url=f"http://127.0.0.1:{9000 + i}", models=("m",),
                               hash_config=config)
        out.append(Replica(target=source.target(), healthy=True))
    return out


def pipeline(index: Any, deadline_s: float = 1.0, name: str = "cache_aware") -> RoutingPipeline:
    policy = build_policy(PolicyConfig(name=name, seed=1, tolerance=0.0))
    return RoutingPipeline(tokenizers={}, chains=ChainCache(), index=index, policy=policy,
                           index_deadline_s=deadline_s)


def completion(tokens: list[int], **extra: Any) -> bytes:
    return json.dumps({"model": "m", "prompt": tokens, **extra}).encode()


REGISTRY = TenantRegistry.from_config(TenantsConfig(allow_anonymous=True))
ANONYMOUS = REGISTRY.identify(None)


def parse_body(raw: bytes, endpoint: str) -> ParsedRequest:
    """The request edge as the gateway runs it, for an anonymous client."""
    return parse_request(raw, endpoint, served_models=(), limits=LimitsConfig(),
                         tenant=ANONYMOUS, registry=REGISTRY)


def test_upstream_payload_adds_salt_and_usage_to_the_raw_body() -> None:
    raw = completion([1, 2], stream=True, note="caf\u00e9 \u2603") + b"\n"
    parsed = dataclasses.replace(parse_body(raw, "completions"), cache_salt="salt-a")
    payload, strip = upstream_payload(parsed, want_token_ids=True)
    body = json.loads(payload)
    assert body == {**json.loads(raw), "cache_salt": "salt-a",
                    "stream_options": {"include_usage": True}, "return_token_ids": True}
    assert strip and payload.startswith(raw.rstrip()[:-1])  # the client's bytes, untouched
    assert not parsed.client_wants_usage
    assert "cache_salt" not in parsed.body and "stream_options" not in parsed.body
    # Nothing to add: the body goes as it came.
    plain = parse_body(completion([1]), "completions")
    assert upstream_payload(plain, want_token_ids=False) == (plain.raw, False)
    asked = parse_body(completion([1], stream=True, return_token_ids=True,
                                  stream_options={"include_usage": True}), "completions")
    assert asked.client_wants_usage
    assert upstream_payload(asked, want_token_ids=True) == (asked.raw, False)


def test_upstream_payload_never_duplicates_a_key_the_client_sent() -> None:
    raw = completion([1], stream=True, stream_options={"continuous_usage_stats": False})
    parsed = dataclasses.replace(parse_body(raw, "completions"), cache_salt="salt-a")
    payload, _ = upstream_payload(parsed, want_token_ids=False)
    assert payload.count(b'"stream_options"') == 1
    assert json.loads(payload)["stream_options"] == {"continuous_usage_stats": False,
                                                     "include_usage": True}


def test_the_collector_does_not_walk_what_the_chain_cache_remembers() -> None:
    """A full collection visits every element of every tracked container: the chain
    cache's keys, digests and fingerprints must not be such containers (router/collector.py
    measured what walking them cost a serving gateway)."""
    cache = ChainCache()
    history = list(range(1000, 1000 + 16 * 40))
    cache.event_keys(CONFIG, history, "s")
    cache.event_keys(CONFIG, [*history, *range(7000, 7000 + 16 * 3)], "s")  # grown in place
    cache.event_keys(CONFIG, [*history[:16 * 20], *range(9000, 9000 + 16 * 5)], "s")  # a branch
    gc.collect()
    assert len(cache._chains) == 2
    assert not gc.is_tracked(cache._memo)
    for chain in cache._chains.values():
        for part in (chain.digests, chain.event_keys, chain.prints):
            assert not gc.is_tracked(part), type(part)
    # and what they hold is still the keys, in order
    grown = [*history, *range(7000, 7000 + 16 * 3)]
    assert cache.event_keys(CONFIG, grown, "s") == \
        [event_key(d) for d in chain_hashes(CONFIG, grown, cache_salt="s")]


def test_chain_cache_matches_vllm_keys_and_hashes_only_new_blocks() -> None:
    cache = ChainCache()
    history = list(range(1000, 1000 + 16 * 40 + 5))
    keys = cache.event_keys(CONFIG, history, "salt")
    assert keys == [event_key(d) for d in chain_hashes(CONFIG, history, cache_salt="salt")]
    assert cache.hashed_blocks == 40
    grown = [*history, *range(5000, 5000 + 16 * 3)]
    grown_keys = cache.event_keys(CONFIG, grown, "salt")
    assert grown_keys == [event_key(d) for d in chain_hashes(CONFIG, grown, cache_salt="salt")]
    assert cache.hashed_blocks == 40 + 3  # the history's 40 blocks came from the cache
    assert cache.reused_blocks == 40
    # Another salt shares nothing (its block 0 key differs, so every key does).
    other = cache.event_keys(CONFIG, history, "other")
    assert not set(other) & set(keys)
    assert cache.hashed_blocks == 43 + 40


def test_chain_cache_is_bounded() -> None:
    cache = ChainCache(capacity_blocks=10)
    cache.event_keys(CONFIG, list(range(16 * 30)), None)
    assert cache.blocks == 30  # the newest chain stays whole, past the bound
    for first in range(5):  # more chains: the oldest go, whole
        cache.event_keys(CONFIG, [first, *range(16 * 6)], None)
    assert cache.blocks <= 10 and len(cache._chains) == 1
    assert len(cache._memo) == 6  # chain [4, ...]'s fingerprints, one a block up to its 6


def test_chain_cache_reuses_branches_and_repeats_exactly() -> None:
    cache = ChainCache()
    system = list(range(16 * 20))
    a = [*system, *range(5000, 5000 + 16 * 10)]
    b = [*system, *range(7000, 7000 + 16 * 5)]
    for tokens in (a, b, a, b, a[: 16 * 25 + 3]):
        keys = cache.event_keys(CONFIG, tokens, None)
        assert keys == [event_key(d) for d in chain_hashes(CONFIG, tokens)]
    # a: 30 blocks. b: from a's fingerprint at 16 blocks (PRINT_STRIDE), its 9 after.
    # The repeats: none. The prefix of a: from 16 again, and its 9 are a's own (no new
    # chain: the repeats of it hash nothing).
    assert PRINT_STRIDE == 16
    assert cache.hashed_blocks == 30 + 9 + 9 and len(cache._chains) == 2
    cache.event_keys(CONFIG, a[: 16 * 25 + 3], None)
    assert cache.hashed_blocks == 48


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 70), st.integers(0, 40)),
                min_size=1, max_size=12))
# Found by CI: the last request's 17 blocks were known (a prefix of the second's) and an
# earlier request had 17 blocks too, but other ones: not asked before.
@example([(0, 0, 17), (0, 17, 1), (0, 17, 0)])
def test_chain_cache_hashes_at_most_a_stride_more_than_is_new(
        turns: list[tuple[int, int, int]]) -> None:
    # Requests built from a few shared histories (a prefix of one, then new blocks):
    # each gets vLLM's keys, and hashes no more than its blocks past the longest prefix
    # any earlier request had, plus PRINT_STRIDE - 1 (nothing is evicted here).
    cache = ChainCache()
    histories = [list(range(10_000 * h, 10_000 * h + 16 * 70)) for h in range(4)]
    seen: list[list[int]] = []
    for n, (h, shared, new) in enumerate(turns):
        tokens = [*histories[h][: 16 * shared], *range(900_000 + 1000 * n,
                                                        900_000 + 1000 * n + 16 * new)]
        before = cache.hashed_blocks
        keys = cache.event_keys(CONFIG, tokens, "s")
        assert keys == [event_key(d) for d in chain_hashes(CONFIG, tokens, cache_salt="s")]
        blocks = len(tokens) // 16
        known = max((_common_blocks(tokens, old) for old in seen), default=0)
        assert cache.hashed_blocks - before <= blocks - known + PRINT_STRIDE - 1
        if any(len(old) // 16 == blocks == _common_blocks(tokens, old) for old in seen):
            assert cache.hashed_blocks == before  # asked before: nothing hashed
        seen.append(tokens)


def _common_blocks(a: list[int], b: list[int]) -> int:
    n = 0
    while (n + 1) * 16 <= min(len(a), len(b)) and a[n * 16:(n + 1) * 16] == b[n * 16:(n + 1) * 16]:
        n += 1
    return n


def test_chain_cache_grows_a_conversation_in_place_hashing_only_the_turn() -> None:
    cache = ChainCache()
    history = list(range(16 * 512))
    cache.event_keys(CONFIG, history, "s")
    for turn in range(1, 6):
        history += list(range(100 * turn, 100 * turn + 256))
        keys = cache.event_keys(CONFIG, history, "s")
        assert keys[-1] == event_key(chain_hashes(CONFIG, history, cache_salt="s")[-1])
    assert cache.hashed_blocks == 512 + 5 * 16
    assert cache.blocks == 512 + 5 * 16 and len(cache._chains) == 1


def test_chain_cache_grows_a_short_conversation_in_place_across_the_first_stride() -> None:
    # Turns of 3 blocks from 5 to 29: under PRINT_STRIDE blocks a chain is found by its
    # every-block fingerprints, past it by the stride's and its last turn's length.
    cache = ChainCache()
    history = list(range(16 * 5))
    for turn in range(9):
        keys = cache.event_keys(CONFIG, history, "s")
        assert keys == [event_key(d) for d in chain_hashes(CONFIG, history, cache_salt="s")]
        history += list(range(1000 * (turn + 1), 1000 * (turn + 1) + 48))
    assert cache.hashed_blocks == 5 + 3 * 8 and len(cache._chains) == 1


def test_chain_cache_branches_off_a_chain_that_grew_since() -> None:
    # A conversation grows in place; then a request shares only its first turns (a
    # retried turn, an edited message): the branch takes the grown chain's keys up to
    # where they part and continues from there, and the grown chain is unchanged.
    cache = ChainCache()
    history = list(range(16 * 40))
    cache.event_keys(CONFIG, history, "s")
    for turn in range(3):
        history += list(range(9000 + 100 * turn, 9000 + 100 * turn + 64))
        cache.event_keys(CONFIG, history, "s")
    branch = [*history[: 16 * 44 + 5], *range(60_000, 60_000 + 16 * 6)]
    # ... and the branch grows in turn, keyed on from its own chain's last key.
    for tokens in (branch, history, branch[: 16 * 47], [*branch, *range(70_000, 70_032)]):
        keys = cache.event_keys(CONFIG, tokens, "s")
        assert keys == [event_key(d) for d in chain_hashes(CONFIG, tokens, cache_salt="s")]
    # The turns: 4 blocks each. The branch (50 blocks): from the history's fingerprint at
    # 32 (its own first 48 differ from the grown chain's), 18. The branch's prefix of 47
    # blocks: from the history's 32 again, 15 (they part from the history's at 44, so
    # it becomes a chain of its own). The grown branch: 2, from the branch's end.
    assert cache.hashed_blocks == 40 + 3 * 4 + 18 + 15 + 2


def test_prepare_prompt_without_tokenizer_keys_token_id_prompts_only() -> None:
    parsed = parse_body(completion(list(range(40))), "completions")
    prompt = prepare_prompt(None, ChainCache(), parsed, [CONFIG], None)
    assert prompt.num_tokens == 40 and len(prompt.keys[CONFIG]) == 2
    text = parse_body(json.dumps({"model": "m", "prompt": "hello"}).encode(), "completions")
    assert prepare_prompt(None, ChainCache(), text, [CONFIG], None).keys == {}


def test_predicted_cached_tokens_leaves_the_last_token_to_compute() -> None:
    assert predicted_cached_tokens(4, 64, 16) == 48  # (64 - 1) // 16 = 3 blocks at most
    assert predicted_cached_tokens(2, 64, 16) == 32
    assert predicted_cached_tokens(0, 64, 16) == 0


async def test_routes_to_the_replica_holding_the_prefix() -> None:
    index = MemoryIndex()
    fleet = replicas(3)
    tokens = list(range(16 * 8 + 3))
    keys = [event_key(d) for d in chain_hashes(CONFIG, tokens, cache_salt="s")]
    await index.add("m", "r2", keys[:6])
    await index.add("m", "r1", keys[:2])
    p = pipeline(index)
    route = await p.route(parse_body(completion(tokens), "completions"), fleet, time.monotonic(),
                          tenant="t", cache_salt="s")
    assert route.decision.replica_id == "r2"
    assert route.candidates[0].replica_id == "r2"
    assert set(r.replica_id for r in route.candidates) == {"r0", "r1", "r2"}
    assert route.matches == {"r2": 6, "r1": 2}
    assert route.predicted_for("r2") == 96 and route.predicted_for("r1") == 32
    assert route.lookup.fallback is None
    # The same prompt under another tenant's salt matches nothing.
    other = await p.route(parse_body(completion(tokens), "completions"), fleet, time.monotonic(),
                          tenant="u", cache_salt="other")
    assert other.matches == {} and other.predicted_for("r2") == 0


async def test_unhealthy_replica_is_not_chosen_even_with_the_prefix() -> None:
    index = MemoryIndex()
    fleet = replicas(2)
    fleet[1].healthy = False
    tokens = list(range(64))
    await index.add("m", "r1", [event_key(d) for d in chain_hashes(CONFIG, tokens)])
    route = await pipeline(index).route(parse_body(completion(tokens), "completions"), fleet,
                                        time.monotonic(), tenant=None, cache_salt=None)
    assert route.decision.replica_id == "r0"


async def test_mixed_hash_groups_are_matched_against_their_own_chains() -> None:
    other_config = HashConfig(block_size=32)
    fleet = [*replicas(1), *replicas(1, other_config)]
    fleet[1] = Replica(target=ReplicaSource(name="big", url="http://127.0.0.1:9100", models=("m",),
                                            hash_config=other_config).target(), healthy=True)
    tokens = list(range(100))
    index = MemoryIndex()
    small = [event_key(d) for d in chain_hashes(CONFIG, tokens)]
    big = [event_key(d) for d in chain_hashes(other_config, tokens)]
    await index.add("m", "big", big)
    await index.add("m", "r0", small[:1])
    # r0 "holding" the 32-block keys must not count: they are not its group's keys.
    await index.add("m", "r0", big)
    route = await pipeline(index).route(parse_body(completion(tokens), "completions"), fleet,
                                        time.monotonic(), tenant=None, cache_salt=None)
    assert route.matches == {"r0": 1, "big": 3}
    assert route.predicted_for("big") == 96


async def test_index_past_its_deadline_routes_on_load_alone(redis_server: Any) -> None:
    # Every lookup's outcome is collected: asyncio reports nothing "never retrieved".
    unhandled: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unhandled.append(ctx))
    index = RedisIndex.from_url(redis_server.url, socket_timeout_s=5.0)
    fleet = replicas(2)
    fleet[0].inflight = 5  # the load-only choice is r1
    tokens = list(range(64))
    await index.add("m", "r0", [event_key(d) for d in chain_hashes(CONFIG, tokens)])
    p = pipeline(index, deadline_s=0.2)
    body = parse_body(completion(tokens), "completions")
    ok = await p.route(body, fleet, time.monotonic(), tenant=None, cache_salt=None)
    assert ok.matches == {"r0": 4} and ok.lookup.fallback is None
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # Redis hangs: lookups cannot answer
    try:
        started = time.monotonic()
        slow = await p.route(body, fleet, time.monotonic(), tenant=None, cache_salt=None)
        assert time.monotonic() - started < 1.0  # the request was not held
        assert slow.lookup.fallback == "deadline" and slow.matches == {}
        assert slow.decision.replica_id == "r1"
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    redis_server.stop()  # Redis gone: connection refused
    down = await p.route(body, fleet, time.monotonic(), tenant=None, cache_salt=None)
    assert down.lookup.fallback == "index_down"
    assert down.decision.replica_id == "r1"
    await index.close()
    await asyncio.sleep(0)
    gc.collect()
    assert not unhandled, [ctx.get("message") for ctx in unhandled]


@pytest.mark.parametrize("width", [32, 16, 8, 12])
def test_event_keys_in_c_match_hashing_event_key(width: int) -> None:
    rng = random.Random(width)
    digests = [rng.randbytes(width) for _ in range(50)]
    assert _event_keys(digests) == [event_key(d) for d in digests]
    assert _event_keys([]) == []


async def test_a_burst_decided_before_any_is_forwarded_spreads_by_reserved_work() -> None:
    # Eight cold, distinct 2k-token prompts decided back to back, none forwarded yet:
    # each decision reserves its prefill on its replica, so the next one sees it.
    fleet = replicas(4)
    p = pipeline(MemoryIndex())
    routes = [await p.route(parse_body(completion([1000 + i] * 2048), "completions"), fleet,
                            time.monotonic(), tenant="t", cache_salt=None, reserve=True)
              for i in range(8)]
    per_replica = Counter(r.decision.replica_id for r in routes)
    assert sorted(per_replica.values()) == [2, 2, 2, 2]
    assert all(len(r.work) == 2 for r in fleet)
    # A request refused or failed over before reaching its replica releases it.
    now = time.monotonic()
    for route in routes:
        route.release(now)
        route.release(now)  # twice is harmless
    assert all(len(r.work) == 0 for r in fleet)
    # Without reserving (the other endpoints), decisions leave no trace.
    await p.route(parse_body(completion([7] * 2048), "completions"), fleet, time.monotonic(),
                  tenant="t", cache_salt=None)
    assert all(len(r.work) == 0 for r in fleet)


async def test_followers_find_a_just_routed_turn_as_index_run_plus_pending_tail() -> None:
    # r1 is indexed with a conversation's first 6 blocks. Its next turn (10 blocks) goes
    # there; before r1's events announce blocks 6-9, the turn after sees all 10 on r1,
    # and the pending store holds only the 4 new blocks, not the whole history.
    index = MemoryIndex()
    fleet = replicas(3)
    p = RoutingPipeline(tokenizers={}, chains=ChainCache(), index=index,
                        policy=build_policy(PolicyConfig(seed=1, tolerance=0.0)),
                        index_deadline_s=1.0, pending=PendingChains(ttl_s=10.0))
    history = list(range(16 * 10 + 5))
    keys = [event_key(d) for d in chain_hashes(CONFIG, history, cache_salt=None)]
    await index.add("m", "r1", keys[:6])
    turn = await p.route(parse_body(completion(history), "completions"), fleet,
                         time.monotonic(), tenant="t", cache_salt=None)
    assert turn.decision.replica_id == "r1" and turn.matches == {"r1": 6}
    assert p.pending is not None and p.pending.blocks == 4
    follower = await p.route(parse_body(completion([*history, 7, 7, 7]), "completions"), fleet,
                             time.monotonic(), tenant="t", cache_salt=None)
    # The index still says 6; the decision counted the pending tail as well.
    assert follower.matches == {"r1": 6} and follower.decision.replica_id == "r1"
    assert follower.decision.predicted_cached["r1"] == 10 * 16
    assert p.pending.blocks == 4  # nothing new to remember: all 10 already known


async def test_a_burst_of_one_hot_prefix_decided_before_forwarding_still_spreads() -> None:
    # 24 requests over one cached prefix, all decided before any is forwarded (the
    # proxy's in-flight count is still 0 everywhere): each reservation counts as load,
    # so the hot-spot guard sends part of the burst elsewhere instead of pinning it all
    # on the holder.
    index = MemoryIndex()
    fleet = replicas(3)
    hot = list(range(2000))
    keys = [event_key(d) for d in chain_hashes(CONFIG, hot, cache_salt=None)]
    await index.add("m", "r0", keys)
    p = pipeline(index)
    routes = [await p.route(parse_body(completion([*hot, 5000 + i, 6000 + i]), "completions"),
                            fleet, time.monotonic(), tenant="t", cache_salt=None, reserve=True)
              for i in range(24)]
    placed = Counter(r.decision.replica_id for r in routes)
    # Without the reservations counted as load: r0 24 of 24. With them: 20 / 2 / 2 (a hit
    # costs the holder little; each cold copy a 2,000-token prefill, and the copies' own
    # queues then weigh against more).
    assert placed["r0"] >= 6 and len(placed) >= 2 and placed["r0"] < 24, placed


class CountingExecutor(ThreadPoolExecutor):
    """A real thread pool that counts what is handed to it."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.calls = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.calls += 1
        return super().submit(fn, *args, **kwargs)


def _parsed(body: dict[str, Any], endpoint: str) -> ParsedRequest:
    registry = TenantRegistry.from_config(TenantsConfig(allow_anonymous=True))
    return parse_request(json.dumps(body).encode(), endpoint, served_models=(),
                         limits=LimitsConfig(), tenant=registry.identify(None),
                         registry=registry)


async def test_only_a_long_encode_of_unseen_text_leaves_the_event_loop(
        tiny_model_dir: Path) -> None:
    # Rendering, id checks and hashing hold the GIL (a thread only adds hand-offs); the
    # Rust encode of long text releases it, so that alone goes to the tokenizer threads.
    tok = await asyncio.to_thread(PromptTokenizer.from_dir, tiny_model_dir)  # slow import
    assert tok.segment_cache is not None
    pool = CountingExecutor()
    try:
        long_chat = _parsed({"model": "m", "messages": [
            {"role": "system", "content": "alpha beta gamma " * 1000},
            {"role": "user", "content": "hi"}]}, "chat")
        first = await tokens_off_the_loop_when_long(tok, long_chat, pool)
        assert pool.calls == 1
        assert first == tok.chat_tokens(long_chat.body)
        # The next turn resends the same 17 KB system prompt: its segments are cached
        # now, only the new turn is encoded, on the loop.
        next_turn = _parsed({"model": "m", "messages": [
            *long_chat.body["messages"], {"role": "assistant", "content": "yes"},
            {"role": "user", "content": "and then?"}]}, "chat")
        assert await tokens_off_the_loop_when_long(tok, next_turn, pool) == \
            tok.chat_tokens(next_turn.body)
        assert pool.calls == 1
        ids = _parsed({"model": "m", "prompt": [17] * 12000}, "completions")
        got = await tokens_off_the_loop_when_long(tok, ids, pool)
        assert got is not None and list(got) == [17] * 12000
        assert pool.calls == 1  # token ids never leave the loop
        text = _parsed({"model": "m", "prompt": "delta epsilon " * 1000}, "completions")
        assert await tokens_off_the_loop_when_long(tok, text, pool) == \
            tok.completion_tokens(text.body)
        assert pool.calls == 2  # 14 KB of text to encode
        short = _parsed({"model": "m", "prompt": "delta epsilon"}, "completions")
        await tokens_off_the_loop_when_long(tok, short, pool)
        assert pool.calls == 2
    finally:
        pool.shutdown()


def _question(seed: int, words: int = 200) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(["delta", "epsilon", "zeta", "eta", "theta", "iota"]) +
                    str(rng.randrange(100)) for _ in range(words))


async def test_a_chats_new_question_is_encoded_after_deciding_and_keys_end_the_same(
        tiny_model_dir: Path) -> None:
    # A shared system prompt the gateway has seen, then a new 1,400-character question:
    # the decision is made on the system prompt's ids (no replica can hold the question),
    # the same decision as with every id up front, and once finished the prompt's ids,
    # keys and pending chain are those of the whole prompt.
    tok = await asyncio.to_thread(PromptTokenizer.from_dir, tiny_model_dir)
    system = {"role": "system", "content": "You answer questions about wells. " * 60}
    tok.chat_tokens({"messages": [system, {"role": "user", "content": "hi"}]})  # seen
    body = {"model": "m", "messages": [system, {"role": "user", "content": _question(1)}],
            "max_tokens": 4}
    whole = tok.chat_tokens(body)
    outcomes = []
    for defer in (True, False):
        fleet = replicas(3)
        index = MemoryIndex()
        shared = [event_key(d) for d in chain_hashes(CONFIG, whole)][:20]
        await index.add("m", "r1", shared)  # r1 holds the system prompt
        fresh = await asyncio.to_thread(PromptTokenizer.from_dir, tiny_model_dir)
        fresh.chat_tokens({"messages": [system, {"role": "user", "content": "hi"}]})
        p = RoutingPipeline(tokenizers={"m": fresh}, chains=ChainCache(), index=index,
                            policy=build_policy(PolicyConfig(seed=1, tolerance=0.0)),
                            index_deadline_s=1.0, pending=PendingChains(ttl_s=10.0),
                            executor=ThreadPoolExecutor(1))
        route = await p.route(_parsed(body, "chat"), fleet, time.monotonic(), tenant="t",
                              cache_salt=None, reserve=True, defer_keys=defer)
        assert route.prompt.complete is not defer
        if defer:
            assert route.prompt.rest is not None and route.prompt.tokens is not None
            known = list(route.prompt.tokens)
            assert known == whole[:len(known)] and len(known) < len(whole) - 200
            # an estimate near the truth, and a bound above it
            assert 0.5 * len(whole) < route.prompt.num_tokens < 2 * len(whole)
            assert route.prompt.at_most >= len(whole)
            assert fresh.segment_cache is not None
            assert not fresh.segment_cache.holds(body["messages"][1]["content"])
        outcomes.append((route.decision.replica_id, route.decision.predicted_cached))
        route.finish_keys(p.chains, p.pending)
        assert route.prompt.complete and list(route.prompt.tokens or ()) == whole
        full = [event_key(d) for d in chain_hashes(CONFIG, whole)]
        assert list(route.prompt.keys[CONFIG]) == full
        assert p.pending is not None
        assert p.pending.matches("m", full, ["r0", "r1", "r2"], time.monotonic(),
                                 {"r1": 20}) == {"r1": len(full)}
    assert outcomes[0] == outcomes[1] and outcomes[0][0] == "r1"


async def test_a_chat_is_not_deferred_where_its_first_ids_could_differ(
        tiny_model_dir: Path) -> None:
    tok = await asyncio.to_thread(PromptTokenizer.from_dir, tiny_model_dir)
    system = {"role": "system", "content": "Be brief. " * 40}
    tok.chat_tokens({"messages": [system, {"role": "user", "content": "hi"}]})
    question = {"role": "user", "content": _question(2)}
    pool = CountingExecutor()
    try:
        plain = {"model": "m", "messages": [system, question]}
        got = await tokens_off_the_loop_when_long(tok, _parsed(plain, "chat"), pool, defer=True)
        assert isinstance(got, DeferredIds)
        assert got.finish() == tok.chat_tokens(plain)
        for seed, extra in ((6, {"truncate_prompt_tokens": 100}), (7, {"add_special_tokens": True})):
            body = {"model": "m", "messages": [system, {"role": "user", "content": _question(seed)}],
                    **extra}
            got = await tokens_off_the_loop_when_long(tok, _parsed(body, "chat"), pool,
                                                      defer=True)
            assert not isinstance(got, DeferredIds)  # ids, encoded before deciding
            assert got == tok.chat_tokens(body)
        # a short new question, or nothing new at all: encoded as before
        short = {"model": "m", "messages": [system, {"role": "user", "content": "why?"}]}
        assert await tokens_off_the_loop_when_long(tok, _parsed(short, "chat"), pool,
                                                   defer=True) == tok.chat_tokens(short)
        assert await tokens_off_the_loop_when_long(tok, _parsed(plain, "chat"), pool,
                                                   defer=True) == tok.chat_tokens(plain)
        # an older piece the cache lacks (a conversation new to this gateway) is encoded
        # now; only the newest is deferred
        older = {"model": "m", "messages": [
            system, {"role": "user", "content": _question(3)},
            {"role": "assistant", "content": _question(4)}, {"role": "user", "content": _question(5)}]}
        got = await tokens_off_the_loop_when_long(tok, _parsed(older, "chat"), pool, defer=True)
        assert isinstance(got, DeferredIds)
        whole = tok.chat_tokens(older)
        assert got.known == whole[:len(got.known)]
        assert len(got.known) > len(tok.chat_tokens({"messages": older["messages"][:3]})) - 10
        assert pool.calls == 0
    finally:
        pool.shutdown()


def test_chain_cache_probe_keys_a_long_new_part_only_as_far_as_the_probe() -> None:
    cache = ChainCache()
    system = list(range(16 * 20))
    cache.event_keys(CONFIG, system, None)
    prompt = [*system, *range(5000, 5000 + 16 * 100)]
    full = [event_key(d) for d in chain_hashes(CONFIG, prompt)]
    probed = cache.event_keys(CONFIG, prompt, None, probe=8)
    assert probed == full[: 20 + 8] and cache.hashed_blocks == 20 + 8
    # The rest, later: only the blocks past the probe are hashed.
    assert cache.event_keys(CONFIG, prompt, None) == full
    assert cache.hashed_blocks == 20 + 100
    # A new part of at most twice the probe is keyed whole.
    short = [*system, *range(9000, 9000 + 16 * 16)]
    assert cache.event_keys(CONFIG, short, None, probe=8) == \
        [event_key(d) for d in chain_hashes(CONFIG, short)]


async def test_a_cold_prompt_is_decided_on_its_probe_and_keyed_whole_after() -> None:
    # Nothing holds the probe's last block, so nothing holds past it: the decision is
    # the one all keys give, and the rest is keyed (and pending) once the request left.
    fleet = replicas(3)
    cold = list(range(16 * 200))
    full = [event_key(d) for d in chain_hashes(CONFIG, cold)]
    decisions = []
    for defer in (True, False):
        p = RoutingPipeline(tokenizers={}, chains=ChainCache(), index=MemoryIndex(),
                            policy=build_policy(PolicyConfig(seed=1, tolerance=0.0)),
                            index_deadline_s=1.0, pending=PendingChains(ttl_s=10.0))
        route = await p.route(parse_body(completion(cold), "completions"), fleet,
                              time.monotonic(), tenant="t", cache_salt=None, defer_keys=defer)
        decisions.append((route.decision.replica_id, route.decision.predicted_cached,
                          route.prompt.num_tokens))
        assert route.prompt.complete is not defer
        assert p.pending is not None
        if defer:
            assert len(route.prompt.keys[CONFIG]) < 200 and p.chains.hashed_blocks < 200
            assert p.pending.blocks == len(route.prompt.keys[CONFIG])
        route.finish_keys(p.chains, p.pending)
        route.finish_keys(p.chains, p.pending)  # twice is harmless
        assert list(route.prompt.keys[CONFIG]) == full and route.prompt.complete
        assert p.pending.blocks == 200
        assert p.pending.matches("m", full, ["r0", "r1", "r2"], time.monotonic()) == \
            {route.decision.replica_id: 200}
    assert decisions[0] == decisions[1]


async def test_a_probe_held_whole_is_keyed_and_looked_up_in_full_before_deciding() -> None:
    # A replica holds a long prefix this gateway never hashed (routed by another
    # gateway, or before a restart): the probe matches to its end, so the decision waits
    # for the whole chain and sees every held block.
    index = MemoryIndex()
    fleet = replicas(3)
    prompt = list(range(16 * 200))
    full = [event_key(d) for d in chain_hashes(CONFIG, prompt)]
    await index.add("m", "r2", full[:150])
    p = RoutingPipeline(tokenizers={}, chains=ChainCache(), index=index,
                        policy=build_policy(PolicyConfig(seed=1, tolerance=0.0)),
                        index_deadline_s=1.0, pending=PendingChains(ttl_s=10.0))
    route = await p.route(parse_body(completion(prompt), "completions"), fleet,
                          time.monotonic(), tenant="t", cache_salt=None, defer_keys=True)
    assert route.prompt.complete and list(route.prompt.keys[CONFIG]) == full
    assert route.matches == {"r2": 150} and route.decision.replica_id == "r2"
    assert route.predicted_for("r2") == 150 * 16
    assert p.pending is not None and p.pending.blocks == 50


async def test_a_burst_over_one_new_prefix_sees_the_first_requests_whole_chain_pending() -> None:
    # Two requests share a new 150-block prefix and are both decided before the first
    # is sent (a burst). The first was decided on a probe; the second, sharing it,
    # keys the first's rest, so it sees all 150 blocks pending where the first went,
    # not just the probe: the same prediction as with every key up front.
    shared = list(range(16 * 150))
    first, second = [*shared, *range(9000, 9000 + 16 * 3)], [*shared, *range(7000, 7100)]
    outcomes = []
    for defer in (True, False):
        fleet = replicas(3)
        p = RoutingPipeline(tokenizers={}, chains=ChainCache(), index=MemoryIndex(),
                            policy=build_policy(PolicyConfig(seed=1, tolerance=0.0)),
                            index_deadline_s=1.0, pending=PendingChains(ttl_s=10.0))
        a = await p.route(parse_body(completion(first), "completions"), fleet,
                          time.monotonic(), tenant="t", cache_salt=None, reserve=True,
                          defer_keys=defer)
        assert a.prompt.complete is not defer
        b = await p.route(parse_body(completion(second), "completions"), fleet,
                          time.monotonic(), tenant="t", cache_salt=None, reserve=True,
                          defer_keys=defer)
        assert a.prompt.complete and b.prompt.complete  # the second finished the first
        outcomes.append((a.decision.replica_id, b.decision.replica_id,
                         b.decision.predicted_cached))
        assert b.decision.predicted_cached[a.decision.replica_id] == 150 * 16
        assert p.pending is not None
        held = p.pending.blocks
        a.finish_keys(p.chains, p.pending)  # its own send, later: nothing left to do
        assert p.pending.blocks == held
    assert outcomes[0] == outcomes[1]


def test_the_chain_cache_benchmark_runs_and_names_a_bad_value() -> None:
    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_chain_cache.py"
    done = subprocess.run([sys.executable, str(bench), "--blocks", "20", "--prompts", "3",
                           "--rounds", "1"], capture_output=True, text=True, timeout=120,
                          check=True)
    assert "bytes / block" in done.stdout and "this checkout" in done.stdout
    bad = subprocess.run([sys.executable, str(bench), "--prompts", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--prompts must be at least 1" in bad.stderr
