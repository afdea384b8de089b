"""The harness's own latency floor: TTFT the driver measures when prefill costs nothing.

A sim with the `instant` profile answers with zero simulated cost, so whatever TTFT the
driver measures against it is the client + HTTP + sim-process overhead; through the
gateway it adds the gateway's. Compare runs' TTFTs should be read against these floors,
and with `--time-scale K` the floor is multiplied by K in the report.

    .venv/bin/python benchmarks/bench_loadgen_overhead.py [--requests 200]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

from loadgen import compare
from loadgen.driver import Driver, DriverConfig, RunResult
from loadgen.gateway_under_test import GatewayProfile, gateway
from loadgen.harness import MODEL_NAME
from loadgen.peers import VLLM_ROUTER, peer_router
from loadgen.target_fleet import ensure_model_dir, start_sim_fleet
from loadgen.workloads import RandomWorkload


def _row(name: str, result: RunResult) -> str:
    ttft = sorted((r.ttft_s or 0.0) * 1000 for r in result.completed())
    p99 = ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))]
    return (f"{name:<28} {len(ttft):>5} ok  TTFT p50 {statistics.median(ttft):6.2f} ms  "
            f"p99 {p99:6.2f} ms")


async def _drive(url: str, requests: int, prompt: int, concurrency: int) -> RunResult:
    workload = RandomWorkload(requests=requests, input_tokens=prompt, output_tokens=2)
    return await Driver(DriverConfig(base_url=url, model=MODEL_NAME,
                                     concurrency=concurrency, deadline_s=120)).run(workload)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=1)
    opts = parser.parse_args()
    n, prompt, conc = opts.requests, opts.prompt_tokens, opts.concurrency
    cargs = argparse.ArgumentParser()
    compare.add_arguments(cargs)
    args = cargs.parse_args(["--out", "unused", "--replicas", "1", "--prefill-profile",
                             "instant", "--kv-tokens", "65536", "--max-model-len", "8192",
                             "--index", "memory"])
    args.model_dir = ensure_model_dir(Path(args.model_dir))
    fleet = start_sim_fleet(args)
    # The gateway's own prefill profile: with an instant sim every profile routes alike.
    profile = GatewayProfile("default", None)
    rows: list[tuple[str, RunResult]] = []
    try:
        rows.append(("driver -> sim", asyncio.run(
            _drive(fleet.replicas[0].url, n, prompt, conc))))
        with tempfile.TemporaryDirectory() as tmp:
            fleet.reset_caches()
            with gateway("round_robin", fleet, "memory", profile, args, Path(tmp)) as url:
                rows.append(("driver -> gateway -> sim", asyncio.run(
                    _drive(url, n, prompt, conc))))
            if VLLM_ROUTER.executable():
                fleet.reset_caches()
                with peer_router(VLLM_ROUTER, "round_robin", fleet, args.model_dir,
                                 Path(tmp)) as url:
                    rows.append(("driver -> vllm-router -> sim", asyncio.run(
                        _drive(url, n, prompt, conc))))
    finally:
        fleet.stop()
    print(f"{n} requests of {prompt} prompt tokens, 2 output tokens, concurrency {conc}, "
          "instant-profile sim (zero simulated cost)")
    for name, result in rows:
        print(_row(name, result))


if __name__ == "__main__":
    main()
