"""Forwarding and streaming: timeouts, failover before the first byte, clean mid-stream errors.

The rule that shapes this module: a request may move to another replica only while the
client has seen none of its answer. So a streamed response's events are held until its
first *content* token (vLLM's first chunk carries only the assistant role and arrives
before the model has produced anything; a replica that dies on its first token would
otherwise have committed us to it). Until then every failure (connect error, 5xx, reset,
first-token timeout) is retryable on the next replica in the decision's ranking, within
a retry budget. After the first content nothing is retried: the stream ends with a
well-formed SSE error event and `data: [DONE]`.

The head of a streamed answer (200, text/event-stream) waits for that first content by
default, so a request that fails on every replica gets an error status (502, 504), which
clients such as the openai package retry. With proxy.early_head it goes out as soon as the
first replica accepted the stream, as vLLM and vllm-router send theirs: for clients, or
proxies in front, that give up on a response with no head during a long prefill (or a
prefill hold). A failover after that head streams the next replica's answer into the same
response, an SSE comment (`: x-cacheroute-replica: ID`, which clients skip) naming the
replica answering where the head named another; a request that fails on every replica
then ends with an error event whose `code` is the status, as a stream from vLLM does.
It is not a latency lever: timed per hop on the agent workload (token ids, 4 sims, 8 in
flight, 3 rounds interleaved), the gateway's write of the first token reached the client
in 1.67 ms (p50) with the head gone before and 1.64 ms with head and token written
together; the rounds' TTFT medians moved either way within their spread.

Which failures move on: only those that are the replica's state, not the request's. A
connection refused, a 503 (not ready, overloaded) and a stall (no first token in time: a
paused or wedged replica) go to the next replica. A 5xx or a lost connection after the
replica accepted the request first asks the replica's /health: if it is dying, the
request may be what killed it (vLLM's EngineCore dies on some inputs), so it is not
carried to the next replica but answered with an error and held back for a while
(router/suspects.py); a lost connection is carried once, since a replica killed from
outside looks the same.

Timeouts are explicit and there is no total timeout (it would cut long generations):
connect, first token (request sent -> first content event), and idle (between events).
A non-streamed response shows no tokens until it is done, so its deadline is the first-
token timeout plus the idle timeout per requested token: what a replica that keeps
producing tokens could take.

The upstream response is closed the moment the client goes away (a write fails, or
aiohttp cancels the handler: the gateway runs with handler_cancellation on), which drops
the connection and makes vLLM abort the request instead of generating for nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from router.config import ProxyConfig
from router.front_http import AnyRequest, AnyResponse, prepare, send_head, stream_response
from router.metrics import GatewayMetrics
from router.replicas import Fleet, Replica
from router.request import error_payload
from router.suspects import SuspectList, Suspicion
from router.upstream import ProxyOutcome, SSEReader, StreamState, UpstreamRequest, event_data
from router.upstream_http import (
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamPool,
    UpstreamResponse,
)

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
# The response header naming the replica that answered (proxy.expose_routing_headers).
REPLICA_HEADER = "x-cacheroute-replica"
_MAX_ERROR_BODY = 64 * 1024


def json_error(status: int, message: str, err_type: str, *, param: str | None = None,
               headers: Mapping[str, str] | None = None) -> web.Response:
    """An OpenAI-style JSON error response (router.request's one error shape)."""
    return web.json_response(error_payload(message, err_type, param=param, code=status),
                             status=status, headers=headers)


class RetryBudget:
    """Retries in progress may not exceed a share of the requests in flight.

    Under a fleet-wide failure every request would otherwise retry and multiply the
    load on whatever still works; the floor keeps retries possible at low traffic.
    Retries after a refused connection are exempt (see Forwarder.forward).
    """

    def __init__(self, ratio: float, minimum: int) -> None:
        self.ratio = ratio
        self.minimum = minimum
        self.inflight = 0
        self.retrying = 0

    def try_acquire(self) -> bool:
        if self.retrying >= max(self.minimum, int(self.ratio * self.inflight)):
            return False
        self.retrying += 1
        return True

    def release(self) -> None:
        self.retrying -= 1


class UpstreamFailure(Exception):
    """An attempt failed before any byte reached the client.

    `accepted`: the replica had taken the request on (it answered 5xx other than 503, or
    the connection was lost after the request went out), so the request itself may be
    the cause; such a failure moves on only while the replica stays healthy.
    """

    def __init__(self, reason: str, detail: str, status: int = 502, *,
                 accepted: bool = False) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.status = status
        self.accepted = accepted
        self.status_seen = 0  # the replica's own HTTP status, where it answered one


@dataclass
class _Answer:
    """The client's streamed answer once its head is out (proxy.early_head): a later
    attempt streams into it, and a request failed on every attempt ends it with an error
    event."""

    response: AnyResponse | None = None
    replica_id: str = ""  # whose acceptance sent the head (and whom its headers name)


class Forwarder:
    """Sends a routed request to the ranked replicas in turn and relays the answer."""

    def __init__(self, session: aiohttp.ClientSession, pool: UpstreamPool, fleet: Fleet,
                 settings: ProxyConfig, metrics: GatewayMetrics,
                 rng: random.Random | None = None) -> None:
        # Routed requests go through `pool` (router/upstream_http.py says why); the
        # health probe of a suspect replica through the session, as the gateway's own
        # calls do.
        self._session = session
        self._pool = pool
        self._fleet = fleet
        self.settings = settings
        self._metrics = metrics
        self._rng = rng or random.Random()
        self.budget = RetryBudget(settings.retry_budget_ratio, settings.min_retry_budget)
        self.suspects = SuspectList(settings.suspect_ttl_s, settings.suspect_capacity)

    async def forward(self, request: AnyRequest, up: UpstreamRequest,
                      ranked: Sequence[Replica],
                      response_headers: Callable[[Replica], dict[str, str]] | None = None,
                      ) -> tuple[AnyResponse, ProxyOutcome]:
        """Try `ranked` in order (at most 1 + max_retries attempts) and answer the client."""
        outcome = ProxyOutcome()
        if len(self.suspects):
            suspicion = self.suspects.refused(up.identity())
            if suspicion is not None:
                self._metrics.record_suspect_refusal()
                outcome.status = 422
                outcome.error = "suspect request"
                return json_error(422, suspicion.message(self.suspects.now()),
                                  "invalid_request_error"), outcome
        self.budget.inflight += 1
        retrying = False
        answer = _Answer()
        try:
            last: UpstreamFailure | None = None
            for replica in ranked[: 1 + self.settings.max_retries]:
                if outcome.attempts > 0:
                    if retrying:
                        self.budget.release()
                        retrying = False
                    # A connection that was never made cost no replica anything, so its
                    # retry adds no load a storm could multiply: only other failures
                    # (resets, 5xx, stalls) spend the budget. A replica going away in a
                    # rolling restart refuses connections; those requests must move on.
                    if outcome.failures[-1][1] != "connect":
                        if not self.budget.try_acquire():
                            self._metrics.record_retry_budget_exhausted()
                            break
                        retrying = True
                    self._metrics.record_retry(*outcome.failures[-1])
                    await asyncio.sleep(self._backoff(outcome.attempts))
                outcome.attempts += 1
                outcome.replica_id = replica.replica_id
                try:
                    return await self._attempt(request, up, replica, outcome,
                                               response_headers or _no_headers, answer)
                except UpstreamFailure as failure:
                    last = failure
                    outcome.failures.append((replica.replica_id, failure.reason))
                    self._metrics.record_upstream_failure(replica.replica_id, failure.reason)
                    if self._fleet.report_failure(replica, failure.reason):
                        self._metrics.record_ejection(replica.replica_id)
                    log.warning("attempt %d on %s failed before the first byte: %s",
                                outcome.attempts, replica.replica_id, failure)
                    suspicion = await self._suspect(replica, up, failure)
                    if suspicion is not None and suspicion.refused:
                        outcome.status = 502
                        outcome.error = f"suspect: {failure}"
                        return await self._fail(answer, 502, (
                            f"replica {replica.replica_id} failed while serving this request "
                            f"({failure.detail[:200]}) and then failed its health check "
                            f"({suspicion.cause}): the request may be what killed it, so it "
                            "is not retried on another replica, and identical requests are "
                            f"refused for {self.suspects.ttl_s:.0f}s"), "upstream_error"), outcome
            if last is None:
                outcome.status = 503
                outcome.error = "no replica available"
                return json_error(503, "no healthy replica serves this model",
                                  "service_unavailable"), outcome
            outcome.status = last.status
            outcome.error = str(last)
            return await self._fail(answer, last.status, f"upstream failed after "
                                    f"{outcome.attempts} attempt(s): {last}",
                                    "upstream_error"), outcome
        finally:
            if retrying:
                self.budget.release()
            self.budget.inflight -= 1

    async def _fail(self, answer: _Answer, status: int, message: str,
                    err_type: str) -> AnyResponse:
        """A request that failed on every attempt: a JSON error with `status`, or where
        its head is out already, the stream's last event (the status as its `code`)."""
        if answer.response is None:
            return json_error(status, message, err_type)
        with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError):
            await answer.response.write(_error_event(message, err_type, status))
            await answer.response.write_eof()
        return answer.response

    async def _suspect(self, replica: Replica, up: UpstreamRequest,
                       failure: UpstreamFailure) -> Suspicion | None:
        """When the replica accepted the request and is now failing its health, record
        the request as a suspect (router/suspects.py); None when the replica is healthy
        or the failure was never the request's."""
        if not failure.accepted:
            return None
        problem = await self._health_problem(replica)
        if problem is None:
            return None
        conclusive = failure.reason != "reset"
        what = f"HTTP {failure.status_seen}" if conclusive else "connection lost"
        suspicion = self.suspects.strike(up.identity(), replica.replica_id,
                                         f"{what}, then {problem}", conclusive=conclusive)
        self._metrics.record_suspect(replica.replica_id, suspicion.refused)
        verdict = (f"refused for {self.suspects.ttl_s:.0f}s" if suspicion.refused
                   else f"strike {suspicion.strikes}, retried")
        log.warning("request %s suspected of killing replica %s (%s, then %s): %s",
                    up.headers.get("x-request-id", "-"), replica.replica_id, what, problem,
                    verdict)
        return suspicion

    async def _health_problem(self, replica: Replica) -> str | None:
        """Ask the replica's /health now (a short deadline); None when it answers 200."""
        timeout = aiohttp.ClientTimeout(total=self.settings.suspect_probe_timeout_s)
        try:
            async with self._session.get(f"{replica.base_url}/health", timeout=timeout) as resp:
                await resp.read()
                return None if resp.status == 200 else f"/health {resp.status}"
        except TimeoutError:
            return "/health timed out"
        except (aiohttp.ClientError, OSError) as exc:
            return f"/health {type(exc).__name__}"

    def _backoff(self, attempt: int) -> float:
        """Full-jitter exponential backoff, so retries from many requests spread out."""
        cap = min(self.settings.backoff_max_s, self.settings.backoff_base_s * (2 ** attempt))
        return self._rng.uniform(0, cap)

    async def _attempt(self, request: AnyRequest, up: UpstreamRequest, replica: Replica,
                       outcome: ProxyOutcome, headers_for: Callable[[Replica], dict[str, str]],
                       answer: _Answer) -> tuple[AnyResponse, ProxyOutcome]:
        """One try at `replica`. The response's own headers come from `headers_for`, asked
        once the answer's head can go out (streamed: on the replica's head with
        proxy.early_head, else on its first token), so that they can say how long that
        took."""
        s = self.settings
        if up.stream:
            deadline = s.first_token_timeout_s
        else:
            deadline = s.first_token_timeout_s + s.idle_timeout_s * max(1, up.max_tokens or 1)
        replica.start_request()
        # The routing decision already entered this request in its chosen replica's
        # account (so that the next decision saw it); a failover attempt enters its own.
        work = up.reserved.pop(replica.replica_id, None)
        if work is None:
            prefill_s, predicted_ttft_s = up.predicted_work.get(replica.replica_id, (0.0, 0.0))
            work = replica.work.begin(self._fleet.now(), prefill_s, predicted_ttft_s, up.stream,
                                      up.predicted_cached.get(replica.replica_id))
        resp: UpstreamResponse | None = None
        try:
            state = StreamState(up, outcome)
            held: list[bytes] = []
            reader: SSEReader | None = None
            try:
                async with asyncio.timeout(deadline):
                    body = up.payload if up.payload is not None else \
                        json.dumps(up.body).encode()
                    resp = await self._pool.send(
                        "POST", replica.base_url, up.path, body, up.headers,
                        connect_timeout_s=s.connect_timeout_s, on_sent=up.on_sent)
                    if resp.status >= 500:
                        text = (await resp.read(_MAX_ERROR_BODY)).decode(errors="replace")
                        raise _status_failure(resp.status, text)
                    if resp.status >= 400 or not up.stream:
                        payload = await resp.read()
                    else:
                        if s.early_head and answer.response is None:
                            answer.response = stream_response(
                                request, resp.status, _stream_headers(resp, headers_for(replica)))
                            answer.replica_id = replica.replica_id
                            # A client gone by now is noticed where it always is: its
                            # handler is cancelled, or the first content's write fails.
                            with contextlib.suppress(ConnectionError,
                                                     aiohttp.ClientConnectionResetError):
                                await send_head(answer.response, request)
                        reader = SSEReader(resp)
                        while True:
                            event = await reader.next_event()
                            if event is None:
                                raise UpstreamFailure("reset", "stream ended before any content")
                            out, content = state.process(event)
                            failed = state.error_code
                            if failed is not None:
                                # The replica failed it before any content: as a 5xx answer.
                                raise _status_failure(failed, event_data(event).decode(
                                    errors="replace"))
                            if out is not None:
                                held.append(out)
                            if content or not s.hold_until_content:
                                break
                        # Its first token: the replica's prefill of it is done.
                        replica.work.first_byte(work, self._fleet.now())
            except TimeoutError as exc:
                if isinstance(exc, UpstreamConnectTimeout):
                    raise UpstreamFailure("connect", "connect timed out", 504) from exc
                # Connected but silent (no headers, or no content yet): a stalled replica,
                # e.g. one that is paused or whose engine is stuck.
                raise UpstreamFailure("first_token_timeout",
                                      f"no first token within {deadline:.1f}s", 504) from exc
            except UpstreamConnectError as exc:
                raise UpstreamFailure("connect", str(exc)) from exc
            except (aiohttp.ClientError, ConnectionError) as exc:
                raise UpstreamFailure("reset", f"{type(exc).__name__}: {exc}",
                                      accepted=True) from exc

            self._fleet.report_success(replica)
            outcome.status = resp.status
            if reader is None:
                outcome.completed = resp.status < 400
                outcome.first_byte_at = time.perf_counter()
                return self._plain_response(resp, payload, state, headers_for(replica)), outcome
            response = answer.response
            if response is None:
                response = stream_response(request, resp.status,
                                           _stream_headers(resp, headers_for(replica)))
            elif answer.replica_id != replica.replica_id:
                # The head named the replica that failed after accepting: an SSE comment
                # (which clients skip) names the one answering, where headers say it.
                named = headers_for(replica).get(REPLICA_HEADER)
                if named is not None:
                    held.insert(0, b": %s: %s\n\n" % (REPLICA_HEADER.encode(), named.encode()))
            await self._relay(request, response, reader, held, state, replica)
            return response, outcome
        finally:
            replica.end_request()
            # The usage of this attempt's answer (streamed: its last chunk), if it came.
            replica.work.end(work, self._fleet.now(), outcome.cached_tokens)
            if resp is not None:
                # An answer read to its end leaves its connection for the next request;
                # one cut short drops it, which is how vLLM learns to abort the request.
                resp.release()
            if state.saw_token_ids:
                outcome.output_token_ids = state.token_ids

    def _plain_response(self, resp: UpstreamResponse, payload: bytes,
                        state: StreamState, headers: dict[str, str]) -> web.Response:
        body = payload
        if resp.status < 400:
            body = state.absorb_body(payload)
        return web.Response(status=resp.status, body=body, headers={
            "Content-Type": resp.headers.get("content-type", "application/json"), **headers})

    async def _relay(self, request: AnyRequest, response: AnyResponse,
                     reader: SSEReader, held: list[bytes], state: StreamState,
                     replica: Replica) -> None:
        """Send the held events, then every further event as it arrives."""
        outcome = state.outcome
        try:
            await prepare(response, request)
            outcome.first_byte_at = time.perf_counter()
            if held:  # the role event and the first token: one write, one packet
                await response.write(b"".join(held))
            async for event in self._events_after_commit(reader, state, replica):
                await response.write(event)
            outcome.completed = outcome.error is None
            with contextlib.suppress(ConnectionError):
                await response.write_eof()
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            outcome.client_disconnected = True
            self._metrics.record_client_disconnect()
            log.info("client went away; closing the upstream request on %s", replica.replica_id)
        except asyncio.CancelledError:
            # aiohttp cancels the handler when the client disconnects.
            outcome.client_disconnected = True
            self._metrics.record_client_disconnect()
            raise

    async def _events_after_commit(self, reader: SSEReader, state: StreamState,
                                   replica: Replica) -> AsyncIterator[bytes]:
        """Upstream events after the first byte, a run of them at a time; a failure now
        ends the stream with an SSE error event, because the client has already seen
        part of the answer."""
        idle = IdleWatch(self.settings.idle_timeout_s)
        try:
            while True:
                try:
                    idle.reading()
                    events = await reader.next_events()
                except asyncio.CancelledError:
                    if not idle.expired():
                        raise
                    reason = "idle_timeout"
                    detail = f"no data for {self.settings.idle_timeout_s:.1f}s"
                except (aiohttp.ClientError, ConnectionError) as exc:
                    reason, detail = "reset", f"{type(exc).__name__}: {exc}"
                else:
                    if events is None:
                        return
                    idle.done_reading()
                    out = state.process_run(events)
                    if out:
                        yield out
                    continue
                break
        finally:
            idle.close()
        state.outcome.error = f"{reason}: {detail}"
        self._metrics.record_upstream_failure(replica.replica_id, reason)
        if self._fleet.report_failure(replica, reason):
            self._metrics.record_ejection(replica.replica_id)
        log.warning("upstream %s failed mid-stream: %s", replica.replica_id, detail)
        yield _error_event(f"upstream replica failed mid-stream ({reason})", "upstream_error",
                           502)


class IdleWatch:
    """Cancels the current task once no data arrived for `idle_s`: the idle timeout of
    a stream that is being relayed.

    Only time spent waiting for the replica counts, as with asyncio.timeout around each
    read; but that would create and cancel a timer per event, where this keeps one
    timer per idle period, and a read only moves a number (the timer, when it fires
    early, sleeps again until the current read's deadline). Like
    asyncio.timeout, it tells its own cancellation from another's (the client going
    away) by the task's cancel count."""

    def __init__(self, idle_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None, "IdleWatch runs inside a task"
        self._task = task
        self._idle_s = idle_s
        self._last = self._loop.time()
        self._waiting = False
        self._fired = False
        self._handle: asyncio.TimerHandle | None = self._loop.call_at(
            self._last + idle_s, self._check)

    def reading(self) -> None:
        """A read starts now: the clock runs from here."""
        self._last = self._loop.time()
        self._waiting = True

    def done_reading(self) -> None:
        """Data arrived; writing it to the client does not count."""
        self._waiting = False

    def _check(self) -> None:
        due = self._last + self._idle_s
        if not self._waiting:
            due = self._loop.time() + self._idle_s
        if self._loop.time() < due:
            self._handle = self._loop.call_at(due, self._check)
            return
        self._handle = None
        self._fired = True
        self._task.cancel()

    def expired(self) -> bool:
        """After a CancelledError: whether it was this watch's, and so a timeout (the
        cancellation is then taken back); False when someone else cancelled the task."""
        return self._fired and self._task.uncancel() == 0

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


def _error_event(message: str, err_type: str, code: int) -> bytes:
    """A stream's last events after a failure: the error, as vLLM sends it, and [DONE]."""
    err = error_payload(message, err_type, code=code)
    return b"data: " + json.dumps(err).encode() + b"\n\n" + DONE


def _no_headers(replica: Replica) -> dict[str, str]:
    return {}


def _stream_headers(resp: UpstreamResponse, headers: Mapping[str, str]) -> dict[str, str]:
    """The head of a streamed answer relayed from `resp`, with the gateway's `headers`."""
    return {"Content-Type": resp.headers.get("content-type", "text/event-stream"),
            "Cache-Control": "no-cache", **headers}


def _status_failure(status: int, text: str) -> UpstreamFailure:
    """A 5xx answer: 503 is the replica's state (not ready, overloaded); any other the
    replica took the request on and failed it, which may be the request's doing."""
    if status == 503:
        failure = UpstreamFailure("status_503", f"HTTP 503: {text[:200]}")
    else:
        failure = UpstreamFailure("status_5xx", f"HTTP {status}: {text[:200]}", accepted=True)
    failure.status_seen = status
    return failure


# Body fields that change how /tokenize renders a prompt (vLLM's TokenizeRequest).
_TOKENIZE_FIELDS = ("model", "messages", "prompt", "add_generation_prompt",
                    "continue_final_message", "add_special_tokens", "chat_template",
                    "chat_template_kwargs", "tools", "mm_processor_kwargs")


async def remote_tokenize(session: aiohttp.ClientSession, replica: Replica,
                          body: Mapping[str, Any], deadline_s: float) -> list[int] | None:
    """The prompt's token ids as the replica itself renders them (its /tokenize).

    For proxy.tokenize_mode "remote": exact by construction (the replica's own template
    and tokenizer), at the price of one round trip. None when the replica cannot answer
    within the deadline; the request then routes on load alone.
    """
    payload = {k: body[k] for k in _TOKENIZE_FIELDS if k in body}
    if isinstance(payload.get("prompt"), list) and payload["prompt"] and \
            not isinstance(payload["prompt"][0], int):
        payload["prompt"] = payload["prompt"][0]  # a batch: its first prompt, as routed
    try:
        async with session.post(f"{replica.base_url}/tokenize", json=payload,
                                timeout=aiohttp.ClientTimeout(total=deadline_s)) as resp:
            if resp.status != 200:
                log.info("remote tokenize on %s: HTTP %d", replica.replica_id, resp.status)
                return None
            data = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
        log.info("remote tokenize on %s failed: %s", replica.replica_id, exc)
        return None
    tokens = data.get("tokens") if isinstance(data, dict) else None
    return [int(t) for t in tokens] if isinstance(tokens, list) else None
