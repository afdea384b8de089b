"""Token ids of long prompt pieces shared between gateways through a real Redis
(router/shared_segments.py, wired in router/routing.py)."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from replica.processes import free_port
from router.config import LimitsConfig, TenantsConfig
from router.request import parse_request
from router.routing import tokens_off_the_loop_when_long
from router.shared_segments import SharedSegments, decode_ids, encode_ids
from router.tenants import TenantRegistry
from router.tokenize import PromptTokenizer

REGISTRY = TenantRegistry.from_config(TenantsConfig(allow_anonymous=True))
SYSTEM = "You are a careful assistant for the weather service. " * 200  # ~10 KB


def test_ids_round_trip_and_a_value_that_cannot_be_this_tokenizers_is_refused() -> None:
    ids = (0, 1, 255, 65_536, 151_935)
    assert decode_ids(encode_ids(ids), vocab_size=151_936) == ids
    assert decode_ids(encode_ids(ids)[:-1], vocab_size=151_936) is None  # not whole ids
    assert decode_ids(encode_ids((5, 3_389)), vocab_size=3_389) is None  # past the vocab
    assert decode_ids(b"", vocab_size=3_389) is None


def _ids(model_dir: Path, question: str) -> list[int]:
    """The chat's ids from a tokenizer of its own (no cache shared with any gateway)."""
    return PromptTokenizer.from_dir(model_dir).chat_tokens({"messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]})


class _Gateway:
    """One gateway's tokenizer and shared segments, counting the long pieces it encodes."""

    def __init__(self, model_dir: Path, client: Redis) -> None:
        self.tokenizer = PromptTokenizer.from_dir(model_dir)
        self.segments = SharedSegments(client, min_chars=4096, timeout_s=1.0)
        self.encoded_long: list[int] = []
        encode = self.tokenizer._encode_segment

        def counting(piece: str) -> tuple[int, ...]:
            if len(piece) >= self.segments.min_chars:
                self.encoded_long.append(len(piece))
            return encode(piece)

        self.tokenizer._encode_segment = counting  # type: ignore[method-assign]

    async def tokens(self, question: str, executor: ThreadPoolExecutor) -> list[int]:
        raw = json.dumps({"model": "m", "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question}]}).encode()
        parsed = parse_request(raw, "chat", served_models=(), limits=LimitsConfig(),
                               tenant=REGISTRY.identify(None), registry=REGISTRY)
        ids = await tokens_off_the_loop_when_long(self.tokenizer, parsed, executor,
                                                  self.segments)
        await self.segments.drain()
        assert ids is not None
        return ids


async def _gateway(model_dir: Path, client: Redis) -> _Gateway:
    # Loading a tokenizer takes seconds (transformers): not on the event loop.
    return await asyncio.to_thread(_Gateway, model_dir, client)


async def test_the_second_gateway_to_encode_a_long_piece_shares_it_and_the_third_reads_it(
        redis_server: Any, tiny_model_dir: Path) -> None:
    client = Redis.from_url(redis_server.url)
    executor = ThreadPoolExecutor(2)
    try:
        a, b, c = [await _gateway(tiny_model_dir, client) for _ in range(3)]
        expected = await asyncio.to_thread(_ids, tiny_model_dir, "hi a")
        assert await a.tokens("hi a", executor) == expected
        assert len(a.encoded_long) == 1
        # One encode counted, nothing stored: a one-off prompt costs only its counter.
        assert [k async for k in client.scan_iter(b"cr:{seg:*}:i:*")] == []
        assert len([k async for k in client.scan_iter(b"cr:{seg:*}:n:*")]) == 1

        await b.tokens("hi b", executor)
        assert len(b.encoded_long) == 1 and b.segments.fetched == 0
        assert len([k async for k in client.scan_iter(b"cr:{seg:*}:i:*")]) == 1

        ids_c = await c.tokens("hi a", executor)
        assert c.encoded_long == [] and c.segments.fetched == 1
        assert ids_c == expected  # the same ids its own tokenizer would have made
        ttl = await client.pttl(next(iter([k async for k in client.scan_iter(b"cr:{seg:*}:i:*")])))
        assert 0 < ttl <= 600_000
    finally:
        executor.shutdown()
        await client.aclose()


async def test_a_burst_at_one_gateway_counts_as_one_encode(
        redis_server: Any, tiny_model_dir: Path) -> None:
    client = Redis.from_url(redis_server.url)
    executor = ThreadPoolExecutor(2)
    try:
        gateway = await _gateway(tiny_model_dir, client)
        await asyncio.gather(*(gateway.tokens(f"question {i}", executor) for i in range(6)))
        assert len(gateway.encoded_long) == 1  # the segment cache's single flight
        [count_key] = [k async for k in client.scan_iter(b"cr:{seg:*}:n:*")]
        assert await client.get(count_key) == b"1"
        assert [k async for k in client.scan_iter(b"cr:{seg:*}:i:*")] == []
    finally:
        executor.shutdown()
        await client.aclose()


async def test_other_tokenizers_and_bad_values_are_not_used(
        redis_server: Any, tiny_model_dir: Path) -> None:
    client = Redis.from_url(redis_server.url)
    executor = ThreadPoolExecutor(2)
    try:
        a, b = await _gateway(tiny_model_dir, client), await _gateway(tiny_model_dir, client)
        expected = await a.tokens("q", executor)
        await b.tokens("q", executor)  # second encode: stored
        [ids_key] = [k async for k in client.scan_iter(b"cr:{seg:*}:i:*")]

        other = await _gateway(tiny_model_dir, client)
        other.tokenizer.identity = "a-different-tokenizer"
        await other.tokens("q", executor)
        assert other.segments.fetched == 0 and len(other.encoded_long) == 1

        await client.set(ids_key, encode_ids([10**6] * 8))  # not this vocabulary's ids
        fresh = await _gateway(tiny_model_dir, client)
        assert await fresh.tokens("q", executor) == expected
        assert fresh.segments.fetched == 0 and len(fresh.encoded_long) == 1
    finally:
        executor.shutdown()
        await client.aclose()


async def test_with_redis_away_the_gateway_encodes_for_itself(tiny_model_dir: Path) -> None:
    client = Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.2)
    executor = ThreadPoolExecutor(2)
    try:
        gateway = await _gateway(tiny_model_dir, client)
        gateway.segments.timeout_s = 0.2
        expected = await asyncio.to_thread(_ids, tiny_model_dir, "q")
        assert await gateway.tokens("q", executor) == expected
        assert gateway.segments.failures == 2  # the read and the report, both refused
        assert len(gateway.encoded_long) == 1
    finally:
        executor.shutdown()
        await client.aclose()


@pytest.mark.parametrize("share", [True, False])
def test_index_share_segments_is_a_setting(share: bool) -> None:
    from router.config import build_config

    config = build_config({
        "replicas": [{"url": "http://127.0.0.1:9", "models": ["m"]}],
        "index": {"backend": "redis://127.0.0.1:6390", "share_segments": share,
                  "segment_ttl_s": 60},
        "tenants": {"allow_anonymous": True},
    }, {"CACHEROUTE_SALT_SECRET": "shared-segments-test-secret-01"})
    assert config.index.share_segments is share
    assert config.index.segment_ttl_s == 60


async def test_a_gateway_alone_neither_asks_nor_reports(
        redis_server: Any, tiny_model_dir: Path) -> None:
    from router.hashing import HashConfig
    from router.index import MemoryIndex
    from router.outstanding import WorkView
    from router.policy.pipeline import build_policy
    from router.policy.types import PolicyConfig
    from router.replicas import Replica, ReplicaSource
    from router.routing import ChainCache, RoutingPipeline
    from router.shared_work import SharedWork

    client = Redis.from_url(redis_server.url)
    executor = ThreadPoolExecutor(2)
    try:
        gateway = await _gateway(tiny_model_dir, client)
        shared = SharedWork(client, gateway_id="me")
        pipeline = RoutingPipeline(
            tokenizers={"m": gateway.tokenizer}, chains=ChainCache(), index=MemoryIndex(),
            policy=build_policy(PolicyConfig(seed=1)), index_deadline_s=1.0,
            executor=executor, shared=shared, segments=gateway.segments)
        source = ReplicaSource(name="r0", url="http://127.0.0.1:9000", models=("m",),
                               hash_config=HashConfig(block_size=16))
        replicas = [Replica(target=source.target(), healthy=True)]

        async def route(question: str) -> None:
            raw = json.dumps({"model": "m", "messages": [
                {"role": "system", "content": SYSTEM + question},
                {"role": "user", "content": question}]}).encode()
            parsed = parse_request(raw, "chat", served_models=(), limits=LimitsConfig(),
                                   tenant=REGISTRY.identify(None), registry=REGISTRY)
            await pipeline.route(parsed, replicas, 0.0, tenant=None, cache_salt=None)
            await gateway.segments.drain()

        await shared.read(1.0)
        assert shared.alone
        await route("alone")
        assert len(gateway.encoded_long) == 1
        assert [k async for k in client.scan_iter(b"cr:{seg:*}")] == []  # not even a count

        other = SharedWork(client, gateway_id="other")
        other.publish("r0", WorkView())
        await other.flushed()
        await shared.read(1.0)
        assert not shared.alone
        await route("with company")
        assert len([k async for k in client.scan_iter(b"cr:{seg:*}:n:*")]) == 1
    finally:
        executor.shutdown()
        await client.aclose()


def test_the_gateway_exports_what_sharing_did() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from router.metrics import shared_segment_families

    class Families:
        def collect(self) -> Any:
            return shared_segment_families(fetched=3, reported=5, failures=1)

    registry = CollectorRegistry()
    registry.register(Families())  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    assert 'cacheroute_shared_segments_total{outcome="fetched"} 3.0' in text
    assert 'cacheroute_shared_segments_total{outcome="reported"} 5.0' in text
    assert 'cacheroute_shared_segments_total{outcome="failed"} 1.0' in text
