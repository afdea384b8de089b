"""What applying one replica's KV events costs the process that indexes them.

    .venv/bin/python benchmarks/bench_events.py [--blocks 512] [--batches 60]
        [--rounds 5] [--baseline-repo DIR]

Every prefill a replica runs comes back as a KV-event batch: a BlockStored for its new
blocks and, once the cache is full, one BlockRemoved per block it evicted to make room
(vLLM sends them one by one). A gateway on the memory index applies them on its event
loop, between requests; the indexer does the same before writing to Redis. This times
the CPU (thread time) of decode (msgspec) + plan (router/events/planning.py) + apply
(the memory index) for batches of --blocks stored and --blocks removed blocks, the
shape an 8k-token cold prompt makes on a full cache at block size 16.

--baseline-repo DIR runs the same batches with another checkout's code (a git worktree
of an earlier commit), in a child process per round, alternating with this checkout's:
before and after side by side in one run, as this machine's noise requires. Prints per
round the median per batch, then the median and spread over rounds and their ratio.
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


def child(repo: Path, blocks: int, batches: int) -> float:
    """Median thread-time seconds per batch, with `repo`'s router package."""
    sys.path.insert(0, str(repo))
    from router.events.planning import BatchPlanner
    from router.events.stats import StreamStats
    from router.index.memory import MemoryIndex
    from router.kv_events import (
        BlockRemoved,
        BlockStored,
        EventBatch,
        KVEvent,
        decode_batch,
        encode_batch,
        encoded_ids,
    )

    rng = random.Random(7)
    payloads = []
    previous: list[int | bytes] = []
    for _ in range(batches):
        keys: list[int | bytes] = [rng.getrandbits(63) for _ in range(blocks)]
        events: list[KVEvent] = [
            BlockRemoved(block_hashes=[k], medium="GPU") for k in previous]
        events.append(BlockStored(
            block_hashes=keys, parent_block_hash=None,
            token_ids=encoded_ids([rng.randrange(3000) for _ in range(blocks * 16)]),
            block_size=16,
            lora_id=None, medium="GPU", lora_name=None))
        previous = keys
        payloads.append(encode_batch(EventBatch(ts=time.time(), events=events)))

    async def run() -> list[float]:
        planner = BatchPlanner("r0", "m", StreamStats())
        index = MemoryIndex()
        seconds = []
        for payload in payloads:
            started = time.thread_time()
            await index.apply("r0", planner.plan(decode_batch(payload)).ops)
            seconds.append(time.thread_time() - started)
        return seconds

    return statistics.median(asyncio.run(run())[1:])  # the first has nothing to evict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline-repo", type=Path, metavar="DIR")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("blocks", "batches", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.child is not None:
        print(json.dumps(child(args.child, args.blocks, args.batches)))
        return 0
    repos = {"this checkout": REPO}
    if args.baseline_repo is not None:
        if not (args.baseline_repo / "router" / "events" / "planning.py").is_file():
            parser.error(f"--baseline-repo {args.baseline_repo}: not a cacheroute checkout")
        repos["baseline"] = args.baseline_repo.resolve()
    print(f"decode + plan + apply (memory index) per batch of {args.blocks} stored + "
          f"{args.blocks} removed blocks, ms of CPU (thread time); {args.rounds} rounds, "
          "checkouts alternating")
    seen: dict[str, list[float]] = {name: [] for name in repos}
    for round_ in range(args.rounds):
        order = list(repos.items())
        if round_ % 2:
            order.reverse()
        for name, repo in order:
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(repo), "--blocks", str(args.blocks),
                 "--batches", str(args.batches)], check=True, capture_output=True, text=True)
            seen[name].append(json.loads(out.stdout) * 1000)
        print(f"round {round_ + 1}: " + ", ".join(f"{n} {v[-1]:.3f}" for n, v in seen.items()))
    for name, values in seen.items():
        print(f"{name:<14} median {statistics.median(values):.3f} ms "
              f"[{min(values):.3f}..{max(values):.3f}], "
              f"{statistics.median(values) * 1000 / (2 * args.blocks):.2f} us a block")
    if "baseline" in seen:
        ratios = [a / b for a, b in zip(seen["this checkout"], seen["baseline"], strict=True)]
        print(f"this checkout / baseline, per round: median x{statistics.median(ratios):.2f} "
              f"[x{min(ratios):.2f}..x{max(ratios):.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
