"""What the shared index costs Redis, per block and per lookup: the inputs of docs/SCALING.md.

    .venv/bin/python benchmarks/bench_index_scale.py [--replicas 8] [--chains 1500] [--length 64]

Starts its own redis-server on a free loopback port (and stops it). Fills the index the
way the indexer does (RedisIndex.apply with each add's parent): `replicas` replicas,
each holding `chains` chains of `length` blocks, every other chain shared by two
neighbouring replicas. Then measures, from Redis's own accounting (INFO memory and INFO
commandstats, which count the commands a script runs, with their CPU time):

  memory      bytes per block entry (one replica holding one block) and per million
  writes      Redis commands and server CPU (us) per KV-event batch (--stored, --removed)
  lookups     Redis commands and server CPU (us) per lookup, chains of 64 and 512 blocks
  shared work server CPU (us) per read of other gateways' outstanding work (one HGETALL
              of gateways x replicas fields, router/shared_work.py) and per write

Server CPU is what bounds one Redis (one core): ops/s = 1e6 / (us per op). Client-side
latency on this shared machine is not reported here (benchmarks/bench_index.py has it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable

from replica.processes import redis_server
from router.index import IndexOp, RedisIndex
from router.outstanding import WorkView
from router.shared_work import SharedWork

MODEL = "m"


async def commandstats(index: RedisIndex) -> dict[str, tuple[int, float]]:
    """Command -> (calls, total usec) since the last CONFIG RESETSTAT."""
    raw = await index.client.info("commandstats")
    return {name.removeprefix("cmdstat_"): (int(v["calls"]), float(v["usec"]))
            for name, v in raw.items()}


async def cpu_s(index: RedisIndex) -> float:
    """The redis-server process's CPU seconds so far (user + system, all its work)."""
    info = await index.client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def measured(index: RedisIndex, n: int, work: Callable[[int], Awaitable[object]]
                   ) -> tuple[dict[str, float], float, float]:
    """Run work(0..n-1); (calls per run by command, Redis CPU us per run, wall s).

    The CPU is the whole server process's (parsing, networking, scripts), so it is what
    one Redis core can sustain; command counts include the commands scripts run.
    """
    await index.client.config_resetstat()
    cpu0 = await cpu_s(index)
    t0 = time.perf_counter()
    for i in range(n):
        await work(i)
    wall = time.perf_counter() - t0
    cpu = await cpu_s(index) - cpu0
    stats = await commandstats(index)
    for name in ("config|resetstat", "info"):
        stats.pop(name, None)
    return {name: calls / n for name, (calls, _) in sorted(stats.items())}, cpu * 1e6 / n, wall


def chain(replica: int, c: int, length: int) -> list[int]:
    # Every other chain is shared with the next replica: its keys depend on (replica//2, c).
    owner = replica if c % 2 else replica // 2 * 2 + 10_000
    base = (owner * 1_000_003 + c) * 4096
    return list(range(base, base + length))


async def run(url: str, replicas: int, chains: int, length: int, stored: int, removed: int
              ) -> None:
    index = RedisIndex.from_url(url, op_timeout_s=60, socket_timeout_s=60)
    try:
        await index.client.flushall()
        before = int((await index.client.info("memory"))["used_memory"])
        entries = 0
        distinct: set[int] = set()
        for r in range(replicas):
            for c in range(0, chains, 8):
                ops = []
                for k in range(c, min(c + 8, chains)):
                    keys = chain(r, k, length)
                    ops.append(IndexOp("add", MODEL, tuple(keys), parent=None))
                    entries += length
                    distinct.add(keys[0])
                await index.apply(f"replica-{r}", ops)
        after = int((await index.client.info("memory"))["used_memory"])
        blocks = len(distinct) * length
        per_entry = (after - before) / entries
        print(f"index: {replicas} replicas x {chains} chains x {length} blocks = {entries:,} "
              f"entries over {blocks:,} distinct blocks; {await index.client.dbsize():,} keys")
        print(f"memory: {per_entry:.0f} bytes per entry, {per_entry * 1e6 / 2**20:.0f} MiB per "
              f"million entries ({(after - before) / blocks:.0f} bytes per distinct block)")

        def batch(i: int) -> Awaitable[None]:
            r = i % replicas
            base = 9_000_000_000 + 64 * i
            # As the planner merges them: one add of the new run, one remove of the evicted.
            old = chain(r, 3 + 2 * (i // replicas) % (chains - 4), length)
            return index.apply(f"replica-{r}", [
                IndexOp("add", MODEL, tuple(range(base, base + stored)),
                        parent=chain(r, 1, length)[-1]),
                IndexOp("remove", MODEL, tuple(old[-removed:]))])

        await lookups(index, replicas, length, "before any remove")
        calls, us, wall = await measured(index, 2000, batch)
        print(f"writes: per KV-event batch ({stored} stored + {removed} removed): {us:.1f} us "
              f"Redis CPU ({1e6 / us:,.0f} batches/s, {stored * 1e6 / us:,.0f} stored blocks/s "
              f"per Redis core); "
              f"commands {sum(calls.values()):.1f}: "
              + ", ".join(f"{k} {v:.2f}" for k, v in calls.items() if v >= 0.01)
              + f"; client wall {wall / 2000 * 1e3:.2f} ms")
        await lookups(index, replicas, length, "after removes (hole flags up)")
    finally:
        await index.close()


async def lookups(index: RedisIndex, replicas: int, length: int, when: str) -> None:
    for probe_len in (64, 512):
        def look(i: int, n: int = probe_len) -> Awaitable[dict[str, int]]:
            keys = chain(i % replicas, 0, length)
            tail = list(range(8_000_000_000 + i * 1024, 8_000_000_000 + i * 1024 + n))
            return index.lookup(MODEL, (keys + tail)[:n], deadline_s=10)

        calls, us, wall = await measured(index, 2000, look)
        print(f"lookups {when}: chain of {probe_len} blocks (first {min(probe_len, length)} "
              f"held by 2 replicas): {us:.1f} us Redis CPU ({1e6 / us:,.0f} lookups/s per Redis "
              f"core); commands {sum(calls.values()):.1f}: "
              + ", ".join(f"{k} {v:.2f}" for k, v in calls.items() if v >= 0.01)
              + f"; client wall {wall / 2000 * 1e3:.2f} ms")


async def shared_work(url: str, fleets: list[tuple[int, int]]) -> None:
    """Redis CPU per read and per write of the shared outstanding work, for each
    (gateways, replicas): every gateway has a field per replica."""
    index = RedisIndex.from_url(url, op_timeout_s=60, socket_timeout_s=60)
    try:
        for gateways, replicas in fleets:
            await index.client.flushall()
            others = [SharedWork(index.client, gateway_id=f"g{g}") for g in range(gateways)]
            for gw in others:
                for r in range(replicas):
                    gw.publish(f"replica-{r}", WorkView(wait_s=0.2, pending=2, decoding=3))
                await gw.flushed()
            reader = others[0]

            def read(i: int, reader: SharedWork = reader) -> Awaitable[object]:
                return reader.read(10.0)

            async def write(i: int, reader: SharedWork = reader, replicas: int = replicas) -> None:
                reader.publish(f"replica-{i % replicas}", WorkView(wait_s=0.1, pending=1))
                await reader.flushed()

            _, read_us, read_wall = await measured(index, 2000, read)

            _, write_us, _ = await measured(index, 2000, write)
            print(f"shared work, {gateways} gateways x {replicas} replicas: read {read_us:.1f} us "
                  f"Redis CPU ({1e6 / read_us:,.0f} reads/s per Redis core), client wall "
                  f"{read_wall / 2000 * 1e3:.2f} ms; write (one field) {write_us:.1f} us")
    finally:
        await index.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--chains", type=int, default=1500)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--stored", type=int, default=4, help="blocks stored per batch")
    parser.add_argument("--removed", type=int, default=1, help="blocks removed per batch")
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, loopback Redis")
    with redis_server() as server:
        asyncio.run(run(server.url, args.replicas, args.chains, args.length, args.stored,
                        args.removed))
        asyncio.run(shared_work(server.url, [(4, 4), (4, 32), (8, 128), (10, 1000)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
