"""The replicas every router of a comparison sends to: started once, reset per run.

Sims (`python -m replica sim`) start in seconds; real vLLM (`python -m replica vllm`)
takes minutes each. Between runs every replica's prefix cache is emptied, and the
shared index too, so each router starts cold on the same fleet.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loadgen.harness import MODEL_NAME, REPO, HarnessError, LoggedProcess, answers_ok
from loadgen.workloads.base import TOKEN_LOW
from replica.processes import free_port

DEFAULT_MODEL_DIR = REPO / ".cache" / "tiny-model"


@dataclass(frozen=True)
class TargetReplica:
    """A running replica as routers name it: URL and KV-event endpoints."""

    name: str
    url: str
    kv_events: str | None
    kv_replay: str | None


@dataclass
class TargetFleet:
    """The replicas every router runs against, and how to reset their caches."""

    replicas: list[TargetReplica]
    block_size: int
    blocks_per_replica: int
    max_model_len: int
    stop: Callable[[], None] = field(repr=False)

    def reset_caches(self, timeout: float = 30.0) -> None:
        """Empty every replica's prefix cache so the next run starts cold.

        A replica refuses (success false) while a request still holds blocks, e.g. one the
        previous router was cancelling; retried until it is idle or the deadline passes.
        """
        for r in self.replicas:
            deadline = time.monotonic() + timeout
            while not _reset_once(r.url):
                if time.monotonic() > deadline:
                    raise HarnessError(f"{r.name}: POST /reset_prefix_cache kept failing (real "
                                       "vLLM needs VLLM_SERVER_DEV_MODE=1 for it)")
                time.sleep(0.2)  # polling the replica until it is idle, against a deadline
            # vLLM publishes AllBlocksCleared with its next engine step, not at the reset
            # (the sims follow it): an idle replica's event history would end with the last
            # run's blocks, and the next router's indexer, replaying that history when it
            # subscribes, would route the first requests to prefixes nobody holds. One
            # request under a block long makes the step and caches nothing.
            _step_once(r.url, r.name)

    def ttft_totals(self) -> dict[str, tuple[int, float]]:
        """Each replica's TTFT histogram so far: (requests, seconds summed), as it measures
        them (vLLM: from its API server's arrival of the request to its first token)."""
        out: dict[str, tuple[int, float]] = {}
        for r in self.replicas:
            try:
                with urllib.request.urlopen(f"{r.url}/metrics", timeout=5) as resp:
                    text = resp.read().decode()
            except (urllib.error.URLError, OSError) as exc:
                raise HarnessError(f"{r.name}: GET /metrics failed: {exc}") from exc
            count = total = 0.0
            for line in text.splitlines():
                if line.startswith("vllm:time_to_first_token_seconds_count"):
                    count += float(line.rsplit(" ", 1)[1])
                elif line.startswith("vllm:time_to_first_token_seconds_sum"):
                    total += float(line.rsplit(" ", 1)[1])
            out[r.name] = (int(count), total)
        return out


def _reset_once(url: str) -> bool:
    req = urllib.request.Request(f"{url}/reset_prefix_cache", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = resp.read()
    except (urllib.error.URLError, OSError):
        return False
    try:
        # The sim answers {"success": bool}; vLLM answers 200 with an empty body.
        return bool(json.loads(body).get("success", True)) if body.strip() else True
    except (ValueError, AttributeError):
        return True


def _step_once(url: str, name: str) -> None:
    body = json.dumps({"model": MODEL_NAME, "prompt": [TOKEN_LOW], "max_tokens": 1,
                       "temperature": 0.0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()
    except (urllib.error.URLError, OSError) as exc:
        raise HarnessError(f"{name}: the request after the cache reset failed: {exc}") from exc


def flush_index(url: str) -> None:
    """Empty the shared Redis index between runs so each starts cold."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


def ensure_model_dir(path: Path) -> Path:
    """The tiny model's directory (the routers' tokenizer), built once if missing."""
    if (path / "tokenizer.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "replica", "tiny-model", "--out", str(path)],
                   check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return path


def start_sim_fleet(args: argparse.Namespace) -> TargetFleet:
    """N sims with KV events on free loopback ports, healthy on return."""
    from replica.fleet import SimFleet

    sim = SimFleet(
        args.replicas, block_size=args.block_size, kv_tokens=args.kv_tokens, kv_events=True,
        time_scale=args.time_scale, prefill_profile=args.prefill_profile, seed=str(args.seed),
        # Token-id prompts need no tokenizer in the sims, and loading one costs seconds each.
        model_dir=args.model_dir if args.sim_tokenizer or args.api == "chat" else None,
        served_model_name=MODEL_NAME,
        extra_args=["--max-model-len", str(args.max_model_len)],
    )
    sim.start()
    replicas = [TargetReplica(r.name, r.url, r.kv_events_endpoint, r.replay_endpoint)
                for r in sim.replicas]
    return TargetFleet(replicas, args.block_size, args.kv_tokens // args.block_size,
                       args.max_model_len, sim.stop)


def start_vllm_fleet(args: argparse.Namespace, log_dir: Path) -> TargetFleet:
    """N real vLLM servers via `python -m replica vllm` (minutes to start)."""
    procs: list[LoggedProcess] = []
    replicas: list[TargetReplica] = []

    def stop_all() -> None:
        for p in procs:
            p.stop()

    try:
        for i in range(args.replicas):
            port, events, replay = free_port(), free_port(), free_port()
            env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}  # for /reset_prefix_cache
            cmd = [sys.executable, "-m", "replica", "vllm", "--model", str(args.model_dir),
                   "--port", str(port), "--block-size", str(args.block_size),
                   "--seed", str(args.seed), "--kv-events-port", str(events),
                   "--kv-replay-port", str(replay), "--served-model-name", MODEL_NAME,
                   "--cpu-kv-cache-gib", str(args.vllm_kv_gib),
                   "--", "--max-model-len", str(args.max_model_len)]
            p = LoggedProcess(f"vllm-{i}", cmd, env=env)
            p.start(log_dir)
            procs.append(p)
            replicas.append(TargetReplica(f"vllm-{i}", f"http://127.0.0.1:{port}",
                                          f"tcp://127.0.0.1:{events}",
                                          f"tcp://127.0.0.1:{replay}"))
        for p, r in zip(procs, replicas, strict=True):
            p.wait_until(functools.partial(answers_ok, f"{r.url}/health"), timeout=600)
    except BaseException:
        stop_all()
        raise
    # vLLM's CPU cache size is set in GiB; the oracle needs blocks, so it is estimated.
    blocks = args.kv_tokens // args.block_size
    return TargetFleet(replicas, args.block_size, blocks, args.max_model_len, stop_all)
