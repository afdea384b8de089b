"""The proxy against small real aiohttp upstreams on loopback that fail in controlled ways."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import threading
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from servers import free_port, serving

from router import completions
from router.app import build_app, running_gateway
from router.config import HealthConfig, ProxyConfig, build_config
from router.hashing import HashConfig
from router.metrics import GatewayMetrics
from router.outstanding import FleetBias
from router.proxy import Forwarder, RetryBudget, UpstreamRequest
from router.replicas import (
    Fleet,
    Replica,
    ReplicaSource,
    parse_prometheus_gauges,
)
from router.suspects import SuspectList, request_fingerprint
from router.tenants import derive_salt
from router.upstream_http import UpstreamPool

Handler = Callable[["Upstream", web.Request], Awaitable[web.StreamResponse]]


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


ROLE = {"id": "c1", "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                     "finish_reason": None}]}


def content(text: str, **extra: Any) -> dict[str, Any]:
    return {"id": "c1", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None, **extra}]}


ENGINE_DEAD = {"error": {
    "message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
    "type": "InternalServerError", "param": None, "code": 500}}

USAGE = {"id": "c1", "object": "chat.completion.chunk", "choices": [],
         "usage": {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42,
                   "prompt_tokens_details": {"cached_tokens": 32}}}


@dataclass
class Upstream:
    """A loopback HTTP server standing in for a replica, with one behaviour."""

    behaviour: Handler
    name: str
    hits: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    runner: web.AppRunner | None = None
    port: int = 0
    health_status: int = 200  # what its /health answers (503: an engine that died)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/chat/completions", self._handle)
        # handler_cancellation: the upstream notices the gateway dropping the connection,
        # as vLLM does (it aborts the request).
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        self.port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        self.bodies.append(await request.json())
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        try:
            return await self.behaviour(self, request)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({}, status=self.health_status)

    async def stop(self) -> None:
        self.release.set()
        if self.runner is not None:
            await self.runner.cleanup()


async def _stream(request: web.Request, *chunks: bytes) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for chunk in chunks:
        await resp.write(chunk)
    return resp


async def ok_stream(up: Upstream, request: web.Request) -> web.StreamResponse:
    resp = await _stream(request, sse(ROLE), sse(content(f"hello from {up.name}")),
                         sse(content("!")), sse(USAGE), b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def ok_json(up: Upstream, request: web.Request) -> web.StreamResponse:
    return web.json_response({
        "id": "c1", "object": "chat.completion", "prompt_token_ids": [1, 2, 3],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": up.name},
                     "finish_reason": "stop", "token_ids": [7, 8, 9]}],
        "usage": USAGE["usage"]})


async def fail_500(up: Upstream, request: web.Request) -> web.StreamResponse:
    return web.json_response({"error": "boom"}, status=500)


async def engine_dies(up: Upstream, request: web.Request) -> web.StreamResponse:
    """vLLM's EngineCore dying on this request: 500, and /health fails from then on."""
    up.health_status = 503
    return web.json_response(ENGINE_DEAD, status=500)


async def engine_dies_in_stream(up: Upstream, request: web.Request) -> web.StreamResponse:
    """The same in a stream: 200 went out, the error comes as the first event after the role."""
    up.health_status = 503
    resp = await _stream(request, sse(ROLE), sse(ENGINE_DEAD), b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def overloaded_503(up: Upstream, request: web.Request) -> web.StreamResponse:
    up.health_status = 503  # not ready: the replica's state, never the request's
    return web.json_response({"error": "not ready"}, status=503)


async def dies_mid_request(up: Upstream, request: web.Request) -> web.StreamResponse:
    """The process goes away with the request taken: connection lost, /health fails."""
    up.health_status = 503
    assert request.transport is not None
    request.transport.close()
    return web.Response()


async def stall_after_role(up: Upstream, request: web.Request) -> web.StreamResponse:
    resp = await _stream(request, sse(ROLE))
    await up.release.wait()  # never set during the test: the first token never comes
    return resp


async def held_before_first_token(up: Upstream, request: web.Request) -> web.StreamResponse:
    """vLLM's completions stream: the head at once, nothing until the first token."""
    resp = await _stream(request)
    await up.release.wait()
    await resp.write(sse(content("late")) + b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def reset_after_first_token(up: Upstream, request: web.Request) -> web.StreamResponse:
    resp = await _stream(request, sse(ROLE), sse(content("partial")))
    assert request.transport is not None
    request.transport.close()  # the replica dies mid-answer
    return resp


async def endless(up: Upstream, request: web.Request) -> web.StreamResponse:
    resp = await _stream(request, sse(ROLE), sse(content("first")))
    await up.release.wait()  # a long generation: holds the request until cancelled
    return resp


async def all_in_one_write(up: Upstream, request: web.Request) -> web.StreamResponse:
    """A whole answer in one write, token ids in every chunk: the gateway reads it as one
    run of events (router/upstream.py SSEReader.next_events) and must still open the
    chunks that carry usage or token ids."""
    resp = await _stream(request, b"".join([
        sse(ROLE), sse(content("a", token_ids=[5])), sse(content("b", token_ids=[6])),
        sse(content("c", token_ids=[7])), sse(USAGE), b"data: [DONE]\n\n"]))
    await resp.write_eof()
    return resp


async def split_mid_event(up: Upstream, request: web.Request) -> web.StreamResponse:
    """Events cut across writes: a run must end at an event's end, never inside one."""
    whole = b"".join([sse(ROLE), sse(content("ab")), sse(content("cd")), sse(USAGE),
                      b"data: [DONE]\n\n"])
    cuts = [0, 30, whole.index(b"\n\n") + 1, len(whole) - 20, len(whole)]
    resp = await _stream(request, *(whole[a:b] for a, b in itertools.pairwise(cuts)))
    await resp.write_eof()
    return resp


async def silent_after_first_token(up: Upstream, request: web.Request) -> web.StreamResponse:
    resp = await _stream(request, sse(ROLE), sse(content("first")))
    await up.release.wait()  # the replica stalls mid-answer
    return resp


def _closer(pool: UpstreamPool) -> Callable[[], Awaitable[None]]:
    async def close() -> None:
        pool.close()
    return close


@dataclass
class Harness:
    """A gateway-shaped aiohttp app whose one route forwards to the upstreams in order."""

    upstreams: list[Upstream]
    fleet: Fleet
    forwarder: Forwarder
    metrics: GatewayMetrics
    session: aiohttp.ClientSession
    pool: UpstreamPool
    url: str
    outcomes: list[Any]


@pytest.fixture
async def make_harness() -> AsyncIterator[Callable[..., Awaitable[Harness]]]:
    cleanups: list[Callable[[], Awaitable[None]]] = []

    async def build(*behaviours: Handler, dead_first: bool = False,
                    **settings: Any) -> Harness:
        upstreams = [Upstream(b, f"up{i}") for i, b in enumerate(behaviours)]
        for up in upstreams:
            await up.start()
            cleanups.append(up.stop)
        urls = [u.url for u in upstreams]
        if dead_first:
            urls.insert(0, f"http://127.0.0.1:{free_port()}")  # nothing listens there
        session = aiohttp.ClientSession()
        cleanups.append(session.close)
        sources = [ReplicaSource(name=u.split("//")[1], url=u, models=("m",), hash_config=HashConfig())
                   for u in urls]
        fleet = Fleet(sources, HealthConfig(eject_after_failures=2), session)
        await fleet.refresh_discovery()
        for r in fleet.all():
            r.healthy = True  # the dead one too: only the proxy may find out
        metrics = GatewayMetrics()
        defaults: dict[str, Any] = {"connect_timeout_s": 1.0, "first_token_timeout_s": 0.5,
                                    "idle_timeout_s": 2.0, "backoff_base_s": 0.001}
        pool = UpstreamPool()
        cleanups.append(_closer(pool))
        forwarder = Forwarder(session, pool, fleet, ProxyConfig(**{**defaults, **settings}),
                              metrics)
        outcomes: list[Any] = []

        async def handle(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            stream = bool(body.get("stream"))
            up = UpstreamRequest(path="/v1/chat/completions", body=body,
                                 headers={"x-request-id": "rid-1"}, stream=stream,
                                 client_wants_usage=bool(body.get("want_usage", not stream)),
                                 strip_token_ids=bool(body.get("strip", False)), max_tokens=4,
                                 collect_token_ids=bool(body.get("collect", True)))
            ranked = [fleet.get(u.split("//")[1]) for u in urls]
            resp, outcome = await forwarder.forward(
                request, up, [r for r in ranked if r is not None],
                lambda r: {"x-cacheroute-replica": r.replica_id})
            outcomes.append(outcome)
            return resp

        app = web.Application()
        app.router.add_post("/v1/chat/completions", handle)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        cleanups.append(runner.cleanup)
        return Harness(upstreams, fleet, forwarder, metrics, session, pool,
                       f"http://127.0.0.1:{port}/v1/chat/completions", outcomes)

    yield build
    for cleanup in reversed(cleanups):
        await cleanup()


def events(text: str) -> list[Any]:
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metric(h: Harness, name: str, **labels: str) -> float:
    value = h.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


async def post(h: Harness, body: dict[str, Any]) -> tuple[int, dict[str, str], str]:
    async with h.session.post(h.url, json=body) as resp:
        return resp.status, dict(resp.headers), await resp.text()


async def test_stream_passes_through_and_strips_usage_the_client_did_not_ask_for(
        make_harness: Callable[..., Awaitable[Harness]]) -> None:
    h = await make_harness(ok_stream)
    status, headers, text = await post(h, {"stream": True})
    assert status == 200
    assert headers["x-cacheroute-replica"] == h.upstreams[0].url.split("//")[1]
    got = events(text)
    assert got == [ROLE, content("hello from up0"), content("!"), "[DONE]"]
    outcome = h.outcomes[0]
    assert (outcome.prompt_tokens, outcome.cached_tokens, outcome.completed) == (40, 32, True)
    assert h.upstreams[0].headers[0]["x-request-id"] == "rid-1"

    status, _, text = await post(h, {"stream": True, "want_usage": True})
    assert events(text)[-2] == USAGE  # kept when the client asked for usage


async def test_answers_read_to_their_end_leave_their_connection_for_the_next_request(
        make_harness: Callable[..., Awaitable[Harness]]) -> None:
    h = await make_harness(ok_json)
    for _ in range(3):
        status, _, text = await post(h, {})
        assert status == 200, text
    h.upstreams[0].behaviour = ok_stream
    for _ in range(2):
        status, _, text = await post(h, {"stream": True})
        assert status == 200 and events(text)[-1] == "[DONE]"
    assert h.pool.connections_made == 1


async def test_events_that_arrive_together_are_relayed_with_usage_and_token_ids_handled(
        make_harness: Callable[..., Awaitable[Harness]]) -> None:
    h = await make_harness(all_in_one_write)
    status, _, text = await post(h, {"stream": True, "strip": True})
    assert status == 200
    assert events(text) == [ROLE, content("a"), content("b"), content("c"), "[DONE]"]
    outcome = h.outcomes[0]
    assert outcome.output_token_ids == [5, 6, 7]
    assert (outcome.prompt_tokens, outcome.cached_tokens, outcome.completed) == (40, 32, True)

    status, _, text = await post(h, {"stream": True, "want_usage": True})
    assert events(text) == [ROLE, content("a", token_ids=[5]), content("b", token_ids=[6]),
                            content("c", token_ids=[7]), USAGE, "[DONE]"]


async def test_token_ids_the_client_asked_for_pass_through_unread_when_not_recorded(
        make_harness: Callable[..., Awaitable[Harness]]) -> None:
    h = await make_harness(all_in_one_write)
    status, _, text = await post(h, {"stream": True, "collect": False})
    assert status == 200
    assert events(text) == [ROLE, content("a", token_ids=[5]), content("b", token_ids=[6]),
                            content("c", token_ids=[7]), "[DONE]"]
    outcome = h.outcomes[0]
    assert outcome.output_token_ids is None  # not collected: no replica records
    assert (outcome.prompt_tokens, outcome.cached_tokens) == (40, 32)  # usage still read


async def test_events_cut_across_writes_are_relayed_whole(
        make_harness: Callable[..., Awaitable[Harness]]) -> None:
    h = await make_harness(split_mid_event)
    status, _, text = await post(h, {"stream": True})
    assert status == 200
    assert events(text) == [ROLE, content("ab"), content("cd"), "[DONE]"]
    assert h.outcomes[0].completed is True


async def test_a_replica_silent_mid_stream_past_the_idle_timeout_ends_it_with_an_error(
        make_harness: Callable[..., Awaitable[Harness]]) -> None:
    h = await make_harness(silent_after_first_token, ok_stream, idle_timeout_s=0.3)
    status, _, text = await post(h, {"stream": True})
    assert status == 200
    got = events(text)
    assert got[:2] == [ROLE, content("first")]
    assert got[2]["error"]["message"] == "upstream replica failed mid-stream (idle_timeout)"
    assert got[3] == "[DONE]"
    assert h.upstreams[1].hits == 0  # the client had seen a byte: not retried
    assert h.outcomes[0].completed is False
    stalled = h.upstreams[0].url.split("//")[1]
    assert metric(h, "cacheroute_upstream_failures_total", replica=stalled,
                  reason="idle_timeout") == 1
    # The gateway hung up on the stalled replica.
    await asyncio.wait_for(h.upstreams[0].cancelled.wait(), 5)


async def test_connect_refused_is_retried_on_the_next_replica(
        make_harness: Callable[..., Awaitable[Harness]]) -> None:
    h = await make_harness(ok_stream, dead_first=True)
    status, _, text = await post(h, {"stream": True})
    assert status == 200
    assert content("hello from up0") in events(text)
    outcome = h.outcomes[0]
    assert outcome.attempts == 2
    assert outcome.failures[0][1] == "connect"
    dead = outcome.failures[0][0]
    assert metric(h, "cacheroute_retries_total", replica=dead, reason="connect") == 1


async def test_5xx_is_retried_and_repeated_failures_eject(
        make_harness: Callable[..., Awaitable[Harness]]) -> None:
    h = await make_harness(fail_500, ok_json)
    for _ in range(2):
        status, _, text = await post(h, {})
        assert status == 200
        assert json.loads(text)["choices"][0]["message"]["content"] == "up1"
    bad = h.fleet.get(h.upstreams[0].url.split("//")[1])
    assert bad is not None
    assert bad.ejected(h.fleet.now())
    assert metric(h, "cacheroute_ejections_total", replica=bad.replica_id) == 1
    assert h.upstreams[0].hits == 2 and h.upstreams[1].hits == 2


async def test_never_ejects_the_last_replica(
        make_harness: Callable[..., Awaitable[Harness]]) -> None:
    h = await make_harness(fail_500, max_retries=0)
    for _ in range(4):
        status, _, text = await post(h, {})
        assert status == 502
        assert json.loads(text)["error"]["type"] == "upstream_error"
    only = h.fleet.all()[0]
    assert not only.ejected(h.fleet.now())
    assert only.consecutive_failures == 4


async def test_stall_before_first_token_is_retried_and_counts_as_failure(
        make_harness: Callable[..., Awaitable[Harness]]) -> None:
    h = await make_harness(stall_after_role, ok_stream, first_token_timeout_s=0.3)
    status, _, text = await post(h, {"stream": True})
    assert status == 200
    got = events(text)
    assert got[0] == ROLE and got[1] == content("hello from up1")  # nothing from up0 leaked
    outcome = h.outcomes[0]
    assert outcome.failures == [(h.upstreams[0].url.split("//")[1], "first_token_timeout")]
    stalled = h.fleet.get(outcome.failures[0][0])
    assert stalled is not None and stalled.consecutive_failures == 1
    # The gateway hung up on the stalled replica rather than leaving it generating.
    await asyncio.wait_for(h.upstreams[0].cancelled.wait(), 5)


async def test_a_streams_head_goes_out_before_its_first_token(
        make_harness: Callable[..., Awaitable[Harness]]) -> None:
    h = await make_harness(held_before_first_token, first_token_timeout_s=10.0, early_head=True)
    async with asyncio.timeout(5):
        async with h.session.post(h.url, json={"stream": True}) as resp:
            # The client has its 200 while the replica is still on the prompt.
            assert resp.status == 200 and not h.upstreams[0].release.is_set()
            h.upstreams[0].release.set()
            text = await resp.text()
    assert events(text) == [content("late"), "[DONE]"]
    assert h.outcomes[0].completed is True


async def test_a_failover_after_an_early_head_names_the_replica_answering(
        make_harness: Callable[..., Awaitable[Harness]]) -> None:
    h = await make_harness(stall_after_role, ok_stream, first_token_timeout_s=0.3,
                           early_head=True)
    status, headers, text = await post(h, {"stream": True})
    up0, up1 = (u.url.split("//")[1] for u in h.upstreams)
    assert status == 200 and headers["x-cacheroute-replica"] == up0  # the head's, gone out
    assert text.startswith(f": x-cacheroute-replica: {up1}\n\n"), text[:120]
    got = events(text)
    assert got[0] == ROLE and got[1] == content("hello from up1")  # nothing from up0 leaked
    assert h.outcomes[0].failures == [(up0, "first_token_timeout")]


async def test_reset_after_first_byte_ends_with_sse_error_and_done(
        make_harness: Callable[..., Awaitable[Harness]]) -> None:
    h = await make_harness(reset_after_first_token, ok_stream)
    status, _, text = await post(h, {"stream": True})
    assert status == 200
    got = events(text)
    assert got[:2] == [ROLE, content("partial")]
    assert got[2]["error"]["type"] == "upstream_error"
    assert got[3] == "[DONE]"
    assert h.upstreams[1].hits == 0  # never retried once the client saw a byte
    assert h.outcomes[0].completed is False


async def test_client_disconnect_cancels_the_upstream_request(
        make_harness: Callable[..., Awaitable[Harness]]) -> None:
    h = await make_harness(endless)
    async with h.session.post(h.url, json={"stream": True}) as resp:
        first = await resp.content.readuntil(b"\n\n")
        assert json.loads(first[6:]) == ROLE
        second = await resp.content.readuntil(b"\n\n")
        assert json.loads(second[6:]) == content("first")
        resp.close()  # the client goes away mid-generation
    await asyncio.wait_for(h.upstreams[0].cancelled.wait(), 5)
    # The gateway's count drops before it hangs up, so it is exact by now.
    assert h.fleet.all()[0].inflight == 0
    assert metric(h, "cacheroute_client_disconnects_total") == 1


async def test_non_stream_token_ids_are_recorded_and_stripped(
        make_harness: Callable[..., Awaitable[Harness]]) -> None:
    h = await make_harness(ok_json)
    status, _, text = await post(h, {"strip": True})
    body = json.loads(text)
    assert status == 200
    assert "token_ids" not in body["choices"][0] and "prompt_token_ids" not in body
    assert h.outcomes[0].output_token_ids == [7, 8, 9]
    assert h.outcomes[0].cached_tokens == 32


def test_retry_budget_is_a_share_of_inflight_with_a_floor() -> None:
    budget = RetryBudget(ratio=0.1, minimum=2)
    budget.inflight = 50
    assert [budget.try_acquire() for _ in range(6)] == [True] * 5 + [False]
    budget.release()
    assert budget.try_acquire()
    low = RetryBudget(ratio=0.1, minimum=2)
    low.inflight = 1
    assert [low.try_acquire() for _ in range(3)] == [True, True, False]


async def test_dns_source_finds_every_address_and_health_checks_them() -> None:
    up = Upstream(ok_json, "dns")
    await up.start()
    try:
        async with aiohttp.ClientSession() as session:
            source = ReplicaSource(name="svc", dns=f"localhost:{up.port}", models=("m",),
                                   hash_config=HashConfig(),
                                   kv_events="tcp://{host}:5557")
            fleet = Fleet([source], HealthConfig(timeout_s=1.0), session)
            added: list[str] = []
            fleet.listeners.added.append(lambda r: added.append(r.replica_id))
            await fleet.refresh_discovery()
            replica = fleet.get(f"127.0.0.1:{up.port}")
            assert replica is not None and replica.replica_id in added
            assert replica.base_url == up.url
            assert replica.target.kv_events == "tcp://127.0.0.1:5557"
            await fleet.check_health()
            assert replica.available(fleet.now())
            assert fleet.available("m")[0] is replica
            # Re-resolving the same name changes nothing.
            await fleet.refresh_discovery()
            assert added.count(replica.replica_id) == 1
    finally:
        await up.stop()


def test_scraped_load_counts_other_clients_and_our_fresh_inflight() -> None:
    text = "\n".join([
        "# HELP vllm:num_requests_running x",
        'vllm:num_requests_running{engine="0",model_name="m"} 7.0',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
        "vllm:num_requests_running_other 99"])
    gauges = parse_prometheus_gauges(text, ["vllm:num_requests_running",
                                            "vllm:num_requests_waiting",
                                            "vllm:kv_cache_usage_perc"])
    assert gauges == {"vllm:num_requests_running": 7.0, "vllm:num_requests_waiting": 3.0,
                      "vllm:kv_cache_usage_perc": 0.25}
    source = ReplicaSource(name="r", url="http://127.0.0.1:1", models=("m",),
                           hash_config=HashConfig())

    replica = Replica(target=source.target(), running=7, waiting=3, inflight_at_scrape=4)
    replica.inflight = 0  # ours finished since the scrape: 6 others remain
    assert replica.outstanding() == (3, 3)
    replica.inflight = 10  # a burst since the scrape: counted at once
    assert sum(replica.outstanding()) == 16


async def test_a_request_of_ours_that_ends_while_a_scrape_is_answered_is_not_another_clients(
        ) -> None:
    """The replica renders its gauges with our request running; the request ends before
    the gateway reads the answer. Counted against our in-flight requests at that later
    moment, it would show as another client's request until the next scrape."""
    entered, release = asyncio.Event(), asyncio.Event()

    async def metrics(request: web.Request) -> web.Response:
        entered.set()
        await release.wait()
        return web.Response(text='vllm:num_requests_running{model_name="m"} 1.0\n'
                                 'vllm:num_requests_waiting{model_name="m"} 0.0\n')

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    async with serving(app) as url, aiohttp.ClientSession() as session:
        source = ReplicaSource(name="r", url=url, models=("m",), hash_config=HashConfig())
        fleet = Fleet([source], HealthConfig(), session)
        await fleet.refresh_discovery()
        replica = fleet.get("r")
        assert replica is not None
        replica.healthy = True
        replica.start_request()
        scrape = asyncio.create_task(fleet.scrape())
        await entered.wait()
        replica.end_request()  # answered while the gauges were on their way
        release.set()
        await scrape
        assert replica.running == 1.0
        assert replica.external() == (0, 0)
        # A request begun while a scrape is out may be in its gauges too.
        entered.clear()
        release.clear()
        scrape = asyncio.create_task(fleet.scrape())
        await entered.wait()
        with replica.in_flight():
            release.set()
            await scrape
        assert replica.external() == (0, 0)


def test_ready_shows_what_the_policy_weighs_on_each_replica() -> None:
    source = ReplicaSource(name="r", url="http://127.0.0.1:1", models=("m",),
                           hash_config=HashConfig())
    replica = Replica(target=source.target(), running=3, waiting=2, inflight_at_scrape=1)
    idle = replica.describe(0.0)
    assert (idle["queued_prefill_s"], idle["pending"], idle["ttft_bias"],
            idle["bias_samples"]) == (0.0, 0, 1.0, 0)
    assert (idle["external_running"], idle["external_waiting"]) == (2, 2)
    # A streamed request predicted at 0.1 s answers in 0.2: the bias learns from it once
    # it ends (its usage known); another decodes, a third waits for its prefill.
    done = replica.work.begin(0.0, 0.1, 0.1, True)
    first = replica.work.begin(0.0, 0.1, 0.1, True)
    second = replica.work.begin(0.0, 0.3, 0.4, True)
    replica.work.first_byte(done, 0.2)
    replica.work.end(done, 0.2)
    replica.work.first_byte(first, 0.2)
    state = replica.describe(0.2)
    assert state["pending"] == 1 and state["decoding"] == 1 and state["bias_samples"] == 1
    # Its own reading (the policy draws it toward the fleet's: router/outstanding.py).
    assert state["ttft_bias"] == pytest.approx(2.0, abs=1e-3)
    assert state["queued_prefill_s"] == pytest.approx(0.3 * 2.0, abs=1e-3)
    # Beside a fleet that reads 0.5, one reading of 2.0 is weighed much nearer 0.5.
    weighed = replica.describe(0.2, FleetBias(math.log(0.5)))
    assert weighed["ttft_bias"] == pytest.approx(2.0, abs=1e-3)
    assert 0.5 < weighed["ttft_bias_weighed"] < 1.0
    assert weighed["queued_prefill_s"] == pytest.approx(0.3 * weighed["ttft_bias_weighed"],
                                                        abs=2e-3)
    replica.work.end(second, 0.3)


async def test_gateway_injects_the_tenant_salt_and_forwards_tracing_headers() -> None:
    """The whole app in front of a loopback upstream that records what it was sent."""
    up = Upstream(ok_stream, "replica")
    await up.start()
    secret = "proxy-test-secret-0123456789"
    port = free_port()
    config = build_config({
        "listen": {"host": "127.0.0.1", "port": port},
        "replicas": [{"url": up.url, "models": ["m"]}],
        "tenants": {"keys": [{"key": "sk-t", "tenant": "t"}]},
        "health": {"interval_s": 60},
    }, {"CACHEROUTE_SALT_SECRET": secret})
    trace = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
             "tracestate": "vendor=1", "x-request-id": "abc-123"}
    try:
        async with running_gateway(build_app(config), "127.0.0.1", port), \
                aiohttp.ClientSession() as session:
            async with session.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json={"model": "m", "stream": True,
                          "messages": [{"role": "user", "content": "hi"}]},
                    headers={"Authorization": "Bearer sk-t", **trace}) as resp:
                assert resp.status == 200
                assert resp.headers["x-request-id"] == "abc-123"
                assert "x-cacheroute-replica" not in resp.headers
                got = events(await resp.text())
        sent = up.bodies[0]
        assert sent["cache_salt"] == derive_salt(secret.encode(), "t")
        assert sent["stream_options"] == {"include_usage": True}
        assert all(up.headers[0][k] == v for k, v in trace.items())
        assert "authorization" not in up.headers[0]  # the tenant's key stays at the gateway
        assert got[-1] == "[DONE]" and USAGE not in got  # usage chunk hidden: not asked for
    finally:
        await up.stop()


async def test_a_whole_answer_goes_out_before_the_requests_bookkeeping(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-streamed answer reaches the client while the gateway still has the
    request's bookkeeping to do: the bookkeeping (here: recording the outcome) waits,
    holding the gateway's loop, until a client in another thread has read the whole
    answer. Written after it, as aiohttp does with a returned response, the answer never
    arrives within the wait (then the wait says so, and the answer follows it)."""
    up = Upstream(ok_json, "replica")
    await up.start()
    port = free_port()
    config = build_config({
        "listen": {"host": "127.0.0.1", "port": port},
        "replicas": [{"url": up.url, "models": ["m"]}],
        "tenants": {"allow_anonymous": True},
        "health": {"interval_s": 60},
    }, {})
    answered = threading.Event()
    waits: list[bool] = []
    record = completions.record_outcome

    def record_after_the_client_has_it(*args: Any) -> None:
        waits.append(answered.wait(timeout=10))
        record(*args)

    monkeypatch.setattr(completions, "record_outcome", record_after_the_client_has_it)

    def client() -> dict[str, Any]:
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", method="POST",
            data=json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                            ).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            body: dict[str, Any] = json.loads(resp.read())
        answered.set()
        return body

    try:
        async with running_gateway(build_app(config), "127.0.0.1", port):
            body = await asyncio.to_thread(client)
    finally:
        await up.stop()
    assert body["choices"][0]["message"]["content"]
    assert waits == [True]


# ------------------------------------------------------------- requests that kill replicas


async def test_5xx_from_a_replica_that_then_fails_health_is_not_carried_and_is_refused(
        make_harness: Callable[..., Awaitable[Harness]]) -> None:
    h = await make_harness(engine_dies, ok_json, suspect_ttl_s=60.0)
    dying = h.upstreams[0].url.split("//")[1]
    status, _, text = await post(h, {"prompt": "poison"})
    assert status == 502
    error = json.loads(text)["error"]
    assert error["type"] == "upstream_error"
    assert f"replica {dying} failed while serving this request" in error["message"]
    assert "/health 503" in error["message"] and "refused for 60s" in error["message"]
    assert h.upstreams[1].hits == 0  # never carried to the next replica
    assert metric(h, "cacheroute_suspect_requests_total", replica=dying,
                  outcome="refused") == 1
    # The client's own retry is refused at the gateway: no replica sees it.
    h.upstreams[0].health_status = 200
    status, _, text = await post(h, {"prompt": "poison"})
    assert status == 422
    error = json.loads(text)["error"]
    assert error["type"] == "invalid_request_error"
    assert f"when replica {dying} died (HTTP 500, then /health 503)" in error["message"]
    assert h.upstreams[0].hits == 1 and h.upstreams[1].hits == 0
    assert metric(h, "cacheroute_suspect_refusals_total") == 1
    # Another request is not held back.
    h.upstreams[0].behaviour = ok_json
    status, _, text = await post(h, {"prompt": "ordinary"})
    assert status == 200 and h.upstreams[0].hits == 2, text


@pytest.mark.parametrize("early_head", [False, True])
async def test_an_engine_death_in_a_stream_before_content_counts_as_a_5xx(
        make_harness: Callable[..., Awaitable[Harness]], early_head: bool) -> None:
    h = await make_harness(engine_dies_in_stream, ok_stream, early_head=early_head)
    status, _, text = await post(h, {"stream": True, "prompt": "poison"})
    if early_head:
        # The head went out when the replica accepted the stream: the failure is the
        # stream's one event (nothing of the dead replica's answer leaked), as vLLM ends
        # a stream that fails, its status as the code.
        assert status == 200
        got = events(text)
        assert len(got) == 2 and got[1] == "[DONE]", got
        assert got[0]["error"]["code"] == 502
        assert "failed its health check" in got[0]["error"]["message"]
    else:
        assert status == 502 and "failed its health check" in json.loads(text)["error"]["message"]
    assert h.upstreams[1].hits == 0
    assert h.outcomes[0].failures[0][1] == "status_5xx"
    status, _, _ = await post(h, {"stream": True, "prompt": "poison"})
    assert status == 422 and h.upstreams[1].hits == 0


async def test_a_503_is_the_replicas_state_and_moves_on_even_while_health_fails(
        make_harness: Callable[..., Awaitable[Harness]]) -> None:
    h = await make_harness(overloaded_503, ok_json)
    for _ in range(2):
        status, _, _ = await post(h, {"prompt": "same"})
        assert status == 200
    assert h.outcomes[0].failures[0][1] == "status_503"
    assert len(h.forwarder.suspects) == 0
    assert metric(h, "cacheroute_suspect_requests_total",
                  replica=h.upstreams[0].url.split("//")[1], outcome="refused") == 0


async def test_a_connection_lost_as_the_replica_dies_moves_on_once_then_is_refused(
        make_harness: Callable[..., Awaitable[Harness]]) -> None:
    # A lost connection is also what a replica killed from outside looks like: its
    # requests move on, but the same request coinciding with a second death is refused.
    h = await make_harness(dies_mid_request, dies_mid_request, ok_json)
    status, _, text = await post(h, {"prompt": "poison"})
    assert status == 502, text
    assert "connection lost, then /health" in json.loads(text)["error"]["message"]
    assert [u.hits for u in h.upstreams] == [1, 1, 0]
    first, second = (u.url.split("//")[1] for u in h.upstreams[:2])
    assert metric(h, "cacheroute_suspect_requests_total", replica=first, outcome="strike") == 1
    assert metric(h, "cacheroute_suspect_requests_total", replica=second,
                  outcome="refused") == 1
    status, _, _ = await post(h, {"prompt": "poison"})
    assert status == 422 and [u.hits for u in h.upstreams] == [1, 1, 0]


def test_suspect_list_expires_and_stays_bounded() -> None:
    now = [0.0]
    suspects = SuspectList(ttl_s=10.0, capacity=3, clock=lambda: now[0])
    assert suspects.strike(b"a", "r0", "x", conclusive=False).refused is False
    assert suspects.refused(b"a") is None  # one strike is not a refusal
    assert suspects.strike(b"a", "r1", "x", conclusive=False).refused is True
    assert suspects.refused(b"a") is not None
    for fp in (b"b", b"c", b"d"):
        now[0] += 1.0
        suspects.strike(fp, "r0", "x", conclusive=True)
    assert len(suspects) == 3 and suspects.refused(b"a") is None  # the oldest went first
    now[0] += 9.5  # b was marked at 1.0: expired at 11.0; d (3.0) lives until 13.0
    assert suspects.refused(b"b") is None and suspects.refused(b"d") is not None
    now[0] += 10.0
    suspects.expire()
    assert len(suspects) == 0


def test_fingerprint_is_the_last_block_key_and_length_scoped_by_salt() -> None:
    body = b'{"prompt": [1, 2, 3]}'
    keys = {"g": (11, 22, 33)}
    same = request_fingerprint(keys, 50, b'{"prompt":[1,2,3]}', None)
    assert request_fingerprint(keys, 50, body, None) == same  # re-encoded body, same prompt
    assert request_fingerprint({"g": (11, 22, 34)}, 50, body, None) != same
    assert request_fingerprint(keys, 51, body, None) != same
    assert request_fingerprint(keys, 50, body, "tenant-b") != same
    assert request_fingerprint({}, 0, body, None) != request_fingerprint({}, 0, body + b" ", None)


async def test_a_fleets_replicas_count_their_readings_together() -> None:
    # A replica's learned bias ages by the readings it missed at a fair share of its
    # fleet's (router/outstanding.py): the fleet's replicas share one count.
    async with aiohttp.ClientSession() as session:
        sources = [ReplicaSource(name=n, url=f"http://127.0.0.1:{free_port()}", models=("m",),
                                 hash_config=HashConfig()) for n in ("a", "b", "c", "d")]
        fleet = Fleet(sources, HealthConfig(), session)
        await fleet.refresh_discovery()
        a, b = fleet.get("a"), fleet.get("b")
        assert a is not None and b is not None
        for i in range(6):  # six streamed answers from "a", none from "b"
            token = a.work.begin(float(i), 0.1, 0.1, stream=True)
            a.work.first_byte(token, i + 0.05)
            a.work.end(token, i + 0.5)
        assert a.work.view(10.0).missed_readings == 0.0
        assert b.work.view(10.0).missed_readings == pytest.approx(6 / 4)
