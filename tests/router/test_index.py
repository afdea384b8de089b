"""PrefixIndex behaviour, one suite run against MemoryIndex and RedisIndex (real Redis)."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from servers import RedisServer, free_port

from router.index import (
    IndexOp,
    IndexUnavailable,
    MemoryIndex,
    ObservedBlocks,
    PrefixIndex,
    RedisIndex,
)
from router.index.memory import APPLY_SLICE

MODEL = "tiny"


async def eventually(check: Callable[[], Awaitable[bool]], deadline_s: float = 10.0) -> None:
    """Poll an async condition until it holds, failing after the deadline."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if await check():
            return
        await asyncio.sleep(0.02)  # polling interval, not synchronisation
    raise AssertionError(f"condition not met within {deadline_s}s")


async def test_lookup_returns_each_replicas_leading_run(index: PrefixIndex) -> None:
    await index.add(MODEL, "r1", [1, 2, 3, 4])
    await index.add(MODEL, "r2", [1, 2])
    await index.add(MODEL, "r3", [2, 3, 4])  # no block 0: cannot hit anything
    assert await index.lookup(MODEL, [1, 2, 3, 4, 5]) == {"r1": 4, "r2": 2}
    assert await index.lookup(MODEL, [1, 9, 3]) == {"r1": 1, "r2": 1}
    assert await index.lookup(MODEL, [7, 1, 2]) == {}
    assert await index.lookup(MODEL, []) == {}


async def test_a_hole_ends_the_run(index: PrefixIndex) -> None:
    await index.add(MODEL, "r1", [1, 2, 3, 4, 5])
    await index.remove(MODEL, "r1", [3])
    assert await index.lookup(MODEL, [1, 2, 3, 4, 5]) == {"r1": 2}
    await index.add(MODEL, "r1", [3])
    assert await index.lookup(MODEL, [1, 2, 3, 4, 5]) == {"r1": 5}


async def test_models_and_loras_are_separate_scopes(index: PrefixIndex) -> None:
    await index.add(MODEL, "r1", [1, 2])
    await index.add(f"{MODEL}@sql", "r2", [1, 2, 3])
    assert await index.lookup(MODEL, [1, 2, 3]) == {"r1": 2}
    assert await index.lookup(f"{MODEL}@sql", [1, 2, 3]) == {"r2": 3}
    assert await index.lookup("other", [1, 2, 3]) == {}


async def test_clear_replica_leaves_other_replicas_intact(index: PrefixIndex) -> None:
    await index.add(MODEL, "r1", [1, 2, 3])
    await index.add(f"{MODEL}@sql", "r1", [1, 2])
    await index.add(MODEL, "r2", [1, 2])
    await index.add(f"{MODEL}@sql", "r2", [1])
    await index.clear_replica("r1")
    assert await index.lookup(MODEL, [1, 2, 3]) == {"r2": 2}
    assert await index.lookup(f"{MODEL}@sql", [1, 2]) == {"r2": 1}
    # The replica can be filled again after a clear.
    await index.add(MODEL, "r1", [1])
    assert await index.lookup(MODEL, [1, 2, 3]) == {"r1": 1, "r2": 2}


async def test_record_entries_expire_after_their_ttl(index: PrefixIndex) -> None:
    await index.record(MODEL, "r1", [1, 2, 3], ttl_s=0.3)
    await index.record(MODEL, "r2", [1, 2, 3], ttl_s=60)
    assert await index.lookup(MODEL, [1, 2, 3]) == {"r1": 3, "r2": 3}

    async def r1_expired() -> bool:
        return await index.lookup(MODEL, [1, 2, 3]) == {"r2": 3}

    await eventually(r1_expired)


async def test_touch_refreshes_the_ttl(index: PrefixIndex) -> None:
    await index.record(MODEL, "r1", [1, 2], ttl_s=0.3)
    await index.record(MODEL, "r1", [1, 2], ttl_s=60)  # the gateway sent the chain again
    await index.record(MODEL, "r2", [1, 2], ttl_s=0.3)  # a witness that 0.3 s passed

    async def witness_expired() -> bool:
        return "r2" not in await index.lookup(MODEL, [1, 2])

    await eventually(witness_expired)
    assert await index.lookup(MODEL, [1, 2]) == {"r1": 2}


async def test_an_expired_block_mid_chain_ends_the_run(index: PrefixIndex) -> None:
    await index.record(MODEL, "r1", [1, 2, 3], ttl_s=60)
    await index.record(MODEL, "r1", [2], ttl_s=0.2)  # block 2's entry now expires first

    async def run_cut() -> bool:
        return await index.lookup(MODEL, [1, 2, 3]) == {"r1": 1}

    await eventually(run_cut)


async def test_capacity_trims_least_recently_touched_leaf_first(index: PrefixIndex) -> None:
    a, b = [11, 12, 13], [21, 22, 23]
    await index.record(MODEL, "r1", a, ttl_s=60, capacity_blocks=4)
    await index.record(MODEL, "r1", b, ttl_s=60, capacity_blocks=4)
    # 6 entries, bound 4: chain a was touched first, and its tail goes first.
    assert await index.lookup(MODEL, a) == {"r1": 1}
    assert await index.lookup(MODEL, b) == {"r1": 3}
    await index.record(MODEL, "r1", a, ttl_s=60, capacity_blocks=4)
    assert await index.lookup(MODEL, a) == {"r1": 3}
    assert await index.lookup(MODEL, b) == {"r1": 1}
    # Capacity is per replica: another replica's entries are untouched.
    await index.record(MODEL, "r2", b, ttl_s=60, capacity_blocks=4)
    assert await index.lookup(MODEL, b) == {"r1": 1, "r2": 3}


async def test_capacity_from_the_constructor_applies_to_events_too() -> None:
    index = MemoryIndex(capacity_blocks=2)
    await index.add(MODEL, "r1", [1, 2, 3])
    assert await index.lookup(MODEL, [1, 2, 3]) == {"r1": 2}


async def test_redis_capacity_from_the_constructor(redis_server: RedisServer) -> None:
    index = RedisIndex.from_url(redis_server.url, capacity_blocks=2)
    try:
        await index.add(MODEL, "r1", [1, 2, 3])
        assert await index.lookup(MODEL, [1, 2, 3]) == {"r1": 2}
    finally:
        await index.close()


async def test_long_chains_in_one_call(index: PrefixIndex) -> None:
    chain = list(range(1, 5001))
    await index.add(MODEL, "r1", chain)
    await index.add(MODEL, "r2", chain[:4000])
    assert await index.lookup(MODEL, chain) == {"r1": 5000, "r2": 4000}
    await index.remove(MODEL, "r1", chain[2500:])
    assert await index.lookup(MODEL, chain) == {"r1": 2500, "r2": 4000}


@pytest.mark.parametrize("seed", [7, 8, 9])
async def test_redis_and_memory_agree_on_random_operations(
    redis_server: RedisServer, seed: int
) -> None:
    rng = random.Random(seed)
    memory = MemoryIndex(capacity_blocks=12)
    redis_index = RedisIndex.from_url(redis_server.url, capacity_blocks=12)
    # Keys chained as vLLM's are (each stands for its whole prefix: the memory index
    # counts holes by parent), from 3 tokens so that the chains share prefixes.
    chains = []
    for _ in range(6):
        tokens = tuple(rng.randrange(1, 4) for _ in range(rng.randrange(1, 9)))
        chains.append([hash(tokens[:i + 1]) & (2**63 - 1) for i in range(len(tokens))])
    models, replicas = [MODEL, f"{MODEL}@sql"], ["r1", "r2", "r3"]
    try:
        for step in range(200):
            op = rng.choice(["add", "add", "remove", "record", "clear", "batch"])
            model, replica = rng.choice(models), rng.choice(replicas)
            chain = rng.choice(chains)
            tail = chain[rng.randrange(len(chain)):]
            # A KV-event batch: adds and removes in several scopes, one apply() call.
            batch = [IndexOp(rng.choice(["add", "remove"]), rng.choice(models),
                             tuple(rng.choice(chains))) for _ in range(rng.randrange(1, 5))]
            for idx in (memory, redis_index):
                if op == "batch":
                    await idx.apply(replica, batch)
                elif op == "add":
                    await idx.add(model, replica, chain)
                elif op == "remove":
                    await idx.remove(model, replica, tail)
                elif op == "record":
                    await idx.record(model, replica, chain, ttl_s=600)
                else:
                    await idx.clear_replica(replica)
            for probe in chains:
                for m in models:
                    want = await memory.lookup(m, probe)
                    assert await redis_index.lookup(m, probe) == want, (step, op, probe)
    finally:
        await redis_index.close()


async def test_two_redis_clients_share_one_index(redis_server: RedisServer) -> None:
    a = RedisIndex.from_url(redis_server.url)
    b = RedisIndex.from_url(redis_server.url)
    try:
        await a.add(MODEL, "r1", [1, 2, 3])
        await b.record(MODEL, "r2", [1, 2], ttl_s=60)
        assert await a.lookup(MODEL, [1, 2, 3]) == {"r1": 3, "r2": 2}
        assert await b.lookup(MODEL, [1, 2, 3]) == {"r1": 3, "r2": 2}
        await b.clear_replica("r1")
        assert await a.lookup(MODEL, [1, 2, 3]) == {"r2": 2}
    finally:
        await a.close()
        await b.close()


async def test_redis_holds_no_keys_once_entries_are_gone(redis_server: RedisServer) -> None:
    index = RedisIndex.from_url(redis_server.url)
    try:
        await index.add(MODEL, "r1", [1, 2, 3])
        await index.add(f"{MODEL}@sql", "r1", [4, 5])
        await index.add(MODEL, "r2", [1])
        await index.remove(MODEL, "r2", [1])
        await index.clear_replica("r1")
        # Only r2's list of model scopes (one small set per replica) is left.
        assert await index.client.keys("*") == [b"cr:rm:r2"]
        await index.clear_replica("r2")
        assert await index.client.dbsize() == 0
        await index.record(MODEL, "r3", list(range(1, 100)), ttl_s=0.2)
        assert await index.client.dbsize() > 0

        async def all_expired() -> bool:
            return int(await index.client.dbsize()) == 0

        # Redis expires the keys by itself: nothing needs to write or sweep.
        await eventually(all_expired)
    finally:
        await index.close()


async def test_redis_writes_and_removes_chains_longer_than_one_scripted_call(
    redis_server: RedisServer,
) -> None:
    # The scripts add to and remove from the replica's reverse index in batched calls of
    # at most 2,000 arguments: a chain past that is split, and must come out whole and in
    # order (block 0 scored highest, tails lowest, which capacity trimming relies on).
    index = RedisIndex.from_url(redis_server.url)
    chain = list(range(1, 4501))  # 9,000 ZADD arguments
    try:
        await index.add(MODEL, "r1", chain)
        assert await index.lookup(MODEL, chain) == {"r1": 4500}
        reverse = [k for k in await index.client.keys("*")
                   if await index.client.type(k) == b"zset"]
        assert len(reverse) == 1
        ranked = await index.client.zrange(reverse[0], 0, -1)  # lowest score first
        assert ranked == [index.block_key(MODEL, k)[len(index.block_prefix(MODEL)):]
                          for k in reversed(chain)]
        await index.remove(MODEL, "r1", chain[1000:])  # 3,500 members to ZREM
        assert await index.lookup(MODEL, chain) == {"r1": 1000}
        assert await index.client.zcard(reverse[0]) == 1000
        await index.remove(MODEL, "r1", chain[:1000])
        assert await index.client.keys("*") == [b"cr:rm:r1"]
    finally:
        await index.close()


async def test_a_block_key_outlives_no_entry_once_its_permanent_holder_leaves(
    redis_server: RedisServer,
) -> None:
    index = RedisIndex.from_url(redis_server.url)
    try:
        await index.add(MODEL, "events", [1])  # no expiry: the key persists
        await index.record(MODEL, "recorded", [1], ttl_s=60)
        key = index.block_key(MODEL, 1)
        assert await index.client.pttl(key) == -1
        await index.remove(MODEL, "events", [1])
        assert 0 < await index.client.pttl(key) <= 60_000
        await index.add(MODEL, "events", [1])
        await index.clear_replica("events")
        assert 0 < await index.client.pttl(key) <= 60_000
        assert await index.lookup(MODEL, [1]) == {"recorded": 1}
    finally:
        await index.close()


async def test_redis_down_raises_index_unavailable_within_the_deadline(
    redis_server: RedisServer,
) -> None:
    index = RedisIndex.from_url(redis_server.url)
    try:
        await index.add(MODEL, "r1", [1, 2])
        assert await index.lookup(MODEL, [1, 2]) == {"r1": 2}
        redis_server.stop()
        started = time.monotonic()
        with pytest.raises(IndexUnavailable):
            await index.lookup(MODEL, [1, 2], deadline_s=0.5)
        assert time.monotonic() - started < 1.0
        with pytest.raises(IndexUnavailable):
            await index.add(MODEL, "r1", [3])
        with pytest.raises(IndexUnavailable):
            await index.clear_replica("r1")

        redis_server.start()  # same port, empty: scripts must be loaded again

        async def reconnected() -> bool:
            try:
                await index.add(MODEL, "r1", [1, 2])
                return await index.lookup(MODEL, [1, 2]) == {"r1": 2}
            except IndexUnavailable:
                return False

        await eventually(reconnected)
    finally:
        await index.close()


async def test_hung_redis_lookup_hits_the_callers_deadline(redis_server: RedisServer) -> None:
    index = RedisIndex.from_url(redis_server.url, socket_timeout_s=5)
    assert redis_server.proc is not None
    try:
        await index.add(MODEL, "r1", [1])
        # A stopped process keeps its socket open but never answers: a real hung Redis.
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(IndexUnavailable, match="deadline"):
                await index.lookup(MODEL, [1], deadline_s=0.1)
            assert time.monotonic() - started < 0.5
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        assert await index.lookup(MODEL, [1]) == {"r1": 1}
    finally:
        await index.close()


async def test_apply_writes_a_batch_as_the_separate_calls_would(index: PrefixIndex) -> None:
    await index.add(MODEL, "r2", [1, 2])
    await index.apply("r1", [
        IndexOp("add", MODEL, (1, 2, 3, 4)),
        IndexOp("add", f"{MODEL}@sql", (1, 2)),
        IndexOp("remove", MODEL, (4,)),
        IndexOp("remove", f"{MODEL}@sql", (2,)),
        IndexOp("add", MODEL, (5,)),
    ])
    assert await index.lookup(MODEL, [1, 2, 3, 4]) == {"r1": 3, "r2": 2}
    assert await index.lookup(f"{MODEL}@sql", [1, 2]) == {"r1": 1}
    assert await index.lookup(MODEL, [5]) == {"r1": 1}
    # A clear inside a batch drops what came before it, for this replica only.
    await index.apply("r1", [IndexOp("add", MODEL, (9,)), IndexOp("clear"),
                             IndexOp("add", MODEL, (1,))])
    assert await index.lookup(MODEL, [1, 2, 3]) == {"r1": 1, "r2": 2}
    assert await index.lookup(MODEL, [9]) == {}
    assert await index.lookup(f"{MODEL}@sql", [1]) == {}
    await index.apply("r1", [])  # an empty batch (a step with only ignored events)
    assert await index.lookup(MODEL, [1]) == {"r1": 1, "r2": 1}


async def test_redis_apply_survives_a_flushed_script_cache(redis_server: RedisServer) -> None:
    index = RedisIndex.from_url(redis_server.url)
    try:
        await index.apply("r1", [IndexOp("add", MODEL, (1, 2))])
        await index.client.script_flush()  # as after a Redis restart
        await index.apply("r1", [IndexOp("add", MODEL, (3,)), IndexOp("remove", MODEL, (2,))])
        assert await index.lookup(MODEL, [1, 2, 3]) == {"r1": 1}
        assert await index.lookup(MODEL, [3]) == {"r1": 1}
    finally:
        await index.close()


async def test_probe_observations_are_kept_by_salt_until_their_ttl(index: PrefixIndex) -> None:
    await index.put_probe("cacheroute-probe-a", "r1", 4, [11, 12], list(range(9)), ttl_s=0.5,
                          rekeyed=True)
    await index.put_probe("cacheroute-probe-b", "r2", 4, [21], [1, 2, 3, 4], ttl_s=60)
    assert await index.get_probe("cacheroute-probe-a") == ObservedBlocks(
        4, (11, 12), tuple(range(9)), replica="r1", rekeyed=True)
    assert await index.get_probe("cacheroute-probe-b") == ObservedBlocks(
        4, (21,), (1, 2, 3, 4), replica="r2", rekeyed=False)
    assert await index.get_probe("cacheroute-probe-c") is None
    # Probes are not block entries: no lookup sees them.
    assert await index.lookup(MODEL, [11, 12]) == {}

    async def expired() -> bool:
        return await index.get_probe("cacheroute-probe-a") is None

    await eventually(expired)
    assert await index.get_probe("cacheroute-probe-b") is not None


async def test_warm_opens_the_connections_concurrent_lookups_use_and_loads_the_scripts(
    redis_server: RedisServer,
) -> None:
    """issue #16: cold connections made the first concurrent lookups miss their deadline."""
    index = RedisIndex.from_url(redis_server.url)
    observer = RedisIndex.from_url(redis_server.url).client
    try:
        await observer.script_flush()  # as a fresh or restarted Redis has it
        await index.warm(4)
        assert await observer.script_exists(*index.script_shas) == [True] * 5
        clients = await observer.client_list()
        assert len(clients) >= 4 + 1  # the index's pool and this observer
        received = (await observer.info("stats"))["total_connections_received"]
        loads = (await observer.info("commandstats"))["cmdstat_script|load"]["calls"]
        await index.add(MODEL, "r1", [1, 2, 3])
        answers = await asyncio.gather(*(index.lookup(MODEL, [1, 2, 3]) for _ in range(4)))
        assert answers == [{"r1": 3}] * 4
        # Neither a connect nor a script load happened on the request path.
        assert (await observer.info("stats"))["total_connections_received"] == received
        assert (await observer.info("commandstats"))["cmdstat_script|load"]["calls"] == loads
    finally:
        await index.close()
        await observer.aclose()


async def test_warm_says_when_redis_is_not_there() -> None:
    index = RedisIndex.from_url(f"redis://127.0.0.1:{free_port()}/0", connect_timeout_s=0.1,
                                op_timeout_s=1.0)
    try:
        with pytest.raises(IndexUnavailable, match="warm"):
            await index.warm(2)
    finally:
        await index.close()


async def test_warm_leaves_the_answers_unchanged(index: PrefixIndex) -> None:
    await index.add(MODEL, "r1", [1, 2])
    await index.warm(2)
    assert await index.lookup(MODEL, [1, 2]) == {"r1": 2}


async def test_memory_index_applies_a_long_batch_in_slices_as_one_put_would() -> None:
    # A long event (300 blocks where a slice is 64) is applied APPLY_SLICE blocks at a
    # time with the loop let go between slices (the answer the batch came with goes out
    # meanwhile). The result is the one unsliced write's, down to which blocks a capacity
    # bound evicts first.
    size = 3 * APPLY_SLICE + 108
    cap = size - 50
    chain = tuple(range(1000, 1000 + size))
    sliced, whole = MemoryIndex(capacity_blocks=cap), MemoryIndex(capacity_blocks=cap)
    ran_between: list[int] = []

    async def neighbour() -> None:
        while len(ran_between) < 100:
            ran_between.append(len(sliced._lru.get((MODEL, "r1"), ())))
            await asyncio.sleep(0)

    other = asyncio.ensure_future(neighbour())
    await asyncio.sleep(0)
    await sliced.apply("r1", [IndexOp("add", MODEL, chain),
                              IndexOp("remove", MODEL, chain[size - 100:])])
    other.cancel()
    whole._put(MODEL, "r1", chain, None, cap)
    await whole.remove(MODEL, "r1", chain[size - 100:])
    assert list(sliced._lru[(MODEL, "r1")]) == list(whole._lru[(MODEL, "r1")])
    assert await sliced.lookup(MODEL, list(chain)) == await whole.lookup(MODEL, list(chain))
    # The neighbour ran while the batch was half written.
    assert any(0 < n < cap for n in ran_between)


def test_the_write_benchmark_runs_against_a_baseline_and_names_a_bad_value() -> None:
    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_index_writes.py"
    repo = bench.parents[1]
    done = subprocess.run([sys.executable, str(bench), "--blocks", "8", "--held", "16",
                           "--batches", "2", "--rounds", "2", "--baseline-repo", str(repo)],
                          capture_output=True, text=True, timeout=120, check=True)
    assert "2 batches of 8 blocks stored then as many removed" in done.stdout
    assert "this checkout / baseline, both, per round: median x" in done.stdout
    bad = subprocess.run([sys.executable, str(bench), "--held", "4", "--blocks", "8"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--held must be at least --blocks (8), got 4" in bad.stderr
