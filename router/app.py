"""The gateway's aiohttp application, wired: routes, middleware and resource lifecycles.

Every resource has one owner, a cleanup context here that opens it at start-up and
closes it at shutdown, in reverse order: thread pool -> HTTP client session ->
tokenizers -> prefix index -> fleet (health/scrape/DNS tasks) -> KV-event indexer (and
its event-silence watch, router.event_watch). Handlers find them through the typed
`GATEWAY` AppKey (router.gateway). The request path lives in router.completions
(parse -> route -> admit -> forward -> record), the other endpoints and the middleware
in router.handlers.

The server must run with handler_cancellation=True (see `running_gateway`): aiohttp
otherwise keeps a handler running after its client disconnects, and a streaming proxy
would keep a replica generating tokens nobody reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

import aiohttp
from aiohttp import web
from prometheus_client.core import Metric

from router.admin import build_admin_app
from router.admission import Admission
from router.arrival_order import ArrivalOrder
from router.collector import serving_collector
from router.completions import complete, handle_completion
from router.config import GatewayConfig
from router.endpoints import handle_by_model, handle_conversation, handle_version
from router.event_watch import watch_event_silence
from router.events import EventIndexer, ReplicaFeed, wait_caught_up
from router.front_http import FrontConnection, FrontRequest, drain, send_whole
from router.gateway import GATEWAY, INDEX_OP_TIMEOUT_S, REQUEST_ID, Gateway, ignore_errors
from router.handlers import (
    handle_health,
    handle_metrics,
    handle_models,
    handle_openapi,
    handle_ready,
    request_context,
    run_handler,
)
from router.index import (
    IndexUnavailable,
    MemoryIndex,
    MirroredIndex,
    MirrorFeed,
    PrefixIndex,
    RedisIndex,
)
from router.indexer import rekey_setting
from router.metrics import (
    Bounded,
    GatewayMetrics,
    ReplicaGauges,
    StreamGauges,
    bounded_families,
    fleet_families,
    shared_segment_families,
)
from router.pending import PendingChains
from router.policy.pipeline import build_policy
from router.prefill_hold import PrefillHold
from router.proxy import Forwarder
from router.read_deadline import FrontFactory, ReadDeadlineSite
from router.replicas import Fleet, Replica, ReplicaSource, verify_keys
from router.routing import ChainCache, RoutingPipeline
from router.shared_segments import SharedSegments
from router.shared_work import SharedWork
from router.tenants import TenantRegistry
from router.tokenize import PromptTokenizer
from router.upstream_http import UpstreamPool

# serve.py and the end-to-end tests reach the request id and the gateway through here.
__all__ = ["GATEWAY", "REQUEST_ID", "Gateway", "build_app", "replica_sources", "running_gateway"]

log = logging.getLogger(__name__)

MAX_LINE_BYTES = 8190  # request line and each header line


MAX_HEADERS = 128


_HANDSHAKE_TIMEOUT_S = 10.0


def replica_sources(config: GatewayConfig) -> list[ReplicaSource]:
    """The fleet's replica entries, from the config's replicas section."""
    return [
        ReplicaSource(name=r.name, models=r.models, hash_config=r.hash, url=r.url, dns=r.dns,
                      kv_events=r.kv_events, kv_replay=r.kv_replay,
                      max_concurrency=r.max_concurrency, prefill=r.prefill)
        for r in config.replicas
    ]


async def _executor_ctx(app: web.Application) -> AsyncIterator[None]:
    gw = app[GATEWAY]
    # The tokenizer's encoding of long unseen text runs here (it releases the GIL: see
    # router/routing.py tokens_off_the_loop_when_long), as do loading tokenizers, batches
    # and recorded chains.
    gw.executor = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 2),
                                     thread_name_prefix="tokenize")
    yield
    gw.executor.shutdown(wait=True, cancel_futures=True)


async def _session_ctx(app: web.Application) -> AsyncIterator[None]:
    gw = app[GATEWAY]
    # No connection limit: admission control bounds concurrency, and a pool limit here
    # would queue requests invisibly, outside every deadline.
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
    # No cookie jar: this one session carries every tenant's requests, so a cookie a
    # replica (or an ingress in front of one) set for one would go with the next's.
    gw.session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                       cookie_jar=aiohttp.DummyCookieJar())
    # Client requests go upstream through a client of their own (router/upstream_http.py),
    # which sends no cookies either.
    gw.upstream = UpstreamPool(keepalive_s=30.0)
    yield
    gw.upstream.close()
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
        tokenizer = PromptTokenizer.from_dir(directory)
    else:
        tokenizer = PromptTokenizer.from_dir(directory, max_model_len=max_model_len)
    tokenizer.warm()
    return tokenizer


async def _index_ctx(app: web.Application) -> AsyncIterator[None]:
    gw = app[GATEWAY]
    cfg = gw.config.index
    if cfg.is_redis:
        redis = RedisIndex.from_url(cfg.backend, password=cfg.password, ca_file=cfg.tls_ca_file,
                                    capacity_blocks=cfg.record_capacity_blocks)
        # With every replica's events mirrored here, lookups stay in this process and
        # Redis keeps what only gateways know (router/index/mirror.py).
        gw.index = (MirroredIndex(redis, MemoryIndex(capacity_blocks=cfg.record_capacity_blocks))
                    if cfg.mirror_events else redis)
        try:
            # Connections and scripts ready before the first request: a cold pool makes
            # the first concurrent lookups miss their deadline (issue #16).
            await redis.warm()
        except IndexUnavailable as exc:
            log.warning("prefix index (redis) is not answering at start-up (%s); routing on "
                        "load alone until it does", exc)
    else:
        gw.index = MemoryIndex(capacity_blocks=cfg.record_capacity_blocks)
    yield
    await gw.index.close()


async def _fleet_ctx(app: web.Application) -> AsyncIterator[None]:
    gw = app[GATEWAY]
    assert gw.session is not None and gw.index is not None
    fleet = Fleet(replica_sources(gw.config), gw.config.health, gw.session,
                  rng=gw.rng)
    gw.fleet = fleet
    fleet.listeners.added.append(_set_mode)
    if isinstance(gw.index, MirroredIndex):
        mirror = gw.index
        fleet.listeners.added.append(
            lambda r: mirror.answer_from_shared(r.replica_id, r.mode != "events"))
        fleet.listeners.removed.append(
            lambda r: mirror.answer_from_shared(r.replica_id, False))
    # Ejections are counted by the proxy, the only caller of report_failure; a listener
    # recording them too would count each one twice.
    gw.pipeline = RoutingPipeline(
        tokenizers=gw.tokenizers, chains=ChainCache(gw.config.limits.chain_cache_blocks), index=gw.index,
        policy=build_policy(gw.config.policy, gw.rng),
        index_deadline_s=gw.config.index.deadline_ms / 1000.0, executor=gw.executor,
        pending=PendingChains(ttl_s=gw.config.policy.pending_ttl_s), clock=fleet.now,
        shared=_shared_work(gw, fleet), segments=_shared_segments(gw),
        hold=_prefill_hold(gw, fleet))
    gw.pipeline.claim_listeners.append(gw.metrics.record_claim)
    assert gw.upstream is not None
    gw.forwarder = Forwarder(gw.session, gw.upstream, fleet, gw.config.proxy, gw.metrics,
                             gw.rng)
    admission = Admission.from_config(gw.config.limits)
    gw.admission = admission
    gw.arrival = ArrivalOrder() if gw.config.proxy.route_in_arrival_order else None
    fleet.listeners.added.append(
        lambda r: admission.set_replica_limit(r.replica_id, r.target.max_concurrency))
    gw.metrics.add_scrape_callback(lambda: _fleet_gauges(gw))
    index = gw.index
    session = gw.session

    def handshake(replica: Replica) -> None:
        # Only replicas whose events feed the index can show the probe there.
        model = (replica.target.models or replica.served_models or ("",))[0]
        if replica.mode == "events" and model:
            gw.spawn(ignore_errors(verify_keys(session, index, replica, model,
                                                _HANDSHAKE_TIMEOUT_S)),
                     f"handshake-{replica.replica_id}")

    fleet.listeners.healthy.append(handshake)

    def forget(replica: Replica) -> None:
        # A replica gone from discovery holds nothing any more (event-fed replicas are
        # cleared by the indexer when it unsubscribes).
        if replica.mode == "record":
            gw.spawn(ignore_errors(index.clear_replica(replica.replica_id)),
                     f"forget-{replica.replica_id}")

    fleet.listeners.removed.append(forget)
    await fleet.start()
    shared = gw.pipeline.shared
    jobs = [] if shared is None else [
        gw.spawn(shared.heartbeat(
            lambda: {r.replica_id: r.work.view(fleet.now()) for r in fleet.all()}),
            "shared-work-heartbeat"),
        gw.spawn(shared.follow(), "shared-work-follow")]
    yield
    if gw.pipeline.segments is not None:
        await gw.pipeline.segments.drain()  # each report is bounded by its own deadline
    if shared is not None:
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        await shared.close()
    await fleet.close()


def _shared_work(gw: Gateway, fleet: Fleet) -> SharedWork | None:
    """With a Redis index (and policy.share_work), this gateway's outstanding work per
    replica is shared with the other gateways through it, and theirs read with each
    lookup (router/shared_work.py)."""
    redis = gw.redis
    if redis is None or not gw.config.policy.share_work:
        return None
    shared = SharedWork(redis.client)
    shared.delay_listeners.append(gw.metrics.record_shared_work_delay)

    def share(replica: Replica) -> None:
        def changed(now: float) -> None:
            shared.publish(replica.replica_id, replica.work.view(now))
        replica.work.listeners.append(changed)

    fleet.listeners.added.append(share)
    return shared


def _prefill_hold(gw: Gateway, fleet: Fleet) -> PrefillHold | None:
    """With policy.hold_cap, requests wait here while every replica's prefill queue is
    full (router/prefill_hold.py); each change of a replica's work is a look again."""
    if gw.config.policy.hold_cap is None or gw.config.policy.name != "cache_aware":
        return None
    hold = PrefillHold(fleet.now)
    fleet.listeners.added.append(lambda r: r.work.listeners.append(hold.changed))
    return hold


def _shared_segments(gw: Gateway) -> SharedSegments | None:
    """With a Redis index (and index.share_segments), the token ids of long prompt
    pieces are shared with the other gateways through it (router/shared_segments.py)."""
    cfg = gw.config.index
    redis = gw.redis
    if redis is None or not cfg.share_segments:
        return None
    return SharedSegments(redis.client, ttl_s=cfg.segment_ttl_s,
                          timeout_s=cfg.deadline_ms / 1000.0)


def _set_mode(replica: Replica) -> None:
    replica.mode = "events" if replica.target.kv_events else "record"


# How long start-up waits for the index to catch up: a mirror's snapshots (router/index/
# mirror.py, a few Redis round trips, tens of thousands of keys per replica at most), and
# every stream's replay (a replica's buffered batches; a silent one times out in
# DEFAULT_REPLAY_TIMEOUT_S).
_SEED_TIMEOUT_S = 10.0


async def _indexer_ctx(app: web.Application) -> AsyncIterator[None]:
    """An in-gateway KV-event indexer, for replicas that publish events: it feeds a memory
    index, or the mirror of a Redis index (router/index/mirror.py). A Redis index itself
    is fed by the separate `python -m router indexer`."""
    gw = app[GATEWAY]
    assert gw.fleet is not None and gw.index is not None
    index: PrefixIndex = gw.index
    if isinstance(index, MirroredIndex):
        index = MirrorFeed(index.local, index.shared)  # seeded from Redis as streams start
    if isinstance(index, RedisIndex) or not any(r.kv_events for r in gw.config.replicas):
        yield
        return
    indexer = EventIndexer(index)
    gw.indexer = indexer
    fleet = gw.fleet

    configs = {c.name: c for c in gw.config.replicas}

    def feed(replica: Replica) -> ReplicaFeed | None:
        t = replica.target
        if not t.kv_events:
            return None
        model = (t.models or replica.served_models or ("",))[0]
        # Keyed as the standalone indexer keys it (a replica's `rekey` setting): a
        # mirror keyed otherwise would disagree with Redis and with the replica.
        config = configs.get(t.source)
        rekey, mode = rekey_setting(config, "never") if config is not None else (None, "always")
        return ReplicaFeed(replica_id=t.replica_id, endpoint=t.kv_events, model=model,
                           replay_endpoint=t.kv_replay, rekey=rekey, rekey_mode=mode)

    for replica in fleet.all():
        f = feed(replica)
        if f is not None:
            await indexer.add_replica(f)
    # Serve once the index holds what the replicas announced before this gateway
    # started (a mirror: each stream's snapshot of Redis, then the replay past it; a
    # memory index: the replay of each replica's buffer), not before: a request routed
    # meanwhile would miss every prefix cached before, or follow one the replica has
    # since cleared (the replay applies its history oldest first). Bounded: a slow Redis
    # or a silent replica delays start-up, never blocks it.
    late = await wait_caught_up(indexer.streams, _SEED_TIMEOUT_S)
    if late:
        log.warning("serving before the KV events of %s caught up (%.0f s)",
                    ", ".join(late), _SEED_TIMEOUT_S)

    def on_added(replica: Replica) -> None:
        f = feed(replica)
        if f is not None:
            gw.spawn(ignore_errors(indexer.add_replica(f)), f"subscribe-{replica.replica_id}")

    def on_removed(replica: Replica) -> None:
        gw.spawn(ignore_errors(indexer.remove_replica(replica.replica_id)),
                 f"unsubscribe-{replica.replica_id}")

    def on_unhealthy(replica: Replica) -> None:
        # A replica failing health checks may be restarting with an empty cache: drop
        # its entries now; its stream resyncs (replay from 0) with its next event.
        # Not in a mirror of the Redis index: it answers for the indexer, which keeps
        # its entries through a missed health check (it sees no health checks) and
        # clears them only on its stream's evidence of a restart (router/events/
        # sequence.py), which the mirror's stream acts on as well. Clearing on one slow
        # /health (a 1 s deadline on a busy host) made the mirror claim no hit where
        # Redis and the replica had it, until the replay rebuilt it; an unhealthy
        # replica gets no requests meanwhile anyway.
        if isinstance(index, MirrorFeed):
            return
        stream = indexer.streams.get(replica.replica_id)
        if stream is not None:
            gw.spawn(ignore_errors(stream.mark_stale()), f"stale-{replica.replica_id}")

    fleet.listeners.added.append(on_added)
    fleet.listeners.removed.append(on_removed)
    fleet.listeners.unhealthy.append(on_unhealthy)
    watchdog = asyncio.create_task(watch_event_silence(gw, indexer), name="event-silence")
    yield
    watchdog.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watchdog
    await indexer.stop()


async def _background_ctx(app: web.Application) -> AsyncIterator[None]:
    """Registered last, so it opens last and closes first: finish recording before the
    index closes; keep what start-up built out of the garbage collector while serving
    (router/collector.py)."""
    gw = app[GATEWAY]
    with serving_collector(gw.config.listen.gc_young_threshold, gw.metrics.record_gc_pause):
        yield
    if gw.background:
        await asyncio.wait(list(gw.background), timeout=INDEX_OP_TIMEOUT_S * 2)
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
    segments = None if gw.pipeline is None else gw.pipeline.segments
    shared = [] if segments is None else shared_segment_families(
        segments.fetched, segments.reported, segments.failures)
    return [*fleet_families(replicas, streams), *bounded_families(_bounded(gw)), *shared]


def _bounded(gw: Gateway) -> list[Bounded]:
    out: list[Bounded] = []
    if gw.pipeline is not None:
        chains = gw.pipeline.chains
        out.append(Bounded("chain_cache", chains.blocks, chains.capacity_blocks))
        if gw.pipeline.pending is not None:
            pending = gw.pipeline.pending
            out.append(Bounded("pending", pending.blocks, pending.capacity_blocks))
    if isinstance(gw.index, MemoryIndex | MirroredIndex):
        local = gw.index if isinstance(gw.index, MemoryIndex) else gw.index.local
        out.append(Bounded("index", local.blocks, None))
    if gw.forwarder is not None:
        suspects = gw.forwarder.suspects
        out.append(Bounded("suspects", len(suspects), suspects.capacity))
    return out


def build_app(config: GatewayConfig, *, tenants: TenantRegistry | None = None,
              tokenizers: dict[str, PromptTokenizer] | None = None,
              rng: random.Random | None = None) -> web.Application:
    """The gateway app for `config` (resources open when the app starts)."""
    gw = Gateway(config=config, metrics=GatewayMetrics(),
                 tenants=tenants or TenantRegistry.from_config(config.tenants),
                 rng=rng or random.Random(config.policy.seed),
                 tokenizers=dict(tokenizers or {}))
    # client_max_size is a backstop; _read_body answers oversize bodies with a JSON 413.
    app = web.Application(middlewares=[request_context],
                          client_max_size=config.proxy.max_body_bytes + 1)
    app[GATEWAY] = gw
    app.cleanup_ctx.extend([_executor_ctx, _session_ctx, _tokenizers_ctx, _index_ctx,
                            _fleet_ctx, _indexer_ctx, _background_ctx])
    app.router.add_post("/v1/chat/completions", handle_completion)
    app.router.add_post("/v1/completions", handle_completion)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/health", handle_health)
    if config.listen.admin_port is None:  # else only on the admin listener (router/admin.py)
        app.router.add_get("/ready", handle_ready)
        app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/openapi.json", handle_openapi)
    app.router.add_post("/v1/responses", handle_conversation)
    app.router.add_post("/v1/messages", handle_conversation)
    app.router.add_post("/tokenize", handle_by_model)
    app.router.add_post("/detokenize", handle_by_model)
    app.router.add_post("/v1/embeddings", handle_by_model)
    app.router.add_get("/version", handle_version)
    return app


@contextlib.asynccontextmanager
async def running_gateway(app: web.Application, host: str, port: int, *,
                          shutdown_timeout: float = 10.0,
                          reuse_port: bool = False,
                          response_headers: Mapping[str, str] | None = None,
                          ) -> AsyncIterator[web.AppRunner]:
    """Serve `app` on host:port until the block exits (handler cancellation on), and
    its admin listener on listen.admin_port when that is set (router/admin.py).

    With `reuse_port`, other processes may listen on the same port (SO_REUSEPORT): the
    kernel spreads new connections over them. With listen.fast_front the completion
    endpoints are read by router/front_http.py first; `response_headers` go on its
    answers (aiohttp's have app.on_response_prepare).
    """
    listen = app[GATEWAY].config.listen
    # HTTP framing limits, explicit because they are a security property: a request line
    # or header over 8 KiB, or more than 128 headers, is refused with a 400 before any
    # handler runs (as is a request with both Content-Length and Transfer-Encoding); a
    # request not fully sent within listen.request_read_timeout_s is cut off.
    runners = [web.AppRunner(app, handler_cancellation=True, access_log=None,
                             shutdown_timeout=shutdown_timeout, max_line_size=MAX_LINE_BYTES,
                             max_field_size=MAX_LINE_BYTES, max_headers=MAX_HEADERS)]
    binds = [(host, port)]
    if listen.admin_port is not None:
        runners.append(web.AppRunner(build_admin_app(app[GATEWAY]), access_log=None,
                                     max_line_size=MAX_LINE_BYTES,
                                     max_field_size=MAX_LINE_BYTES, max_headers=MAX_HEADERS))
        binds.append((listen.admin_host or host, listen.admin_port))
    connections: set[FrontConnection] = set()
    front = _fast_front(app, connections, dict(response_headers or {})) \
        if listen.fast_front else None
    sites: list[ReadDeadlineSite] = []
    try:
        for i, (runner, (bind_host, bind_port)) in enumerate(zip(runners, binds, strict=True)):
            await runner.setup()
            site = ReadDeadlineSite(runner, bind_host, bind_port, reuse_port=reuse_port,
                                    read_timeout_s=listen.request_read_timeout_s,
                                    front=front if i == 0 else None)
            await site.start()
            sites.append(site)
        yield runners[0]
    finally:
        if connections:
            # Stop taking connections, then let the fast front's answers finish as
            # aiohttp's own do (runner.cleanup), before the app's resources close.
            await sites[0].stop()
            await drain(connections, shutdown_timeout)
        for runner in reversed(runners):
            await runner.cleanup()


def _fast_front(app: web.Application, connections: set[FrontConnection],
                response_headers: dict[str, str]) -> FrontFactory:
    """How each connection of the API listener is served first (router/front_http.py)."""
    config = app[GATEWAY].config

    async def serve(request: FrontRequest) -> None:
        response = await run_handler(request, complete)
        if not request.answered and isinstance(response, web.Response):
            with contextlib.suppress(ConnectionError):  # the client went away
                send_whole(request, response)

    def make(aiohttp_side: Callable[[], asyncio.Protocol]) -> asyncio.Protocol:
        return FrontConnection(app, serve, aiohttp_side,
                               max_body_bytes=config.proxy.max_body_bytes,
                               read_timeout_s=config.listen.request_read_timeout_s,
                               max_line_bytes=MAX_LINE_BYTES, max_headers=MAX_HEADERS,
                               registry=connections, extra_headers=response_headers)

    return make
