"""`python -m loadgen compare`: run one seeded workload through each routing policy.

For every policy the harness starts a fresh gateway (`python -m router serve`) over
the same fleet, with every replica's prefix cache reset and the shared index emptied
first, so each policy starts cold and sees the same request stream. vllm-router, when
installed, runs as a peer on the same fleet. The report (report.py) puts each policy's
TTFT beside its hit rate and beside the oracle bounds of the stream (oracle.py).

Replicas are simulated (`python -m replica sim`, the default) or real vLLM
(`--replica-kind vllm`, via `python -m replica vllm`: slow to start, minutes each).
Sims may run faster than real time (`--time-scale K`): arrivals are compressed by K and
every measured time is multiplied back by K, so figures are in simulated seconds; the
client's and the gateway's own overhead is multiplied too, which the report says.

`--policy-set KEY=VALUE` and `--index-set KEY=VALUE` change one key of our gateways'
`policy:` or `index:` config (e.g. `load_cost_s=0.25`, `deadline_ms=100`) for a control
run; the report names them beside each policy. `--trace-start N` replays a trace from its
N-th record.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from loadgen.driver import Driver, DriverConfig, RequestRecord, RunResult
from loadgen.oracle import OracleRequest, bounds
from loadgen.report import PolicyRun, ReportFiles, write_report
from loadgen.workloads import (
    AGENT_LAYOUTS,
    PREAMBLE_POSITIONS,
    TOKEN_LOW,
    AgentWorkload,
    ChatWorkload,
    GroupsWorkload,
    PrefixRepetitionWorkload,
    RandomWorkload,
    TraceWorkload,
    Workload,
)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "mooncake_conversation.jsonl"
DEFAULT_MODEL_DIR = REPO / ".cache" / "tiny-model"
MODEL_NAME = "tiny"
POLICIES = ("random", "round_robin", "least_loaded", "session_affinity", "cache_aware")
WORKLOADS = ("chat", "agent", "trace", "groups", "prefix-repetition", "random")
VLLM_ROUTER_PREFIX = "vllm-router:"
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0


class HarnessError(RuntimeError):
    """A component of the harness failed to start or answer; the message says which."""


# ------------------------------------------------------------------------ processes


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http_status(url: str, method: str = "GET", timeout: float = 2.0) -> int | None:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return None


@dataclass
class ManagedProcess:
    """A subprocess the harness started and always stops, its output in a log file."""

    name: str
    cmd: list[str]
    env: dict[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    def start(self, log_dir: Path) -> None:
        self.log_path = log_dir / f"{self.name}.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env, cwd=REPO)

    def wait_until(self, ready: Callable[[], bool], timeout: float = START_TIMEOUT_S) -> None:
        """Poll `ready` until it holds; fail fast if the process exits."""
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise HarnessError(f"{self.name} exited ({code}) before it was ready:\n"
                                   f"{self.log_tail()}")
            if time.monotonic() > deadline:
                raise HarnessError(f"{self.name} not ready within {timeout:.0f}s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.1)  # polling a readiness check against a deadline

    def log_tail(self, chars: int = 3000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def redis_server(log_dir: Path) -> Iterator[str]:
    """A private redis-server on a free loopback port (never 6379); yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise HarnessError("redis-server is not installed")
    port = free_port()
    proc = ManagedProcess("redis", [binary, "--port", str(port), "--bind", "127.0.0.1",
                                    "--save", "", "--appendonly", "no"])
    proc.start(log_dir)
    try:
        proc.wait_until(lambda: _port_open(port))
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.stop()


def _port_open(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def flush_redis(url: str) -> None:
    """Empty the index between policies so each starts cold."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


# ------------------------------------------------------------------------ the fleet


@dataclass(frozen=True)
class Replica:
    """A running replica as the gateway's config names it."""

    name: str
    url: str
    kv_events: str | None
    kv_replay: str | None


@dataclass
class Fleet:
    """The replicas every policy runs against, and how to reset their caches."""

    replicas: list[Replica]
    block_size: int
    blocks_per_replica: int
    max_model_len: int
    stop: Callable[[], None] = field(repr=False)

    def reset_caches(self, timeout: float = 30.0) -> None:
        """Empty every replica's prefix cache so the next policy starts cold.

        A replica refuses (success false) while a request still holds blocks, e.g. one the
        previous gateway was cancelling; retried until it is idle or the deadline passes.
        """
        for r in self.replicas:
            deadline = time.monotonic() + timeout
            while not _reset_once(r.url):
                if time.monotonic() > deadline:
                    raise HarnessError(f"{r.name}: POST /reset_prefix_cache kept failing (real "
                                       "vLLM needs VLLM_SERVER_DEV_MODE=1 for it)")
                time.sleep(0.2)  # polling the replica until it is idle, against a deadline


    def request_counts(self) -> dict[str, int]:
        """Requests each replica has answered so far (its TTFT histogram's count)."""
        out: dict[str, int] = {}
        for r in self.replicas:
            try:
                with urllib.request.urlopen(f"{r.url}/metrics", timeout=5) as resp:
                    text = resp.read().decode()
            except (urllib.error.URLError, OSError) as exc:
                raise HarnessError(f"{r.name}: GET /metrics failed: {exc}") from exc
            out[r.name] = int(sum(
                float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("vllm:time_to_first_token_seconds_count")))
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


def start_sim_fleet(args: argparse.Namespace) -> Fleet:
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
    replicas = [Replica(r.name, r.url, r.kv_events_endpoint, r.replay_endpoint)
                for r in sim.replicas]
    return Fleet(replicas, args.block_size, args.kv_tokens // args.block_size,
                 args.max_model_len, sim.stop)


def start_vllm_fleet(args: argparse.Namespace, log_dir: Path) -> Fleet:
    """N real vLLM servers via `python -m replica vllm` (minutes to start)."""
    procs: list[ManagedProcess] = []
    replicas: list[Replica] = []

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
            p = ManagedProcess(f"vllm-{i}", cmd, env=env)
            p.start(log_dir)
            procs.append(p)
            replicas.append(Replica(f"vllm-{i}", f"http://127.0.0.1:{port}",
                                    f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}"))
        for p, r in zip(procs, replicas, strict=True):
            health = f"{r.url}/health"
            p.wait_until(functools.partial(_is_ok, health), timeout=600)
    except BaseException:
        stop_all()
        raise
    # vLLM's CPU cache size is set in GiB; the oracle needs blocks, so it is estimated.
    blocks = args.kv_tokens // args.block_size
    return Fleet(replicas, args.block_size, blocks, args.max_model_len, stop_all)


# ------------------------------------------------------------------------ gateways


def gateway_config(policy: str, fleet: Fleet, port: int, index: str, model_dir: Path,
                   seed: int, profile: dict[str, float],
                   overrides: dict[str, Any] | None = None,
                   index_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The gateway.yaml the harness runs a policy with (routing headers exposed).

    `overrides` (--policy-set) and `index_overrides` (--index-set) replace or add keys of
    the `policy:` and `index:` sections.
    """
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "models": {MODEL_NAME: {"tokenizer": str(model_dir), "max_model_len": fleet.max_model_len}},
        "replicas": [
            {"url": r.url, "name": r.name, "models": [MODEL_NAME],
             "block_size": fleet.block_size, "hash_algo": "sha256", "hash_seed": str(seed),
             "kv_events": r.kv_events, "kv_replay": r.kv_replay}
            for r in fleet.replicas
        ],
        "index": {"backend": index, **(index_overrides or {})},
        "policy": {"name": policy, "seed": seed, "prefill": profile, **(overrides or {})},
        "tenants": {"allow_anonymous": True},
        "proxy": {"expose_routing_headers": True},
        "health": {"interval_s": 0.5, "scrape_interval_s": 0.25},
    }


def _is_ok(url: str) -> bool:
    return _http_status(url) == 200


def _gateway_ready(url: str) -> bool:
    """Ready once /ready says every replica is healthy: a policy must see the whole fleet."""
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=2) as resp:
            body = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return False
    replicas = body.get("replicas") or []
    return bool(body.get("ready")) and all(r.get("state") == "healthy" for r in replicas)


@contextlib.contextmanager
def gateway(policy: str, fleet: Fleet, index: str, args: argparse.Namespace,
            log_dir: Path) -> Iterator[str]:
    """One gateway process for one policy; yields its base URL."""
    from replica.profiles import load_profile

    sim_profile = load_profile(args.prefill_profile)
    # The policy's cost model predicts the replicas' prefill: give it the sims' own.
    profile = {"base_s": sim_profile.base_s, "per_token_s": sim_profile.token_s,
               "per_token_context_s": sim_profile.attention_s}
    port = free_port()
    config = gateway_config(policy, fleet, port, index, Path(args.model_dir), args.seed, profile,
                            policy_overrides(args), policy_overrides(args, "index_set"))
    path = log_dir / f"gateway-{policy}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    procs: list[ManagedProcess] = []
    try:
        if index.startswith("redis://"):
            # A gateway on a Redis index reads it but does not feed it: the indexer does,
            # from the replicas' KV events. Started first and synced before any request.
            indexer = ManagedProcess(f"indexer-{policy}", [
                sys.executable, "-m", "router", "indexer", "--config", str(path),
                "--log-level", "INFO"])
            procs.append(indexer)
            indexer.start(log_dir)
            indexer.wait_until(lambda: "indexing " in indexer.log_tail(20_000))
        proc = ManagedProcess(f"gateway-{policy}",
                              [sys.executable, "-m", "router", "serve", "--config", str(path),
                               "--shutdown-timeout", "2"])
        procs.append(proc)
        proc.start(log_dir)
        url = f"http://127.0.0.1:{port}"
        proc.wait_until(lambda: _gateway_ready(url))
        yield url
    finally:
        for p in reversed(procs):
            p.stop()


def policy_overrides(args: argparse.Namespace, dest: str = "policy_set") -> dict[str, Any]:
    """--policy-set (or --index-set) KEY=VALUE pairs as a dict, values parsed as YAML."""
    flag = "--" + dest.replace("_", "-")
    out: dict[str, Any] = {}
    for item in getattr(args, dest, None) or []:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise HarnessError(f"{flag} wants KEY=VALUE, got {item!r}")
        if key in ("name", "backend"):
            raise HarnessError(f"{flag} cannot change {key}; use --policies / --index")
        out[key] = yaml.safe_load(value)
    return out


def vllm_router_binary() -> str | None:
    """The vllm-router executable next to this Python, or on PATH."""
    local = Path(sys.executable).parent / "vllm-router"
    if local.exists():
        return str(local)
    return shutil.which("vllm-router")


@contextlib.contextmanager
def vllm_router(policy: str, fleet: Fleet, log_dir: Path) -> Iterator[str]:
    """vllm-router 0.1.17 over the same fleet, as a peer; yields its base URL."""
    binary = vllm_router_binary()
    if binary is None:
        raise HarnessError("vllm-router is not installed")
    port = free_port()
    cmd = [binary, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
           "--worker-urls", *[r.url for r in fleet.replicas], "--log-level", "warning",
           "--prometheus-port", str(free_port())]
    if policy == "kv_aware":
        # kv_aware follows the replicas' KV events, as our gateway does.
        cmd += ["--kv-event-block-size", str(fleet.block_size), "--kv-event-model", MODEL_NAME]
        for r in fleet.replicas:
            if r.kv_events:
                cmd += ["--kv-event-source", f"{r.url}={r.kv_events}"]
            if r.kv_replay:
                cmd += ["--kv-event-replay-source", f"{r.url}={r.kv_replay}"]
    proc = ManagedProcess(f"vllm-router-{policy}", cmd)
    proc.start(log_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_until(functools.partial(_is_ok, f"{url}/health"))
        yield url
    finally:
        proc.stop()


# ------------------------------------------------------------------------ workloads


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """Workload flags shared by compare and demo (unused ones are ignored per workload)."""
    w = parser.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="chat")
    w.add_argument("--requests", type=int, default=None,
                   help="requests (chat, groups, prefix-repetition, random); trace: the limit")
    w.add_argument("--conversations", type=int, default=8, help="chat/agent conversations")
    w.add_argument("--turns", type=int, default=8, help="agent turns per conversation")
    w.add_argument("--shared-prefix-tokens", type=int, default=None,
                   help="chat system prompt / groups and prefix-repetition prefix / random "
                        "common prefix")
    w.add_argument("--preamble-tokens", type=int, default=0)
    w.add_argument("--preamble-position", choices=PREAMBLE_POSITIONS, default="after-system")
    w.add_argument("--question-tokens", type=int, default=None,
                   help="chat/agent/groups question; prefix-repetition suffix; random input")
    w.add_argument("--answer-tokens", type=int, default=None, help="output tokens per request")
    w.add_argument("--salt", choices=("none", "conversation"), default="none")
    w.add_argument("--instruction-tokens", type=int, default=480, help="agent instructions")
    w.add_argument("--tools", type=int, default=24, help="agent tool definitions")
    w.add_argument("--tool-tokens", type=int, default=180, help="tokens per agent tool")
    w.add_argument("--layout", choices=AGENT_LAYOUTS, default="stable", help="agent layout")
    w.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake JSONL trace")
    w.add_argument("--trace-start", type=int, default=0,
                   help="trace: skip this many records first (replay a later window)")
    w.add_argument("--groups", type=int, default=150)
    w.add_argument("--users", type=int, default=5)
    w.add_argument("--rates", default="5",
                   help="groups: comma-separated Poisson rates (req/s), stepped up")
    w.add_argument("--stage-seconds", type=float, default=60.0)
    w.add_argument("--num-prefixes", type=int, default=10)
    w.add_argument("--range-ratio", type=float, default=0.0)


def build_workload(args: argparse.Namespace) -> Workload:
    """The seeded workload the flags describe (defaults per workload where a flag is unset)."""
    def pick(value: int | None, default: int) -> int:
        return default if value is None else value

    seed = args.seed
    if args.workload == "chat":
        return ChatWorkload(
            requests=pick(args.requests, 64), conversations=args.conversations,
            shared_prefix_tokens=pick(args.shared_prefix_tokens, 1000),
            preamble_tokens=args.preamble_tokens, preamble_position=args.preamble_position,
            question_tokens=pick(args.question_tokens, 50),
            answer_tokens=pick(args.answer_tokens, 50), salt=args.salt, seed=seed,
            chat_text=getattr(args, "api", "completions") == "chat")
    if args.workload == "agent":
        return AgentWorkload(
            conversations=args.conversations, turns=args.turns,
            instruction_tokens=args.instruction_tokens, tools=args.tools,
            tool_tokens=args.tool_tokens, question_tokens=pick(args.question_tokens, 60),
            answer_tokens=pick(args.answer_tokens, 80), layout=args.layout, seed=seed)
    if args.workload == "trace":
        return TraceWorkload(
            args.trace, speedup=args.speedup, limit=pick(args.requests, 200),
            max_input_tokens=args.max_model_len - 1 - pick(args.answer_tokens, 64),
            max_output_tokens=pick(args.answer_tokens, 64),
            start=getattr(args, "trace_start", 0), seed=seed)
    if args.workload == "groups":
        return GroupsWorkload(
            groups=args.groups, users=args.users,
            prefix_tokens=pick(args.shared_prefix_tokens, 6000),
            question_tokens=pick(args.question_tokens, 1200),
            output_tokens=pick(args.answer_tokens, 1000), requests=pick(args.requests, 200),
            rates=[float(r) for r in args.rates.split(",")], stage_seconds=args.stage_seconds,
            seed=seed)
    if args.workload == "prefix-repetition":
        return PrefixRepetitionWorkload(
            requests=pick(args.requests, 100), num_prefixes=args.num_prefixes,
            prefix_tokens=pick(args.shared_prefix_tokens, 256),
            suffix_tokens=pick(args.question_tokens, 256),
            output_tokens=pick(args.answer_tokens, 128), seed=seed)
    return RandomWorkload(
        requests=pick(args.requests, 100), input_tokens=pick(args.question_tokens, 1024),
        output_tokens=pick(args.answer_tokens, 128), range_ratio=args.range_ratio,
        prefix_tokens=pick(args.shared_prefix_tokens, 0), seed=seed)


# ------------------------------------------------------------------------ the run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Fleet, policies, pacing, workload and output flags."""
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--policies", default="round_robin,least_loaded,cache_aware",
                        help=f"comma-separated: {', '.join(POLICIES)}; "
                             f"'{VLLM_ROUTER_PREFIX}NAME' runs vllm-router's policy NAME")
    parser.add_argument("--replica-kind", choices=("sim", "vllm"), default="sim",
                        help="vllm: real servers of --model-dir (on CPU the block size must "
                             "be a multiple of 32)")
    parser.add_argument("--vllm-kv-gib", type=int, default=1,
                        help="vllm on CPU: KV cache GiB per replica (VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--index", choices=("memory", "redis", "auto"), default="auto",
                        help="auto: a private redis-server when one is installed")
    parser.add_argument("--vllm-router", default="auto",
                        help="vllm-router peer policies to add when it is installed "
                             "(comma-separated, 'none' to skip; auto: cache_aware,round_robin)")
    parser.add_argument("--out", type=Path, required=True, help="report folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-tokens", type=int, default=65_536, help="KV tokens per replica")
    parser.add_argument("--max-model-len", type=int, default=16_384)
    parser.add_argument("--prefill-profile", default="h100-llama3.1-8b",
                        help="the sims' cost profile (built-in name or JSON file)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="sims run this many times faster than real time")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR,
                        help="tokenizer (and model for vllm) directory; built if missing")
    parser.add_argument("--sim-tokenizer", action="store_true",
                        help="load the tokenizer in each sim (needed for chat text; slow start)")
    parser.add_argument("--api", choices=("completions", "chat"), default="completions",
                        help="token ids to /v1/completions, or chat text to /v1/chat/completions "
                             "(chat workload only; the sims then load the tokenizer)")
    parser.add_argument("--mode", choices=("closed", "open"), default="closed")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rate", type=float, default=None,
                        help="open loop: Poisson req/s for workloads without arrival times")
    parser.add_argument("--speedup", type=float, default=1.0,
                        help="replay the workload's arrival times this many times faster")
    parser.add_argument("--deadline-s", type=float, default=600.0,
                        help="wall-clock bound per policy run")
    parser.add_argument("--warmup", type=int, default=None,
                        help="cache-neutral requests sent to each router before measuring "
                             "(default: 2 x max(concurrency, replicas); 0 for none)")
    parser.add_argument("--policy-set", action="append", default=[], metavar="KEY=VALUE",
                        help="set a key of our gateways' policy config (docs/POLICY.md), e.g. "
                             "load_cost_s=0.25; repeatable; vllm-router peers are unaffected")
    parser.add_argument("--index-set", action="append", default=[], metavar="KEY=VALUE",
                        help="set a key of our gateways' index config, e.g. deadline_ms=100")
    parser.add_argument("--no-plots", action="store_true")
    add_workload_arguments(parser)


def ensure_model_dir(path: Path) -> Path:
    """The tiny model's directory (the gateway's tokenizer), built once if missing."""
    if (path / "tokenizer.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "replica", "tiny-model", "--out", str(path)],
                   check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return path


def parse_policies(args: argparse.Namespace) -> list[str]:
    """The policy list, with vllm-router peers appended when asked for and installed."""
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        if not p.startswith(VLLM_ROUTER_PREFIX) and p not in POLICIES:
            raise SystemExit(f"compare: unknown policy {p!r}; choose from {', '.join(POLICIES)}")
    peers = args.vllm_router
    if peers == "auto":
        peers = "cache_aware,round_robin" if vllm_router_binary() else "none"
    if peers != "none":
        policies += [VLLM_ROUTER_PREFIX + p for p in peers.split(",") if p]
    return policies


@dataclass
class Comparison:
    """Everything one compare run produced."""

    runs: list[PolicyRun]
    files: ReportFiles
    index: str
    skipped: list[str]


def oracle_stream(records: Sequence[RequestRecord]) -> list[OracleRequest]:
    """The stream the oracles replay: completed requests in plan order, answers included."""
    return [OracleRequest(r.prompt_token_ids, r.output_token_ids, r.cache_salt)
            for r in records if r.ok]


async def warm_up(url: str, args: argparse.Namespace) -> None:
    """Send a few requests that leave no cache behind before measuring a router.

    A freshly started router pays one-off costs on its first requests (connections,
    lazy initialisation): a few hundred ms each on this machine, which would land on the
    first turn of whichever policy ran. Each warm-up prompt has block_size - 1 tokens and
    asks for 1 token, so it never fills a block: no replica caches anything from it and
    no KV event is published.
    """
    n = args.warmup if args.warmup is not None else 2 * max(args.concurrency, args.replicas)
    if n <= 0:
        return
    prompt = list(range(TOKEN_LOW, TOKEN_LOW + args.block_size - 1))
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one() -> None:
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise HarnessError(f"warm-up request to {url} answered {resp.status}: "
                                       f"{(await resp.text())[:300]}")
                await resp.read()

        batch = max(1, args.concurrency)
        for start in range(0, n, batch):
            await asyncio.gather(*(one() for _ in range(min(batch, n - start))))


async def _drive(url: str, args: argparse.Namespace,
                 on_record: Callable[[RequestRecord], None]) -> RunResult:
    config = DriverConfig(
        base_url=url, model=MODEL_NAME, api=args.api, mode=args.mode,
        concurrency=args.concurrency,
        rate=None if args.rate is None else args.rate * args.time_scale,
        speedup=args.speedup * args.time_scale, deadline_s=args.deadline_s,
        request_timeout_s=min(args.deadline_s, 600.0), seed=args.seed)
    return await Driver(config, on_record=on_record).run(build_workload(args))


def run_comparison(args: argparse.Namespace, console: Any = None) -> Comparison:
    """Start everything, run every policy, stop everything, write the report."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    console = console or Console(stderr=True)
    policies = parse_policies(args)
    if args.api == "chat" and args.workload != "chat":
        raise HarnessError("--api chat renders text for the chat workload only")
    args.model_dir = ensure_model_dir(Path(args.model_dir))
    args.out.mkdir(parents=True, exist_ok=True)
    total = len(build_workload(args).plan())
    runs: list[PolicyRun] = []
    skipped: list[str] = []
    with tempfile.TemporaryDirectory(prefix="cacheroute-compare-") as tmp, \
            contextlib.ExitStack() as stack:
        log_dir = Path(tmp)
        use_redis = args.index == "redis" or (
            args.index == "auto" and shutil.which("redis-server") is not None)
        index = "memory"
        if use_redis:
            index = stack.enter_context(redis_server(log_dir))
        console.print(f"starting {args.replicas} {args.replica_kind} replicas "
                      f"(index: {'redis' if use_redis else 'memory'})")
        fleet = (start_sim_fleet(args) if args.replica_kind == "sim"
                 else start_vllm_fleet(args, log_dir))
        stack.callback(fleet.stop)
        with Progress("[bold]{task.description}", BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console) as progress:
            for policy in policies:
                task = progress.add_task(policy, total=total)
                fleet.reset_caches()
                if use_redis:
                    flush_redis(index)
                if policy.startswith(VLLM_ROUTER_PREFIX):
                    peer = policy[len(VLLM_ROUTER_PREFIX):]
                    cm = vllm_router(peer, fleet, log_dir)
                    note = "vllm-router 0.1.17 as a peer (its own hashing and load view)"
                else:
                    cm = gateway(policy, fleet, index, args, log_dir)
                    overrides = {**{f"policy.{k}": v for k, v in policy_overrides(args).items()},
                                 **{f"index.{k}": v for k, v in
                                    policy_overrides(args, "index_set").items()}}
                    note = ("settings: " + ", ".join(
                        f"{k}={v}" for k, v in overrides.items())) if overrides else ""
                try:
                    with cm as url:
                        asyncio.run(warm_up(url, args))
                        before = fleet.request_counts()

                        def advance(_record: RequestRecord, t: Any = task) -> None:
                            progress.advance(t)

                        result = asyncio.run(_drive(url, args, advance))
                except HarnessError as exc:
                    if policy.startswith(VLLM_ROUTER_PREFIX):
                        skipped.append(f"{policy}: {exc}")
                        progress.remove_task(task)
                        continue
                    raise
                done = len(result.completed())
                progress.console.print(f"{policy}: {done}/{len(result.records)} completed in "
                                       f"{result.wall_s:.1f}s")
                after = fleet.request_counts()
                counts = {name: after[name] - before.get(name, 0) for name in after}
                runs.append(PolicyRun(policy, result, [r.name for r in fleet.replicas],
                                      note=note, replica_counts=counts))
        if not runs:
            raise HarnessError("no policy ran")
        oracle = bounds(oracle_stream(runs[0].result.records), args.block_size,
                        args.replicas * fleet.blocks_per_replica)
        for run in runs:
            run.oracle = oracle
        meta = {
            "command": "python -m loadgen " + " ".join(getattr(args, "argv", []) or []),
            "workload": json.dumps(build_workload(args).describe()),
            "replicas": f"{args.replicas} x {args.replica_kind}, block size {args.block_size}, "
                        f"{args.kv_tokens} KV tokens each, profile {args.prefill_profile}",
            "index": "redis (private redis-server)" if use_redis else "memory",
            "pacing": (f"closed loop, concurrency {args.concurrency}" if args.mode == "closed"
                       else "open loop at " + (
                           f"a Poisson rate of {args.rate} req/s" if args.rate is not None
                           else "the workload's arrival times")
                       + f", speedup {args.speedup:g} (in simulated time)"),
            "seed": args.seed,
            "warm-up": "each router first served cache-neutral requests (block_size - 1 "
                       "tokens, 1 output token): one-off start-up costs are not measured",
        }
        if skipped:
            meta["skipped"] = "; ".join(s.splitlines()[0] for s in skipped)
        files = write_report(args.out, runs, meta, time_scale=args.time_scale,
                             plots=not args.no_plots)
    return Comparison(runs, files, index, skipped)


def run(args: argparse.Namespace) -> int:
    """Run the comparison and print the table and where the report is."""
    args.argv = ["compare", *sys.argv[2:]] if sys.argv[1:2] == ["compare"] else []
    try:
        comparison = run_comparison(args)
    except (HarnessError, ValueError) as exc:
        print(f"compare: {exc}", file=sys.stderr)
        return 1
    print(comparison.files.table_md.read_text())
    print(f"report: {comparison.files.table_md}")
    return 0
