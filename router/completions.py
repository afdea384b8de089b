"""POST /v1/chat/completions and /v1/completions: parse -> route -> admit -> forward -> record."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from aiohttp import web

from router.admission import Overloaded
from router.arrival_order import NO_TURN, TurnLike
from router.batches import predict_batch
from router.event_watch import expect_events
from router.front_http import AnyRequest, AnyResponse, FrontRequest, send_whole
from router.gateway import (
    GATEWAY,
    REQUEST_ID,
    Gateway,
    ignore_errors,
    note_index_state,
    served_models,
    tenant_of,
)
from router.policy.pipeline import NoReplicasError
from router.policy.types import RoutingDecision
from router.proxy import REPLICA_HEADER, UpstreamRequest, json_error, remote_tokenize
from router.recording import holds_unannounced_blocks, record_blocks, record_outcome
from router.replicas import Replica
from router.request import ENDPOINTS, ClientError, ParsedRequest, parse_request, upstream_payload
from router.routing import KnownTokens, Route
from router.suspects import Fingerprint, request_fingerprint
from router.tenants import Tenant
from router.vllm_rules import check_context

log = logging.getLogger(__name__)

_FORWARDED_HEADERS = ("traceparent", "tracestate", "baggage")


async def _read_body(request: AnyRequest, limit: int) -> bytes:
    """The body, refusing more than `limit` bytes without reading them all."""
    if isinstance(request, FrontRequest):
        return request.body  # read whole by the fast front, which checked the limit
    if request.content_length is not None and request.content_length > limit:
        raise ClientError(f"request body exceeds {limit} bytes", status=413)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > limit:
            raise ClientError(f"request body exceeds {limit} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


def candidates_header(decision: RoutingDecision) -> str:
    """Every candidate the decision ranked, best first, with what the policy saw there:
    its predicted cached tokens, predicted time to first token (cache_aware) and score.
    Why a request went where it went, for a run's analysis (expose_routing_headers)."""
    parts = []
    for rid in decision.ranked:
        part = f"{rid};cached={decision.predicted_cached.get(rid, 0)}"
        if rid in decision.costs:
            part += f";ttft_ms={1000 * decision.costs[rid]:.1f}"
        if rid in decision.scores:
            part += f";score={decision.scores[rid]:.4f}"
        parts.append(part)
    return ", ".join(parts)


@dataclass
class Stages:
    """When a request passed each stage (perf_counter), for the Server-Timing header
    (`proxy.expose_routing_headers`): where the gateway's time went, measured where it
    goes, on a loop shared with every other request (benchmarks/bench_gateway.py reads
    it; the in-process profile there runs the same functions alone)."""

    arrived: float  # the handler began: the head was in
    parsed: float = 0.0
    routed: float = 0.0
    forwarded: float = 0.0
    # Of parse -> routed: held before the decision (prefill_hold.py), and after it for
    # the queue ahead on its replica (policy.step_gate).
    held_s: float = 0.0
    gated_s: float = 0.0

    def server_timing(self, now: float) -> str:
        """parse: the body read and checked; route: tokenized, keyed, looked up and
        decided; hold: held for a replica's prefill queue to fall under a step
        (policy.hold_cap); gate: after the decision, waited for the queue ahead on its
        replica to reach its first tokens (policy.step_gate); neither is part of route;
        admit: admission and the upstream request built; upstream: from forwarding until
        the answer's head can go out (streamed: the replica's head with
        proxy.early_head, else its first token; not streamed: the whole body), failovers
        before it included."""
        marks = (("parse", self.parsed - self.arrived),
                 ("route", self.routed - self.parsed - self.held_s - self.gated_s),
                 ("hold", self.held_s), ("gate", self.gated_s),
                 ("admit", self.forwarded - self.routed), ("upstream", now - self.forwarded))
        return ", ".join(f"{name};dur={max(0.0, dur) * 1000:.2f}" for name, dur in marks)


async def handle_completion(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions and /v1/completions through aiohttp's server."""
    response = await complete(request)
    assert isinstance(response, web.StreamResponse)
    return response


async def complete(request: AnyRequest) -> AnyResponse:
    """POST /v1/chat/completions and /v1/completions: route, forward, record (from
    aiohttp's server or the fast front, router/front_http.py)."""
    gw = request.app[GATEWAY]
    assert gw.fleet is not None and gw.pipeline is not None and gw.forwarder is not None
    stages = Stages(time.perf_counter())
    tenant = tenant_of(gw, request)
    raw = await _read_body(request, gw.config.proxy.max_body_bytes)
    # From here to going upstream the work is the loop's CPU: taken in arrival order
    # (router/arrival_order.py), letting go around I/O waits.
    async with gw.arrival.turn() if gw.arrival is not None else NO_TURN as turn:
        return await _route_and_forward(gw, request, raw, tenant, stages, turn)


async def _route_and_forward(gw: Gateway, request: AnyRequest, raw: bytes, tenant: Tenant,
                             stages: Stages, turn: TurnLike) -> AnyResponse:
    assert gw.fleet is not None and gw.pipeline is not None
    # On the loop whatever its size: msgspec holds the GIL while it decodes (~40 ns a
    # prompt token, 1.3 ms at 32k), so a thread would stall the loop as long, plus the
    # hand-off (router/routing.py tokens_off_the_loop_when_long says what that cost).
    parsed = parse_request(raw, ENDPOINTS[request.path], served_models=served_models(gw),
                           limits=gw.config.limits, tenant=tenant, registry=gw.tenants)
    stages.parsed = time.perf_counter()
    served = gw.fleet.for_model(parsed.model)
    if not served:
        raise ClientError(f"The model '{parsed.model}' does not exist", "model", status=404)
    assert gw.admission is not None
    try:
        # Before tokenizing and looking up: an overloaded gateway must shed load cheaply.
        gw.admission.refuse_if_full([r.replica_id for r in served])
    except Overloaded as exc:
        return _overloaded(gw, tenant, exc)
    session_key = request.headers.get("x-session-id") or _str_or_none(parsed.body.get("user"))
    known: KnownTokens | None = None
    if gw.config.proxy.tokenize_mode == "remote" and parsed.token_ids is None:
        async with turn.away():
            known = await _remote_tokens(gw, parsed, served)
    try:
        route = await gw.pipeline.route(parsed, served, gw.fleet.now(), tenant.tenant_id,
                                        parsed.cache_salt,
                                        session_key, offload=True,
                                        tokenizer=known, reserve=True, turn=turn,
                                        defer_keys=True)
    except NoReplicasError:
        return json_error(503, "no replica serves this model", "service_unavailable")
    try:
        # Behind this gateway's queue on its replica (policy.step_gate).
        route.gated_s = await gw.pipeline.gate(route, turn)
        stages.routed = time.perf_counter()
        stages.held_s, stages.gated_s = route.held_s, route.gated_s
        return await _admit_and_forward(gw, request, route, tenant, parsed, served, stages,
                                        turn)
    finally:
        # Whatever ended it (a refusal, an error, an answer), no reservation outlives it,
        # and no pending chain of a request that never went upstream.
        route.release(gw.fleet.now())
        if not route.sent:
            route.drop_pending(gw.pipeline.pending)


async def _admit_and_forward(gw: Gateway, request: AnyRequest, route: Route, tenant: Tenant,
                             parsed: ParsedRequest, served: list[Replica],
                             stages: Stages, turn: TurnLike) -> AnyResponse:
    assert gw.admission is not None
    _check_context_length(gw, parsed, route)
    await predict_batch(gw, route, served, turn)  # a batch reports its last prompt's cached tokens
    decision = route.decision
    if route.lookup.fallback is not None:
        gw.metrics.record_fallback(route.lookup.fallback)
        note_index_state(gw, "down" if route.lookup.fallback == "index_down" else "slow")
    elif route.prompt.keys:
        note_index_state(gw, "ok")
    if route.lookup.seconds:
        gw.metrics.record_index_lookup(gw.index_backend, route.lookup.seconds,
                                       ok=route.lookup.fallback is None)
    gw.metrics.record_tokenize(route.prompt.seconds)
    if not route.candidates:
        return json_error(503, "no replica serves this model", "service_unavailable")
    candidate_ids = [r.replica_id for r in route.candidates]
    slot = gw.admission.try_acquire(candidate_ids)
    if slot is None:
        try:
            async with turn.away():  # queued behind other requests: maybe for long
                slot = await gw.admission.acquire(candidate_ids)
        except Overloaded as exc:
            return _overloaded(gw, tenant, exc)
    async with slot:  # released when the response is done, however it ends
        # The admitted replica goes first; the rest keep the policy's order for failover.
        candidates = sorted(route.candidates, key=lambda r: r.replica_id != slot.replica_id)
        chosen = candidates[0]
        if log.isEnabledFor(logging.DEBUG):
            log.debug("routed to %s by %s: predicted ttft %.1f ms, cached %d tokens; "
                      "costs %s; relaxed filters %s", chosen.replica_id, decision.policy,
                      1000 * decision.costs.get(chosen.replica_id, 0.0),
                      decision.predicted_cached.get(chosen.replica_id, 0),
                      {rid: round(c * 1000, 1) for rid, c in decision.costs.items()},
                      list(decision.relaxed))
        gw.metrics.record_routed(chosen.replica_id, decision.policy,
                                 route.prompt.num_tokens if route.prompt.rest is None else None,
                                 route.predicted_for(chosen.replica_id), route.decision_seconds)
        return await _forward(gw, request, route, candidates, stages, turn, tenant)


def _overloaded(gw: Gateway, tenant: Tenant, exc: Overloaded) -> web.Response:
    gw.metrics.record_overloaded(tenant.tenant_id)
    return json_error(429, str(exc), "rate_limit_error",
                      headers={"Retry-After": exc.retry_after_header})


def _observe_hygiene(gw: Gateway, tenant: Tenant, route: Route) -> None:
    if route.prompt.tokens:
        finding = gw.hygiene.observe(tenant.tenant_id, route.prompt.tokens)
        if finding is not None:
            gw.metrics.record_hygiene(["prefix_divergence"])
            log.warning("prompt hygiene: %s", finding.describe())


def _check_context_length(gw: Gateway, parsed: ParsedRequest, route: Route) -> None:
    """Refuse what vLLM 0.32 refuses for the prompt's length (its rule and words, see
    router/vllm_rules.py), before any replica spends a prefill on finding out; only where
    the gateway knows the limit. A batch is checked by its first prompt (the one routed).

    A chat decided before its newest text was encoded passes on its bound where that
    fits (the rule only tightens as the prompt grows); else its count must be exact, and
    the text is encoded now."""
    tokenizer = gw.tokenizers.get(parsed.model)
    limit = tokenizer.max_model_len if tokenizer is not None else 0
    if not limit or not route.prompt.num_tokens:
        return
    chat, text = parsed.endpoint == "chat", parsed.token_ids is None
    if route.prompt.rest is not None:
        try:
            check_context(parsed.body, chat, route.prompt.at_most, limit, text_prompt=text)
            return
        except ClientError:
            assert gw.pipeline is not None
            route.finish_keys(gw.pipeline.chains, gw.pipeline.pending)
    check_context(parsed.body, chat, route.prompt.num_tokens, limit, text_prompt=text)


async def _forward(gw: Gateway, request: AnyRequest, route: Route, candidates: list[Replica],
                   stages: Stages, turn: TurnLike, tenant: Tenant) -> AnyResponse:
    assert gw.forwarder is not None and gw.fleet is not None
    parsed = route.parsed
    deferred = route.prompt.rest is not None  # its newest text is encoded once it is sent
    want_ids = any(r.mode == "record" for r in candidates)
    payload, strip = upstream_payload(parsed, want_token_ids=want_ids)
    headers = {"Content-Type": "application/json", "x-request-id": REQUEST_ID.get()}
    for name in _FORWARDED_HEADERS:
        if name in request.headers:
            headers[name] = request.headers[name]
    up = UpstreamRequest(path=request.path, body=parsed.body, headers=headers,
                         stream=parsed.stream, payload=payload,
                         client_wants_usage=parsed.client_wants_usage, strip_token_ids=strip,
                         collect_token_ids=want_ids,
                         max_tokens=parsed.max_tokens,
                         predicted_work=route.decision.predicted_work,
                         predicted_cached=route.decision.predicted_cached,
                         reserved=route.reserved)
    pipeline = gw.pipeline
    assert pipeline is not None

    def finish_keys() -> None:
        route.finish_keys(pipeline.chains, pipeline.pending)

    def fingerprint() -> Fingerprint:
        finish_keys()
        return request_fingerprint(route.prompt.keys, route.prompt.num_tokens, parsed.raw,
                                   route.cache_salt)

    up.fingerprint_of = fingerprint
    up.on_sent = finish_keys
    expose = gw.config.proxy.expose_routing_headers

    def response_headers(replica: Replica) -> dict[str, str]:
        out = {"x-request-id": REQUEST_ID.get()}
        if expose:
            out[REPLICA_HEADER] = replica.replica_id
            out["x-cacheroute-predicted-cached-tokens"] = str(route.predicted_for(replica.replica_id))
            if replica.replica_id in route.decision.costs:  # cache_aware's TTFT prediction
                out["x-cacheroute-predicted-ttft-ms"] = (
                    f"{1000 * route.decision.costs[replica.replica_id]:.1f}")
            out["x-cacheroute-candidates"] = candidates_header(route.decision)
            out["Server-Timing"] = stages.server_timing(time.perf_counter())
        return out

    sent_at = time.time()  # the KV-event streams' clock
    stages.forwarded = time.perf_counter()
    turn.end()  # the next request computes while this one is upstream
    route.sent = True
    response, outcome = await gw.forwarder.forward(request, up, candidates, response_headers)
    replica = gw.fleet.get(outcome.replica_id) if outcome.replica_id else None
    record = replica is not None and outcome.status == 200 and \
        holds_unannounced_blocks(replica, route)
    if not record:
        await _answer_now(request, response)
    try:
        if outcome.first_byte_at is not None:
            gw.metrics.record_first_byte(outcome.first_byte_at - stages.arrived)
        finish_keys()  # where no attempt got as far as sending
        # A diagnostic, not a routing input: read once the answer is on its way, where
        # it costs no request its time to first byte (~10 us a prompt).
        _observe_hygiene(gw, tenant, route)
        if deferred:  # what waited for the whole prompt
            gw.metrics.record_routed_prompt_tokens(candidates[0].replica_id,
                                                   route.decision.policy, route.prompt.num_tokens)
        route.settle_pending(pipeline.pending, outcome.replica_id, outcome.status)
        if replica is not None and outcome.status == 200:
            expect_events(gw, replica, sent_at, outcome.prompt_tokens, outcome.cached_tokens)
            record_outcome(gw, route, replica, outcome.prompt_tokens, outcome.cached_tokens)
            if record:
                # A healthy index records within the lookup deadline, so the next request
                # of the conversation sees it; a slow or black-holed one must not hold the
                # answer (a non-streamed body goes out only when this handler returns) any
                # longer.
                task = gw.spawn(ignore_errors(record_blocks(gw, route, replica,
                                                            outcome.output_token_ids)), "record")
                await asyncio.wait([task], timeout=gw.config.index.deadline_ms / 1000.0)
    except Exception:
        if not (response.prepared or (isinstance(request, FrontRequest) and request.answered)):
            raise
        # The client has its answer: a failure here must not become a second response on
        # the same connection (the middleware's error answer).
        log.exception("bookkeeping after answering failed")
    return response


async def _answer_now(request: AnyRequest, response: AnyResponse) -> None:
    """Send a whole (non-streamed) answer before the request's bookkeeping, not after.

    aiohttp writes a returned response only once the handler is done, and what remains
    then (metrics, the pending chain, the outcome's record, and freeing the request:
    an 8k-token prompt is some 16k Python objects) held each answer 0.4-0.5 ms here
    (a growing 8k-token conversation, traced per stage). A streamed answer is out by now.
    Where the gateway must record the blocks of a replica without KV events it keeps the
    old order: the next turn must find them in the index."""
    if response.prepared:
        return
    response.headers.setdefault("x-request-id", REQUEST_ID.get())
    assert isinstance(response, web.StreamResponse)  # a stream is prepared by now
    try:
        if isinstance(request, FrontRequest):
            send_whole(request, response)
        else:
            await response.prepare(request)
            await response.write_eof()
    except ConnectionError:
        pass  # the client went away: the bookkeeping still runs, the server closes it


async def _remote_tokens(gw: Gateway, parsed: ParsedRequest,
                         served: list[Replica]) -> KnownTokens | None:
    """Ask an available replica of the model for the prompt's ids (tokenize_mode remote)."""
    assert gw.session is not None and gw.fleet is not None
    now = gw.fleet.now()
    available = [r for r in served if r.available(now)]
    if not available:
        return None
    # The least loaded: /tokenize is cheap, but a busy replica answers it late.
    replica = min(available, key=lambda r: sum(r.outstanding()))
    tokens = await remote_tokenize(gw.session, replica, parsed.body,
                                   gw.config.proxy.connect_timeout_s + 1.0)
    if tokens is None:
        gw.metrics.record_fallback("remote_tokenize")
        return None
    return KnownTokens(tuple(tokens))


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) and value else None
