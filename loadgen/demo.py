"""`python -m loadgen demo`: the README demo, about two minutes on a laptop.

Four simulated replicas (H100 / Llama-3.1-8B cost profile), a private redis-server as
the shared index when redis-server is installed (else the in-memory index), the gateway,
and the agent workload (8 sessions x 8 turns over a 4,800-token prompt with 24 tools)
under round_robin, least_loaded and cache_aware. It is `compare` with fixed arguments:
the command it ran is in the report. `--quick` (CI's smoke run of the README's first
command) runs 8 sessions x 4 turns with the sims at 4x real time: well under a minute.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from loadgen import compare

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class DemoSize:
    """How much of the agent workload the demo runs, and how fast the sims' clock goes."""

    conversations: int
    turns: int
    time_scale: float


FULL = DemoSize(conversations=8, turns=8, time_scale=1.0)
QUICK = DemoSize(conversations=8, turns=4, time_scale=4.0)


def demo_size(args: argparse.Namespace) -> DemoSize:
    """The size the flags ask for: --quick or the full demo, --time-scale overriding."""
    size = QUICK if args.quick else FULL
    if args.time_scale is not None:
        size = DemoSize(size.conversations, size.turns, args.time_scale)
    return size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Where to write, and the few knobs worth turning."""
    parser.add_argument("--out", type=Path, default=REPO / "out" / "demo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help=f"a smaller, faster run: {QUICK.conversations} sessions x "
                             f"{QUICK.turns} turns, sims at {QUICK.time_scale:g}x real time")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="run the sims this many times faster than real time (figures "
                             "are scaled back, gateway and client overhead with them; "
                             "default 1, or 4 with --quick)")
    parser.add_argument("--kv-tokens", type=int, default=32_768, help="KV tokens per replica")
    parser.add_argument("--layout", choices=("stable", "timestamp", "shuffle"), default="stable",
                        help="agent prompt layout")


def compare_argv(args: argparse.Namespace) -> list[str]:
    """The compare command line the demo runs."""
    size = demo_size(args)
    return [
        "--replicas", "4", "--policies", "round_robin,least_loaded,cache_aware",
        "--vllm-router", "none", "--index", "auto",
        "--workload", "agent", "--conversations", str(size.conversations), "--turns", str(size.turns),
        "--instruction-tokens", "480", "--tools", "24", "--tool-tokens", "180",
        "--layout", args.layout, "--concurrency", "8",
        "--kv-tokens", str(args.kv_tokens), "--max-model-len", "16384",
        "--time-scale", str(size.time_scale), "--seed", str(args.seed),
        "--deadline-s", "300", "--out", str(args.out),
    ]


def run(args: argparse.Namespace) -> int:
    """Run the demo, print the table and where the plots are."""
    argv = compare_argv(args)
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    cargs = parser.parse_args(argv)
    cargs.argv = ["compare", *argv]
    size = demo_size(args)
    index = "redis" if shutil.which("redis-server") else "memory (redis-server not installed)"
    print(f"demo: 4 simulated replicas, index {index}, agent workload "
          f"({size.conversations} sessions x {size.turns} turns), 3 policies")
    if size.time_scale == 1.0:
        print("demo: the sims run in real time (time scale 1): times are as measured")
    else:
        print(f"demo: the sims run {size.time_scale:g}x faster than real time; times below are "
              "scaled back to simulated seconds (gateway and client overhead included, "
              "so scaled too)")
    try:
        result = compare.run_comparison(cargs)
    except (compare.HarnessError, ValueError) as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    lines = result.files.table_md.read_text().splitlines()
    table = [line for line in lines if line.startswith("|")]
    print("\n".join(table))
    print("\nhit rate = cached / prompt tokens (servers' usage); oracle = one fleet-sized "
          "LRU cache / an unlimited one on the same stream")
    print(f"report: {result.files.table_md}")
    for plot in result.files.plots:
        print(f"plot:   {plot}")
    return 0
