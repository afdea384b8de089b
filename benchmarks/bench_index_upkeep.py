"""The in-memory index's per-block upkeep: its loops in C (router/index/_upkeep.c) against
the same loops in Python, side by side.

What a cold prompt costs the gateway's index once its replica's KV events arrive: one
batch storing its blocks and, the replica's cache being full, one evicting as many of
the oldest, applied to an index already holding `--held` blocks per replica (the dicts'
size decides how often an operation misses the CPU's caches, which dominates here). The
two paths take turns batch by batch, each on its own index fed the same batches; the
figures are medians over `--rounds` rounds with their spread.

    python benchmarks/bench_index_upkeep.py [--blocks 512] [--held 20000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router.index import MemoryIndex
from router.index import memory as memory_module
from router.index.protocol import IndexOp

MODEL = "bench"
REPLICAS = ("r0", "r1")


async def run(blocks: int, held: int, rounds: int, per_round: int) -> dict[str, list[float]]:
    native = memory_module._upkeep
    if native is None:
        raise SystemExit("router/index/_upkeep.c is not built here: nothing to compare")
    rng = random.Random(7)
    indexes = {"C": MemoryIndex(), "Python": MemoryIndex()}
    upkeep = {"C": native, "Python": None}
    # Per replica, its chains oldest first: evicted leaf first, as vLLM does.
    chains: dict[str, deque[tuple[int, ...]]] = {r: deque() for r in REPLICAS}

    def new_chain() -> tuple[int, ...]:
        return tuple(rng.getrandbits(64) for _ in range(blocks))

    async def feed(replica: str, ops: list[IndexOp]) -> dict[str, float]:
        took = {}
        for name in (("C", "Python") if rng.random() < 0.5 else ("Python", "C")):
            memory_module._upkeep = upkeep[name]
            started = time.perf_counter()
            await indexes[name].apply(replica, ops)
            took[name] = time.perf_counter() - started
        memory_module._upkeep = native
        return took

    for replica in REPLICAS:  # fill each replica's share of the index first
        while len(chains[replica]) * blocks < held:
            chain = new_chain()
            chains[replica].append(chain)
            await feed(replica, [IndexOp("add", MODEL, chain)])
    out: dict[str, list[float]] = {"C": [], "Python": []}
    for _ in range(rounds):
        samples: dict[str, list[float]] = {"C": [], "Python": []}
        for i in range(per_round):
            replica = REPLICAS[i % len(REPLICAS)]
            chain = new_chain()
            oldest = chains[replica].popleft()
            chains[replica].append(chain)
            took = await feed(replica, [IndexOp("add", MODEL, chain),
                                        IndexOp("remove", MODEL, oldest[::-1])])
            for name, seconds in took.items():
                samples[name].append(seconds)
        for name, values in samples.items():
            out[name].append(statistics.median(values))
    assert indexes["C"]._lru.keys() == indexes["Python"]._lru.keys()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=512,
                        help="blocks per prompt (512: 8k tokens at block size 16)")
    parser.add_argument("--held", type=int, default=20_000,
                        help="blocks each of the 2 replicas holds in the index")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--per-round", type=int, default=40)
    args = parser.parse_args(argv)
    for flag in ("blocks", "held", "rounds", "per_round"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    out = asyncio.run(run(args.blocks, args.held, args.rounds, args.per_round))
    print(f"one cold prompt's KV events applied to the in-memory index: {args.blocks} blocks "
          f"stored + {args.blocks} evicted, {args.held:,} held per replica, 2 replicas; "
          f"median of per-round medians over {args.rounds} rounds x {args.per_round} "
          f"(the paths alternate batch by batch)")
    med = {name: statistics.median(v) * 1e3 for name, v in out.items()}
    for name, values in out.items():
        print(f"  {name:<7} {med[name]:7.3f} ms  [{min(values) * 1e3:.3f}..{max(values) * 1e3:.3f}]")
    ratios = [c / p for c, p in zip(out["C"], out["Python"], strict=True)]
    print(f"  C / Python: {statistics.median(ratios):.2f}x  "
          f"[{min(ratios):.2f}..{max(ratios):.2f}] (per round)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
