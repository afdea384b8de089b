"""The per-request routing pipeline, as plain functions over plain data.

    raw body -> ParsedRequest -> prompt tokens -> block keys (per hash group)
             -> index lookup (one round trip, with a deadline) -> ReplicaState snapshots
             -> policy.decide -> Route

Nothing here touches the web request or writes a response; the app calls `parse_body`
then `RoutingPipeline.route` and hands the Route to the proxy.

Replicas of one model normally share one HashConfig (block size, algorithm, seed); a
fleet that mixes them forms several hash groups, each keyed and looked up separately
(concurrently, under the same deadline), and each replica is matched only against its
own group's chain.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol

import xxhash

from router.hashing import BlockChain, HashConfig, event_key, max_cacheable_blocks
from router.index import IndexUnavailable, PrefixIndex
from router.policy.types import ReplicaState, RoutingDecision, RoutingRequest
from router.replicas import Replica

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


class ClientError(Exception):
    """A mistake in the client's request: becomes an OpenAI-style 4xx error."""

    def __init__(self, status: int, message: str, err_type: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param


@dataclass(frozen=True)
class ParsedRequest:
    """A decoded request body and the fields routing and proxying read from it."""

    endpoint: str  # "chat" | "completions"
    body: dict[str, Any]
    model: str
    stream: bool
    client_wants_usage: bool
    max_tokens: int | None


def parse_body(raw: bytes, endpoint: str) -> ParsedRequest:
    """Decode and sanity-check a body (400 on invalid UTF-8, malformed JSON, no model)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ClientError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ClientError(400, f"request body is not valid JSON: {exc.msg} at line {exc.lineno} "
                          f"column {exc.colno}") from None
    if not isinstance(body, dict):
        raise ClientError(400, "request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ClientError(400, "'model' is required and must be a string", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ClientError(400, "'stream' must be a boolean", param="stream")
    options = body.get("stream_options")
    wants_usage = not stream or (isinstance(options, dict) and options.get("include_usage") is True)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        max_tokens = None
    return ParsedRequest(endpoint=endpoint, body=body, model=model, stream=stream,
                         client_wants_usage=wants_usage, max_tokens=max_tokens)


def upstream_body(parsed: ParsedRequest, cache_salt: str | None,
                  want_token_ids: bool) -> tuple[dict[str, Any], bool]:
    """The body to forward: the tenant's salt injected, usage always requested.

    Returns (body, strip_token_ids): whether the gateway asked for the generated token
    ids itself (to record a replica's cache without KV events) and must hide them.
    """
    body = dict(parsed.body)
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if parsed.stream:
        options = dict(body.get("stream_options") or {})
        options["include_usage"] = True  # the actual cached tokens ride in the usage chunk
        body["stream_options"] = options
    strip = False
    if want_token_ids and not body.get("return_token_ids"):
        body["return_token_ids"] = True
        strip = True
    return body, strip


class Tokenizer(Protocol):
    def request_tokens(self, body: dict[str, Any], endpoint: Any) -> list[int]: ...


@dataclass(frozen=True)
class KnownTokens:
    """A Tokenizer that answers with ids obtained elsewhere (a replica's /tokenize)."""

    tokens: tuple[int, ...]

    def request_tokens(self, body: dict[str, Any], endpoint: Any) -> list[int]:
        return list(self.tokens)


def token_id_prompt(body: Mapping[str, Any]) -> list[int] | None:
    """A completions prompt given as token ids (no tokenizer needed), else None."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    return None


class ChainCache:
    """Remembers block keys by a cheap fingerprint of the tokens they cover.

    A conversation resends its whole history each turn, and many users share system
    prompts. The fingerprint of block i is xxh3-128 over (hash settings, salt) and the
    token bytes of blocks 0..i: ten times cheaper than vLLM's pickle+sha256 key. A
    request walks its fingerprints until the first one not remembered, takes the keys
    remembered up to there, and computes real keys (router.hashing.BlockChain) only for
    the rest. Bounded LRU in blocks; thread-safe (called from the tokenizer pool).
    """

    def __init__(self, capacity_blocks: int = 500_000) -> None:
        self.capacity_blocks = capacity_blocks
        # fingerprint -> (vLLM block key, its 64-bit event form)
        self._memo: OrderedDict[bytes, tuple[bytes, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.hashed_blocks = 0
        self.reused_blocks = 0

    def event_keys(self, config: HashConfig, tokens: Sequence[int],
                   cache_salt: str | None) -> list[int]:
        """The 64-bit event keys of every full block of `tokens` under config and salt."""
        size = config.block_size
        n = len(tokens) // size
        if n == 0:
            return []
        data = memoryview(array("q", tokens[: n * size]).tobytes())
        step = size * 8
        fp = xxhash.xxh3_128(repr((config.algo, size, config.resolved_seed(), cache_salt)).encode())
        prints = []
        for i in range(n):
            fp.update(data[i * step:(i + 1) * step])
            prints.append(fp.digest())
        known: list[tuple[bytes, int]] = []
        with self._lock:
            for p in prints:
                entry = self._memo.get(p)
                if entry is None:
                    break
                known.append(entry)
        reused = len(known)
        chain = BlockChain(config, cache_salt=cache_salt)
        if reused:
            chain.tokens = list(tokens[: reused * size])
            chain.keys = [digest for digest, _ in known]
        added = chain.extend(tokens[reused * size: n * size])
        fresh = [(digest, event_key(digest)) for digest in added]
        with self._lock:
            # Touch tail first and block 0 last, so eviction (oldest first) trims chains
            # from the tail: a later block is useless once an earlier one is gone.
            for p, entry in zip(prints[reused:][::-1], fresh[::-1], strict=True):
                self._memo[p] = entry
                self._memo.move_to_end(p)
            for p in prints[:reused][::-1]:
                if p in self._memo:
                    self._memo.move_to_end(p)
            while len(self._memo) > self.capacity_blocks:
                self._memo.popitem(last=False)
        self.hashed_blocks += len(added)
        self.reused_blocks += reused
        return [ekey for _, ekey in known] + [ekey for _, ekey in fresh]


@dataclass(frozen=True)
class PreparedPrompt:
    """The CPU-bound part of routing: token count and keys for each hash group."""

    num_tokens: int
    tokens: tuple[int, ...] | None
    keys: Mapping[HashConfig, tuple[int, ...]]
    seconds: float


def prepare_prompt(tokenizer: Tokenizer | None, chains: ChainCache, parsed: ParsedRequest,
                   groups: Iterable[HashConfig], cache_salt: str | None) -> PreparedPrompt:
    """Render + tokenize the prompt as the replica will and key it per hash group.

    Synchronous and thread-safe: the app runs it in a thread pool so long prompts do
    not stall the event loop. Without a tokenizer only token-id prompts can be keyed;
    others route on load alone (num_tokens 0, no keys).
    """
    started = time.perf_counter()
    tokens: list[int] | None
    if tokenizer is not None:
        try:
            tokens = tokenizer.request_tokens(parsed.body, parsed.endpoint)
        except ValueError as exc:  # tokenize.RequestError: the replica would refuse it too
            raise ClientError(400, str(exc), param=getattr(exc, "param", None)) from None
    else:
        tokens = token_id_prompt(parsed.body) if parsed.endpoint == "completions" else None
    keys: dict[HashConfig, tuple[int, ...]] = {}
    if tokens:
        for config in groups:
            keys[config] = tuple(chains.event_keys(config, tokens, cache_salt))
    return PreparedPrompt(num_tokens=len(tokens or ()), tokens=tuple(tokens) if tokens else None,
                          keys=keys, seconds=time.perf_counter() - started)


@dataclass(frozen=True)
class LookupResult:
    """Leading blocks held per replica id, or why the index was not consulted."""

    matches: Mapping[str, int]
    fallback: str | None  # None, "deadline", "index_down"
    seconds: float


# How many loop iterations a lookup past its deadline gets to deliver a reply that has
# already arrived (a redis-py reply wakes its waiter through a chain of callbacks).
_LATE_REPLY_YIELDS = 4


async def lookup_matches(index: PrefixIndex, model: str,
                         keys: Mapping[HashConfig, tuple[int, ...]],
                         members: Mapping[HashConfig, set[str]],
                         deadline_s: float) -> LookupResult:
    """Ask the index once per hash group (usually one), all under one deadline.

    Past the deadline or with the index down the request routes on load alone: a slow
    index must never hold a request (it would cost more than the cache saves).
    """
    started = time.perf_counter()
    groups = [(config, chain) for config, chain in keys.items() if chain]
    if not groups:
        return LookupResult({}, None, 0.0)
    # The index's own timeout is only a backstop (twice ours): this deadline decides.
    pending = asyncio.gather(
        *(index.lookup(model, chain, deadline_s=2 * deadline_s) for _, chain in groups))
    try:
        await asyncio.wait({pending}, timeout=deadline_s)
        # On a busy loop the timer and the index's reply can become ready in the same
        # iteration, and the timer runs first: a lookup that already answered would be
        # thrown away. A few yields let an answer that is already here finish; one still
        # in flight is not waited for.
        for _ in range(_LATE_REPLY_YIELDS):
            if pending.done():
                break
            await asyncio.sleep(0)
        if not pending.done():
            pending.cancel()
            return LookupResult({}, "deadline", time.perf_counter() - started)
        answers = pending.result()
    except (IndexUnavailable, OSError, ConnectionError):
        return LookupResult({}, "index_down", time.perf_counter() - started)
    matches: dict[str, int] = {}
    for (config, _), answer in zip(groups, answers, strict=True):
        allowed = members.get(config, set())
        for replica_id, blocks in answer.items():
            if replica_id in allowed:
                matches[replica_id] = max(matches.get(replica_id, 0), blocks)
    return LookupResult(matches, None, time.perf_counter() - started)


def predicted_cached_tokens(matched_blocks: int, num_prompt_tokens: int, block_size: int) -> int:
    """Tokens a replica holding `matched_blocks` leading blocks will serve from cache."""
    return min(matched_blocks, max_cacheable_blocks(num_prompt_tokens, block_size)) * block_size


def snapshot(replica: Replica, matched_blocks: int, now: float) -> ReplicaState:
    """A frozen ReplicaState of one replica for one decision (see Replica.outstanding)."""
    t = replica.target
    running, waiting = replica.outstanding()
    return ReplicaState(
        replica_id=replica.replica_id, healthy=replica.healthy and not replica.removed,
        verified=replica.verified, inflight=replica.inflight, running=running,
        waiting=waiting, kv_usage=replica.kv_usage, matched_blocks=matched_blocks,
        block_size=t.hash_config.block_size, profile=t.prefill,
        models=frozenset(t.models) if t.models else None, ejected=replica.ejected(now),
        capacity=t.max_concurrency,
    )


class Policy(Protocol):
    def decide(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> RoutingDecision: ...


@dataclass
class Route:
    """A routing decision with everything the proxy and the recorder need."""

    parsed: ParsedRequest
    prompt: PreparedPrompt
    decision: RoutingDecision
    candidates: list[Replica]  # decision.ranked, as Replica objects
    matches: Mapping[str, int]
    lookup: LookupResult
    decision_seconds: float
    cache_salt: str | None
    predicted: dict[str, int] = field(default_factory=dict)  # replica id -> cached tokens

    def predicted_for(self, replica_id: str) -> int:
        return self.predicted.get(replica_id, 0)


class NoReplica(Exception):
    """No replica serves the requested model."""


@dataclass
class RoutingPipeline:
    """Runs one request through prepare -> lookup -> snapshot -> decide.

    Holds what a decision needs (tokenizers per model, the chain cache, the index, the
    policy) but no per-request state; `route` is the whole pipeline.
    """

    tokenizers: Mapping[str, Tokenizer]
    chains: ChainCache
    index: PrefixIndex
    policy: Policy
    index_deadline_s: float
    executor: Executor | None = None

    async def route(self, parsed: ParsedRequest, replicas: Sequence[Replica], now: float,
                    tenant: str | None, cache_salt: str | None,
                    session_key: str | None = None, offload: bool = True,
                    tokenizer: Tokenizer | None = None) -> Route:
        """Decide where `parsed` goes among `replicas` (all those serving its model).

        `offload` runs tokenize+hash in the executor: it must for long prompts (tens of
        ms at 32k tokens, see benchmarks/bench_gateway.py), and should not for short ones,
        where the thread hand-off costs more than the work. `tokenizer` overrides the
        model's local one (remote tokenization).
        """
        if not replicas:
            raise NoReplica(parsed.model)
        started = time.perf_counter()
        members: dict[HashConfig, set[str]] = {}
        for r in replicas:
            members.setdefault(r.target.hash_config, set()).add(r.replica_id)
        tokenizer = tokenizer or self.tokenizers.get(parsed.model)
        if offload:
            loop = asyncio.get_running_loop()
            prompt = await loop.run_in_executor(
                self.executor, prepare_prompt, tokenizer, self.chains, parsed, list(members),
                cache_salt)
        else:
            prompt = prepare_prompt(tokenizer, self.chains, parsed, list(members), cache_salt)
        lookup = await lookup_matches(self.index, parsed.model, prompt.keys, members,
                                      self.index_deadline_s)
        states = [snapshot(r, lookup.matches.get(r.replica_id, 0), now) for r in replicas]
        primary = max(prompt.keys.items(), key=lambda kv: len(members[kv[0]]),
                      default=(None, ()))[1]
        request = RoutingRequest(model=parsed.model, keys=primary,
                                 num_prompt_tokens=prompt.num_tokens, tenant=tenant,
                                 session_key=session_key)
        decision = self.policy.decide(request, states)
        by_id = {r.replica_id: r for r in replicas}
        ranked = [by_id[rid] for rid in decision.ranked if rid in by_id]
        if decision.replica_id in by_id and (not ranked or ranked[0].replica_id != decision.replica_id):
            ranked.insert(0, by_id[decision.replica_id])
        predicted = {
            r.replica_id: predicted_cached_tokens(lookup.matches.get(r.replica_id, 0),
                                                  prompt.num_tokens,
                                                  r.target.hash_config.block_size)
            for r in replicas}
        return Route(parsed=parsed, prompt=prompt, decision=decision, candidates=ranked,
                     matches=lookup.matches, lookup=lookup,
                     decision_seconds=time.perf_counter() - started, cache_salt=cache_salt,
                     predicted=predicted)


def completion_keys(chains: ChainCache, config: HashConfig, prompt_tokens: Sequence[int],
                    output_token_ids: Sequence[int], cache_salt: str | None) -> list[int]:
    """The keys of the blocks a replica caches for prompt + generated tokens.

    vLLM hashes generated tokens as decode fills blocks, so the answer's blocks are
    cached too (and a follow-up turn that resends the answer can hit them, as far as the
    chat template reproduces the same ids).
    """
    return chains.event_keys(config, [*prompt_tokens, *output_token_ids], cache_salt)
