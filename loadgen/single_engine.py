"""`python -m loadgen single-engine`: the chat workload on one in-process simulated engine.

No network and no gateway: the sim's own block pool and cost model (replica/engine.py)
decide every hit, so the figures isolate what a prompt layout does to one replica's
prefix cache. By default requests run one at a time, each arriving when the previous
finished, so the counts are exact and repeatable and follow from the block rules by
hand (a hit is the leading run of cached full blocks, at most (n - 1) // B of them).
The run is made twice, prefix caching on and off, to put the TTFT the cache saves
beside the hit rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import deque
from dataclasses import dataclass, field

from loadgen.workloads import PREAMBLE_POSITIONS, ChatWorkload, PlannedRequest, Workload
from replica.engine import Engine, EngineConfig, EngineRequest, RequestRejected, RequestResult
from replica.profiles import DEFAULT_PROFILE, load_profile
from router.hashing import HashConfig


@dataclass(frozen=True)
class RequestFigures:
    """One request's cache figures and latency, in stream order."""

    request_id: str
    conversation_id: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float | None
    e2e_s: float


@dataclass
class EngineRun:
    """One pass of the workload through one engine."""

    requests: list[RequestFigures] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    evictions: int = 0
    preemptions: int = 0
    virtual_seconds: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)

    @property
    def cached_tokens(self) -> int:
        return sum(r.cached_tokens for r in self.requests)

    @property
    def hit_rate(self) -> float:
        """Tokens served from cache over prompt tokens looked up, as vLLM's metrics count."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ttft_mean_s(self) -> float:
        values = [r.ttft_s for r in self.requests if r.ttft_s is not None]
        return statistics.fmean(values) if values else 0.0


def run_on_engine(workload: Workload, config: EngineConfig, concurrency: int = 1) -> EngineRun:
    """Run every planned request through a fresh engine, at most `concurrency` at a time.

    Requests start in plan order, each as soon as a slot is free and its conversation's
    previous turn has finished (a conversation resends the answer, so it cannot run
    ahead of it); answers are fed back to the workload as the engine produced them.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    engine = Engine(config)
    run = EngineRun()
    pending: deque[PlannedRequest] = deque(workload.plan())
    in_flight: dict[str, PlannedRequest] = {}
    busy: set[str] = set()
    results: dict[int, RequestFigures] = {}
    while pending or in_flight:
        while pending and len(in_flight) < concurrency and pending[0].conversation_id not in busy:
            planned = pending.popleft()
            req = workload.render(planned, at=engine.now)
            try:
                engine.add_request(EngineRequest(
                    request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                    max_tokens=req.max_tokens, cache_salt=req.cache_salt, arrival=engine.now,
                ))
            except RequestRejected:
                run.rejected.append(req.request_id)
                # A rejected turn still moves its conversation on, answering nothing.
                workload.record_answer(planned, ())
                continue
            in_flight[req.request_id] = planned
            busy.add(planned.conversation_id)
        if not in_flight:
            continue
        for result in engine.step():
            planned = in_flight.pop(result.request_id)
            busy.discard(planned.conversation_id)
            workload.record_answer(planned, result.output_token_ids)
            results[planned.index] = _figures(planned, result)
    run.requests = [results[i] for i in sorted(results)]
    run.evictions = engine.stats.evictions
    run.preemptions = engine.stats.preemptions
    run.virtual_seconds = engine.now
    return run


def _figures(planned: PlannedRequest, result: RequestResult) -> RequestFigures:
    return RequestFigures(
        request_id=result.request_id, conversation_id=planned.conversation_id,
        turn=planned.turn, prompt_tokens=result.prompt_tokens,
        cached_tokens=result.cached_tokens, ttft_s=result.ttft,
        e2e_s=result.finish_time - result.arrival,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The chat workload's shape, the engine's cache and the run's pacing."""
    parser.add_argument("--requests", type=int, default=64, help="total requests R")
    parser.add_argument("--conversations", type=int, default=8,
                        help="conversations in flight C; request i is turn i//C of "
                             "conversation i%%C, so C = R makes every request a fresh one")
    parser.add_argument("--shared-prefix-tokens", type=int, default=1000,
                        help="system prompt plus tool schema shared by every request (S)")
    parser.add_argument("--preamble-tokens", type=int, default=0,
                        help="per-request preamble (timestamp, request id, user) (K)")
    parser.add_argument("--preamble-position", choices=PREAMBLE_POSITIONS,
                        default="after-system")
    parser.add_argument("--question-tokens", type=int, default=50, help="user question (Q)")
    parser.add_argument("--answer-tokens", type=int, default=50, help="answer length (A)")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size (B)")
    parser.add_argument("--kv-tokens", type=int, default=262_144,
                        help="usable KV cache in tokens (T): T // B blocks (plus vLLM's null block)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context limit (default: the most the pool allows)")
    parser.add_argument("--salt", choices=("none", "conversation"), default="none",
                        help="cache_salt per conversation isolates conversations' caches")
    parser.add_argument("--profile", default=DEFAULT_PROFILE,
                        help="prefill cost profile: a built-in name or a JSON file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=1,
                        help="requests in flight (default 1: one after another, exact figures)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def engine_config(args: argparse.Namespace, *, caching: bool) -> EngineConfig:
    """The engine the flags describe, with prefix caching on or off."""
    # T counts usable tokens, as the sim's --kv-tokens does; vLLM's pool also holds one
    # null block that never stores KV.
    num_blocks = args.kv_tokens // args.block_size + 1
    capacity = (num_blocks - 1) * args.block_size
    max_model_len = min(args.max_model_len or capacity, capacity)
    return EngineConfig(
        hash=HashConfig(block_size=args.block_size),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_batched_tokens=max(8192, args.block_size),
        enable_prefix_caching=caching,
        profile=load_profile(args.profile),
        seed=args.seed,
    )


def workload_from(args: argparse.Namespace) -> ChatWorkload:
    """The chat workload the flags describe."""
    return ChatWorkload(
        requests=args.requests, conversations=args.conversations,
        shared_prefix_tokens=args.shared_prefix_tokens, preamble_tokens=args.preamble_tokens,
        preamble_position=args.preamble_position, question_tokens=args.question_tokens,
        answer_tokens=args.answer_tokens, salt=args.salt, seed=args.seed,
    )


def summarize(args: argparse.Namespace) -> dict[str, object]:
    """Run the workload with and without prefix caching; the figures as one object."""
    cached = run_on_engine(workload_from(args), engine_config(args, caching=True),
                           args.concurrency)
    uncached = run_on_engine(workload_from(args), engine_config(args, caching=False),
                             args.concurrency)
    return {
        "workload": workload_from(args).describe(),
        "block_size": args.block_size,
        "kv_tokens": args.kv_tokens,
        "profile": args.profile,
        "concurrency": args.concurrency,
        "hit_rate": cached.hit_rate,
        "prompt_tokens": cached.prompt_tokens,
        "cached_tokens": cached.cached_tokens,
        "recomputed_tokens": cached.prompt_tokens - cached.cached_tokens,
        "evictions": cached.evictions,
        "preemptions": cached.preemptions,
        "rejected": cached.rejected,
        "ttft_ms_mean": cached.ttft_mean_s * 1000,
        "ttft_ms_mean_no_cache": uncached.ttft_mean_s * 1000,
        "virtual_seconds": cached.virtual_seconds,
        "virtual_seconds_no_cache": uncached.virtual_seconds,
        "requests": [
            {"request_id": r.request_id, "conversation_id": r.conversation_id, "turn": r.turn,
             "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
             "ttft_ms": None if r.ttft_s is None else r.ttft_s * 1000}
            for r in cached.requests
        ],
    }


def run(args: argparse.Namespace) -> int:
    """Print the figures (a table, or one JSON object with --json)."""
    try:
        summary = summarize(args)
    except ValueError as exc:
        raise SystemExit(f"single-engine: {exc}") from exc
    if args.json:
        print(json.dumps(summary))
        return 0
    w = summary["workload"]
    assert isinstance(w, dict)
    print(f"chat workload on one simulated engine ({args.profile} cost profile, virtual time)")
    print(f"  {args.requests} requests over {w['conversations']} conversations, "
          f"S={args.shared_prefix_tokens} K={args.preamble_tokens} "
          f"({args.preamble_position}) Q={args.question_tokens} A={args.answer_tokens}, "
          f"B={args.block_size}, pool {args.kv_tokens} tokens, salt {args.salt}, "
          f"concurrency {args.concurrency}, seed {args.seed}")
    print(f"  hit rate            {summary['hit_rate']:.1%} "
          f"({summary['cached_tokens']:,} of {summary['prompt_tokens']:,} prompt tokens)")
    print(f"  recomputed tokens   {summary['recomputed_tokens']:,}")
    print(f"  evictions           {summary['evictions']:,}")
    print(f"  mean TTFT           {summary['ttft_ms_mean']:.2f} ms with the cache, "
          f"{summary['ttft_ms_mean_no_cache']:.2f} ms without")
    rejected = summary["rejected"]
    assert isinstance(rejected, list)
    if rejected:
        print(f"  rejected            {len(rejected)} (longer than the context limit)")
    return 0
