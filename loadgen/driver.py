"""Drive a workload against an OpenAI-compatible server and time every request.

Two pacings:

- open loop: each request is sent at its arrival offset (the workload's, or a seeded
  Poisson process at `rate`), whatever the server's backlog: queueing shows up in TTFT.
  A conversation's next turn cannot precede the answer it resends, so it is sent at
  max(its arrival, the previous turn's end).
- closed loop: `concurrency` requests in flight; a free slot takes the first request in
  plan order whose conversation is not waiting on an answer.

Every request streams (`stream_options.include_usage`) so TTFT is the first chunk
carrying tokens; prompt and cached tokens come from the server's usage block, the
serving replica from the gateway's `x-cacheroute-replica` header. `return_token_ids`
asks for the answer's token ids, which the next turn resends; when a server gives none
the workload's own answer is resent instead and the record says so (that resend cannot
hit the answer's blocks, so hit rates come out lower than a real client's).

Bounded: at most `max_requests`, within `deadline_s` (requests still open then are
cancelled and recorded as errors), each within `request_timeout_s`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import aiohttp

from loadgen.workloads import PlannedRequest, TimedRequest, Workload, poisson_arrivals

REPLICA_HEADER = "x-cacheroute-replica"
# The SSE comment that names the replica answering when a failover came after the head
# went out naming another (router/proxy.py).
_ANSWERED_BY = b": " + REPLICA_HEADER.encode() + b":"
PREDICTED_HEADER = "x-cacheroute-predicted-cached-tokens"
PREDICTED_TTFT_HEADER = "x-cacheroute-predicted-ttft-ms"
CANDIDATES_HEADER = "x-cacheroute-candidates"


@dataclass
class RequestRecord:
    """One request's outcome, times in seconds from the start of the run."""

    index: int
    request_id: str
    conversation_id: str
    turn: int
    scheduled_s: float | None
    sent_s: float
    prompt_len: int
    max_tokens: int
    first_token_s: float | None = None
    end_s: float | None = None
    status: int | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int = 0
    replica: str | None = None
    # What the gateway expected the replica to have cached (its index's view).
    predicted_cached_tokens: int | None = None
    # The first token's time the gateway's cost model predicted on the replica it chose
    # (x-cacheroute-predicted-ttft-ms; our gateway only), in the gateway's seconds.
    predicted_ttft_s: float | None = None
    # Where the gateway's time went (its Server-Timing header: parse, route, admit,
    # upstream; router/completions.py Stages), for a run's analysis.
    server_timing: str | None = None
    # Every candidate the gateway ranked, with its predicted cached tokens, TTFT and score
    # (x-cacheroute-candidates): why the request went where it went.
    candidates: str | None = None
    answer_from_server: bool = False
    chunk_times_s: list[float] = field(default_factory=list)
    # Kept for the oracles; left out of results.json (large).
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    cache_salt: str | None = None
    # Whether prompt_token_ids are the server's own (return_token_ids) rather than the
    # workload's; a chat request's messages and tools, to tokenize when they are not.
    prompt_from_server: bool = False
    chat_request: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.sent_s

    @property
    def itl_s(self) -> list[float]:
        """Gaps between successive token-carrying chunks."""
        t = self.chunk_times_s
        return [b - a for a, b in itertools.pairwise(t)]

    def summary(self) -> dict[str, Any]:
        """The record as results.json keeps it (no token ids)."""
        d = asdict(self)
        for k in ("prompt_token_ids", "output_token_ids", "output_text", "chunk_times_s",
                  "chat_request"):
            d.pop(k)
        d["ttft_s"], d["e2e_s"] = self.ttft_s, self.e2e_s
        itl = self.itl_s
        d["itl_mean_s"] = sum(itl) / len(itl) if itl else None
        return d


def predicted_ttft_s(header: str | None) -> float | None:
    """x-cacheroute-predicted-ttft-ms in seconds; None without it, or where it is not a
    finite non-negative number (a record keeps what it can read, never fails on it)."""
    try:
        ms = float(header) if header is not None else math.nan
    except ValueError:
        return None
    return ms / 1000.0 if math.isfinite(ms) and ms >= 0 else None


def server_timing_stages(header: str) -> dict[str, float]:
    """A Server-Timing header's durations in seconds, by metric name, in its order:
    `parse;dur=0.51, route;dur=0.67` -> {"parse": 0.00051, "route": 0.00067}. Metrics
    without a duration are left out; a duration that is not a number raises ValueError."""
    stages: dict[str, float] = {}
    for metric in filter(None, (m.strip() for m in header.split(","))):
        name, _, params = metric.partition(";")
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key == "dur":
                stages[name] = float(value) / 1000.0
    return stages


@dataclass(frozen=True)
class DriverConfig:
    """Where to send, how to pace, and the bounds."""

    base_url: str
    model: str
    # tokens: token ids to /v1/completions; chat: the workload's chat messages (and tools)
    # to /v1/chat/completions.
    api: Literal["tokens", "chat"] = "tokens"
    mode: Literal["open", "closed"] = "closed"
    concurrency: int = 4
    rate: float | None = None
    # Arrival offsets are divided by this (2.0 replays a trace twice as fast).
    speedup: float = 1.0
    max_requests: int | None = None
    deadline_s: float = 300.0
    request_timeout_s: float = 120.0
    api_key: str | None = None
    seed: int = 0


@dataclass
class RunResult:
    """All records of one run, in plan order, and its wall-clock span."""

    records: list[RequestRecord]
    wall_s: float
    started_unix: float

    def completed(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]


class Driver:
    """Sends one workload's requests through one aiohttp session."""

    def __init__(
        self,
        config: DriverConfig,
        on_record: Callable[[RequestRecord], None] | None = None,
    ) -> None:
        self.config = config
        self.on_record = on_record
        self._start = 0.0

    def _now(self) -> float:
        return time.monotonic() - self._start

    async def run(self, workload: Workload) -> RunResult:
        """Run the workload's plan (bounded by max_requests and deadline_s)."""
        cfg = self.config
        plan = workload.plan()
        if cfg.max_requests is not None:
            plan = plan[: cfg.max_requests]
        if cfg.mode == "open":
            plan = self._with_arrivals(plan)
        records: dict[int, RequestRecord] = {}
        self._start = time.monotonic()
        started_unix = time.time()
        timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            if cfg.mode == "open":
                job = self._open_loop(session, workload, plan, records)
            else:
                job = self._closed_loop(session, workload, plan, records)
            try:
                await asyncio.wait_for(job, timeout=cfg.deadline_s)
            except TimeoutError:
                pass  # unfinished requests are recorded below
        ordered = []
        for p in plan:
            rec = records.get(p.index)
            if rec is None:
                scheduled = None if p.arrival is None else p.arrival / cfg.speedup
                rec = RequestRecord(p.index, f"req-{p.index}", p.conversation_id, p.turn,
                                    scheduled, self._now(), 0, 0, error="not sent: deadline")
            elif rec.end_s is None and rec.error is None:
                rec.error = "cancelled: deadline"
            ordered.append(rec)
        return RunResult(ordered, self._now(), started_unix)

    def _with_arrivals(self, plan: list[PlannedRequest]) -> list[PlannedRequest]:
        if all(p.arrival is not None for p in plan):
            return plan
        if self.config.rate is None:
            raise ValueError("open loop needs a rate: this workload has no arrival times")
        arrivals = poisson_arrivals(self.config.seed, "driver", [self.config.rate], 0.0,
                                    len(plan))
        return [PlannedRequest(p.index, p.conversation_id, p.turn, at)
                for p, at in zip(plan, arrivals, strict=True)]

    async def _open_loop(self, session: aiohttp.ClientSession, workload: Workload,
                         plan: Sequence[PlannedRequest],
                         records: dict[int, RequestRecord]) -> None:
        conversations: dict[str, list[PlannedRequest]] = {}
        for p in plan:
            conversations.setdefault(p.conversation_id, []).append(p)

        async def conversation(turns: list[PlannedRequest]) -> None:
            for p in turns:
                assert p.arrival is not None
                # Pacing to the schedule, not synchronisation: the open loop's definition.
                delay = p.arrival / self.config.speedup - self._now()
                if delay > 0:
                    await asyncio.sleep(delay)
                await self._send(session, workload, p, records)

        await asyncio.gather(*(conversation(t) for t in conversations.values()))

    async def _closed_loop(self, session: aiohttp.ClientSession, workload: Workload,
                           plan: Sequence[PlannedRequest],
                           records: dict[int, RequestRecord]) -> None:
        pending: deque[PlannedRequest] = deque(plan)
        busy: set[str] = set()
        changed = asyncio.Condition()

        def take() -> PlannedRequest | None:
            for p in pending:
                if p.conversation_id not in busy:
                    pending.remove(p)
                    busy.add(p.conversation_id)
                    return p
            return None

        async def worker() -> None:
            while True:
                async with changed:
                    p = take()
                    while p is None:
                        if not pending:
                            return
                        await changed.wait()
                        p = take()
                try:
                    await self._send(session, workload, p, records)
                finally:
                    async with changed:
                        busy.discard(p.conversation_id)
                        changed.notify_all()

        await asyncio.gather(*(worker() for _ in range(max(1, self.config.concurrency))))

    def _body(self, req: TimedRequest) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self.config.model,
            "max_tokens": req.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            # Answers of the planned length whatever the model samples: load is the plan's.
            "ignore_eos": True,
            "temperature": 0.0,
            "user": req.conversation_id,
        }
        if req.cache_salt is not None:
            body["cache_salt"] = req.cache_salt
        if self.config.api == "chat":
            if req.messages is None:
                raise ValueError(f"workload gave no chat messages for {req.request_id}")
            body["messages"] = [{"role": m.role, "content": m.content} for m in req.messages]
            if req.tools:
                body["tools"] = list(req.tools)
            return "/v1/chat/completions", body
        body["prompt"] = list(req.prompt_token_ids)
        return "/v1/completions", body

    async def _send(self, session: aiohttp.ClientSession, workload: Workload,
                    planned: PlannedRequest, records: dict[int, RequestRecord]) -> None:
        req = workload.render(planned, at=self._now() * self.config.speedup)
        rec = RequestRecord(
            index=planned.index, request_id=req.request_id,
            conversation_id=planned.conversation_id, turn=planned.turn,
            scheduled_s=None if planned.arrival is None else planned.arrival / self.config.speedup,
            sent_s=self._now(), prompt_len=len(req.prompt_token_ids), max_tokens=req.max_tokens,
            prompt_token_ids=req.prompt_token_ids, cache_salt=req.cache_salt,
        )
        records[planned.index] = rec
        try:
            await self._stream(session, req, rec)
        except asyncio.CancelledError:
            rec.error = rec.error or "cancelled: deadline"
            raise
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
        finally:
            if rec.end_s is None:
                rec.end_s = None if rec.error else self._now()
            answer: Sequence[int] = rec.output_token_ids
            text: str | None = rec.output_text if rec.ok else None
            if not rec.answer_from_server:
                answer, text = req.fallback_answer, None
            workload.record_answer(planned, answer, text)
            if self.on_record is not None:
                self.on_record(rec)

    async def _stream(self, session: aiohttp.ClientSession, req: TimedRequest,
                      rec: RequestRecord) -> None:
        path, body = self._body(req)
        if "messages" in body:
            rec.chat_request = {k: body[k] for k in ("messages", "tools") if k in body}
        # The conversation is the session: session_affinity keys on x-session-id.
        headers = {"x-request-id": req.request_id, "x-session-id": req.conversation_id}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        async with session.post(self.config.base_url.rstrip("/") + path, json=body,
                                headers=headers) as resp:
            rec.status = resp.status
            rec.replica = resp.headers.get(REPLICA_HEADER)
            predicted = resp.headers.get(PREDICTED_HEADER)
            if predicted is not None and predicted.isdigit():
                rec.predicted_cached_tokens = int(predicted)
            rec.predicted_ttft_s = predicted_ttft_s(resp.headers.get(PREDICTED_TTFT_HEADER))
            rec.server_timing = resp.headers.get("Server-Timing")
            rec.candidates = resp.headers.get(CANDIDATES_HEADER)
            if resp.status != 200:
                text = (await resp.text())[:300]
                rec.error = f"HTTP {resp.status}: {text}"
                return
            token_ids: list[int] = []
            texts: list[str] = []
            got_ids = False
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    if line.startswith(_ANSWERED_BY):  # a failover after the head
                        rec.replica = line[len(_ANSWERED_BY):].strip().decode()
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return
                self._read_chunk(chunk, rec, token_ids, texts)
                got_ids = got_ids or any("token_ids" in c for c in chunk.get("choices") or [])
            rec.end_s = self._now()
            rec.output_token_ids = token_ids
            rec.output_text = "".join(texts)
            rec.answer_from_server = got_ids and bool(token_ids)
            if rec.output_tokens == 0:
                rec.output_tokens = len(token_ids)

    def _read_chunk(self, chunk: dict[str, Any], rec: RequestRecord,
                    token_ids: list[int], texts: list[str]) -> None:
        now = self._now()
        carried = False
        # With return_token_ids vLLM sends the prompt as it tokenized it (chat text
        # rendered by its template): the oracles must replay those ids, not ours.
        prompt_ids = chunk.get("prompt_token_ids")
        for choice in chunk.get("choices") or []:
            prompt_ids = prompt_ids or choice.get("prompt_token_ids")
            ids = choice.get("token_ids") or []
            token_ids.extend(int(t) for t in ids)
            text = choice.get("text")
            if text is None:
                text = (choice.get("delta") or {}).get("content")
            if text:
                texts.append(text)
            carried = carried or bool(ids) or bool(text)
        if prompt_ids:
            rec.prompt_token_ids = tuple(int(t) for t in prompt_ids)
            rec.prompt_from_server = True
        if carried:
            if rec.first_token_s is None:
                rec.first_token_s = now
            rec.chunk_times_s.append(now)
        usage = chunk.get("usage")
        if usage:
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.output_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            rec.cached_tokens = details.get("cached_tokens")
