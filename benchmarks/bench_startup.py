"""A gateway process's start: seconds until it listens, and its memory, with torch kept
out (router/without_torch.py) beside torch imported first.

    .venv/bin/python benchmarks/bench_startup.py [--model DIR] [--rounds 4]

Each round starts `python -m router serve` twice on a one-replica config with an
in-memory index (no replica needs to answer): as users run it, where the entry point
keeps torch out, and with `import torch` run first in the same interpreter, which is what
every gateway process paid before (transformers 5 imports torch for a tokenizer when it is
installed). The order alternates between rounds. It prints, per variant, the median and
range of the seconds from spawn to an accepted connection (the tokenizer is loaded and
warmed by then), the resident memory once listening, and whether libtorch was mapped. On
a machine without torch only the first variant runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from replica.processes import free_port  # noqa: E402
from replica.tiny_model import build_tiny_model  # noqa: E402

START_LIMIT_S = 120.0


def _config(path: Path, model_dir: Path, port: int) -> None:
    # A replica nobody serves: the gateway starts (and reports it unhealthy) all the same.
    path.write_text(
        f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        f"models:\n  tiny: {{tokenizer: {str(model_dir)!r}}}\n"
        f"replicas:\n  - {{url: 'http://127.0.0.1:{free_port()}', name: sim-0, models: [tiny],"
        " block_size: 16, kv_events: null, kv_replay: null}\n"
        "index: {backend: memory}\n")


def _commands(config: Path) -> dict[str, list[str]]:
    serve = ["serve", "--config", str(config)]
    out = {"torch kept out": [sys.executable, "-m", "router", *serve]}
    if importlib.util.find_spec("torch") is not None:
        out["torch imported"] = [sys.executable, "-c", (
            "import runpy, sys, torch; sys.argv = ['router'] + sys.argv[1:]; "
            "runpy.run_module('router', run_name='__main__')"), *serve]
    return out


def start_once(cmd: list[str], port: int) -> tuple[float, float, bool]:
    """(seconds until a connection is accepted, resident MB then, libtorch mapped)."""
    began = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if proc.poll() is not None:
                    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                    raise RuntimeError(
                        f"the gateway exited {proc.returncode}: {err[-1500:]}") from None
                if time.perf_counter() - began > START_LIMIT_S:
                    raise RuntimeError(
                        f"the gateway did not listen within {START_LIMIT_S} s") from None
                time.sleep(0.02)
        up = time.perf_counter() - began
        with open(f"/proc/{proc.pid}/status") as f:
            rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        with open(f"/proc/{proc.pid}/maps") as f:
            torch = "libtorch" in f.read()
        return up, rss_kb / 1024, torch
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bench(model_dir: Path, rounds: int) -> list[str]:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="cacheroute-bench-") as tmp:
        config = Path(tmp) / "gateway.yaml"
        _config(config, model_dir, port)
        commands = _commands(config)
        results: dict[str, list[tuple[float, float, bool]]] = {name: [] for name in commands}
        for r in range(rounds):
            order = list(commands) if r % 2 == 0 else list(reversed(commands))
            for name in order:
                results[name].append(start_once(commands[name], port))
    lines = [f"gateway start, {rounds} alternating rounds (median [min..max]):"]
    for name, runs in results.items():
        ups, rss = [x[0] for x in runs], [x[1] for x in runs]
        lines.append(f"  {name:15s} listening after {statistics.median(ups):.2f} s "
                     f"[{min(ups):.2f}..{max(ups):.2f}], resident {statistics.median(rss):.0f} MB "
                     f"[{min(rss):.0f}..{max(rss):.0f}], libtorch mapped in "
                     f"{sum(x[2] for x in runs)} of {len(runs)}")
    if len(results) == 2:
        (_, kept), (_, imported) = results.items()

        def ratio(i: int) -> float:
            return statistics.median(x[i] for x in kept) / statistics.median(x[i] for x in imported)

        lines.append(f"  kept out / imported: start x{ratio(0):.2f}, memory x{ratio(1):.2f}")
    else:
        lines.append("  torch is not installed here: nothing to compare with")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="model directory (default: build the tiny model in a temp dir)")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    if args.rounds <= 0:
        print(f"error: --rounds must be positive, got {args.rounds}")
        return 2
    with tempfile.TemporaryDirectory(prefix="cacheroute-bench-") as tmp:
        model_dir = args.model or build_tiny_model(Path(tmp) / "tiny")
        for line in bench(model_dir, args.rounds):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
