"""What the relay spends on a streamed answer before and after its first token.

    .venv/bin/python benchmarks/bench_relay.py [--sizes 4096,8192,32768] [--streams 300]
        [--rounds 5] [--baseline-repo DIR]

A client that asks for return_token_ids (the load generator does, and token-in/token-out
clients) gets the prompt's ids in the first streamed chunk: 46 KB at 8k ids, 185 KB at
32k. The proxy reads it on the way to the first token (router/upstream.py: SSEReader,
StreamState.process, the proxy's 5xx check), then the rest of the stream. This runs that
path in this process over one completions stream per prompt size: the first chunk
arriving in 16 KB reads, 15 one-token chunks and the usage chunk, as the proxy reads
them (router/proxy.py Forwarder._attempt and _events_after_commit), and prints the CPU
(thread time) per stream, median over --streams. --baseline-repo DIR runs the same with
another checkout (a git worktree), in a child process per round, alternating: medians
over rounds, their spread and the ratio.
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


def measure(repo: Path, size: int, streams: int) -> float:
    """Median CPU seconds per stream through `repo`'s relay for a `size`-id prompt."""
    sys.path.insert(0, str(repo))
    from router.upstream import ProxyOutcome, SSEReader, StreamState, UpstreamRequest

    rng = random.Random(size)
    ids = [rng.randrange(10, 30000) for _ in range(size)]
    first = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": None,
                          "prompt_token_ids": ids, "token_ids": [5]}]}
    head = b"data: " + json.dumps(first, separators=(",", ":")).encode() + b"\n\n"
    tokens = [b"data: " + json.dumps({"id": "cmpl-1", "choices": [
        {"index": 0, "text": " w", "token_ids": [7]}]}, separators=(",", ":")).encode() + b"\n\n"
        for _ in range(15)]
    usage = b"data: " + json.dumps({"id": "cmpl-1", "choices": [], "usage": {
        "prompt_tokens": size, "completion_tokens": 16, "total_tokens": size + 16,
        "prompt_tokens_details": {"cached_tokens": size // 2}}},
        separators=(",", ":")).encode() + b"\n\ndata: [DONE]\n\n"
    reads = [head[i:i + 16384] for i in range(0, len(head), 16384)] + tokens + [usage]

    class Body:
        def __init__(self) -> None:
            self.pieces = list(reads)

        async def readany(self) -> bytes:
            return self.pieces.pop(0) if self.pieces else b""

    up = UpstreamRequest(path="/v1/completions", body={}, headers={}, stream=True,
                         client_wants_usage=True, collect_token_ids=False)

    async def one() -> None:
        state = StreamState(up, ProxyOutcome())
        reader = SSEReader(Body())
        while True:  # to the first token, as Forwarder._attempt reads it
            event = await reader.next_event()
            assert event is not None
            _, content = state.process(event)
            # The 5xx check on each event before the first token: StreamState.error_code
            # where the checkout has it, else the proxy's own search of the event.
            if not hasattr(state, "error_code"):
                from router import proxy
                proxy._error_event_status(event)  # type: ignore[attr-defined]
            if content:
                break
        while (run := await reader.next_events()) is not None:
            state.process_run(run)
        assert state.outcome.cached_tokens == size // 2

    async def run() -> list[float]:
        times = []
        for _ in range(streams):
            started = time.thread_time()
            await one()
            times.append(time.thread_time() - started)
        return times

    return statistics.median(asyncio.run(run()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="4096,8192,32768")
    parser.add_argument("--streams", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline-repo", type=Path)
    parser.add_argument("--one", nargs=3, metavar=("REPO", "SIZE", "STREAMS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(measure(Path(args.one[0]), int(args.one[1]), int(args.one[2])))
        return 0
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes must be comma-separated token counts, got {args.sizes!r}")
    repos = {"this checkout": REPO}
    if args.baseline_repo is not None:
        repos["baseline"] = args.baseline_repo.resolve()
    results: dict[tuple[str, int], list[float]] = {}
    for round_ in range(args.rounds):
        order = list(repos.items())
        for size in sizes:
            for name, repo in order[round_ % len(order):] + order[:round_ % len(order)]:
                out = subprocess.run([sys.executable, __file__, "--one", str(repo), str(size),
                                      str(args.streams)], check=True, capture_output=True,
                                     text=True, timeout=300).stdout
                results.setdefault((name, size), []).append(float(out) * 1e6)
    print(f"relay CPU per streamed answer (first chunk with the prompt's ids in 16 KB reads, "
          f"15 tokens, usage), us: median of {args.streams} streams, median over "
          f"{args.rounds} rounds [min..max]")
    print(f"{'prompt ids':>10} | " + " | ".join(f"{n:>24}" for n in repos)
          + (" | ratio" if len(repos) > 1 else ""))
    for size in sizes:
        cells = []
        for name in repos:
            v = results[(name, size)]
            cells.append(f"{statistics.median(v):8.1f} [{min(v):.1f}..{max(v):.1f}]".rjust(24))
        ratio = ""
        if len(repos) > 1:
            ratio = f" | {statistics.median(results[('this checkout', size)]) / statistics.median(results[('baseline', size)]):.2f}x"
        print(f"{size:>10} | " + " | ".join(cells) + ratio)
    return 0


if __name__ == "__main__":
    sys.exit(main())
