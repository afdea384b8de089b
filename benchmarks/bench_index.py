"""Prefix-index lookup latency and Redis memory per entry, measured side by side.

    .venv/bin/python benchmarks/bench_index.py [--redis redis://127.0.0.1:PORT/0] [--repeat N]

Without --redis it starts its own redis-server on a free loopback port (and stops it).
For each chain length it times one lookup of a chain that replica r0 holds in full
(the worst case: the walk cannot stop early) while r1..r3 hold shorter prefixes, with:

  (a) pipeline     one HGETALL per block in a single redis-py pipeline, walked in Python
  (b) lua walk     RedisIndex(lookup_strategy="walk"): one EVALSHA walking the chain
                   inside Redis, one HMGET per block
  (c) lua bisect   RedisIndex.lookup (the default): one EVALSHA bisecting each holder's
                   run, O(log n) HGETs
  (c2) verified    the same after a remove raised every holder's hole flag: the bisected
                   runs are then verified, one ZMSCORE per 1,024 blocks
  (d) mem walk     MemoryIndex(lookup_strategy="walk").lookup
  (e) mem bisect   MemoryIndex.lookup (the default)
  (e2) evicted     the same after every holder evicted another chain's tail leaf first,
                   as vLLM does: no hole, so nothing to verify
  (e3) holed       the same after an eviction left a hole elsewhere: each bisected run
                   is verified block by block (what (e2) cost before the memory index
                   counted its holes, when any eviction raised the flag)

and the latency of RedisIndex.record for the same chain (in another model scope: a
replica holding entries that expire is walked, see router/index/). Before those, what
`RedisIndex.warm` saves (issue #16): a fresh index's first 16 concurrent lookups, cold
and after warm(). Then Redis memory per block entry: INFO memory before and after indexing N blocks for one replica, and for more
replicas holding the same blocks. Last, how many KV-event batches per second one
ReplicaEventStream applies to each backend (real ZMQ on loopback): memory, Redis with a
batch in one pipelined round trip (RedisIndex.apply), and Redis with one call per
operation (how batches were applied before apply existed).

Variants are timed interleaved, so a shared machine's load falls on each alike; absolute
numbers still move with that load, the ratios much less.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import zmq
import zmq.asyncio

from replica.processes import RedisServer
from router.events import ReplicaEventStream
from router.index import IndexOp, MemoryIndex, PrefixIndex, RedisIndex, StreamPosition
from router.kv_events import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    encode_batch,
    encoded_ids,
    seq_bytes,
)

MODEL = "bench"
CHAIN_LENGTHS = (64, 512, 2048, 8192)


@contextmanager
def own_redis() -> Iterator[str]:
    """A private redis-server on a free loopback port, stopped on exit."""
    server = RedisServer()
    try:
        server.start()
    except FileNotFoundError as exc:  # redis-server is not installed
        raise SystemExit(str(exc)) from None
    try:
        yield server.url
    finally:
        server.stop()


async def pipeline_lookup(index: RedisIndex, model: str, keys: Sequence[int]) -> dict[str, int]:
    """Variant (a): one HGETALL per block in one pipeline, then the walk in Python."""
    pipe = index.client.pipeline(transaction=False)
    for key in keys:
        pipe.hgetall(index.block_key(model, key))
    holders = await pipe.execute()
    now_ms = time.time() * 1000
    counts: dict[str, int] = {}
    alive: set[bytes] | None = None
    for i, held in enumerate(holders, start=1):
        nxt = {r for r, exp in held.items()
               if (alive is None or r in alive) and (exp == b"0" or int(exp) > now_ms)}
        if not nxt:
            break
        for r in nxt:
            counts[r.decode()] = i
        alive = nxt
    return counts


async def timed(fns: Sequence[Callable[[], Awaitable[object]]], repeat: int
                ) -> list[tuple[float, float]]:
    """Median and p99 in ms of each function, interleaved so that load on a shared
    machine falls on every variant alike (after two warm-up rounds)."""
    samples: list[list[float]] = [[] for _ in fns]
    for round_ in range(repeat + 2):
        for fn, out in zip(fns, samples, strict=True):
            t0 = time.perf_counter()
            await fn()
            if round_ >= 2:
                out.append((time.perf_counter() - t0) * 1000)
    result = []
    for out in samples:
        out.sort()
        result.append((statistics.median(out), out[min(len(out) - 1, int(len(out) * 0.99))]))
    return result


async def bench_lookups(url: str, repeat: int) -> None:
    redis_index = RedisIndex.from_url(url, lookup_timeout_s=10, op_timeout_s=30,
                                      socket_timeout_s=30)
    redis_walk = RedisIndex.from_url(url, lookup_timeout_s=10, op_timeout_s=30,
                                     socket_timeout_s=30, lookup_strategy="walk")
    memory = MemoryIndex()
    memory_walk = MemoryIndex(lookup_strategy="walk")
    try:
        print(f"lookup latency, ms (median / p99 of {repeat}); r0 holds the whole chain")
        header = f"{'blocks':>7} | {'(a) pipeline':>15} | {'(b) lua walk':>15} | " \
                 f"{'(c) lua bisect':>15} | {'(c2) verified':>15} | " \
                 f"{'(d) mem walk':>15} | {'(e) mem bisect':>15} | " \
                 f"{'(e2) evicted':>15} | {'(e3) holed':>15} | {'record (lua)':>15}"
        print(header)
        print("-" * len(header))
        for n in CHAIN_LENGTHS:
            base = n * 1_000_003  # disjoint key ranges per chain length
            chain = list(range(base, base + n))
            evicted, holed_memory = MemoryIndex(), MemoryIndex()
            for idx in (redis_index, memory, memory_walk, evicted, holed_memory):
                await idx.add(MODEL, "r0", chain)
                await idx.add(MODEL, "r1", chain[: n // 2])
                await idx.add(MODEL, "r2", chain[: n // 4])
                await idx.add(MODEL, "r3", chain[: n // 8])
            for r in ("r0", "r1", "r2", "r3"):
                # Another conversation after the first block: stored, then evicted.
                side = [chain[0], *range(-base - 1, -base - 9, -1)]
                for idx in (evicted, holed_memory):
                    await idx.add(MODEL, r, side)
                await evicted.remove(MODEL, r, side[:0:-1])  # leaf first
                await holed_memory.remove(MODEL, r, side[2:3])  # mid-chain: a hole
            holed = f"{MODEL}-holed"
            for r, size in (("r0", n), ("r1", n // 2), ("r2", n // 4), ("r3", n // 8)):
                await redis_index.add(holed, r, chain[:size])
                await redis_index.remove(holed, r, [0])  # not in the chain: only the flag
            expect = {"r0": n, "r1": n // 2, "r2": n // 4, "r3": n // 8}
            assert await redis_index.lookup(holed, chain) == expect
            assert await pipeline_lookup(redis_index, MODEL, chain) == expect
            assert await redis_walk.lookup(MODEL, chain) == expect
            assert await redis_index.lookup(MODEL, chain) == expect
            assert await memory_walk.lookup(MODEL, chain) == expect
            assert await memory.lookup(MODEL, chain) == expect
            assert await evicted.lookup(MODEL, chain) == expect
            assert await holed_memory.lookup(MODEL, chain) == expect
            assert evicted.holes(MODEL, "r0") == 0 and holed_memory.holes(MODEL, "r0") == 1
            results = await timed([
                partial(pipeline_lookup, redis_index, MODEL, chain),
                partial(redis_walk.lookup, MODEL, chain),
                partial(redis_index.lookup, MODEL, chain),
                partial(redis_index.lookup, holed, chain),
                partial(memory_walk.lookup, MODEL, chain),
                partial(memory.lookup, MODEL, chain),
                partial(evicted.lookup, MODEL, chain),
                partial(holed_memory.lookup, MODEL, chain),
                partial(redis_index.record, f"{MODEL}-record", "rw", chain, 600),
            ], repeat)
            cells = [f"{m:7.3f} / {p:6.3f}" for m, p in results]
            print(f"{n:>7} | " + " | ".join(cells))
    finally:
        await redis_index.close()
        await redis_walk.close()


async def used_memory(index: RedisIndex) -> int:
    info = await index.client.info("memory")
    return int(info["used_memory"])


async def bench_memory(url: str, blocks: int) -> None:
    index = RedisIndex.from_url(url, op_timeout_s=60, socket_timeout_s=60)
    try:
        await index.client.flushall()
        chunk = 4096
        keys = list(range(7_000_000_000, 7_000_000_000 + blocks))
        before = await used_memory(index)
        for i in range(0, blocks, chunk):
            await index.add(MODEL, "replica-0", keys[i:i + chunk])
        one = await used_memory(index)
        for i in range(0, blocks, chunk):
            await index.add(MODEL, "replica-1", keys[i:i + chunk])
        two = await used_memory(index)
        for i in range(0, blocks, chunk):
            await index.record(MODEL, "replica-2", keys[i:i + chunk], ttl_s=3600)
        three = await used_memory(index)
        print(f"\nRedis memory, {blocks:,} blocks (INFO used_memory):")
        print(f"  first holder (new block key + reverse index):     "
              f"{(one - before) / blocks:7.1f} bytes/block")
        print(f"  second holder (extra hash field + reverse index): "
              f"{(two - one) / blocks:7.1f} bytes/block")
        print(f"  third holder, record() with a TTL:                "
              f"{(three - two) / blocks:7.1f} bytes/block")
        print(f"  total for {blocks:,} blocks x 3 holders: {(three - before) / 2**20:.1f} MiB")
        await index.clear_replica("replica-0")
        await index.clear_replica("replica-1")
        await index.clear_replica("replica-2")
        left = await index.client.dbsize()
        print(f"  keys left after clear_replica of all three: {left}")
    finally:
        await index.close()


async def apply_rate(index: PrefixIndex, batches: int) -> float:
    """Batches per second one ReplicaEventStream applies (each: 4 blocks stored, 1 removed)."""
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # the benchmark must not drop: no replay socket here
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    stream = ReplicaEventStream("r0", f"tcp://127.0.0.1:{port}", None, index, MODEL,
                                context=ctx)
    stream.start()
    try:
        async with asyncio.timeout(30):
            await pub.recv()  # the subscription arrived
        payloads = []
        for i in range(batches):
            base = 10_000_000 + 4 * i
            payloads.append(encode_batch(EventBatch(ts=time.time(), events=[
                BlockStored(block_hashes=list(range(base, base + 4)), parent_block_hash=None,
                            token_ids=encoded_ids([0] * 64), block_size=16, lora_id=None, medium="GPU",
                            lora_name=None),
                BlockRemoved(block_hashes=[base - 1], medium="GPU")])))
        t0 = time.perf_counter()
        for seq, payload in enumerate(payloads):
            await pub.send_multipart([b"", seq_bytes(seq), payload])
        async with asyncio.timeout(300):
            while True:
                if stream.stats.last_seq == batches - 1:
                    break
                await asyncio.sleep(0.005)  # polling for completion
        elapsed = time.perf_counter() - t0
        assert stream.stats.gaps == 0 and stream.stats.decode_errors == 0
        return batches / elapsed
    finally:
        await stream.stop()
        pub.close(linger=0)
        ctx.term()


class PerOpRedisIndex(RedisIndex):
    """RedisIndex applying a batch one call (one round trip) per operation: the baseline."""

    async def apply(self, replica: str, ops: Sequence[IndexOp], *,
                    position: StreamPosition | None = None) -> None:
        for op in ops:
            if op.kind == "add":
                await self.add(op.scope, replica, op.keys)
            elif op.kind == "remove":
                await self.remove(op.scope, replica, op.keys)
            else:
                await self.clear_replica(replica)


async def bench_events(url: str, batches: int) -> None:
    redis_index = RedisIndex.from_url(url, op_timeout_s=30, socket_timeout_s=30)
    per_op = PerOpRedisIndex.from_url(url, op_timeout_s=30, socket_timeout_s=30)
    rates: dict[str, list[float]] = {"memory": [], "batch": [], "per_op": []}
    try:
        # Interleaved rounds, so the shared machine's load falls on each variant alike.
        for _ in range(3):
            rates["memory"].append(await apply_rate(MemoryIndex(), batches))
            await redis_index.client.flushdb()
            rates["batch"].append(await apply_rate(redis_index, batches))
            await redis_index.client.flushdb()
            rates["per_op"].append(await apply_rate(per_op, batches))
    finally:
        await redis_index.close()
        await per_op.close()
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"\nKV-event apply rate, one stream, {batches:,} batches of 4 stored + 1 removed "
          "(median of 3 interleaved rounds):")
    print(f"  memory index:                     {med['memory']:8.0f} batches/s")
    print(f"  redis, batch in one round trip:   {med['batch']:8.0f} batches/s")
    print(f"  redis, one round trip per op:     {med['per_op']:8.0f} batches/s")


async def first_lookups(url: str, concurrency: int, *, warm: bool) -> tuple[list[float], int]:
    """Latencies (ms) of a fresh RedisIndex's first `concurrency` concurrent lookups, and
    how many connections they opened; the script cache flushed first, as after a restart."""
    chain = list(range(1, 301))
    seed = RedisIndex.from_url(url)
    index = RedisIndex.from_url(url)
    try:
        await seed.add(MODEL, "r0", chain)
        await seed.client.script_flush()
        if warm:
            await index.warm(concurrency)
        before = (await seed.client.info("stats"))["total_connections_received"]

        async def one() -> float:
            t0 = time.perf_counter()
            await index.lookup(MODEL, chain, deadline_s=10)
            return (time.perf_counter() - t0) * 1000

        latencies = sorted(await asyncio.gather(*(one() for _ in range(concurrency))))
        opened = (await seed.client.info("stats"))["total_connections_received"] - before
        return latencies, int(opened)
    finally:
        await seed.close()
        await index.close()


async def bench_first_lookups(url: str, concurrency: int = 16, rounds: int = 3) -> None:
    print(f"\nfirst {concurrency} concurrent lookups of a fresh gateway's RedisIndex "
          f"(300 blocks; median of {rounds} interleaved rounds):")
    results: dict[bool, list[tuple[list[float], int]]] = {False: [], True: []}
    for _ in range(rounds):
        for warm in (False, True):
            results[warm].append(await first_lookups(url, concurrency, warm=warm))
    for warm, runs in results.items():
        medians = statistics.median(statistics.median(lat) for lat, _ in runs)
        worst = statistics.median(lat[-1] for lat, _ in runs)
        over = statistics.median(sum(x > 10 for x in lat) for lat, _ in runs)
        opened = statistics.median(n for _, n in runs)
        print(f"  {'after warm()' if warm else 'cold':>12}: median {medians:6.2f} ms, "
              f"slowest {worst:6.2f} ms, over 10 ms: {over:.0f}, connections opened: {opened:.0f}")


async def main_async(args: argparse.Namespace, url: str) -> None:
    if not args.events_only:
        await bench_first_lookups(url)
        await bench_lookups(url, args.repeat)
        await bench_memory(url, args.memory_blocks)
    await bench_events(url, args.event_batches)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--redis", help="use this Redis (its data is flushed!) instead of "
                        "starting a private one")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--memory-blocks", type=int, default=200_000)
    parser.add_argument("--event-batches", type=int, default=5_000)
    parser.add_argument("--events-only", action="store_true",
                        help="only the KV-event apply rate")
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, loopback Redis\n")
    if args.redis:
        asyncio.run(main_async(args, args.redis))
    else:
        with own_redis() as url:
            asyncio.run(main_async(args, url))
    return 0


if __name__ == "__main__":
    sys.exit(main())
