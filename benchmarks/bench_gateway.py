"""What the gateway costs: added latency per prompt size, and routed requests per second.

    .venv/bin/python benchmarks/bench_gateway.py [--sizes 1024,8192,32768,131072] [--repeats 20]

Side by side, in one run, against the same simulated replicas (instant profile, so the
replica itself costs next to nothing and the gateway's work is what shows):

1. Added latency: p50/p99 of a non-streamed /v1/completions (token-id prompt, max_tokens
   1) sent to the replica directly and through each router, per prompt size. Every
   request has a fresh prompt (its first token differs), so the gateway hashes every
   block: the cold case. The gateway's tokenize+hash time per size is printed too: it is
   how long the event loop would stall per request without the thread pool.
2. Throughput: routed requests/s with 64 concurrent clients and 256-token prompts.

Routers: cacheroute (`python -m router serve`, memory index fed by KV events) and, when
vllm-router is installed in this environment, vllm-router 0.1.17 with cache_aware and
kv_aware (fed by the same KV events). Every router and replica is a separate process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from replica.fleet import SimFleet  # noqa: E402
from replica.processes import free_port, stop_process, wait_until  # noqa: E402
from router.hashing import HashConfig  # noqa: E402
from router.routing import ChainCache  # noqa: E402

BLOCK_SIZE = 16
MODEL = "sim"


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class Router:
    name: str
    url: str
    proc: subprocess.Popen[bytes] | None = None


def start_process(cmd: list[str], ready_url: str, log_path: Path,
                  env: dict[str, str] | None = None, timeout: float = 90.0,
                  ) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: _ok(ready_url), timeout, f"{cmd[0:4]} to be ready", proc=proc)
    except (TimeoutError, RuntimeError) as exc:
        stop_process(proc)
        raise RuntimeError(f"{exc}:\n{log_path.read_text(errors='replace')[-3000:]}") from None
    return proc


def start_cacheroute(fleet: SimFleet, tmp: Path) -> Router:
    port = free_port()
    raw: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": port},
        "replicas": [{"url": r.url, "models": [MODEL], "block_size": BLOCK_SIZE,
                      "hash_seed": "0", "kv_events": r.kv_events_endpoint,
                      "kv_replay": r.replay_endpoint} for r in fleet.replicas],
        "index": {"backend": "memory", "deadline_ms": 50},
        "tenants": {"allow_anonymous": True},
        "proxy": {"max_body_bytes": 64 * 1024 * 1024},
        "limits": {"max_tokens_limit": 16},
    }
    path = tmp / "gateway.yaml"
    path.write_text(yaml.safe_dump(raw))
    proc = start_process([sys.executable, "-m", "router", "serve", "--config", str(path),
                          "--log-level", "WARNING"], f"http://127.0.0.1:{port}/ready",
                         tmp / "gateway.log")
    return Router("cacheroute", f"http://127.0.0.1:{port}", proc)


def start_vllm_router(fleet: SimFleet, tmp: Path, policy: str) -> Router | None:
    binary = shutil.which("vllm-router", path=str(Path(sys.executable).parent))
    if binary is None:
        return None
    port = free_port()
    cmd = [binary, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
           "--worker-urls", *fleet.urls, "--log-level", "warning",
           "--prometheus-port", str(free_port()), "--max-payload-size", str(256 * 1024 * 1024)]
    if policy == "kv_aware":
        for r in fleet.replicas:
            cmd += ["--kv-event-source", f"{r.url}={r.kv_events_endpoint}"]
        cmd += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", MODEL]
    try:
        proc = start_process(cmd, f"http://127.0.0.1:{port}/health", tmp / f"vllm-router-{policy}.log")
    except RuntimeError as exc:
        print(f"vllm-router {policy}: could not start ({str(exc).splitlines()[0]})")
        return None
    return Router(f"vllm-router {policy}", f"http://127.0.0.1:{port}", proc)


def fresh_prompt(rng: random.Random, size: int) -> list[int]:
    # A random first block makes every block's key new (keys chain from block 0).
    return [rng.randrange(10, 30000) for _ in range(BLOCK_SIZE)] + \
        [(i * 7919) % 30000 + 10 for i in range(size - BLOCK_SIZE)]


async def one_request(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> float:
    started = time.perf_counter()
    async with session.post(url + "/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": 1}) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:200]}")
    return time.perf_counter() - started


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def latency_table(targets: list[tuple[str, str]], sizes: list[int], repeats: int) -> None:
    rng = random.Random(1)
    print("\n1) latency of one non-streamed request (ms; fresh prompt each time, max_tokens 1)")
    header = f"{'prompt tokens':>13} | {'target':<24} | {'p50':>8} | {'p99':>8} | {'+p50 vs direct':>14}"
    print(header)
    print("-" * len(header))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for size in sizes:
            n = max(5, repeats if size <= 32768 else repeats // 3)
            prompts = [fresh_prompt(rng, size) for _ in range(n)]
            results: dict[str, list[float]] = {}
            for name, url in targets:
                await one_request(session, url, fresh_prompt(rng, size))  # warm connection
                # The same prompts for every target, interleaved in time per request.
                results[name] = []
            for prompt in prompts:
                for name, url in targets:
                    # Perturb per target so no target sees a prompt another already cached.
                    results[name].append(await one_request(
                        session, url, [rng.randrange(10, 30000), *prompt[1:]]))
            base = statistics.median(results[targets[0][0]])
            for name, _ in targets:
                p50, p99 = pct(results[name], 0.5), pct(results[name], 0.99)
                added = "" if name == targets[0][0] else f"{(p50 - base) * 1000:+.2f}"
                print(f"{size:>13} | {name:<24} | {p50 * 1000:>8.2f} | {p99 * 1000:>8.2f} | {added:>14}")


def tokenize_hash_table(sizes: list[int]) -> None:
    """Tokenize+hash cost per request: what would block the loop without the thread pool."""
    print("\n   gateway work per request off the event loop (sha256 block keys, block 16):")
    config = HashConfig(block_size=BLOCK_SIZE, seed="0")
    rng = random.Random(2)
    ChainCache().event_keys(config, fresh_prompt(rng, 1024), "warm-up")  # imports, caches
    for size in sizes:
        prompt = fresh_prompt(rng, size)
        cache = ChainCache()
        t = time.perf_counter()
        cache.event_keys(config, prompt, "salt")
        cold = time.perf_counter() - t
        grown = [*prompt, *range(100, 100 + 200)]
        t = time.perf_counter()
        cache.event_keys(config, grown, "salt")
        warm = time.perf_counter() - t
        print(f"   {size:>7} tokens: {cold * 1000:8.2f} ms cold, {warm * 1000:6.2f} ms for the "
              f"next turn (+200 tokens, history from the chain cache)")


def chat_tokenize_table(model_dir: str, sizes: list[int]) -> None:
    """Chat render+tokenize time per request (the tiny model's Llama template)."""
    from router.tokenize import PromptTokenizer

    tok = PromptTokenizer.from_dir(model_dir)
    print(f"\n   chat render+tokenize ({Path(model_dir).name}), same thread pool:")
    words = "the quick brown fox jumps over a lazy dog near five old wells "
    system = [{"role": "system", "content": "Be brief. " * 20}]
    pair = [{"role": "user", "content": words * 8}, {"role": "assistant", "content": words * 8}]
    per_pair = len(tok.chat_tokens({"messages": system + pair})) - \
        len(tok.chat_tokens({"messages": system}))
    for size in sizes:
        # Distinct turns (a number in each), so nothing repeats within one history.
        turns = system + [{"role": m["role"], "content": f"{i}: {m['content']}"}
                          for i in range(max(1, size // per_pair)) for m in pair]
        body = {"messages": [*turns, {"role": "user", "content": "and then?"}]}
        cold = PromptTokenizer.from_dir(model_dir)
        t = time.perf_counter()
        n = len(cold.chat_tokens(body))
        first = time.perf_counter() - t
        body2 = {"messages": [*body["messages"], {"role": "assistant", "content": "ok"},
                              {"role": "user", "content": "more?"}]}
        t = time.perf_counter()
        cold.chat_tokens(body2)
        nxt = time.perf_counter() - t
        print(f"   {n:>7} tokens: {first * 1000:8.2f} ms first time, {nxt * 1000:6.2f} ms for "
              f"the next turn (segment cache)")


async def throughput(name: str, url: str, seconds: float, concurrency: int) -> float:
    rng = random.Random(3)
    done = 0
    stop_at = time.perf_counter() + seconds

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await one_request(session, url, fresh_prompt(rng, 256))
            done += 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await one_request(session, url, fresh_prompt(rng, 256))
        started = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        return done / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1024,8192,32768,131072")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--model-dir", help="a model directory (python -m replica tiny-model): "
                        "also time chat render+tokenize")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    blocks = max(sizes) * 4 // BLOCK_SIZE + 64
    routers: list[Router] = []
    with SimFleet(args.replicas, block_size=BLOCK_SIZE, num_blocks=blocks,
                  prefill_profile="instant", served_model_name=MODEL,
                  extra_args=["--max-model-len", str(max(sizes) + 64)]) as fleet:
        try:
            routers.append(start_cacheroute(fleet, tmp))
            for policy in ("cache_aware", "kv_aware"):
                r = start_vllm_router(fleet, tmp, policy)
                if r is not None:
                    routers.append(r)
            direct = ("direct (replica 0)", fleet.urls[0])
            targets = [direct, *((r.name, r.url) for r in routers)]
            print(f"{args.replicas} sim replicas (instant profile); routers: "
                  f"{', '.join(r.name for r in routers)}")
            asyncio.run(latency_table(targets, sizes, args.repeats))
            tokenize_hash_table(sizes)
            if args.model_dir:
                chat_tokenize_table(args.model_dir, sizes)
            print(f"\n2) routed requests/s ({args.concurrency} concurrent clients, 256-token "
                  f"prompts, max_tokens 1, {args.seconds:.0f} s each)")
            for name, url in targets:
                rps = asyncio.run(throughput(name, url, args.seconds, args.concurrency))
                print(f"   {name:<24} {rps:8.0f} req/s")
        finally:
            for r in routers:
                if r.proc is not None:
                    stop_process(r.proc)
    return 0



if __name__ == "__main__":
    sys.exit(main())
