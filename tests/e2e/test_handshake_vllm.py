"""The hash handshake against real vLLM: probe, KV events, indexer, comparison.

The session's vLLM server keys blocks with sha256, block size 32 and PYTHONHASHSEED "0".
`run_handshake` probes it as the gateway would, with the gateway's view of the replica
configured right or wrong in one setting at a time; the replica's KV events reach an
in-process EventIndexer writing to a MemoryIndex, which is where the handshake reads
the probe's observation. Probes carry unique salts, so the state other tests left in
the shared server cannot hit them.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from vllm_server import VllmServer

from router.events import EventIndexer, ReplicaFeed
from router.handshake import HandshakeResult, run_handshake
from router.hashing import BlockChain, HashConfig
from router.index import MemoryIndex

pytestmark = pytest.mark.vllm

REPLICA = "vllm-0"
HANDSHAKE_TIMEOUT_S = 30.0  # a loaded 2-core machine answers a probe in well under this


def vocab_size(server: VllmServer) -> int:
    return int(json.loads((server.model_dir / "config.json").read_text())["vocab_size"])


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def handshake(server: VllmServer, session: aiohttp.ClientSession, ours: HashConfig,
                    index: MemoryIndex) -> HandshakeResult:
    return await run_handshake(session, server.url, server.served_model_name, ours, index,
                               timeout_s=HANDSHAKE_TIMEOUT_S, vocab_size=vocab_size(server))


@pytest.mark.parametrize(
    ("ours", "mismatch"),
    [
        (HashConfig("sha256", 32, "0"), None),
        (HashConfig("sha256", 32, "1"), "hash_seed"),
        (HashConfig("sha256", 64, "0"), "block_size"),
        (HashConfig("sha256_cbor", 32, "0"), "hash_algo"),
    ],
    ids=["agree", "seed", "block_size", "algo"],
)
async def test_handshake_with_vllm_names_the_differing_setting(
    vllm_server: VllmServer, http: aiohttp.ClientSession, ours: HashConfig,
    mismatch: str | None,
) -> None:
    index = MemoryIndex()
    indexer = EventIndexer(index)
    await indexer.add_replica(ReplicaFeed(REPLICA, vllm_server.kv_events_endpoint,
                                          vllm_server.served_model_name,
                                          replay_endpoint=vllm_server.replay_endpoint))
    try:
        result = await handshake(vllm_server, http, ours, index)
        stats = indexer.stats()[REPLICA]
    finally:
        await indexer.stop()
    assert result.verified == (mismatch is None), result
    assert result.mismatch == mismatch, result
    assert result.detail
    assert stats.probes >= 1, stats


async def test_a_misconfigured_replica_stays_routable_by_prefix_through_rekey(
    vllm_server: VllmServer, http: aiohttp.ClientSession,
) -> None:
    """The gateway believes seed "1"; the indexer re-keys vLLM's blocks into that view."""
    ours = HashConfig("sha256", 32, "1")
    model = vllm_server.served_model_name
    index = MemoryIndex()
    indexer = EventIndexer(index)
    stream = await indexer.add_replica(ReplicaFeed(
        REPLICA, vllm_server.kv_events_endpoint, model,
        replay_endpoint=vllm_server.replay_endpoint, rekey=ours, rekey_mode="auto"))
    try:
        result = await handshake(vllm_server, http, ours, index)
        assert (result.verified, result.mismatch, result.rekeyed) == (False, "hash_seed", True)
        assert result.routable_by_prefix
        assert stream.stats.key_check == "differ"
        # A real prompt: its blocks appear in the index under the keys the gateway
        # computes with its (wrong) seed, so prefix routing still finds them.
        rng = random.Random()
        prompt = [rng.randrange(3, vocab_size(vllm_server)) for _ in range(3 * 32 + 5)]
        async with http.post(f"{vllm_server.url}/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": 1}) as resp:
            assert resp.status == 200, await resp.text()
        ours_keys = BlockChain(ours, tokens=prompt).event_keys()
        vllm_keys = BlockChain(vllm_server.hash, tokens=prompt).event_keys()
        assert not set(ours_keys) & set(vllm_keys)

        async def indexed() -> bool:
            return (await index.lookup(model, ours_keys)).get(REPLICA, 0) == 3

        await poll(indexed)
        assert await index.lookup(model, vllm_keys) == {}
    finally:
        await indexer.stop()


async def poll(check: Callable[[], Awaitable[bool]], within_s: float = 30.0) -> None:
    """Await `check()` until it returns True, failing after `within_s`."""
    deadline = time.monotonic() + within_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within_s}s")
        await asyncio.sleep(0.05)  # polling against a deadline, not synchronisation
