"""`python -m replica vllm`: run a real vLLM replica with the fleet's cache settings.

A gateway can only compute a replica's block keys when it knows the replica's block
size, hash algorithm and seed, and can only follow its cache when the replica publishes
KV events. This launcher turns those settings into the one vLLM command line that
produces them, so the gateway's config and the replica's flags come from the same
values. `vllm_command` is pure: tests and the Helm chart's docs rely on its output.

Facts it encodes (vLLM 0.32, see docs VLLM_FACTS.md):
- the seed is the server's PYTHONHASHSEED; without it, xxhash keys are random per
  process, so the launcher removes an inherited PYTHONHASHSEED unless one is asked for;
- the KV-event publisher binds only when its endpoint holds a wildcard (`tcp://*:P`),
  otherwise vLLM connects out; the replay endpoint always binds;
- on CPU the KV cache size comes from VLLM_CPU_KVCACHE_SPACE (GiB),
  --gpu-memory-utilization means nothing, so it is dropped, and the block size must
  be a multiple of 32 (CPU attention), checked here rather than after model loading.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from router.hashing import HASH_ALGOS

SEED_ENV = "PYTHONHASHSEED"
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
CPU_BLOCK_MULTIPLE = 32


@dataclass(frozen=True)
class VllmSettings:
    """What a replica must agree on with the gateway, plus where it listens."""

    model: str
    port: int = 8000
    host: str = "127.0.0.1"
    block_size: int = 16
    hash_algo: str = "sha256"
    seed: str | None = None
    kv_events_port: int | None = None
    kv_replay_port: int | None = None
    gpu_memory_utilization: float | None = None
    served_model_name: str | None = None
    # None: detect (nvidia-smi on PATH means GPU). Tests pass False to be deterministic.
    gpu: bool | None = None
    cpu_kv_cache_gib: int = 1
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    python: str = sys.executable

    def __post_init__(self) -> None:
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(
                f"unknown hash algorithm {self.hash_algo!r}; expected one of {', '.join(HASH_ALGOS)}"
            )
        if self.block_size <= 0:
            raise ValueError(f"block size must be positive, got {self.block_size}")
        if self.kv_replay_port is not None and self.kv_events_port is None:
            raise ValueError("--kv-replay-port needs --kv-events-port (replay serves the events)")
        for name in ("port", "kv_events_port", "kv_replay_port"):
            value = getattr(self, name)
            if value is not None and not 0 < value < 65536:
                raise ValueError(f"{name.replace('_', '-')} must be in 1..65535, got {value}")


def has_gpu() -> bool:
    """A cheap guess at whether vLLM will run on a GPU here: is nvidia-smi on PATH."""
    return shutil.which("nvidia-smi") is not None


def kv_events_config(settings: VllmSettings) -> dict[str, object] | None:
    """The --kv-events-config value: a ZMQ publisher bound on the events port."""
    if settings.kv_events_port is None:
        return None
    config: dict[str, object] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # A wildcard makes vLLM bind (a concrete host makes it connect out instead).
        "endpoint": f"tcp://*:{settings.kv_events_port}",
        "topic": "",
    }
    if settings.kv_replay_port is not None:
        config["replay_endpoint"] = f"tcp://*:{settings.kv_replay_port}"
    return config


def vllm_command(settings: VllmSettings) -> tuple[list[str], dict[str, str]]:
    """The argv and the environment variables to set for a vLLM server with `settings`.

    The child's environment is the caller's minus PYTHONHASHSEED, plus the returned
    variables (see `child_env`).
    """
    gpu = has_gpu() if settings.gpu is None else settings.gpu
    if not gpu and settings.block_size % CPU_BLOCK_MULTIPLE:
        # vLLM would fail only after loading the model ("No common block size").
        raise ValueError(
            f"block size {settings.block_size} does not work on CPU: vLLM's CPU attention "
            f"needs a multiple of {CPU_BLOCK_MULTIPLE}"
        )
    argv = [
        settings.python, "-m", API_SERVER_MODULE,
        "--model", settings.model,
        "--host", settings.host,
        "--port", str(settings.port),
        "--enable-prefix-caching",
        "--block-size", str(settings.block_size),
        "--prefix-caching-hash-algo", settings.hash_algo,
        "--enable-prompt-tokens-details",
    ]
    if settings.served_model_name:
        argv += ["--served-model-name", settings.served_model_name]
    events = kv_events_config(settings)
    if events is not None:
        argv += ["--kv-events-config", json.dumps(events, separators=(",", ":"))]
    if gpu and settings.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(settings.gpu_memory_utilization)]
    argv += list(settings.extra_args)

    env: dict[str, str] = {}
    if settings.seed is not None:
        env[SEED_ENV] = settings.seed
    if not gpu:
        env[CPU_KV_CACHE_ENV] = str(settings.cpu_kv_cache_gib)
    return argv, env


def child_env(env: dict[str, str], base: dict[str, str] | None = None) -> dict[str, str]:
    """The full environment for the server: `base` (default os.environ) without an
    inherited PYTHONHASHSEED, plus `env`, so the seed is exactly the one asked for."""
    merged = dict(os.environ if base is None else base)
    merged.pop(SEED_ENV, None)
    merged.update(env)
    return merged


def format_command(argv: list[str], env: dict[str, str]) -> str:
    """A shell line that reproduces the command, with the variables it sets."""
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    line = shlex.join(argv)
    return f"{prefix} {line}" if prefix else line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory or Hugging Face id")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hash-algo", choices=HASH_ALGOS, default="sha256")
    parser.add_argument("--seed", default=None,
                        help="PYTHONHASHSEED for the server (the root of every block key)")
    parser.add_argument("--kv-events-port", type=int, default=None,
                        help="publish KV events on tcp://*:PORT")
    parser.add_argument("--kv-replay-port", type=int, default=None,
                        help="serve KV-event replay on tcp://*:PORT")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--cpu-kv-cache-gib", type=int, default=1,
                        help="VLLM_CPU_KVCACHE_SPACE when no GPU is found (default 1)")
    device = parser.add_mutually_exclusive_group()
    device.add_argument("--cpu", dest="gpu", action="store_false", default=None,
                        help="treat the machine as GPU-less whatever is installed")
    device.add_argument("--gpu", dest="gpu", action="store_true",
                        help="treat the machine as having a GPU")
    parser.add_argument("extra", nargs=argparse.REMAINDER,
                        help="after --: arguments passed to vLLM unchanged")


def settings_from_args(args: argparse.Namespace) -> VllmSettings:
    """VllmSettings from parsed command-line arguments."""
    extra = list(args.extra)
    if extra and extra[0] == "--":
        extra = extra[1:]
    return VllmSettings(
        model=str(Path(args.model)) if Path(args.model).exists() else args.model,
        port=args.port,
        host=args.host,
        block_size=args.block_size,
        hash_algo=args.hash_algo,
        seed=args.seed,
        kv_events_port=args.kv_events_port,
        kv_replay_port=args.kv_replay_port,
        gpu_memory_utilization=args.gpu_memory_utilization,
        served_model_name=args.served_model_name,
        gpu=args.gpu,
        cpu_kv_cache_gib=args.cpu_kv_cache_gib,
        extra_args=tuple(extra),
    )


def run(args: argparse.Namespace) -> int:
    try:
        argv, env = vllm_command(settings_from_args(args))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_command(argv, env), flush=True)
    # exec, not a child: signals sent to this process reach vLLM directly.
    os.execve(argv[0], argv, child_env(env))
