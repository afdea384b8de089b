"""What the gateway adds to a request, where that time goes, and routed requests per second.

    .venv/bin/python benchmarks/bench_gateway.py [--rounds 5] [--per-round 12]
        [--model-dir DIR] [--cold-sizes 8192] [--seconds 5] [--workers 2]
        [--gateway-set SECTION.KEY=VALUE] [--baseline-repo DIR] [--return-token-ids]

Three requests, as issue #13 sets their targets: an 8k-token token-id prompt, cold (a
fresh first block, so every block is new); a conversation growing 256 tokens a turn at
8k (token ids); a chat's next turn at 8k (rendered with the tiny model's template and
tokenized as the replica will). A fourth, an agent's first turn as chat (instructions
and 24 tool definitions every session shares, one new question each: the burst an agent
fleet opens with). The growing conversation once more, streamed and timed to its first
token: a client's TTFT (with --return-token-ids its first chunk carries the prompt's 8k
ids, as the load generator's do). `--cold-sizes 64,8192` adds a short cold prompt, where
what is left is the HTTP hops themselves. Replicas are simulated with the instant profile, so the
replica costs next to nothing and what the routers add is what shows.

1. Where the gateway's time goes, per request: the gateway's own functions, called in
   request order in this process (parse, validate, tokenize, hash, lookup against a
   memory index, decide, serialize the forwarded body); the median CPU time of each
   (thread time: on a shared machine, wall time mostly measures the neighbours). A
   long new prompt is keyed only through a probe before sending; the rest of its keys
   is a column of its own (the gateway computes them once the body is upstream).
2. Added latency end to end: the same requests sent to replica 0 directly, through
   cacheroute (`python -m router serve`, memory index fed by KV events) and through
   vllm-router 0.1.17 (cache_aware, kv_aware; when installed in this environment),
   interleaved request by request in a rotating order, over --rounds rounds (each
   target its own conversation each round; its first request is the warm-up and not
   counted). Per round
   the p50 of each target minus direct's p50; printed as the median over rounds and the
   spread (min..max). "proxy+HTTP" is cacheroute's added p50 minus its in-process stages:
   the HTTP server and client, the event loop, the upstream connection.
3. Routed requests/s with 64 concurrent clients and 256-token prompts (--seconds 0 skips),
   with the CPU each router's processes spent per request and its inverse, requests per
   busy core. On 2 shared cores the rate is bounded by the client and the sims as much as
   by the router (vllm-router used a third of a core at its best rate here); the
   per-core figure is what a gateway with one worker per core on its own cores scales by.
   For our gateways, the garbage collections over the section's requests too (from
   cacheroute_gc_pause_seconds; `--gateway-set listen.gc_young_threshold=700` puts
   Python's default beside ours).
4. CPU per routed request: the user + system time each router's processes use over
   --cpu-requests streamed conversation turns, 8 at a time (the shape of the agent
   workload's bursts); the routers take turns each round. On a machine whose cores the
   sims and clients share, what a router burns per request slows everything else.

--splice adds benchmarks/splice_hop.py in front of replica 0 as one more target: the
leanest Python hop (bytes copied both ways, nothing parsed). Its added latency and CPU per
request are the floor under any Python gateway's; section 2 then says what cacheroute
adds beyond it ("cacheroute beyond a hop").

--workers N adds a second gateway as production runs it: N worker processes
(listen.workers) on a private redis-server index fed by an indexer process; it takes
part in 2 and 3 like every other target (the in-process profile is the memory index's),
and in 4 with its Redis's CPU counted as its own. With --baseline-repo as well, the
baseline runs such a gateway too, on a redis-server of its own (on one Redis the two
would share their work as two gateways do, and neither would be alone).
--gateway-set SECTION.KEY=VALUE adds a gateway with one setting changed (e.g.
listen.event_loop=uvloop), --baseline-repo DIR one run from another checkout (a git
worktree of an earlier commit): before/after and setting comparisons interleaved in one
run, as this machine's noise requires.

Every router and replica is a separate process. --model-dir defaults to a tiny model
built into a temporary directory (python -m replica tiny-model).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loadgen.driver import server_timing_stages  # noqa: E402
from loadgen.harness import unbuilt_warning  # noqa: E402
from replica.fleet import SimFleet  # noqa: E402
from replica.processes import (  # noqa: E402
    children,
    cpu_seconds,
    free_port,
    redis_server,
    stop_process,
    wait_until,
)
from router.config import LimitsConfig, TenantsConfig  # noqa: E402
from router.hashing import HashConfig  # noqa: E402
from router.index import MemoryIndex  # noqa: E402
from router.policy.pipeline import build_policy  # noqa: E402
from router.policy.types import PolicyConfig, RoutingRequest  # noqa: E402
from router.replicas import Replica, ReplicaSource  # noqa: E402
from router.request import (  # noqa: E402
    decode_body,
    decode_completion,
    upstream_payload,
    validate_body,
)
from router.routing import (  # noqa: E402
    DEFER_NEW_TEXT_CHARS,
    ENCODE_OFFLOAD_CHARS,
    PROBE_BLOCKS,
    ChainCache,
    lookup_matches,
    prompt_tokens,
    snapshot,
)
from router.tenants import TenantRegistry  # noqa: E402
from router.tokenize import PromptTokenizer  # noqa: E402

BLOCK_SIZE = 16
MODEL = "sim"
SPLICE = "python splice hop"  # --splice's target
MAX_MODEL_LEN = 65536
TURN_TOKENS = 256
VOCAB = 3000  # token ids stay inside the tiny model's vocabulary (3,389): the sims check
WORDS = "the quick brown fox jumps over a lazy dog near five old wells "


# ---------------------------------------------------------------------- the requests


@dataclass(frozen=True)
class Scenario:
    """A kind of request: `conversation(rng)` yields its successive bodies."""

    name: str
    path: str
    conversation: Callable[[random.Random], Iterator[dict[str, Any]]]

    @property
    def endpoint(self) -> str:
        return "chat" if self.path.endswith("chat/completions") else "completions"


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def cold(size: int) -> Scenario:
    def bodies(rng: random.Random) -> Iterator[dict[str, Any]]:
        tail = [(i * 7919) % (VOCAB - 10) + 10 for i in range(size - BLOCK_SIZE)]
        while True:  # a random first block makes every block's key new (keys chain)
            yield {"model": MODEL, "prompt": [*_ids(rng, BLOCK_SIZE), *tail], "max_tokens": 1}
    return Scenario(f"token ids {size // 1024}k cold", "/v1/completions", bodies)


def growing(size: int, stream: bool = False) -> Scenario:
    """A conversation growing TURN_TOKENS a turn from `size`; `stream`: each turn
    streamed, 8 tokens out, timed to its first token (what the client's TTFT is)."""
    def bodies(rng: random.Random) -> Iterator[dict[str, Any]]:
        history = _ids(rng, size)
        while True:
            if stream:
                yield {"model": MODEL, "prompt": list(history), "max_tokens": 8,
                       "stream": True}
            else:
                yield {"model": MODEL, "prompt": list(history), "max_tokens": 1}
            history += _ids(rng, TURN_TOKENS)
    name = f"streamed at {size // 1024}k: 1st token" if stream else \
        f"token ids growing at {size // 1024}k"
    return Scenario(name, "/v1/completions", bodies)


def chat(size: int, tokenizer: PromptTokenizer) -> Scenario:
    system = [{"role": "system", "content": "Be brief. " * 20}]
    pair_tokens = len(tokenizer.chat_tokens({"messages": [*system,
        {"role": "user", "content": WORDS * 8}, {"role": "assistant", "content": WORDS * 8}]}))
    pairs = max(1, size // max(1, pair_tokens - len(tokenizer.chat_tokens({"messages": system}))))

    def bodies(rng: random.Random) -> Iterator[dict[str, Any]]:
        tag = rng.randrange(10**9)  # distinct per conversation: nothing shared across them
        messages: list[dict[str, str]] = [{"role": "system", "content": f"{tag}. " + "Be brief. " * 20}]
        for i in range(pairs):
            messages += [{"role": "user", "content": f"{i}: {WORDS * 8}"},
                         {"role": "assistant", "content": f"{i}: {WORDS * 8}"}]
        turn = 0
        while True:
            question = {"role": "user", "content": f"and then, {turn}?"}
            yield {"model": MODEL, "messages": [*messages, question], "max_tokens": 1}
            messages += [question, {"role": "assistant", "content": f"{turn}: {WORDS}"}]
            turn += 1
    return Scenario(f"chat next turn at {size // 1024}k", "/v1/chat/completions", bodies)


def agent_first_turn(tools: int, tool_words: int) -> Scenario:
    """An agent's first turn as chat: instructions and `tools` tool definitions (each
    `tool_words` words of description) shared by every session, one new question each:
    the burst an agent fleet opens with (loadgen's agent workload sent as chat)."""
    system = "You are an agent. Use the tools when they help. " * 48
    tool_defs = [{"type": "function", "function": {
        "name": f"tool_{k}", "description": f"Tool {k}. " + WORDS * (tool_words // 12),
        "parameters": {"type": "object", "properties": {}}}} for k in range(tools)]

    def bodies(rng: random.Random) -> Iterator[dict[str, Any]]:
        while True:  # every request opens a session of its own
            question = f"task {rng.randrange(10**9)}: " + WORDS * 5
            yield {"model": MODEL, "max_tokens": 1, "tools": tool_defs,
                   "messages": [{"role": "system", "content": system},
                                {"role": "user", "content": question}]}
    return Scenario(f"agent turn 1 ({tools} tools)", "/v1/chat/completions", bodies)


def question_after_shared_prefix(prefix_tokens: int, question_words: int,
                                 tokenizer: PromptTokenizer) -> Scenario:
    """A new question of `question_words` words (~2 tokens each with the tiny model)
    after a system prompt of ~`prefix_tokens` tokens every request shares: llm-d's
    groups shape (loadgen's groups workload), where the gateway knows the prefix and has
    never seen the question."""
    unit = "You answer from the shared documents below. " + WORDS
    per_unit = len(tokenizer.encode(unit, add_special_tokens=False))
    system = unit * max(1, prefix_tokens // per_unit)
    words = ("delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma", "omega")

    def bodies(rng: random.Random) -> Iterator[dict[str, Any]]:
        while True:
            question = " ".join(f"{rng.choice(words)}{rng.randrange(100)}"
                                for _ in range(question_words))
            yield {"model": MODEL, "max_tokens": 1,
                   "messages": [{"role": "system", "content": system},
                                {"role": "user", "content": question}]}
    return Scenario(f"new question after {prefix_tokens // 1000}k", "/v1/chat/completions",
                    bodies)


# ------------------------------------------------------------- 1. where the time goes

STAGES = ("parse", "validate", "tokenize", "hash", "lookup", "decide", "serialize")
# Keys a long new prompt has past its probe (router/routing.py PROBE_BLOCKS), and a chat's
# newest text (DEFER_NEW_TEXT_CHARS): computed once the body is upstream, while the
# replica works; not in the total before sending.
AFTER_SEND = "hash after send"


async def stage_profile(scenario: Scenario, tokenizer: PromptTokenizer, requests: int,
                        ) -> tuple[dict[str, float], float]:
    """Median seconds per stage over `requests` (after one warm-up), and blocks hashed
    per request."""
    config = HashConfig(block_size=BLOCK_SIZE, seed="0")
    registry = TenantRegistry.from_config(TenantsConfig(allow_anonymous=True))
    tenant = registry.identify(None)
    chains, index = ChainCache(), MemoryIndex()
    policy = build_policy(PolicyConfig(name="cache_aware", seed=1))
    fleet = [Replica(target=ReplicaSource(name=f"r{i}", url=f"http://127.0.0.1:{9000 + i}",
                                          models=(MODEL,), hash_config=config).target(),
                     healthy=True) for i in range(2)]
    members = {config: {r.replica_id for r in fleet}}
    times: dict[str, list[float]] = {stage: [] for stage in (*STAGES, AFTER_SEND)}
    hashed: list[int] = []
    bodies = scenario.conversation(random.Random(7))
    for n in range(requests + 1):
        raw = json.dumps(next(bodies)).encode()
        before = chains.hashed_blocks
        t0 = time.thread_time()
        # As parse_request decodes it: a completions prompt of ids read packed, in C.
        body, ids = decode_completion(raw) if scenario.endpoint == "completions" else \
            (decode_body(raw), None)
        t1 = time.thread_time()
        parsed = validate_body(body, raw, scenario.endpoint, served_models={MODEL},
                               limits=LimitsConfig(), tenant=tenant, registry=registry,
                               token_ids=ids)
        t2 = time.thread_time()
        # As the gateway prepares it: a chat's newest text, where it is long enough and
        # no cache holds it, encoded once the request is upstream.
        deferred = None
        tokens: Sequence[int]
        if scenario.endpoint == "chat":
            text, special = tokenizer.chat_text(parsed.body)
            if DEFER_NEW_TEXT_CHARS <= tokenizer.uncached_chars(text, special) \
                    <= ENCODE_OFFLOAD_CHARS:
                deferred = tokenizer.chat_ids_deferred(text, special, parsed.body,
                                                       DEFER_NEW_TEXT_CHARS)
            tokens = deferred.known if deferred is not None else \
                tokenizer.chat_ids(text, special, parsed.body)
        else:
            tokens = prompt_tokens(tokenizer, parsed) or []
        t3 = time.thread_time()
        # As the gateway keys it: a long new part only through a probe before deciding.
        keys = tuple(chains.event_keys(config, tokens, parsed.cache_salt,
                                       None if deferred is not None else PROBE_BLOCKS))
        t4 = time.thread_time()
        lookup = await lookup_matches(index, MODEL, {config: keys}, members, 0.05)
        t5 = time.thread_time()
        states = [snapshot(r, lookup.matches.get(r.replica_id, 0), time.monotonic())
                  for r in fleet]
        policy.decide(RoutingRequest(model=MODEL, keys=keys, num_prompt_tokens=len(tokens)
                                     if deferred is None else deferred.estimate), states)
        t6 = time.thread_time()
        upstream_payload(parsed, want_token_ids=False)
        t7 = time.thread_time()
        if deferred is not None:  # the newest text, encoded and keyed once sent
            chains.event_keys(config, deferred.finish(), parsed.cache_salt)
        elif len(keys) < len(tokens) // BLOCK_SIZE:
            chains.event_keys(config, tokens, parsed.cache_salt)  # the rest, once sent
        t8 = time.thread_time()
        if n == 0:
            continue  # the conversation's first request: caches cold
        for stage, seconds in zip((*STAGES, AFTER_SEND),
                                  (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5,
                                   t7 - t6, t8 - t7), strict=True):
            times[stage].append(seconds)
        hashed.append(chains.hashed_blocks - before)
    return {s: statistics.median(v) for s, v in times.items()}, statistics.median(hashed)


def print_profile(profiles: dict[str, tuple[dict[str, float], float]]) -> None:
    print("\n1) where the gateway's time goes per request (CPU ms of the serving thread, median;"
          " in-process; CPU time, so other processes on a busy machine do not inflate it)")
    header = f"{'request':<26} | " + " | ".join(f"{s:>9}" for s in STAGES) + \
        f" | {'total':>7} | {AFTER_SEND} | blocks hashed"
    print(header)
    print("-" * len(header))
    for name, (stages, hashed) in profiles.items():
        total = sum(stages[s] for s in STAGES)
        print(f"{name:<26} | " + " | ".join(f"{stages[s] * 1000:>9.3f}" for s in STAGES) +
              f" | {total * 1000:>7.3f} | {stages[AFTER_SEND] * 1000:>{len(AFTER_SEND)}.3f}"
              f" | {hashed:.0f}")


# ------------------------------------------------------------------ processes


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
    helpers: list[subprocess.Popen[bytes]] = field(default_factory=list)  # its indexer
    counted: list[int] = field(default_factory=list)  # not its own, its CPU counted: Redis


def start_process(cmd: list[str], ready_url: str, log_path: Path,
                  env: dict[str, str] | None = None, timeout: float = 90.0, cwd: Path = REPO,
                  ) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: _ok(ready_url), timeout, f"{cmd[0:4]} to be ready", proc=proc)
    except (TimeoutError, RuntimeError) as exc:
        stop_process(proc)
        raise RuntimeError(f"{exc}:\n{log_path.read_text(errors='replace')[-3000:]}") from None
    return proc


def start_cacheroute(fleet: SimFleet, tmp: Path, model_dir: str, repo: Path = REPO,
                     redis_url: str | None = None, workers: int = 1,
                     setting: str | None = None, name: str | None = None) -> Router:
    """A gateway on the sims: on a memory index it feeds itself from the KV events; on
    `redis_url` with `workers` processes, with an indexer process feeding the index (the
    production layout). `setting` ("SECTION.KEY=VALUE") changes one setting of it, and
    names it; `name` names it otherwise."""
    port = free_port()
    raw: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": port},
        "models": {MODEL: {"tokenizer": model_dir, "max_model_len": MAX_MODEL_LEN}},
        "replicas": [{"url": r.url, "models": [MODEL], "block_size": BLOCK_SIZE,
                      "hash_seed": "0", "kv_events": r.kv_events_endpoint,
                      "kv_replay": r.replay_endpoint} for r in fleet.replicas],
        "index": {"backend": redis_url or "memory", "deadline_ms": 50},
        "tenants": {"allow_anonymous": True},
        "proxy": {"max_body_bytes": 64 * 1024 * 1024, "expose_routing_headers": True},
        "limits": {"max_tokens_limit": 16},
    }
    name = name or ("cacheroute" if redis_url is None else f"cacheroute redis {workers}w")
    if redis_url is not None:
        raw["listen"]["workers"] = workers
    if setting is not None:
        key, value = split_setting(setting)
        section, _, leaf = key.partition(".")
        raw.setdefault(section, {})[leaf] = yaml.safe_load(value)
        name += f" {setting}"
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", name)
    path = tmp / f"{stem}.yaml"
    path.write_text(yaml.safe_dump(raw))
    helpers = []
    if redis_url is not None:
        with open(tmp / f"{stem}-indexer.log", "wb") as log:
            helpers.append(subprocess.Popen(
                [sys.executable, "-m", "router", "indexer", "--config", str(path),
                 "--log-level", "WARNING"], cwd=repo, stdout=log, stderr=subprocess.STDOUT))
    proc = start_process([sys.executable, "-m", "router", "serve", "--config", str(path),
                          "--log-level", "WARNING"], f"http://127.0.0.1:{port}/ready",
                         tmp / f"{stem}.log", cwd=repo)
    return Router(name, f"http://127.0.0.1:{port}", proc, helpers)


def split_setting(text: str) -> tuple[str, str]:
    """"SECTION.KEY=VALUE" -> (SECTION.KEY, VALUE); ValueError naming `text` otherwise."""
    key, eq, value = text.partition("=")
    section, dot, leaf = key.partition(".")
    if not eq or not dot or not section or not leaf or "." in leaf:
        raise ValueError(f"--gateway-set {text!r}: expected SECTION.KEY=VALUE, "
                         "e.g. listen.event_loop=asyncio")
    return key, value


def start_splice(fleet: SimFleet, tmp: Path) -> Router:
    """benchmarks/splice_hop.py in front of replica 0: the floor of a Python hop (bytes
    copied both ways, nothing parsed), as a target beside the routers (`--splice`)."""
    port = free_port()
    upstream = urllib.parse.urlsplit(fleet.urls[0])
    assert upstream.hostname is not None and upstream.port is not None
    # Ready once the replica's own /health answers through it.
    proc = start_process([sys.executable, str(REPO / "benchmarks" / "splice_hop.py"), str(port),
                          upstream.hostname, str(upstream.port)],
                         f"http://127.0.0.1:{port}/health", tmp / "splice-hop.log")
    return Router(SPLICE, f"http://127.0.0.1:{port}", proc)


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




# ------------------------------------------------------------- 2. added latency, e2e


async def one_request(session: aiohttp.ClientSession, url: str, path: str, raw: bytes
                      ) -> tuple[float, dict[str, float]]:
    """Seconds to the whole answer (a streamed one: to its first token, the first
    event with text), and the stages of cacheroute's Server-Timing header (seconds;
    empty from other routers)."""
    started = time.perf_counter()
    first: float | None = None
    async with session.post(url + path, data=raw,
                            headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}{path}: HTTP {resp.status}: {(await resp.text())[:200]}")
        if resp.content_type == "text/event-stream":
            seen = b""
            async for piece in resp.content.iter_any():  # read to the end: keep-alive
                seen += piece
                if first is None and re.search(rb'"text": ?"', seen):
                    first = time.perf_counter()
        else:
            await resp.read()
        timing = resp.headers.get("Server-Timing", "")
    end = first if first is not None else time.perf_counter()
    return end - started, server_timing_stages(timing)


async def added_latency(targets: list[tuple[str, str]], scenarios: list[Scenario], rounds: int,
                        per_round: int, extra: dict[str, Any] | None = None,
                        ) -> tuple[dict[str, dict[str, list[float]]],
                                   dict[str, dict[str, list[float]]]]:
    """scenario -> target -> per-round p50 (seconds), targets[0] being the direct
    baseline; and scenario -> Server-Timing stage -> its per-round p50 on `cacheroute`."""
    out: dict[str, dict[str, list[float]]] = {s.name: {t: [] for t, _ in targets} for s in scenarios}
    in_situ: dict[str, dict[str, list[float]]] = {s.name: {} for s in scenarios}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for round_ in range(rounds):
            for scenario in scenarios:
                convs = {name: scenario.conversation(random.Random(f"{round_}-{scenario.name}-{name}"))
                         for name, _ in targets}
                seen: dict[str, list[float]] = {name: [] for name, _ in targets}
                stages: dict[str, list[float]] = {}
                for i in range(per_round + 1):
                    # Interleaved, each target in turn, starting one further along per
                    # request: whoever follows a given target inherits its wake (the
                    # replicas' KV events from the last cold prompt reach every gateway
                    # just then), which with a fixed order cost the gateway right after
                    # `direct` ~3 ms on the cold prompt, whichever code it ran.
                    shift = i % len(targets)
                    for name, url in targets[shift:] + targets[:shift]:
                        raw = json.dumps({**next(convs[name]), **(extra or {})}).encode()
                        seconds, timing = await one_request(session, url, scenario.path, raw)
                        if i:
                            seen[name].append(seconds)
                            if name == "cacheroute":
                                for stage, value in timing.items():
                                    stages.setdefault(stage, []).append(value)
                for name, values in seen.items():
                    out[scenario.name][name].append(statistics.median(values))
                for stage, values in stages.items():
                    in_situ[scenario.name].setdefault(stage, []).append(statistics.median(values))
    return out, in_situ


def print_added(results: dict[str, dict[str, list[float]]], direct: str,
                profiles: dict[str, tuple[dict[str, float], float]],
                in_situ: dict[str, dict[str, list[float]]]) -> None:
    print("\n2) added latency end to end (ms): per round p50(target) - p50(direct); "
          "median over rounds [min..max]")
    header = f"{'request':<26} | {'target':<24} | {'p50':>8} | {'added p50':>9} | {'spread':>17}"
    print(header)
    print("-" * len(header))
    for scenario, by_target in results.items():
        base = by_target[direct]
        for name, p50s in by_target.items():
            if name == direct:
                print(f"{scenario:<26} | {name:<24} | {statistics.median(p50s) * 1000:>8.2f} |")
                continue
            added = [p - b for p, b in zip(p50s, base, strict=True)]
            med = statistics.median(added)
            print(f"{scenario:<26} | {name:<24} | {statistics.median(p50s) * 1000:>8.2f} | "
                  f"{med * 1000:>+9.2f} | {min(added) * 1000:>+7.2f}..{max(added) * 1000:<+7.2f}")
        if "cacheroute" in by_target and scenario in profiles:
            inproc = sum(profiles[scenario][0].values())
            ours = statistics.median(p - b for p, b in zip(by_target["cacheroute"], base,
                                                            strict=True))
            print(f"{'':<26} | {'cacheroute proxy+HTTP':<24} | {'':>8} | "
                  f"{(ours - inproc) * 1000:>+9.2f} | (added - in-process stages)")
        if "cacheroute" in by_target and SPLICE in by_target:
            # Per round, like every figure here: what is ours beyond the hop itself.
            beyond = statistics.median(c - h for c, h in zip(by_target["cacheroute"],
                                                            by_target[SPLICE], strict=True))
            print(f"{'':<26} | {'cacheroute beyond a hop':<24} | {'':>8} | "
                  f"{beyond * 1000:>+9.2f} | (cacheroute - {SPLICE})")
        stages = in_situ.get(scenario, {})
        if stages:
            # The same functions as the in-process profile, timed inside the serving
            # gateway (its Server-Timing header), on a loop shared with KV events,
            # scrapes and the other requests' answers.
            cells = ", ".join(f"{name} {statistics.median(v) * 1000:.2f}"
                              for name, v in stages.items())
            print(f"{'':<26} | {'cacheroute in situ':<24} | {'':>8} | {cells} "
                  "(Server-Timing, ms)")


# ------------------------------------------------------------------- 3. throughput


async def throughput(url: str, seconds: float, concurrency: int) -> tuple[int, float]:
    """(requests answered, seconds taken) by `concurrency` clients sending for `seconds`."""
    rng = random.Random(3)
    done = 0
    stop_at = time.perf_counter() + seconds

    def body() -> bytes:
        return json.dumps({"model": MODEL, "prompt": _ids(rng, 256), "max_tokens": 1}).encode()

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await one_request(session, url, "/v1/completions", body())
            done += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await one_request(session, url, "/v1/completions", body())
        started = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        return done + 1, time.perf_counter() - started


@dataclass
class Saturation:
    """One target's figures over the rounds of section 3."""

    rates: list[float] = field(default_factory=list)  # req/s, one per round
    cpu: list[float] = field(default_factory=list)  # CPU seconds per request, one per round
    # Our gateway's garbage collections over all rounds, by generation: (count, seconds),
    # from its cacheroute_gc_pause_seconds (none for a router without that metric).
    gc: dict[str, tuple[float, float]] = field(default_factory=dict)
    requests: int = 0


_GC_LINE = re.compile(r'^cacheroute_gc_pause_seconds_(count|sum)\{generation="(\d)"\} (\S+)$')


def gc_pauses(url: str) -> dict[str, tuple[float, float]]:
    """Generation -> (collections, seconds) from a gateway's /metrics; {} without it."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError):
        return {}
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        m = _GC_LINE.match(line)
        if m:
            out.setdefault(m.group(2), [0.0, 0.0])[m.group(1) == "sum"] = float(m.group(3))
    return {gen: (v[0], v[1]) for gen, v in out.items()}


def saturation(routers: list[Router], targets: list[tuple[str, str]], rounds: int,
               seconds: float, concurrency: int) -> dict[str, Saturation]:
    """Target name -> its rates, CPU per request and (ours) collections. Targets take
    turns, starting one further along each round: the 2-core machine's speed drifts by
    more than the gaps measured."""
    procs = {r.name: r for r in routers}
    out = {name: Saturation() for name, _ in targets}
    for round_ in range(rounds):
        shift = round_ % len(targets)
        for name, url in targets[shift:] + targets[:shift]:
            r = procs.get(name)
            pids = [] if r is None or r.proc is None else \
                [r.proc.pid, *children(r.proc.pid), *(h.pid for h in r.helpers), *r.counted]
            gc_before = gc_pauses(url) if r is not None else {}
            before = sum(cpu_seconds(pid) for pid in pids)
            answered, elapsed = asyncio.run(throughput(url, seconds, concurrency))
            used = sum(cpu_seconds(pid) for pid in pids) - before
            got = out[name]
            got.rates.append((answered - 1) / elapsed)
            got.requests += answered
            if pids:  # the CPU of every request answered, the first (unhurried) one too
                got.cpu.append(used / answered)
            for gen, (count, secs) in (gc_pauses(url) if gc_before else {}).items():
                c0, s0 = gc_before.get(gen, (0.0, 0.0))
                c1, s1 = got.gc.get(gen, (0.0, 0.0))
                got.gc[gen] = (c1 + count - c0, s1 + secs - s0)
    return out


def _spread(values: list[float], fmt: str) -> str:
    return (f"{format(statistics.median(values), fmt)} "
            f"[{format(min(values), fmt)}..{format(max(values), fmt)}]")


# ------------------------------------------------------- 4. CPU per routed request


async def streamed_burst(url: str, requests: int, concurrency: int, size: int,
                         seed: int, extra: dict[str, Any] | None = None,
                         cold: bool = False) -> int:
    """About `requests` streamed conversation turns (token ids, `size` tokens growing 256
    a turn, 16 tokens out, usage asked for), `concurrency` conversations at a time; how
    many it sent. `cold`: each request a new prompt of `size` tokens instead."""
    per_client = max(1, requests // concurrency)

    async def client(session: aiohttp.ClientSession, rng: random.Random) -> None:
        history = _ids(rng, size)
        for _ in range(per_client):
            body = {"model": MODEL, "prompt": list(history), "max_tokens": 16,
                    "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
            async with session.post(url + "/v1/completions", json=body) as resp:
                async for _chunk in resp.content.iter_any():
                    pass
                if resp.status != 200:
                    raise RuntimeError(f"{url}: HTTP {resp.status}")
            history = _ids(rng, size) if cold else history + _ids(rng, TURN_TOKENS)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        await asyncio.gather(*(client(session, random.Random(f"{seed}-{i}"))
                               for i in range(concurrency)))
    return per_client * concurrency


def cpu_per_request(routers: list[Router], rounds: int, requests: int, concurrency: int,
                    size: int, extra: dict[str, Any] | None = None, cold: bool = False,
                    ) -> dict[str, list[float]]:
    """Router -> CPU seconds per request of its processes, one figure per round; the
    routers take turns within each round, starting one further along each round: in a
    fixed order the first router measured 5-20% more than the second, whichever code
    either ran (the sims' KV events of the last burst reach every gateway)."""
    out: dict[str, list[float]] = {r.name: [] for r in routers if r.proc is not None}
    for round_ in range(rounds):
        shift = round_ % max(1, len(routers))
        for r in routers[shift:] + routers[:shift]:
            if r.proc is None:
                continue
            pids = [r.proc.pid, *children(r.proc.pid), *(h.pid for h in r.helpers), *r.counted]
            asyncio.run(streamed_burst(r.url, concurrency, concurrency, size, -1 - round_, extra,
                                       cold))
            before = sum(cpu_seconds(pid) for pid in pids)
            sent = asyncio.run(streamed_burst(r.url, requests, concurrency, size, round_, extra,
                                              cold))
            out[r.name].append((sum(cpu_seconds(pid) for pid in pids) - before) / sent)
    return out


def tiny_model(tmp: Path) -> str:
    out = tmp / "tiny-model"
    subprocess.run([sys.executable, "-m", "replica", "tiny-model", "--out", str(out)],
                   cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return str(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="0: the in-process profile only")
    parser.add_argument("--per-round", type=int, default=12,
                        help="requests per target, scenario and round (after one warm-up)")
    parser.add_argument("--cold-sizes", default="8192",
                        help="token-id prompt sizes for the cold request, comma-separated")
    parser.add_argument("--size", type=int, default=8192,
                        help="where the growing conversation and the chat start (tokens)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--model-dir", help="a model directory (python -m replica tiny-model)")
    parser.add_argument("--no-peers", action="store_true", help="leave vllm-router out")
    parser.add_argument("--splice", action="store_true",
                        help="also a bare Python hop to replica 0 (benchmarks/splice_hop.py: "
                        "bytes copied both ways, nothing parsed), the floor under any Python "
                        "gateway's added latency and CPU per request")
    parser.add_argument("--workers", type=int, default=0, metavar="N",
                        help="also run a gateway of N worker processes on a private Redis "
                        "index with its indexer (production's layout; 0: not)")
    parser.add_argument("--cpu-requests", type=int, default=160,
                        help="streamed requests per router and round for the CPU figure "
                        "(0: skip it)")
    parser.add_argument("--gateway-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="also run a gateway (memory index) with this one setting changed, "
                        "interleaved with the others, e.g. listen.event_loop=asyncio "
                        "(repeatable: one gateway each)")
    parser.add_argument("--baseline-repo", type=Path, metavar="DIR",
                        help="also run a gateway (memory index) from this checkout, e.g. a "
                        "git worktree of main, interleaved with the others: a before/after "
                        "comparison in one run")
    parser.add_argument("--return-token-ids", action="store_true",
                        help="every request asks for return_token_ids, as the load generator "
                        "(loadgen/driver.py) and token-in/token-out clients do: answers carry "
                        "the prompt's ids, which the gateway reads on the way to the first "
                        "token")
    parser.add_argument("--gateway-repo", type=Path, default=REPO,
                        help="run the gateway from this checkout (a before/after comparison)")
    args = parser.parse_args(argv)
    for setting in args.gateway_set:
        try:
            split_setting(setting)
        except ValueError as exc:
            parser.error(str(exc))
    for repo in dict.fromkeys(filter(None, (args.gateway_repo, args.baseline_repo))):
        if warning := unbuilt_warning(repo.resolve()):
            print(warning, file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    model_dir = args.model_dir or tiny_model(tmp)
    tokenizer = PromptTokenizer.from_dir(model_dir, max_model_len=MAX_MODEL_LEN)
    scenarios = [*(cold(int(s)) for s in args.cold_sizes.split(",")), growing(args.size),
                 growing(args.size, stream=True),
                 chat(args.size, tokenizer), agent_first_turn(24, 180),
                 question_after_shared_prefix(3000, 300, tokenizer)]
    profiles = {s.name: asyncio.run(stage_profile(s, tokenizer, max(20, args.per_round)))
                for s in scenarios}
    print_profile(profiles)
    if args.rounds < 1:
        return 0  # the in-process profile only
    longest = max(int(s) for s in args.cold_sizes.split(",")) + \
        args.size + TURN_TOKENS * (args.per_round + 2)
    routers: list[Router] = []
    with contextlib.ExitStack() as stack, SimFleet(args.replicas, block_size=BLOCK_SIZE, num_blocks=longest * 8 // BLOCK_SIZE,
                  prefill_profile="instant", served_model_name=MODEL, model_dir=model_dir,
                  extra_args=["--max-model-len", str(MAX_MODEL_LEN)]) as fleet:
        # One private redis-server per Redis gateway: two on one would see each other's
        # shared work (neither alone), and each one's CPU is its gateway's (section 4).
        redis = stack.enter_context(redis_server(tmp / "redis.log")) if args.workers else None
        redis_base = stack.enter_context(redis_server(tmp / "redis-baseline.log")) \
            if args.workers and args.baseline_repo is not None else None
        try:
            routers.append(start_cacheroute(fleet, tmp, model_dir, args.gateway_repo))
            for setting in args.gateway_set:
                routers.append(start_cacheroute(fleet, tmp, model_dir, args.gateway_repo,
                                                setting=setting))
            if args.baseline_repo is not None:
                routers.append(start_cacheroute(fleet, tmp, model_dir, args.baseline_repo,
                                                name="cacheroute baseline"))
            for server, repo, label in ((redis, args.gateway_repo, None),
                                        (redis_base, args.baseline_repo, "baseline ")):
                if server is None or repo is None:
                    continue
                gateway = start_cacheroute(
                    fleet, tmp, model_dir, repo, server.url, args.workers,
                    name=f"cacheroute {label or ''}redis {args.workers}w")
                assert server.proc is not None
                gateway.counted.append(server.proc.pid)
                routers.append(gateway)
            for policy in () if args.no_peers else ("cache_aware", "kv_aware"):
                r = start_vllm_router(fleet, tmp, policy)
                if r is not None:
                    routers.append(r)
            if args.splice:
                routers.append(start_splice(fleet, tmp))
            direct = ("direct (replica 0)", fleet.urls[0])
            targets = [direct, *((r.name, r.url) for r in routers)]
            print(f"\n{args.replicas} sim replicas (instant profile); routers: "
                  f"{', '.join(r.name for r in routers)}; {args.rounds} rounds x "
                  f"{args.per_round} requests per target and request kind")
            extra = {"return_token_ids": True} if args.return_token_ids else None
            results, in_situ = asyncio.run(added_latency(targets, scenarios, args.rounds,
                                                         args.per_round, extra))
            print_added(results, direct[0], profiles, in_situ)
            if args.seconds > 0:
                print(f"\n3) routed requests/s ({args.concurrency} concurrent clients, 256-token "
                      f"prompts, max_tokens 1, {args.seconds:.0f} s each, the targets taking "
                      f"turns over {max(1, args.rounds)} rounds): the rate here is what 2 shared "
                      f"cores allow the client, the sims and the router together; CPU per "
                      f"request (the router's processes) and requests per busy core of the "
                      f"router are what one worker per core scales by; median [min..max]")
                rates = saturation(routers, targets, max(1, args.rounds), args.seconds,
                                   args.concurrency)
                for name, sat in rates.items():
                    line = f"   {name:<24} {_spread(sat.rates, '.0f')} req/s"
                    if sat.cpu:
                        line += (f"   CPU {_spread([c * 1000 for c in sat.cpu], '.3f')} ms/req"
                                 f"   {_spread([1 / c for c in sat.cpu], '.0f')} req/s per core")
                    print(line)
                    if sat.gc:
                        print(f"   {'':<24} garbage collector over its {sat.requests} requests "
                              "(generation: collections, ms in all): " + ", ".join(
                                  f"{gen}: {count:.0f}, {secs * 1000:.0f}"
                                  for gen, (count, secs) in sorted(sat.gc.items())))
            if args.cpu_requests > 0:
                sent = max(1, args.cpu_requests // 8) * 8
                cpu = cpu_per_request(routers, args.rounds, args.cpu_requests, 8, 4096, extra)
                print(f"\n4) CPU per routed request (ms; user + system time of the router's "
                      f"processes, its indexer and Redis included, over {sent} streamed "
                      f"requests: 8 conversations at a time, token ids from 4k growing 256 a "
                      f"turn, 16 tokens out); median over rounds [min..max]")
                for name, values in cpu.items():
                    print(f"   {name:<24} {statistics.median(values) * 1000:8.2f} "
                          f"[{min(values) * 1000:.2f}..{max(values) * 1000:.2f}]")
                # Every block of a cold prompt is new: keyed, and stored (then, on a full
                # cache, evicted) in the gateway's index from the replica's KV events.
                cpu = cpu_per_request(routers, args.rounds, args.cpu_requests, 8, 8192, extra,
                                      cold=True)
                print(f"\n   the same over {sent} cold 8k-token prompts (8 at a time, each "
                      f"new): median over rounds [min..max]")
                for name, values in cpu.items():
                    print(f"   {name:<24} {statistics.median(values) * 1000:8.2f} "
                          f"[{min(values) * 1000:.2f}..{max(values) * 1000:.2f}]")
        finally:
            for r in routers:
                for proc in [*([r.proc] if r.proc is not None else []), *r.helpers]:
                    stop_process(proc)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
