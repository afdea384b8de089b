"""How many simulated replicas one core sustains, and how fast the in-process engine runs.

Two measurements, printed side by side:

1. Processes: K `python -m replica sim` replicas (instant profile, so the sim's own CPU
   cost is all there is) receive an open-loop Poisson stream at a target total rate of
   /v1/completions requests (token-id prompts sharing a prefix, max_tokens 8) for a fixed
   duration. Reported: achieved req/s, p50/p99 latency, and the CPU seconds the sim
   processes used (from /proc), hence requests per CPU-second and the replicas one core
   sustains at the per-replica rate asked for.
2. In-process: the Engine alone (loadgen's single-engine mode) on a synthetic multi-turn
   workload: requests and engine steps per wall second.

    .venv/bin/python benchmarks/bench_sim.py --replicas 4 --rate 200 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import httpx

from replica.engine import Engine, EngineConfig, EngineRequest
from replica.fleet import SimFleet
from replica.processes import cpu_seconds
from router.hashing import HashConfig


async def drive(urls: list[str], rate: float, duration: float, prompt_len: int,
                seed: int) -> tuple[int, int, list[float], float]:
    """Open-loop Poisson load over the replicas; returns (ok, errors, latencies, elapsed)."""
    rng = random.Random(seed)
    shared = [rng.randrange(100, 30000) for _ in range(prompt_len // 2)]
    latencies: list[float] = []
    errors = 0
    ok = 0
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        async def one(i: int) -> None:
            nonlocal errors, ok
            tail = [rng.randrange(100, 30000) for _ in range(prompt_len - len(shared))]
            t0 = time.perf_counter()
            try:
                resp = await client.post(f"{urls[i % len(urls)]}/v1/completions",
                                         json={"prompt": shared + tail, "max_tokens": 8})
                if resp.status_code == 200:
                    ok += 1
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1
            except httpx.HTTPError:
                errors += 1

        tasks: list[asyncio.Task[None]] = []
        start = time.perf_counter()
        next_at = start
        i = 0
        while next_at - start < duration:
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # pacing the open-loop arrivals
            tasks.append(asyncio.create_task(one(i)))
            i += 1
            next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return ok, errors, latencies, elapsed


def bench_processes(replicas: int, rate: float, duration: float, prompt_len: int) -> None:
    with SimFleet(replicas, prefill_profile="instant", num_blocks=16385) as fleet:
        pids = [r.proc.pid for r in fleet.replicas]
        cpu0 = sum(cpu_seconds(p) for p in pids)
        ok, errors, lat, elapsed = asyncio.run(drive(fleet.urls, rate, duration, prompt_len, 0))
        cpu = sum(cpu_seconds(p) for p in pids) - cpu0
    achieved = ok / elapsed
    per_cpu_s = ok / cpu if cpu > 0 else float("inf")
    per_replica_rate = rate / replicas
    lat.sort()
    print(f"processes: {replicas} sims, target {rate:.0f} req/s total "
          f"({per_replica_rate:.1f} req/s each), {prompt_len}-token prompts, {duration:.0f} s")
    print(f"  achieved {achieved:.1f} req/s, {errors} errors, "
          f"p50 {statistics.median(lat) * 1000:.1f} ms, p99 {lat[int(len(lat) * 0.99) - 1] * 1000:.1f} ms")
    print(f"  sim CPU {cpu:.2f} s over {elapsed:.1f} s wall = {cpu / elapsed:.2f} cores; "
          f"{per_cpu_s:.0f} requests per CPU-second")
    print(f"  => one core sustains about {per_cpu_s / per_replica_rate:.0f} replicas at "
          f"{per_replica_rate:.1f} req/s each (sim work only; the load generator excluded)")


def bench_engine(requests: int, prompt_len: int) -> None:
    rng = random.Random(1)
    cfg = EngineConfig(hash=HashConfig(block_size=16), num_blocks=65537, max_model_len=32768)
    engine = Engine(cfg)
    systems = [[rng.randrange(100, 30000) for _ in range(prompt_len)] for _ in range(8)]
    for i in range(requests):
        prompt = systems[i % 8] + [rng.randrange(100, 30000) for _ in range(64)]
        engine.add_request(EngineRequest(f"r{i}", prompt, 16, arrival=i * 0.01))
    t0 = time.perf_counter()
    done = engine.run_until_idle()
    wall = time.perf_counter() - t0
    print(f"in-process engine: {len(done)} requests ({prompt_len}+64-token prompts, 16 tokens "
          f"out) in {wall:.2f} s = {len(done) / wall:.0f} req/s, "
          f"{engine.stats.steps / wall:.0f} steps/s, hit rate {engine.stats.hit_rate:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--rate", type=float, default=200.0, help="total requests per second")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--engine-requests", type=int, default=2000)
    args = parser.parse_args()
    bench_processes(args.replicas, args.rate, args.duration, args.prompt_len)
    bench_engine(args.engine_requests, args.prompt_len)


if __name__ == "__main__":
    main()
