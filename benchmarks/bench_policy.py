"""What one routing decision costs the gateway as the fleet grows.

    .venv/bin/python benchmarks/bench_policy.py [--replicas 2,8,32,128] [--requests 400]
        [--holders 1] [--baseline-repo DIR]

The whole of RoutingPipeline.route for a 4k-token token-id prompt (a conversation's next
turn: its earlier 3.75k tokens held by one replica, or by --holders of them, 256 new), in
this process against a memory index: keying, the lookup, the pending chains, every
replica's outstanding work (each has some in flight, half of it past its first token,
and a learned TTFT bias a little off its fleet's) and the policy's estimate for each,
then the pick. The held tokens are recorded as the gateway records what it sent to a
replica without KV events (entries that expire). Per-replica work grows with the fleet;
the rest does not, so the figure at 2 replicas is the fixed part. CPU time of this thread, median over
--requests decisions, interleaved with --baseline-repo's (a git worktree of an earlier
commit, run in a subprocess of its own) when given, each fleet size in turn, --rounds
times, the two checkouts taking turns at going first: medians over rounds, their spread,
and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 16


def measure(repo: Path, replicas: int, requests: int, holders: int = 1) -> float:
    """Median CPU seconds of one decision in a fleet of `replicas`, run from `repo`;
    the conversation's earlier tokens are held by the first `holders` of them."""
    sys.path.insert(0, str(repo))
    from router.config import LimitsConfig, TenantsConfig
    from router.hashing import HashConfig
    from router.index import MemoryIndex
    from router.pending import PendingChains
    from router.policy.pipeline import build_policy
    from router.policy.types import PolicyConfig
    from router.replicas import Replica, ReplicaSource
    from router.request import parse_request
    from router.routing import ChainCache, RoutingPipeline
    from router.tenants import TenantRegistry

    config = HashConfig(block_size=BLOCK_SIZE)
    registry = TenantRegistry.from_config(TenantsConfig(allow_anonymous=True))
    tenant = registry.identify(None)
    fleet = [Replica(target=ReplicaSource(name=f"r{i}", url=f"http://127.0.0.1:{9000 + i}",
                                          models=("m",), hash_config=config).target(),
                     healthy=True) for i in range(replicas)]
    now = time.monotonic()
    for i, r in enumerate(fleet):
        # A learned TTFT bias on each (each a little off its fleet's, so each is drawn
        # toward it per decision), then some outstanding work, half of it decoding.
        for k in range(4):
            token = r.work.begin(now - 1.0, 0.02, 0.03, True)
            r.work.first_byte(token, now - 1.0 + 0.03 * (1 + (i + k) % 5 / 10))
            r.work.end(token, now - 0.9)
        for k in range(1 + i % 3):
            token = r.work.begin(now - 0.01 * k, 0.02, 0.03, True)
            if k % 2:
                r.work.first_byte(token, now)
    index = MemoryIndex()
    # As the gateway runs it: with the prefill hold where the checkout has one (nothing is
    # held here, every replica has room; what shows is the check's cost).
    extra: dict[str, object] = {}
    if (repo / "router" / "prefill_hold.py").exists():
        from router.prefill_hold import PrefillHold
        extra["hold"] = PrefillHold(time.monotonic)
    pipeline = RoutingPipeline(tokenizers={}, chains=ChainCache(), index=index,
                               policy=build_policy(PolicyConfig(name="cache_aware", seed=1)),
                               index_deadline_s=1.0, pending=PendingChains(),
                               **extra)  # type: ignore[arg-type]
    rng = random.Random(replicas)
    history = [rng.randrange(10, 30000) for _ in range(3840)]
    keys = ChainCache().event_keys(config, history, None)
    for r in fleet[:max(1, holders)]:
        asyncio.run(index.record("m", r.replica_id, keys, 3600.0))

    async def decide_all() -> list[float]:
        times = []
        for n in range(requests + 1):
            prompt = history + [rng.randrange(10, 30000) for _ in range(256)]
            raw = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}).encode()
            parsed = parse_request(raw, "completions", served_models=(), limits=LimitsConfig(),
                                   tenant=tenant, registry=registry)
            t0 = time.thread_time()
            route = await pipeline.route(parsed, fleet, time.monotonic(), None, None,
                                         offload=False, reserve=True)
            t1 = time.thread_time()
            route.release(time.monotonic())
            route.drop_pending(pipeline.pending)
            if n:
                times.append(t1 - t0)
        return times

    return statistics.median(asyncio.run(decide_all()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", default="2,8,32,128")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline-repo", type=Path)
    parser.add_argument("--holders", type=int, default=1,
                        help="replicas holding the conversation's earlier tokens (capped at "
                             "the fleet's size): a prefix every replica holds, such as a "
                             "shared system prompt, is looked up on each of them")
    parser.add_argument("--one", nargs=4, metavar=("REPO", "REPLICAS", "REQUESTS", "HOLDERS"),
                        help=argparse.SUPPRESS)  # a subprocess's measurement
    args = parser.parse_args(argv)
    if args.one:
        print(measure(Path(args.one[0]), int(args.one[1]), int(args.one[2]), int(args.one[3])))
        return 0
    try:
        sizes = [int(s) for s in args.replicas.split(",")]
    except ValueError:
        parser.error(f"--replicas must be comma-separated counts, got {args.replicas!r}")
    repos = {"this checkout": REPO}
    if args.baseline_repo is not None:
        repos["baseline"] = args.baseline_repo.resolve()
    results: dict[tuple[str, int], list[float]] = {}
    order = list(repos.items())
    for _ in range(args.rounds):
        for size in sizes:
            # Each in a fresh process (no shared caches), and whoever went first goes
            # last next time: on this machine a neighbour's burst or a frequency step
            # would otherwise always land on the same checkout.
            order.reverse()
            for name, repo in order:
                out = subprocess.run([sys.executable, __file__, "--one", str(repo), str(size),
                                      str(args.requests), str(args.holders)], check=True,
                                     capture_output=True,
                                     text=True).stdout
                results.setdefault((name, size), []).append(float(out))
    print(f"one routing decision, 4k-token prompt, its first 3.75k tokens recorded on "
          f"{args.holders} replica(s), CPU us (median of {args.requests}; median over "
          f"{args.rounds} rounds [min..max])")
    ratio = len(repos) == 2
    print(f"{'replicas':>8} | " + " | ".join(f"{n:>26}" for n in repos)
          + (f" | {'this / baseline':>15}" if ratio else ""))
    for size in sizes:
        cells = []
        for name in repos:
            v = [x * 1e6 for x in results[(name, size)]]
            cells.append(f"{statistics.median(v):8.0f} [{min(v):.0f}..{max(v):.0f}]".rjust(26))
        if ratio:
            this, base = (statistics.median(results[(n, size)]) for n in repos)
            cells.append(f"{this / base:15.2f}")
        print(f"{size:>8} | " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
