"""The gateway's aiohttp application: routes, middlewares and resource lifecycles.

Every resource has one owner, a cleanup context that opens it at start-up and closes it
at shutdown, in reverse order: thread pool -> HTTP client session -> tokenizers ->
prefix index -> fleet (health/scrape/DNS tasks) -> KV-event indexer. Handlers find
them through typed AppKeys. The request path itself is a short sequence of calls into
router.routing (decide) and router.proxy (forward); recording what happened goes to
router.metrics and the index.

The server must run with handler_cancellation=True (see `start_gateway`): aiohttp
otherwise keeps a handler running after its client disconnects, and a streaming proxy
would keep a replica generating tokens nobody reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import itertools
import json
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.core import Metric

from router.admission import Admission, Overloaded
from router.config import GatewayConfig
from router.events import EventIndexer, ReplicaFeed
from router.hygiene import PromptHygiene
from router.index import IndexUnavailable, MemoryIndex, PrefixIndex, RedisIndex
from router.metrics import (
    CONTENT_TYPE,
    GatewayMetrics,
    ReplicaGauges,
    StreamGauges,
    fleet_families,
)
from router.openapi import openapi_spec
from router.policy.pipeline import NoReplicasError, build_policy
from router.proxy import Forwarder, ProxySettings, UpstreamRequest, json_error, remote_tokenize
from router.replicas import Fleet, HealthSettings, Replica, ReplicaSource, verify_keys
from router.routing import (
    ENDPOINTS,
    ChainCache,
    ClientError,
    KnownTokens,
    NoReplica,
    ParsedRequest,
    Route,
    RoutingPipeline,
    completion_keys,
    parse_body,
    token_id_prompt,
    upstream_body,
)
from router.tenants import Tenant, TenantError, TenantRegistry, api_key_from_headers
from router.tokenize import PromptTokenizer
from router.validate import RequestError, validate_request

log = logging.getLogger(__name__)

# The request id of the request a task is serving, for log records (see serve.py's
# filter). A ContextVar is per task, so concurrent requests never see each other's.
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

# Headers forwarded upstream as they came (tracing and correlation).
_FORWARDED_HEADERS = ("traceparent", "tracestate", "baggage")
_INDEX_OP_TIMEOUT_S = 1.0
_HANDSHAKE_TIMEOUT_S = 10.0
_OFFLOAD_BODY_BYTES = 64 * 1024
MAX_LINE_BYTES = 8190  # request line and each header line
MAX_HEADERS = 128


class RequestIds:
    """Unique request ids without a syscall per request (uuid4 reads os.urandom, ~0.2 ms
    under load): a random per-process prefix and a counter."""

    def __init__(self) -> None:
        self._prefix = os.urandom(6).hex()
        self._counter = itertools.count(1)

    def next(self) -> str:
        return f"{self._prefix}-{next(self._counter):x}"


@dataclass
class Gateway:
    """The app's resources; each is opened and closed by one cleanup context."""

    config: GatewayConfig
    metrics: GatewayMetrics
    tenants: TenantRegistry
    rng: random.Random
    executor: ThreadPoolExecutor | None = None
    session: aiohttp.ClientSession | None = None
    tokenizers: dict[str, PromptTokenizer] = field(default_factory=dict)
    index: PrefixIndex | None = None
    fleet: Fleet | None = None
    indexer: EventIndexer | None = None
    pipeline: RoutingPipeline | None = None
    forwarder: Forwarder | None = None
    admission: Admission | None = None
    hygiene: PromptHygiene = field(default_factory=PromptHygiene)
    index_status: str = "unknown"
    index_up: bool | None = None  # None until the index has first answered or failed
    request_ids: RequestIds = field(default_factory=RequestIds)
    background: set[asyncio.Task[None]] = field(default_factory=set)
    # Event-fed replicas owing KV events: replica id -> (wall time the request that
    # must have stored blocks was sent, deadline on the fleet's clock). See EventWatch.
    events_due: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def index_backend(self) -> str:
        return "redis" if self.config.index.is_redis else "memory"

    def spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        """Run a small background job owned by the gateway (awaited at shutdown)."""
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task


GATEWAY = web.AppKey("gateway", Gateway)


def replica_sources(config: GatewayConfig) -> list[ReplicaSource]:
    """The fleet's replica entries, from the config's replicas section."""
    return [
        ReplicaSource(name=r.name, models=r.models, hash_config=r.hash, url=r.url, dns=r.dns,
                      kv_events=r.kv_events, kv_replay=r.kv_replay,
                      max_concurrency=r.max_concurrency, prefill=r.prefill)
        for r in config.replicas
    ]


def health_settings(config: GatewayConfig) -> HealthSettings:
    h = config.health
    dns = [r.dns_refresh_s for r in config.replicas if r.dns]
    return HealthSettings(interval_s=h.interval_s, timeout_s=h.timeout_s,
                          eject_after_failures=h.eject_after_failures,
                          eject_base_s=h.eject_base_s, eject_max_s=h.eject_max_s,
                          scrape_interval_s=h.scrape_interval_s,
                          dns_interval_s=min(dns) if dns else 10.0)


def proxy_settings(config: GatewayConfig) -> ProxySettings:
    p = config.proxy
    return ProxySettings(connect_timeout_s=p.connect_timeout_s,
                         first_token_timeout_s=p.first_token_timeout_s,
                         idle_timeout_s=p.idle_timeout_s, max_retries=p.max_retries,
                         retry_budget_ratio=p.retry_budget_ratio,
                         hold_until_content=p.hold_until_content)


# ------------------------------------------------------------------ cleanup contexts


async def _executor_ctx(app: web.Application) -> AsyncIterator[None]:
    gw = app[GATEWAY]
    # Tokenizing and hashing long prompts runs here, off the event loop.
    gw.executor = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 2),
                                     thread_name_prefix="tokenize")
    yield
    gw.executor.shutdown(wait=True, cancel_futures=True)


async def _session_ctx(app: web.Application) -> AsyncIterator[None]:
    gw = app[GATEWAY]
    # No connection limit: admission control bounds concurrency, and a pool limit here
    # would queue requests invisibly, outside every deadline.
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
    gw.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
    yield
    await gw.session.close()


async def _tokenizers_ctx(app: web.Application) -> AsyncIterator[None]:
    gw = app[GATEWAY]
    loop = asyncio.get_running_loop()
    for name, model in gw.config.models.items():
        if name not in gw.tokenizers:
            # Loading a tokenizer takes a while: keep the loop free for other start-up work.
            gw.tokenizers[name] = await loop.run_in_executor(
                gw.executor, _load_tokenizer, model.tokenizer, model.max_model_len)
    yield


def _load_tokenizer(directory: str, max_model_len: int | None) -> PromptTokenizer:
    if max_model_len is None:
        return PromptTokenizer.from_dir(directory)
    return PromptTokenizer.from_dir(directory, max_model_len=max_model_len)


async def _index_ctx(app: web.Application) -> AsyncIterator[None]:
    gw = app[GATEWAY]
    cfg = gw.config.index
    if cfg.is_redis:
        gw.index = RedisIndex.from_url(cfg.backend, capacity_blocks=cfg.record_capacity_blocks)
    else:
        gw.index = MemoryIndex(capacity_blocks=cfg.record_capacity_blocks)
    yield
    await gw.index.close()


async def _fleet_ctx(app: web.Application) -> AsyncIterator[None]:
    gw = app[GATEWAY]
    assert gw.session is not None and gw.index is not None
    fleet = Fleet(replica_sources(gw.config), health_settings(gw.config), gw.session,
                  rng=gw.rng)
    gw.fleet = fleet
    fleet.listeners.added.append(_set_mode)
    # Ejections are counted by the proxy, the only caller of report_failure; a listener
    # recording them too would count each one twice.
    gw.pipeline = RoutingPipeline(
        tokenizers=gw.tokenizers, chains=ChainCache(), index=gw.index,
        policy=build_policy(gw.config.policy, gw.rng),
        index_deadline_s=gw.config.index.deadline_ms / 1000.0, executor=gw.executor)
    gw.forwarder = Forwarder(gw.session, fleet, proxy_settings(gw.config), gw.metrics, gw.rng)
    admission = Admission.from_config(gw.config.limits)
    gw.admission = admission
    fleet.listeners.added.append(
        lambda r: admission.set_replica_limit(r.replica_id, r.target.max_concurrency))
    gw.metrics.add_scrape_callback(lambda: _fleet_gauges(gw))
    index = gw.index
    session = gw.session

    def handshake(replica: Replica) -> None:
        # Only replicas whose events feed the index can show the probe there.
        model = (replica.target.models or replica.served_models or ("",))[0]
        if replica.mode == "events" and model:
            gw.spawn(_ignore_errors(verify_keys(session, index, replica, model,
                                                _HANDSHAKE_TIMEOUT_S)),
                     f"handshake-{replica.replica_id}")

    fleet.listeners.healthy.append(handshake)

    def forget(replica: Replica) -> None:
        # A replica gone from discovery holds nothing any more (event-fed replicas are
        # cleared by the indexer when it unsubscribes).
        if replica.mode == "record":
            gw.spawn(_ignore_errors(index.clear_replica(replica.replica_id)),
                     f"forget-{replica.replica_id}")

    fleet.listeners.removed.append(forget)
    await fleet.start()
    yield
    await fleet.close()


def _set_mode(replica: Replica) -> None:
    replica.mode = "events" if replica.target.kv_events else "record"


async def _indexer_ctx(app: web.Application) -> AsyncIterator[None]:
    """An in-gateway KV-event indexer: only with a memory index (a Redis index is fed by
    the separate `python -m router indexer`) and only for replicas that publish events."""
    gw = app[GATEWAY]
    assert gw.fleet is not None and gw.index is not None
    if gw.config.index.is_redis or not any(r.kv_events for r in gw.config.replicas):
        yield
        return
    indexer = EventIndexer(gw.index)
    gw.indexer = indexer
    fleet = gw.fleet

    def feed(replica: Replica) -> ReplicaFeed | None:
        t = replica.target
        if not t.kv_events:
            return None
        model = (t.models or replica.served_models or ("",))[0]
        return ReplicaFeed(replica_id=t.replica_id, endpoint=t.kv_events, model=model,
                           replay_endpoint=t.kv_replay)

    for replica in fleet.all():
        f = feed(replica)
        if f is not None:
            await indexer.add_replica(f)

    def on_added(replica: Replica) -> None:
        f = feed(replica)
        if f is not None:
            gw.spawn(_ignore_errors(indexer.add_replica(f)), f"subscribe-{replica.replica_id}")

    def on_removed(replica: Replica) -> None:
        gw.spawn(_ignore_errors(indexer.remove_replica(replica.replica_id)),
                 f"unsubscribe-{replica.replica_id}")

    def on_unhealthy(replica: Replica) -> None:
        # A replica failing health checks may be restarting with an empty cache: drop
        # its entries now; its stream resyncs (replay from 0) with its next event.
        stream = indexer.streams.get(replica.replica_id)
        if stream is not None:
            gw.spawn(_ignore_errors(stream.mark_stale()), f"stale-{replica.replica_id}")

    fleet.listeners.added.append(on_added)
    fleet.listeners.removed.append(on_removed)
    fleet.listeners.unhealthy.append(on_unhealthy)
    watchdog = asyncio.create_task(_watch_event_silence(gw, indexer), name="event-silence")
    yield
    watchdog.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watchdog
    await indexer.stop()


def _event_silence_s(config: GatewayConfig) -> float:
    # A replica publishes a request's stored blocks during its prefill, long before the
    # answer is done; a few health intervals of silence after that is not lag.
    return max(2.0, 4 * config.health.interval_s)


def _expect_events(gw: Gateway, replica: Replica, sent_at: float, prompt_tokens: int | None,
                   cached_tokens: int | None) -> None:
    """Note that `replica` owes KV events: its answer says it computed (so stored) at
    least one new full prompt block, which vLLM always announces with a BlockStored."""
    if gw.indexer is None or replica.mode != "events" or prompt_tokens is None or \
            cached_tokens is None:
        return
    block = replica.target.hash_config.block_size
    if cached_tokens >= (prompt_tokens // block) * block:
        return  # a full hit stores nothing new, and publishes nothing
    due = gw.events_due.get(replica.replica_id)
    if due is not None and not _heard_since(gw.indexer, replica.replica_id, due[0]):
        return  # an older debt is still open: its deadline is the one that counts
    assert gw.fleet is not None
    gw.events_due[replica.replica_id] = (sent_at, gw.fleet.now() + _event_silence_s(gw.config))


def _heard_since(indexer: EventIndexer, replica_id: str, since: float) -> bool:
    stream = indexer.streams.get(replica_id)
    heard = stream.stats.last_received_at if stream is not None else None
    return heard is not None and heard >= since


async def _watch_event_silence(gw: Gateway, indexer: EventIndexer) -> None:
    """Drop the entries of a replica whose event stream went silent while events were
    due (a cut or black-holed socket, a stuck publisher): the index would otherwise go
    on trusting what the replica held when its events stopped. Silence alone proves
    nothing (an idle replica sends nothing), so only owed events count."""
    assert gw.fleet is not None
    while True:
        await asyncio.sleep(0.25)  # the watch's resolution; deadlines are seconds
        now = gw.fleet.now()
        streams = indexer.streams
        for rid, (sent_at, deadline) in list(gw.events_due.items()):
            stream = streams.get(rid)
            if stream is None or _heard_since(indexer, rid, sent_at):
                del gw.events_due[rid]
            elif now > deadline:
                del gw.events_due[rid]
                gw.metrics.record_event_silence(rid)
                log.warning("replica %s served requests but sent no KV events for %.1fs; "
                            "dropping its index entries until its stream resyncs", rid,
                            _event_silence_s(gw.config))
                gw.spawn(_ignore_errors(stream.mark_stale()), f"silent-{rid}")


async def _ignore_errors(coro: Awaitable[Any]) -> None:
    try:
        await coro
    except Exception:
        log.exception("background index job failed")


async def _background_ctx(app: web.Application) -> AsyncIterator[None]:
    """Registered last, so it closes first: finish recording before the index closes."""
    yield
    gw = app[GATEWAY]
    if gw.background:
        await asyncio.wait(list(gw.background), timeout=_INDEX_OP_TIMEOUT_S * 2)
        for task in gw.background:
            task.cancel()


def _fleet_gauges(gw: Gateway) -> Iterable[Metric]:
    if gw.fleet is None:
        return []
    now = gw.fleet.now()
    replicas = [ReplicaGauges(r.replica_id, r.available(now), r.inflight, r.verified)
                for r in gw.fleet.all()]
    streams = {} if gw.indexer is None else {
        rid: StreamGauges(s.lag_s(), s.gaps, s.restarts, s.index_errors, s.decode_errors)
        for rid, s in gw.indexer.stats().items()}
    return fleet_families(replicas, streams)


# ----------------------------------------------------------------------- middlewares


@web.middleware
async def _request_context(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                           ) -> web.StreamResponse:
    """Request id (forwarded or generated), OpenAI-style errors, request counting."""
    gw = request.app[GATEWAY]
    request_id = request.headers.get("x-request-id") or gw.request_ids.next()
    token = REQUEST_ID.set(request_id)
    status = 500
    try:
        try:
            response = await handler(request)
        except ClientError as exc:
            response = json_error(exc.status, exc.message, exc.err_type, param=exc.param)
        except RequestError as exc:
            response = web.json_response(exc.to_dict(), status=exc.status)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            response = json_error(exc.status, exc.reason, "invalid_request_error")
        except Exception:
            log.exception("unhandled error serving %s %s", request.method, request.path)
            response = json_error(500, "internal gateway error", "internal_error")
        if not response.prepared:
            response.headers.setdefault("x-request-id", request_id)
        status = response.status
        return response
    finally:
        gw.metrics.record_request(request.path if request.path in _COUNTED_PATHS else "other",
                                  status)
        REQUEST_ID.reset(token)


_COUNTED_PATHS = frozenset({*ENDPOINTS, "/v1/models", "/health", "/ready", "/metrics",
                            "/openapi.json"})


# -------------------------------------------------------------------------- handlers


def _tenant(gw: Gateway, request: web.Request) -> Tenant:
    try:
        return gw.tenants.identify(api_key_from_headers(request.headers))
    except TenantError as exc:
        raise ClientError(401, str(exc), "authentication_error") from None


async def _read_body(request: web.Request, limit: int) -> bytes:
    """The body, refusing more than `limit` bytes without reading them all."""
    if request.content_length is not None and request.content_length > limit:
        raise ClientError(413, f"request body exceeds {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > limit:
            raise ClientError(413, f"request body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def handle_completion(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions and /v1/completions: route, forward, record."""
    gw = request.app[GATEWAY]
    assert gw.fleet is not None and gw.pipeline is not None and gw.forwarder is not None
    arrived = time.perf_counter()
    tenant = _tenant(gw, request)
    raw = await _read_body(request, gw.config.proxy.max_body_bytes)
    check = functools.partial(_parse_and_validate, raw, ENDPOINTS[request.path],
                              _served_models(gw), gw.config.limits, tenant, gw.tenants)
    if len(raw) > _OFFLOAD_BODY_BYTES:
        # Decoding and checking a long prompt costs ~1 us per token (30 ms at 32k):
        # too long to hold the event loop, which serves every other request meanwhile.
        parsed, salt = await asyncio.get_running_loop().run_in_executor(gw.executor, check)
    else:
        parsed, salt = check()
    served = gw.fleet.for_model(parsed.model)
    if not served:
        raise ClientError(404, f"The model '{parsed.model}' does not exist", "invalid_request_error",
                          param="model")
    session_key = request.headers.get("x-session-id") or _str_or_none(parsed.body.get("user"))
    known: KnownTokens | None = None
    if gw.config.proxy.tokenize_mode == "remote" and token_id_prompt(parsed.body) is None:
        known = await _remote_tokens(gw, parsed, served)
    try:
        route = await gw.pipeline.route(parsed, served, gw.fleet.now(), tenant.tenant_id, salt,
                                        session_key, offload=len(raw) > _OFFLOAD_BODY_BYTES,
                                        tokenizer=known)
    except (NoReplica, NoReplicasError):
        return json_error(503, "no replica serves this model", "service_unavailable")
    _check_context_length(gw, parsed, route.prompt.num_tokens)
    decision = route.decision
    if route.lookup.fallback is not None:
        gw.metrics.record_fallback(route.lookup.fallback)
        _index_state(gw, "down" if route.lookup.fallback == "index_down" else "slow")
    elif route.prompt.keys:
        _index_state(gw, "ok")
    if route.lookup.seconds:
        gw.metrics.record_index_lookup(gw.index_backend, route.lookup.seconds,
                                       ok=route.lookup.fallback is None)
    gw.metrics.record_tokenize(route.prompt.seconds)
    if not route.candidates:
        return json_error(503, "no replica serves this model", "service_unavailable")
    if route.prompt.tokens:
        finding = gw.hygiene.observe(tenant.tenant_id, route.prompt.tokens)
        if finding is not None:
            gw.metrics.record_hygiene(["prefix_divergence"])
            log.warning("prompt hygiene: %s", finding.describe())
    assert gw.admission is not None
    try:
        slot = await gw.admission.acquire([r.replica_id for r in route.candidates])
    except Overloaded as exc:
        gw.metrics.record_overloaded(tenant.tenant_id)
        return json_error(429, str(exc), "rate_limit_error",
                          headers={"Retry-After": exc.retry_after_header})
    async with slot:  # released when the response is done, however it ends
        # The admitted replica goes first; the rest keep the policy's order for failover.
        candidates = sorted(route.candidates, key=lambda r: r.replica_id != slot.replica_id)
        chosen = candidates[0]
        gw.metrics.record_routed(chosen.replica_id, decision.policy, route.prompt.num_tokens,
                                 route.predicted_for(chosen.replica_id), route.decision_seconds)
        return await _forward(gw, request, route, candidates, arrived, len(raw))


def _index_state(gw: Gateway, status: str) -> None:
    """Note the index's state ("ok", "slow", "down"); a change between up and down is
    logged once and counted, so a lost and regained Redis shows in logs and metrics."""
    gw.index_status = status
    if status == "slow":
        return  # it answered, late: neither lost nor regained
    up = status == "ok"
    changed = gw.index_up is not None and gw.index_up != up
    if changed:
        if up:
            log.info("prefix index (%s) answers again; routing on cache matches", gw.index_backend)
        else:
            log.warning("prefix index (%s) is down; routing on load alone", gw.index_backend)
    gw.index_up = up
    gw.metrics.record_index_state(gw.index_backend, up, changed)


def _check_context_length(gw: Gateway, parsed: ParsedRequest, prompt_tokens: int) -> None:
    """Refuse a prompt that cannot fit the model (vLLM's rule and message), before any
    replica spends a prefill on finding out; only where the gateway knows the limit."""
    tokenizer = gw.tokenizers.get(parsed.model)
    limit = tokenizer.max_model_len if tokenizer is not None else 0
    if not limit or not prompt_tokens:
        return
    wanted = prompt_tokens + (parsed.max_tokens or 0)
    if prompt_tokens >= limit or wanted > limit:
        raise ClientError(
            400, f"This model's maximum context length is {limit} tokens. However, you "
            f"requested {wanted} tokens ({prompt_tokens} in the prompt, "
            f"{parsed.max_tokens or 0} in the completion). Please reduce the length of the "
            "prompt or completion.", param="messages" if "messages" in parsed.body else "prompt")


async def _forward(gw: Gateway, request: web.Request, route: Route, candidates: list[Replica],
                   arrived: float, body_bytes: int) -> web.StreamResponse:
    assert gw.forwarder is not None and gw.fleet is not None
    parsed = route.parsed
    want_ids = any(r.mode == "record" for r in candidates)
    body, strip = upstream_body(parsed, route.cache_salt, want_token_ids=want_ids)
    headers = {"Content-Type": "application/json", "x-request-id": REQUEST_ID.get()}
    for name in _FORWARDED_HEADERS:
        if name in request.headers:
            headers[name] = request.headers[name]
    up = UpstreamRequest(path=request.path, body=body, headers=headers, stream=parsed.stream,
                         client_wants_usage=parsed.client_wants_usage, strip_token_ids=strip,
                         max_tokens=parsed.max_tokens)
    if body_bytes > _OFFLOAD_BODY_BYTES:
        up.payload = await asyncio.get_running_loop().run_in_executor(gw.executor, _dump, body)
    expose = gw.config.proxy.expose_routing_headers

    def response_headers(replica: Replica) -> dict[str, str]:
        out = {"x-request-id": REQUEST_ID.get()}
        if expose:
            out["x-cacheroute-replica"] = replica.replica_id
            out["x-cacheroute-predicted-cached-tokens"] = str(route.predicted_for(replica.replica_id))
        return out

    sent_at = time.time()  # the KV-event streams' clock
    response, outcome = await gw.forwarder.forward(request, up, candidates, response_headers)
    if outcome.first_byte_at is not None:
        gw.metrics.record_first_byte(outcome.first_byte_at - arrived)
    replica = gw.fleet.get(outcome.replica_id) if outcome.replica_id else None
    if replica is not None and outcome.status == 200:
        _expect_events(gw, replica, sent_at, outcome.prompt_tokens, outcome.cached_tokens)
        # A healthy index records within the lookup deadline, so the next request of
        # the conversation sees it; a slow or black-holed one must not hold the answer
        # (a non-streamed body goes out only when this handler returns) any longer.
        task = gw.spawn(_ignore_errors(_record(gw, route, replica, outcome.prompt_tokens,
                                               outcome.cached_tokens, outcome.output_token_ids)),
                        "record")
        await asyncio.wait([task], timeout=gw.config.index.deadline_ms / 1000.0)
    return response


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


def _parse_and_validate(raw: bytes, endpoint: str, served_models: set[str], limits: Any,
                        tenant: Tenant, registry: TenantRegistry,
                        ) -> tuple[ParsedRequest, str | None]:
    """Decode the body and validate it; returns it with the cache_salt to forward."""
    parsed = parse_body(raw, endpoint)
    validated = validate_request("chat" if endpoint == "chat" else "completion", parsed.body,
                                 served_models=served_models, limits=limits, tenant=tenant,
                                 registry=registry)
    return parsed, validated.cache_salt


def _dump(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


async def _record(gw: Gateway, route: Route, replica: Replica, prompt_tokens: int | None,
                  cached_tokens: int | None, output_token_ids: list[int] | None) -> None:
    """Predicted vs actual cached tokens, and (replicas without events) what it now holds."""
    predicted = route.predicted_for(replica.replica_id)
    if cached_tokens is not None:
        gw.metrics.record_actual(replica.replica_id, route.decision.policy,
                                 prompt_tokens or route.prompt.num_tokens, cached_tokens, predicted)
        assert gw.fleet is not None
        gw.fleet.record_prediction(replica, predicted, cached_tokens)
    if replica.mode != "record" or route.prompt.tokens is None:
        return
    assert gw.index is not None and gw.pipeline is not None
    config = replica.target.hash_config
    keys: list[int] | tuple[int, ...] = route.prompt.keys.get(config, ())
    if output_token_ids:
        loop = asyncio.get_running_loop()
        keys = await loop.run_in_executor(
            gw.executor, completion_keys, gw.pipeline.chains, config, route.prompt.tokens,
            output_token_ids, route.cache_salt)
    if not keys:
        return
    try:
        await asyncio.wait_for(
            gw.index.record(route.parsed.model, replica.replica_id, keys,
                            gw.config.index.record_ttl_s,
                            capacity_blocks=gw.config.index.record_capacity_blocks),
            _INDEX_OP_TIMEOUT_S)
    except (TimeoutError, IndexUnavailable, OSError) as exc:
        gw.metrics.record_index_error(gw.index_backend, "record")
        log.warning("recording %d blocks for %s failed: %s", len(keys), replica.replica_id, exc)


def _served_models(gw: Gateway) -> set[str]:
    assert gw.fleet is not None
    return set(gw.fleet.models()) | set(gw.config.served_models())


async def handle_models(request: web.Request) -> web.Response:
    """GET /v1/models: the union of the models the fleet serves."""
    gw = request.app[GATEWAY]
    _tenant(gw, request)
    names = sorted(_served_models(gw))
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "cacheroute"}
        for name in names]})


async def handle_health(request: web.Request) -> web.Response:
    """GET /health: the process is alive."""
    return web.json_response({"status": "ok"})


async def handle_ready(request: web.Request) -> web.Response:
    """GET /ready: 200 while some replica is available; index and replica states."""
    gw = request.app[GATEWAY]
    assert gw.fleet is not None and gw.index is not None
    try:
        await asyncio.wait_for(gw.index.lookup("cacheroute-ready-probe", [0]), _INDEX_OP_TIMEOUT_S)
        index_state = "ok"
    except (TimeoutError, IndexUnavailable, OSError) as exc:
        index_state = f"down: {type(exc).__name__}"
    # A probe answers for the index too: with no traffic, /ready is what notices.
    _index_state(gw, "ok" if index_state == "ok" else "down")
    ready = gw.fleet.any_available()
    body: dict[str, Any] = {
        "ready": ready,
        "index": {"backend": gw.index_backend, "status": index_state,
                  "last_lookup": gw.index_status},
        "replicas": gw.fleet.describe(),
    }
    if gw.indexer is not None:
        body["events"] = {rid: {"last_seq": s.last_seq, "batches": s.batches, "gaps": s.gaps,
                                "restarts": s.restarts, "lag_s": s.lag_s()}
                          for rid, s in gw.indexer.stats().items()}
    return web.json_response(body, status=200 if ready else 503)


async def handle_metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus exposition of the cacheroute_* collectors."""
    gw = request.app[GATEWAY]
    return web.Response(body=gw.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def handle_openapi(request: web.Request) -> web.Response:
    """GET /openapi.json: the gateway's HTTP surface."""
    return web.json_response(openapi_spec())


# -------------------------------------------------------------------------- assembly


def build_app(config: GatewayConfig, *, tenants: TenantRegistry | None = None,
              tokenizers: dict[str, PromptTokenizer] | None = None,
              rng: random.Random | None = None) -> web.Application:
    """The gateway app for `config` (resources open when the app starts)."""
    gw = Gateway(config=config, metrics=GatewayMetrics(),
                 tenants=tenants or TenantRegistry.from_config(config.tenants),
                 rng=rng or random.Random(config.policy.seed),
                 tokenizers=dict(tokenizers or {}))
    # client_max_size is a backstop; _read_body answers oversize bodies with a JSON 413.
    app = web.Application(middlewares=[_request_context],
                          client_max_size=config.proxy.max_body_bytes + 1)
    app[GATEWAY] = gw
    app.cleanup_ctx.extend([_executor_ctx, _session_ctx, _tokenizers_ctx, _index_ctx,
                            _fleet_ctx, _indexer_ctx, _background_ctx])
    app.router.add_post("/v1/chat/completions", handle_completion)
    app.router.add_post("/v1/completions", handle_completion)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/ready", handle_ready)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/openapi.json", handle_openapi)
    return app


@contextlib.asynccontextmanager
async def running_gateway(app: web.Application, host: str, port: int, *,
                          shutdown_timeout: float = 10.0) -> AsyncIterator[web.AppRunner]:
    """Serve `app` on host:port until the block exits (handler cancellation on)."""
    # HTTP framing limits, explicit because they are a security property: a request line
    # or header over 8 KiB, or more than 128 headers, is refused with a 400 before any
    # handler runs (as is a request with both Content-Length and Transfer-Encoding).
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=shutdown_timeout, max_line_size=MAX_LINE_BYTES,
                           max_field_size=MAX_LINE_BYTES, max_headers=MAX_HEADERS)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        yield runner
    finally:
        await runner.cleanup()
