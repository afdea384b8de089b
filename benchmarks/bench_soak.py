"""Soak: sustained load through the gateway, watched window by window.

    .venv/bin/python benchmarks/bench_soak.py [--duration 60] [--window 10] [--clients 16]
                                              [--replicas 3] [--num-blocks 20000]

A gateway process (`python -m router serve`, memory index fed by KV events) in front of
simulated replicas (processes, the "unit" prefill profile sped up 20x so a request is a
few ms of simulated work), under a closed loop of `--clients` clients for `--duration`
seconds. The workload mixes multi-turn conversations (each turn resends its history, so
prefixes repeat and the index grows), a shared system prompt, and streamed and
non-streamed requests. Reported per window: requests, errors (any non-200, any stream
that does not end in a finish and [DONE], any transport error), latency p50/p99; and the
gateway's resident memory (RSS, from /proc via psutil) at the start, per window, and at
the end: a leak shows as RSS climbing window after window at a steady request rate.

Every structure the gateway keeps is bounded by something the soak reaches: the index by
the replicas' caches (`--num-blocks` each; smaller fills them, and so shows the plateau,
sooner), the chain cache and pending chains by their capacities, suspects by theirs. So
memory grows while the replicas' caches fill and must then stay flat: the report gives
the RSS slope over the last half of the windows (MB per minute), which must be near 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from replica.fleet import SimFleet  # noqa: E402
from replica.processes import free_port, stop_process, wait_until  # noqa: E402

MODEL = "sim"
SECRET = "soak-salt-secret-0123456789abcdef"


@dataclass
class Window:
    """What one time window of the soak saw."""

    start: float
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    rss_mb: float = 0.0
    # The gateway's bounded structures at the window's end (cacheroute_bounded_entries):
    # RSS that grows while these fill is the caches filling; RSS that grows with these
    # flat at their caps is a leak.
    bounded: dict[str, float] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return len(self.latencies) + self.errors


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rss_slope(windows: list[Window], window_s: float) -> float:
    """Least-squares RSS slope (MB per minute) over the last half of the windows."""
    tail = windows[len(windows) // 2:]
    if len(tail) < 2:
        return float("nan")
    xs = [w.start / 60.0 for w in tail]
    ys = [w.rss_mb for w in tail]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=2) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def start_gateway(fleet: SimFleet, tmp: Path, chain_cache_blocks: int | None = None,
                  ) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    raw = {
        "listen": {"host": "127.0.0.1", "port": port},
        "replicas": [{"url": r.url, "models": [MODEL], "block_size": 16, "hash_seed": "0",
                      "kv_events": r.kv_events_endpoint, "kv_replay": r.replay_endpoint}
                     for r in fleet.replicas],
        "index": {"backend": "memory", "deadline_ms": 50},
        "policy": {"name": "cache_aware"},
        "tenants": {"secret_env": "CACHEROUTE_SALT_SECRET",
                    "keys": [{"key": "sk-soak", "tenant": "soak"}]},
    }
    if chain_cache_blocks is not None:
        raw["limits"] = {"chain_cache_blocks": chain_cache_blocks}
    config = tmp / "gateway.yaml"
    config.write_text(yaml.safe_dump(raw))
    with open(tmp / "gateway.log", "wb") as log:  # the child keeps its own copy of the fd
        proc = subprocess.Popen(
            [sys.executable, "-m", "router", "serve", "--config", str(config), "--log-level",
             "WARNING"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env={**os.environ, "CACHEROUTE_SALT_SECRET": SECRET})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(url), 60, "the gateway to be ready", proc=proc)
    except (TimeoutError, RuntimeError) as exc:
        stop_process(proc)
        raise RuntimeError(f"{exc}:\n{(tmp / 'gateway.log').read_text()[-3000:]}") from None
    return proc, url


class Workload:
    """Conversations over a shared system prompt; each turn appends the answer."""

    def __init__(self, rng: random.Random, conversations: int = 64) -> None:
        self.rng = rng
        self.system = [rng.randrange(10, 3000) for _ in range(256)]
        self.histories = [self._fresh() for _ in range(conversations)]

    def _fresh(self) -> list[int]:
        return [*self.system, *(self.rng.randrange(10, 3000) for _ in range(64))]

    def next(self) -> tuple[int, dict[str, Any]]:
        c = self.rng.randrange(len(self.histories))
        if len(self.histories[c]) > 2048:
            self.histories[c] = self._fresh()  # the conversation ends; a new one starts
        body = {"model": MODEL, "prompt": self.histories[c], "max_tokens": 16,
                "return_token_ids": True, "stream": self.rng.random() < 0.5}
        return c, body

    def answered(self, c: int, output: list[int]) -> None:
        self.histories[c] = [*self.histories[c], *output,
                             *(self.rng.randrange(10, 3000) for _ in range(32))]


async def one(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
              ) -> tuple[bool, list[int]]:
    """Send one request; (succeeded, generated token ids)."""
    async with session.post(url + "/v1/completions", json=body,
                            headers={"Authorization": "Bearer sk-soak"}) as resp:
        text = await resp.text()
        if resp.status != 200:
            return False, []
    if not body["stream"]:
        return True, list(json.loads(text)["choices"][0]["token_ids"])
    if not text.endswith("data: [DONE]\n\n"):
        return False, []
    ids: list[int] = []
    finished = False
    for block in text.split("\n\n"):
        if not block.startswith("data: {"):
            continue
        chunk = json.loads(block[6:])
        if "error" in chunk:
            return False, []
        for choice in chunk.get("choices") or ():
            ids.extend(choice.get("token_ids") or ())
            finished = finished or bool(choice.get("finish_reason"))
    return finished, ids


async def bounded_entries(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The gateway's cacheroute_bounded_entries gauges, by structure."""
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith('cacheroute_bounded_entries{structure="'):
            out[line.split('"')[1]] = float(line.split()[-1])
    return out


async def soak(url: str, gateway: psutil.Process, duration: float, window_s: float,
               clients: int, seed: int) -> tuple[list[Window], float, float]:
    workload = Workload(random.Random(seed))
    started = time.monotonic()
    windows = [Window(0.0)]
    rss_start = gateway.memory_info().rss / 2**20

    scrapes: set[asyncio.Task[None]] = set()

    async def scrape(window: Window, session: aiohttp.ClientSession) -> None:
        window.bounded = await bounded_entries(session, url)

    def close(window: Window, session: aiohttp.ClientSession) -> None:
        window.rss_mb = gateway.memory_info().rss / 2**20
        task = asyncio.ensure_future(scrape(window, session))
        scrapes.add(task)
        task.add_done_callback(scrapes.discard)

    def current(session: aiohttp.ClientSession) -> Window:
        index = int((time.monotonic() - started) // window_s)
        while len(windows) <= index:
            close(windows[-1], session)
            windows.append(Window(len(windows) * window_s))
        return windows[index]

    async def client(session: aiohttp.ClientSession) -> None:
        while time.monotonic() - started < duration:
            c, body = workload.next()
            t0 = time.perf_counter()
            try:
                ok, output = await one(session, url, body)
            except (aiohttp.ClientError, TimeoutError):
                ok, output = False, []
            window = current(session)
            if ok:
                window.latencies.append(time.perf_counter() - t0)
                workload.answered(c, output)
            else:
                window.errors += 1

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
        close(windows[-1], session)
        await asyncio.gather(*scrapes)
    # A last window shorter than a quarter of the others is folded into its predecessor.
    if len(windows) > 1 and duration - windows[-1].start < window_s / 4:
        last = windows.pop()
        windows[-1].latencies += last.latencies
        windows[-1].errors += last.errors
        windows[-1].rss_mb = last.rss_mb
        windows[-1].bounded = last.bounded
    return windows, rss_start, windows[-1].rss_mb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--window", type=float, default=10.0, help="seconds per report window")
    parser.add_argument("--clients", type=int, default=16, help="closed-loop clients")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--num-blocks", type=int, default=20000,
                        help="KV blocks per replica (the index holds at most these)")
    parser.add_argument("--chain-cache-blocks", type=int, default=None,
                        help="the gateway's limits.chain_cache_blocks (default 500,000: "
                        "~65 MB at most)")
    args = parser.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="cacheroute-soak-"))
    with SimFleet(args.replicas, block_size=16, num_blocks=args.num_blocks, prefill_profile="unit",
                  time_scale=20.0) as fleet:
        proc, url = start_gateway(fleet, tmp, args.chain_cache_blocks)
        try:
            gateway = psutil.Process(proc.pid)
            windows, rss_start, rss_end = asyncio.run(
                soak(url, gateway, args.duration, args.window, args.clients, args.seed))
        finally:
            stop_process(proc, grace_s=15)

    total = sum(w.requests for w in windows)
    errors = sum(w.errors for w in windows)
    print(f"soak: {args.duration:.0f} s, {args.clients} clients, {args.replicas} sim replicas "
          f"(unit profile x20), cacheroute gateway process")
    structures = sorted({k for w in windows for k in w.bounded})
    print(f"{'window':>10} {'requests':>9} {'req/s':>7} {'errors':>7} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'RSS MB':>8} " + " ".join(f"{k:>11}" for k in structures))
    for w in windows:
        span = min(args.window, args.duration - w.start) or args.window
        print(f"{w.start:>4.0f}-{w.start + span:<4.0f}s {w.requests:>9} {w.requests / span:>7.1f} "
              f"{w.errors:>7} {pct(w.latencies, 0.5) * 1000:>8.1f} "
              f"{pct(w.latencies, 0.99) * 1000:>8.1f} {w.rss_mb:>8.1f} "
              + " ".join(f"{w.bounded.get(k, float('nan')):>11.0f}" for k in structures))
    all_latencies = [x for w in windows for x in w.latencies]
    print(f"total: {total} requests, {errors} errors (error rate {errors / max(1, total):.4%}), "
          f"p50 {pct(all_latencies, 0.5) * 1000:.1f} ms, p99 {pct(all_latencies, 0.99) * 1000:.1f} "
          f"ms, mean {statistics.fmean(all_latencies) * 1000 if all_latencies else 0:.1f} ms")
    print(f"gateway RSS: start {rss_start:.1f} MB, end {rss_end:.1f} MB "
          f"({rss_end - rss_start:+.1f} MB); last half's slope {rss_slope(windows, args.window):+.2f} "
          "MB/min")
    print("columns after RSS: entries of the gateway's bounded structures at each window's end "
          "(cacheroute_bounded_entries): RSS should stop growing once they stop growing")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
