"""The gateway's chain cache (router.routing.ChainCache): time per prompt and memory per
remembered block, this checkout against another side by side.

    python benchmarks/bench_chain_cache.py [--blocks 512] [--prompts 40] [--rounds 5]
        [--baseline-repo DIR]

Each round runs every checkout in a fresh subprocess (the checkouts take turns at going
first): `--prompts` new prompts of `--blocks` blocks of 16 tokens (a cold prompt's keys,
all computed), then a conversation growing 16 blocks a turn from there (the next turn's,
mostly remembered); the CPU time of each call, median; tracemalloc's count of what
the cache holds after the new prompts, per remembered block; and what a full garbage
collection takes with the filled cache (the start-up heap frozen, as a serving gateway
has it: router/collector.py), less the same collection without it. Medians over rounds,
with their spread.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def measure(repo: Path, blocks: int, prompts: int) -> dict[str, float]:
    sys.path.insert(0, str(repo))
    from router.hashing import HashConfig
    from router.routing import ChainCache

    gc.freeze()  # what start-up built, as a serving gateway freezes it
    config = HashConfig(block_size=16)
    rng = random.Random(1)
    new = [[rng.randrange(30_000) for _ in range(16 * blocks)] for _ in range(prompts)]
    # Memory first, in a cache of its own: tracemalloc slows every allocation, so the
    # timed cache below runs without it.
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    traced = ChainCache()
    for tokens in new:
        traced.event_keys(config, tokens, "salt")
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del traced
    remembered = prompts * blocks
    cache = ChainCache()
    cold = []
    for tokens in new:
        started = time.thread_time()
        cache.event_keys(config, tokens, "salt")
        cold.append(time.thread_time() - started)
    history = list(new[-1])
    turns = []
    for _ in range(prompts):
        history += [rng.randrange(30_000) for _ in range(16 * 16)]
        started = time.thread_time()
        cache.event_keys(config, history, "salt")
        turns.append(time.thread_time() - started)
    del new
    with_cache = _full_collection_s()
    del cache, history
    without = _full_collection_s()
    return {"cold_ms": statistics.median(cold) * 1e3, "turn_ms": statistics.median(turns) * 1e3,
            "bytes_per_block": held / remembered,
            "gc_ms": max(0.0, with_cache - without) * 1e3}


def _full_collection_s() -> float:
    """The median of 5 full collections' time, after one that frees what was let go."""
    gc.collect()
    times = []
    for _ in range(5):
        started = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=512,
                        help="blocks of 16 tokens per new prompt (512: 8k tokens)")
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline-repo", type=Path,
                        help="another checkout (a git worktree of an earlier commit)")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for flag in ("blocks", "prompts", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1")
    if args.measure is not None:
        print(json.dumps(measure(args.measure, args.blocks, args.prompts)))
        return 0
    repos = {"this checkout": REPO}
    if args.baseline_repo is not None:
        if not (args.baseline_repo / "router" / "routing.py").is_file():
            parser.error(f"--baseline-repo {args.baseline_repo}: not a cacheroute checkout")
        repos["baseline"] = args.baseline_repo.resolve()
    out: dict[str, list[dict[str, float]]] = {name: [] for name in repos}
    for round_ in range(args.rounds):
        names = list(repos)
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            done = subprocess.run(
                [sys.executable, __file__, "--measure", str(repos[name]), "--blocks",
                 str(args.blocks), "--prompts", str(args.prompts)],
                capture_output=True, text=True, timeout=600, check=True, cwd=repos[name])
            out[name].append(json.loads(done.stdout))
    print(f"chain cache, {args.prompts} new prompts of {args.blocks} blocks of 16 tokens, then "
          f"a conversation growing 16 blocks a turn; CPU ms per call (median), memory per "
          f"remembered block; median over {args.rounds} rounds [min..max]")
    for figure, label in (("cold_ms", "new prompt, ms"), ("turn_ms", "next turn, ms"),
                          ("bytes_per_block", "bytes / block"),
                          ("gc_ms", "full GC, +ms")):
        cells = []
        for name, runs in out.items():
            values = [r.get(figure, float("nan")) for r in runs]
            cells.append(f"{name} {statistics.median(values):.3f} "
                         f"[{min(values):.3f}..{max(values):.3f}]")
        print(f"  {label:<15} " + "   ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
