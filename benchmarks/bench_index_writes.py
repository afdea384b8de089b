"""Redis's CPU per block the indexer writes: a cold prompt's blocks stored, and as many
evicted, through RedisIndex.apply (the write and remove scripts), side by side with a
baseline checkout.

    .venv/bin/python benchmarks/bench_index_writes.py [--blocks 512] [--batches 40]
        [--held 8192] [--rounds 5] [--baseline-repo DIR]

Every block a replica stores comes back as a KV event that the indexer writes to Redis,
and every block it evicts as one it removes there: on a fleet whose caches are full,
both for every new block. Redis runs each script on its one thread, which every gateway's
lookups and the shared work also need, so its CPU per block bounds how many replicas'
events one Redis can index (docs/SCALING.md). The figure is the server's own CPU (INFO
cpu, user + system), so the client's Python does not count. Each round runs each checkout
in a child process (alternating which goes first) on a private redis-server emptied
before each run, with a replica already holding --held blocks: --batches batches of
--blocks new blocks stored, each followed by the oldest --blocks removed (events as the
indexer applies them: no TTL, no capacity). Prints per round the microseconds per block
stored and per block removed, then the medians, spread and ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def child(repo: Path, url: str, blocks: int, batches: int, held: int) -> tuple[float, float]:
    """Redis CPU seconds per block stored and per block removed, with `repo`'s scripts."""
    sys.path.insert(0, str(repo))
    from redis.asyncio import Redis

    from router.index.protocol import IndexOp
    from router.index.redis import RedisIndex

    async def server_cpu(client: Redis) -> float:
        info = await client.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    async def run() -> tuple[float, float]:
        client = Redis.from_url(url)
        try:
            await client.flushall()
            index = RedisIndex(client)
            rng = random.Random(11)
            oldest = [rng.getrandbits(63) for _ in range(held)]
            await index.apply("r0", [IndexOp("add", "m", tuple(oldest))])
            stored = removed = 0.0
            for _ in range(batches):
                keys = tuple(rng.getrandbits(63) for _ in range(blocks))
                before = await server_cpu(client)
                await index.apply("r0", [IndexOp("add", "m", keys)])
                middle = await server_cpu(client)
                await index.apply("r0", [IndexOp("remove", "m", tuple(oldest[:blocks]))])
                after = await server_cpu(client)
                stored += middle - before
                removed += after - middle
                oldest = oldest[blocks:] + list(keys)
            return stored / (batches * blocks), removed / (batches * blocks)
        finally:
            await client.aclose()

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--held", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline-repo", type=Path, metavar="DIR")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("blocks", "batches", "held", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.held < args.blocks:
        parser.error(f"--held must be at least --blocks ({args.blocks}), got {args.held}")
    if args.child is not None:
        print(json.dumps(child(args.child, args.url, args.blocks, args.batches, args.held)))
        return 0
    repos = {"this checkout": REPO}
    if args.baseline_repo is not None:
        if not (args.baseline_repo / "router" / "index" / "write.lua").is_file():
            parser.error(f"--baseline-repo {args.baseline_repo}: not a cacheroute checkout")
        repos["baseline"] = args.baseline_repo.resolve()
    sys.path.insert(0, str(REPO))
    from replica.processes import redis_server

    print(f"Redis CPU (server, user + system) per block: {args.batches} batches of "
          f"{args.blocks} blocks stored then as many removed, a replica holding "
          f"{args.held}; {args.rounds} rounds, checkouts alternating (us a block)")
    seen: dict[str, list[tuple[float, float]]] = {name: [] for name in repos}
    with redis_server() as server:
        for round_ in range(args.rounds):
            order = list(repos.items())
            if round_ % 2:
                order.reverse()
            for name, repo in order:
                out = subprocess.run(
                    [sys.executable, __file__, "--child", str(repo), "--url", server.url,
                     "--blocks", str(args.blocks), "--batches", str(args.batches),
                     "--held", str(args.held)], check=True, capture_output=True, text=True)
                stored, removed = json.loads(out.stdout)
                seen[name].append((stored * 1e6, removed * 1e6))
            print(f"round {round_ + 1}: " + ", ".join(
                f"{n} stored {v[-1][0]:.2f}, removed {v[-1][1]:.2f}" for n, v in seen.items()))
    for name, values in seen.items():
        for i, what in enumerate(("stored", "removed")):
            column = [v[i] for v in values]
            print(f"{name:<14} {what:<8} median {statistics.median(column):.2f} us a block "
                  f"[{min(column):.2f}..{max(column):.2f}]")
    if "baseline" in seen:
        for i, what in enumerate(("stored", "removed", "both")):
            ratios = [(a[i] if i < 2 else a[0] + a[1]) / (b[i] if i < 2 else b[0] + b[1])
                      for a, b in zip(seen["this checkout"], seen["baseline"], strict=True)]
            print(f"this checkout / baseline, {what}, per round: median "
                  f"x{statistics.median(ratios):.2f} [x{min(ratios):.2f}..x{max(ratios):.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
