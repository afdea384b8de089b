"""Peer routers run over the same fleet: vllm-router 0.1.17 and SMG 1.13 (SGLang's gateway).

A peer policy is named `PEER:POLICY` in a comparison (`vllm-router:kv_aware`,
`smg:cache_aware`). Each peer is a Rust binary installed next to this Python (pip
packages `vllm-router==0.1.17` and `smg==1.13.0`, scripts/setup.sh); a peer that is not
installed, or cannot take the run's traffic, is skipped with the reason printed.

- vllm-router routes token ids and chat alike; its kv_aware follows the replicas' KV
  events and matches prefixes only for token-id prompts.
- SMG tokenizes chat with the served model's tokenizer (`--tokenizer-path`) and refuses
  token-id prompts on /v1/completions, so it runs on chat traffic only.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from loadgen.harness import MODEL_NAME, HarnessError, LoggedProcess, answers_ok
from loadgen.target_fleet import TargetFleet
from replica.processes import free_port


@dataclass(frozen=True)
class Peer:
    """A peer router: its executable, the policies a comparison adds by default, its label."""

    name: str
    binary: str
    default_policies: tuple[str, ...]
    label: str
    chat_only: bool = False

    def executable(self) -> str | None:
        """The executable next to this Python, or on PATH; None when not installed."""
        local = Path(sys.executable).parent / self.binary
        if local.exists():
            return str(local)
        return shutil.which(self.binary)


VLLM_ROUTER = Peer("vllm-router", "vllm-router", ("cache_aware", "round_robin"),
                   "vllm-router 0.1.17 as a peer (its own hashing and load view)")
SMG = Peer("smg", "smg", ("cache_aware", "prefix_hash"),
           "SMG 1.13 (SGLang model gateway) as a peer (its own tokenizer, tree and load view)",
           chat_only=True)
PEERS = {p.name: p for p in (VLLM_ROUTER, SMG)}


def split_policy(policy: str) -> tuple[Peer | None, str]:
    """`PEER:POLICY` -> (the peer, its policy); our own policies -> (None, policy)."""
    name, sep, rest = policy.partition(":")
    if sep and name in PEERS:
        return PEERS[name], rest
    return None, policy


def skip_reason(peer: Peer, api: str) -> str | None:
    """Why `peer` cannot run this comparison, or None when it can."""
    if peer.executable() is None:
        return f"{peer.name} is not installed (scripts/setup.sh installs it)"
    if peer.chat_only and api != "chat":
        return (f"{peer.name} refuses token-id prompts on /v1/completions; "
                "run with --api chat to compare it")
    return None


@contextlib.contextmanager
def peer_router(peer: Peer, policy: str, fleet: TargetFleet, model_dir: Path,
                log_dir: Path, tag: str = "") -> Iterator[str]:
    """One peer router over the fleet, started and healthy; yields its base URL."""
    with peer_routers(peer, policy, fleet, model_dir, log_dir, tag) as urls:
        yield urls[0]


@contextlib.contextmanager
def peer_routers(peer: Peer, policy: str, fleet: TargetFleet, model_dir: Path,
                 log_dir: Path, tag: str = "", count: int = 1,
                 cpus: frozenset[int] | None = None) -> Iterator[list[str]]:
    """`count` instances of a peer router over the fleet, started and healthy; their URLs.

    vllm-router instances are independent (each its own tree and load view). SMG
    instances are joined by SMG's own mesh (--enable-mesh, every other instance as a
    --mesh-peer-urls peer), which gossips their cache trees: the peer that shares
    state its own way.
    """
    binary = peer.executable()
    if binary is None:
        raise HarnessError(f"{peer.name} is not installed")
    mesh = [free_port() for _ in range(count)] if peer is SMG and count > 1 else []
    procs: list[LoggedProcess] = []
    urls_ready: list[tuple[LoggedProcess, Callable[[], bool], str]] = []
    try:
        for i in range(count):
            port = free_port()
            cmd, ready = _peer_command(peer, binary, policy, fleet, model_dir, port, i, mesh)
            proc = LoggedProcess(f"{peer.name}-{policy}{tag}" + (f"-g{i}" if count > 1 else ""),
                                 cmd, cpus=cpus)
            procs.append(proc)
            proc.start(log_dir)
            urls_ready.append((proc, ready, f"http://127.0.0.1:{port}"))
        for proc, ready, _ in urls_ready:
            proc.wait_until(ready)
        yield [url for _, _, url in urls_ready]
    finally:
        for proc in reversed(procs):
            proc.stop()


def _peer_command(peer: Peer, binary: str, policy: str, fleet: TargetFleet, model_dir: Path,
                  port: int, i: int, mesh: list[int]) -> tuple[list[str], Callable[[], bool]]:
    """The command line of a peer's instance i and its readiness check."""
    urls = [r.url for r in fleet.replicas]
    ready: Callable[[], bool]
    if peer is SMG:
        cmd = [binary, "launch", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *urls, "--policy", policy, "--tokenizer-path", str(model_dir),
               "--log-level", "warn", "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(free_port())]
        if mesh:
            cmd += ["--enable-mesh", "--mesh-server-name", f"smg-{i}", "--mesh-host",
                    "127.0.0.1", "--mesh-advertise-host", "127.0.0.1", "--mesh-port",
                    str(mesh[i]), "--mesh-peer-urls",
                    *(f"127.0.0.1:{p}" for j, p in enumerate(mesh) if j != i)]
        ready = functools.partial(_smg_ready, f"http://127.0.0.1:{port}", len(urls))
    else:
        cmd = [binary, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
               "--worker-urls", *urls, "--log-level", "warning",
               "--prometheus-port", str(free_port())]
        if policy == "kv_aware":
            # kv_aware follows the replicas' KV events, as our gateway does.
            cmd += ["--kv-event-block-size", str(fleet.block_size),
                    "--kv-event-model", MODEL_NAME]
            for r in fleet.replicas:
                if r.kv_events:
                    cmd += ["--kv-event-source", f"{r.url}={r.kv_events}"]
                if r.kv_replay:
                    cmd += ["--kv-event-replay-source", f"{r.url}={r.kv_replay}"]
        ready = functools.partial(answers_ok, f"http://127.0.0.1:{port}/health")
    return cmd, ready


def _smg_ready(url: str, workers: int) -> bool:
    """SMG answers /health at once but registers its workers afterwards: wait for all."""
    try:
        with urllib.request.urlopen(f"{url}/workers", timeout=2) as resp:
            body = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return False
    listed = body.get("workers") or []
    return len(listed) >= workers and all(w.get("is_healthy", True) for w in listed)
