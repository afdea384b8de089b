"""What receiving one KV-event message costs a gateway or indexer, apart from applying it.

    .venv/bin/python benchmarks/bench_event_transport.py [--messages 3000] [--rounds 5]
        [--baseline-repo DIR] [--spaced]

A replica publishes one message per engine step that stored or evicted blocks; a
gateway (its memory index, or its mirror of Redis) and the indexer take each off a ZMQ
SUB socket. This publishes --messages batches of one stored block each, in a burst
while the stream is held up by its first (as on a busy process, where they queue), then
times the process's CPU (thread time) from releasing it until the last is applied:
receive + decode + plan + apply per message, the apply of one block being the least of
it. Publisher and stream share the process, the same for every checkout. --spaced
publishes each message only once the one before is applied, so each finds the stream
idle (a gateway at low load: one message per engine step, the loop waiting in between);
the publisher's send and the loop's wake-ups are then part of every message's figure.
--baseline-repo DIR runs the same with another checkout (a git worktree), in a child
process per round, alternating: medians over rounds, their spread and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def measure(repo: Path, messages: int, spaced: bool = False) -> float:
    """CPU seconds per message through `repo`'s ReplicaEventStream."""
    sys.path.insert(0, str(repo))
    import zmq
    import zmq.asyncio

    from router.events import ReplicaEventStream
    from router.index import MemoryIndex
    from router.kv_events import BlockStored, EventBatch, encode_batch, encoded_ids, seq_bytes

    class Gated(MemoryIndex):
        """Holds the first batch until released: the rest queue in the socket."""

        def __init__(self) -> None:
            super().__init__()
            self.gate = asyncio.Event()
            self.holding = asyncio.Event()
            self.done = asyncio.Event()
            self.applied_one = asyncio.Event()
            self.applied = 0

        async def apply(self, *args: Any, **kwargs: Any) -> None:
            if not self.gate.is_set():
                self.holding.set()
                await self.gate.wait()
            await super().apply(*args, **kwargs)
            self.applied += 1
            self.applied_one.set()
            if self.applied == messages + 1:
                self.done.set()

    def batch(key: int) -> bytes:
        return encode_batch(EventBatch(ts=time.time(), events=[BlockStored(
            block_hashes=[key], parent_block_hash=key - 1 if key else None,
            token_ids=encoded_ids([0] * 16), block_size=16, lora_id=None, medium="GPU", lora_name=None)]))

    async def run() -> float:
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.SNDHWM, 0)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        index = Gated()
        stream = ReplicaEventStream("r0", f"tcp://127.0.0.1:{port}", None, index, "m",
                                    context=ctx)
        stream.start()
        try:
            await pub.recv()  # the subscription: nothing published is lost to a late join
            payloads = [batch(k) for k in range(messages + 1)]
            await pub.send_multipart([b"", seq_bytes(0), payloads[0]])
            await index.holding.wait()
            if spaced:
                index.gate.set()
                await index.applied_one.wait()
                started = time.thread_time()
                for seq in range(1, messages + 1):
                    index.applied_one.clear()
                    await pub.send_multipart([b"", seq_bytes(seq), payloads[seq]])
                    await index.applied_one.wait()
                spent = time.thread_time() - started
                assert stream.stats.gaps == 0 and index.done.is_set()
                return spent / messages
            for seq in range(1, messages + 1):
                await pub.send_multipart([b"", seq_bytes(seq), payloads[seq]])
            await asyncio.sleep(0.5)  # let ZMQ move the burst into the SUB's queue
            started = time.thread_time()
            index.gate.set()
            await index.done.wait()
            spent = time.thread_time() - started
            assert stream.stats.gaps == 0
            return spent / messages
        finally:
            await stream.stop()
            pub.close(linger=0)
            ctx.term()

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline-repo", type=Path)
    parser.add_argument("--spaced", action="store_true",
                        help="each message sent once the one before is applied")
    parser.add_argument("--one", nargs=2, metavar=("REPO", "MESSAGES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(measure(Path(args.one[0]), int(args.one[1]), args.spaced))
        return 0
    if args.messages < 1:
        parser.error(f"--messages must be at least 1, got {args.messages}")
    repos = {"this checkout": REPO}
    if args.baseline_repo is not None:
        repos["baseline"] = args.baseline_repo.resolve()
    results: dict[str, list[float]] = {name: [] for name in repos}
    for round_ in range(args.rounds):
        order = list(repos.items())
        for name, repo in order[round_ % len(order):] + order[:round_ % len(order)]:
            out = subprocess.run([sys.executable, __file__, "--one", str(repo),
                                  str(args.messages), *(["--spaced"] if args.spaced else [])],
                                 check=True, capture_output=True, text=True,
                                 timeout=300).stdout
            results[name].append(float(out) * 1e6)
    kind = ("each sent to an idle stream, CPU us: send + receive + decode + plan + apply"
            if args.spaced else "queued, CPU us: receive + decode + plan + apply")
    print(f"one KV-event message (one stored block) {kind}; {args.messages} messages, "
          f"{args.rounds} rounds, checkouts alternating")
    for name, values in results.items():
        print(f"  {name:<14} median {statistics.median(values):6.2f} "
              f"[{min(values):.2f}..{max(values):.2f}]")
    if "baseline" in results:
        ratio = statistics.median(results["this checkout"]) / statistics.median(results["baseline"])
        print(f"  this checkout / baseline: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
