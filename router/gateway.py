"""The gateway's resources and shared state, found by handlers through `GATEWAY`.

Each resource is opened and closed by one cleanup context in router.app; the request
handlers (router.handlers, router.completions), the event-silence watch and the
recorder read and update what is here.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import os
import random
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from router.admission import Admission
from router.arrival_order import ArrivalOrder
from router.config import GatewayConfig
from router.events import EventIndexer
from router.front_http import FrontRequest
from router.hygiene import PromptHygiene
from router.index import MirroredIndex, PrefixIndex, RedisIndex
from router.metrics import GatewayMetrics
from router.proxy import Forwarder
from router.replicas import Fleet
from router.request import ClientError
from router.routing import RoutingPipeline
from router.tenants import Tenant, TenantError, TenantRegistry, api_key_from_headers
from router.tokenize import PromptTokenizer
from router.upstream_http import UpstreamPool

log = logging.getLogger(__name__)

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


INDEX_OP_TIMEOUT_S = 1.0


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
    upstream: UpstreamPool | None = None  # routed requests' connections (upstream_http)
    tokenizers: dict[str, PromptTokenizer] = field(default_factory=dict)
    index: PrefixIndex | None = None
    fleet: Fleet | None = None
    indexer: EventIndexer | None = None
    pipeline: RoutingPipeline | None = None
    forwarder: Forwarder | None = None
    admission: Admission | None = None
    # Requests' routing work in arrival order (proxy.route_in_arrival_order); None: off.
    arrival: ArrivalOrder | None = None
    hygiene: PromptHygiene = field(default_factory=PromptHygiene)
    index_status: str = "unknown"
    index_up: bool | None = None  # None until the index has first answered or failed
    request_ids: RequestIds = field(default_factory=RequestIds)
    background: set[asyncio.Task[None]] = field(default_factory=set)
    # Event-fed replicas owing KV events: replica id -> (wall time the request that
    # must have stored blocks was sent, deadline on the fleet's clock). See router.event_watch.
    events_due: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def index_backend(self) -> str:
        return "redis" if self.config.index.is_redis else "memory"

    @property
    def redis(self) -> RedisIndex | None:
        """The Redis index shared with other gateways, mirrored here or not (None: memory)."""
        if isinstance(self.index, MirroredIndex):
            return self.index.shared
        return self.index if isinstance(self.index, RedisIndex) else None

    def spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        """Run a small background job owned by the gateway (awaited at shutdown)."""
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task


GATEWAY = web.AppKey("gateway", Gateway)


async def ignore_errors(coro: Awaitable[Any]) -> None:
    try:
        await coro
    except Exception:
        log.exception("background index job failed")


def tenant_of(gw: Gateway, request: web.Request | FrontRequest) -> Tenant:
    try:
        return gw.tenants.identify(api_key_from_headers(request.headers))
    except TenantError as exc:
        raise ClientError(str(exc), status=401, type="authentication_error") from None


def served_models(gw: Gateway) -> set[str]:
    assert gw.fleet is not None
    return set(gw.fleet.models()) | set(gw.config.served_models())


def note_index_state(gw: Gateway, status: str) -> None:
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
