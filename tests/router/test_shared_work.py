"""Outstanding work shared between gateways through a real Redis (router/shared_work.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from redis.asyncio import Redis

from replica.fleet import free_port
from replica.processes import wait_until_async
from router.app import build_app, running_gateway
from router.config import LimitsConfig, TenantsConfig, build_config
from router.hashing import HashConfig
from router.index import MemoryIndex
from router.outstanding import OutstandingWork, WorkView
from router.pending import PendingChains
from router.policy.pipeline import build_policy
from router.policy.types import PolicyConfig
from router.replicas import Replica, ReplicaSource
from router.request import parse_request
from router.routing import ChainCache, RoutingPipeline
from router.shared_work import PeerWork, SharedWork, encode, joined_wait, lane_of, parse
from router.tenants import TenantRegistry

REGISTRY = TenantRegistry.from_config(TenantsConfig(allow_anonymous=True))


def test_parse_sums_other_gateways_and_skips_own_stale_and_malformed() -> None:
    now = 1000.0
    raw = {
        b"a/r0": encode(WorkView(wait_s=0.5, pending=2, decoding=1), now - 0.1),  # 0.4 s left
        b"b/r0": encode(WorkView(wait_s=0.2, pending=1, decoding=0), now),
        b"b/r1": encode(WorkView(wait_s=0.1, pending=1, decoding=3), now - 0.5),  # drained
        b"me/r0": encode(WorkView(wait_s=9.0, pending=9, decoding=9), now),  # our own
        b"c/r2": encode(WorkView(wait_s=9.0, pending=9, decoding=9), now - 5.0),  # stale
        b"d/r2": encode(WorkView(wait_s=9.0, pending=9, decoding=9), now - 100.0),  # dead
        b"e/r2": b"not a value",
        b"no-slash": encode(WorkView(wait_s=1.0, pending=1), now),
    }
    peers, dead, live = parse(raw, "me", now, stale_s=3.0, forget_s=60.0)
    assert set(peers) == {"r0", "r1"}
    assert abs(peers["r0"].wait_s - 0.6) < 1e-3
    assert (peers["r0"].pending, peers["r0"].decoding) == (3, 1)
    assert (peers["r1"].wait_s, peers["r1"].pending, peers["r1"].decoding) == (0.0, 1, 3)
    assert dead == [b"d/r2"]
    assert live == {"a", "b"}


def _through_the_hash(views: dict[str, WorkView], wall: float) -> PeerWork:
    """Other gateways' views of one replica, written and read back as routing reads them."""
    raw = {f"{g}/r0".encode(): encode(v, wall) for g, v in views.items()}
    return parse(raw, "me", wall, stale_s=3.0)[0].get("r0", PeerWork())


def test_two_gateways_queues_on_one_replica_drain_as_one_line() -> None:
    # Two gateways each sent a 1 s prefill to one replica at t=0. Half a second on, the
    # replica has worked half a second of the two: 1.5 s are left, not 0.5 + 0.5 (each
    # gateway drains its own queue from its own first bytes as if alone there).
    own, other = OutstandingWork(), OutstandingWork()
    own.begin(0.0, 1.0, 1.0, stream=True)
    other.begin(0.0, 1.0, 1.0, stream=True)
    mine = own.view(0.5)
    peers = _through_the_hash({"b": other.view(0.5)}, wall=100.5)
    assert mine.wait_s == pytest.approx(0.5) and peers.wait_s == pytest.approx(0.5)
    assert joined_wait(mine, peers) == pytest.approx(1.5, abs=1e-3)


def test_a_first_byte_at_any_gateway_reanchors_the_joined_line() -> None:
    # The other gateway's first request came back at t=0.8: whatever is still pending
    # anywhere started from there (first come, first served), ours included.
    own, other = OutstandingWork(), OutstandingWork()
    own.begin(0.0, 1.0, 1.0, stream=True)
    first = other.begin(0.0, 0.6, 0.6, stream=True)
    other.begin(0.1, 0.5, 0.5, stream=True)
    other.first_byte(first, 0.8)
    peers = _through_the_hash({"b": other.view(1.0)}, wall=101.0)
    assert joined_wait(own.view(1.0), peers) == pytest.approx(1.0 + 0.5 - 0.2, abs=1e-3)
    # Three gateways: the pending work adds up, the latest first byte anchors.
    third = OutstandingWork()
    third.begin(0.9, 0.4, 0.4, stream=True)
    peers = _through_the_hash({"b": other.view(1.0), "c": third.view(1.0)}, wall=101.0)
    assert joined_wait(own.view(1.0), peers) == pytest.approx(1.9 - 0.2, abs=1e-3)


def test_a_joined_line_from_an_idle_start_drains_from_its_oldest_request() -> None:
    # No first byte yet anywhere: the line started when its oldest request was sent,
    # whichever gateway sent it (here the other, 0.3 s before ours).
    own, other = OutstandingWork(), OutstandingWork()
    other.begin(0.0, 0.5, 0.5, stream=True)
    own.begin(0.3, 0.5, 0.5, stream=True)
    peers = _through_the_hash({"b": other.view(0.4)}, wall=100.4)
    assert joined_wait(own.view(0.4), peers) == pytest.approx(1.0 - 0.4, abs=1e-3)


def test_without_other_gateways_pending_the_wait_is_this_gateways_own() -> None:
    own, other = OutstandingWork(), OutstandingWork()
    own.begin(0.0, 1.0, 1.0, stream=True)
    token = other.begin(0.0, 0.2, 0.2, stream=True)
    other.first_byte(token, 0.2)  # past its prefill: it decodes, it queues nothing
    for peers in (PeerWork(), _through_the_hash({"b": other.view(0.5)}, wall=100.5)):
        assert joined_wait(own.view(0.5), peers) == own.view(0.5).wait_s


def test_a_gateways_lane_is_its_place_among_the_live_gateways() -> None:
    now = 1000.0
    raw = {
        b"c/r0": encode(WorkView(), now),
        b"a/r0": encode(WorkView(), now - 1.0),
        b"a/r1": encode(WorkView(), now - 1.0),
        b"d/r0": encode(WorkView(), now - 10.0),  # stale: gone
        b"e/r0": b"not a value",
    }
    live = parse(raw, "b", now, stale_s=3.0)[2]
    assert lane_of(live, "b") == (1, 3)  # a, b, c
    assert lane_of(live, "z") == (2, 3)
    assert lane_of(parse({}, "b", now, stale_s=3.0)[2], "b") == (0, 1)


async def test_two_gateways_take_different_idle_replicas_for_a_burst_from_one_snapshot(
        redis_server: Any) -> None:
    # Both see the same idle fleet (each other's work shared, nothing queued) and decide
    # at once: in lanes they split; alone-style draws from one seed took the same one.
    client = Redis.from_url(redis_server.url)
    shared = [SharedWork(client, gateway_id=g) for g in ("a", "b")]
    fleet = _replicas(4)
    try:
        for s in shared:
            await s.beat({r.replica_id: r.work.view(time.monotonic()) for r in fleet})
            await s.flushed()
        for s in shared:
            await s.read(1.0)
        assert [s.lane for s in shared] == [(0, 2), (1, 2)]
        chosen = []
        for s in shared:
            gateway = RoutingPipeline(tokenizers={}, chains=ChainCache(), index=MemoryIndex(),
                                      policy=build_policy(PolicyConfig(seed=1)),
                                      index_deadline_s=1.0, shared=s)
            route = await gateway.route(_body(list(range(1, 501))), fleet, time.monotonic(),
                                        tenant="t", cache_salt=None)
            chosen.append(route.decision.replica_id)
        assert chosen == ["r0", "r2"]
    finally:
        for s in shared:
            await s.close()
        await client.aclose()


async def test_gateways_see_each_others_work_until_it_ends(redis_server: Any) -> None:
    client_a, client_b = Redis.from_url(redis_server.url), Redis.from_url(redis_server.url)
    a = SharedWork(client_a, gateway_id="a")
    b = SharedWork(client_b, gateway_id="b")
    replica = _replicas(1)[0]
    replica.work.listeners.append(lambda now: a.publish(replica.replica_id, replica.work.view(now)))
    try:
        assert await b.read(1.0) == {}
        await b.beat({"r0": WorkView()})  # live, as its heartbeat shows it from the start
        await b.flushed()
        token = replica.work.begin(time.monotonic(), 0.4, 0.4, stream=True)
        await a.flushed()
        seen = (await b.read(1.0))["r0"]
        assert (seen.pending, seen.decoding) == (1, 0) and 0.3 < seen.wait_s <= 0.4
        own = (await a.read(1.0))["r0"]  # b's idle field only: a's own work not twice
        assert (own.wait_s, own.pending, own.decoding) == (0.0, 0, 0) and not a.alone
        replica.work.first_byte(token, time.monotonic())
        await a.flushed()
        seen = (await b.read(1.0))["r0"]
        assert (seen.wait_s, seen.pending, seen.decoding, seen.queued_s) == (0.0, 0, 1, 0.0)
        replica.work.end(token, time.monotonic())
        await a.flushed()
        seen = (await b.read(1.0))["r0"]
        assert (seen.wait_s, seen.pending, seen.decoding, seen.queued_s) == (0.0, 0, 0, 0.0)
        await a.close()  # a gateway that stops takes its fields with it
        assert set(await client_b.hgetall(b.key)) == {b"b/r0"}
    finally:
        await client_a.aclose()
        await client_b.aclose()


async def test_a_dead_gateways_fields_go_stale_then_are_deleted(redis_server: Any) -> None:
    client = Redis.from_url(redis_server.url)
    clock = [1000.0]
    dead = SharedWork(client, gateway_id="dead", clock=lambda: clock[0])
    live = SharedWork(client, gateway_id="live", clock=lambda: clock[0], stale_s=3.0,
                      forget_s=60.0)
    try:
        dead.publish("r0", WorkView(wait_s=30.0, pending=5))
        await dead.flushed()
        assert (await live.read(1.0))["r0"].pending == 5
        clock[0] += 4.0  # not rewritten by its heartbeat: stale, ignored, still there
        assert await live.read(1.0) == {}
        assert await client.hlen(live.key) == 1
        clock[0] += 60.0  # long dead: the next heartbeat deletes it
        assert await live.read(1.0) == {}
        await live.beat({"r0": WorkView()})
        await live.flushed()
        assert set(await client.hkeys(live.key)) == {b"live/r0"}
    finally:
        await client.aclose()


async def test_a_second_gateway_avoids_the_replica_another_just_loaded(redis_server: Any) -> None:
    # Gateway A sends a cold 2k-token prompt to one of two idle replicas. Gateway B,
    # deciding moments later (long before any scrape), puts its own cold prompts on the
    # other one when it reads A's work, and on either when it does not share.
    client = Redis.from_url(redis_server.url)
    shared_a = SharedWork(client, gateway_id="a")
    shared_b = SharedWork(client, gateway_id="b")
    fleet_a, fleet_b = _replicas(2), _replicas(2)
    for r in fleet_a:
        r.work.listeners.append(lambda now, r=r: shared_a.publish(r.replica_id, r.work.view(now)))
    gateway_a = _pipeline(shared_a)
    try:
        # B is live (its heartbeat from its start): A is not alone, so it writes at once.
        await shared_b.beat({r.replica_id: WorkView() for r in fleet_b})
        await shared_b.flushed()
        first = await gateway_a.route(_body([1] * 2048), fleet_a, time.monotonic(),
                                      tenant="t", cache_salt=None, reserve=True)
        await shared_a.flushed()
        loaded = first.decision.replica_id

        async def placements(shared: SharedWork | None) -> Counter[str]:
            gateway_b = _pipeline(shared)
            return Counter([(await gateway_b.route(
                _body([100 + i] * 2048), fleet_b, time.monotonic(), tenant="t",
                cache_salt=None)).decision.replica_id for i in range(20)])

        sharing, blind = await placements(shared_b), await placements(None)
        assert loaded not in sharing, sharing
        assert blind[loaded] > 0, blind  # blind, the two idle-looking replicas tie
    finally:
        await client.aclose()


async def test_a_gateway_set_to_share_publishes_and_withdraws_its_work(
        redis_server: Any) -> None:
    # The whole app: with share_work it enters each replica it sends to in the shared
    # hash, and takes its fields away when it stops; without it, writes nothing there.
    # With claim, it claims a replica once another gateway is live.
    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def complete(_: web.Request) -> web.Response:
        return web.json_response({
            "id": "c1", "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": "x", "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})

    upstream = web.Application()
    upstream.router.add_get("/health", health)
    upstream.router.add_post("/v1/completions", complete)
    runner = web.AppRunner(upstream)
    await runner.setup()
    up_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", up_port).start()
    client = Redis.from_url(redis_server.url)
    try:
        for share in (True, False):
            port = free_port()
            config = build_config({
                "listen": {"host": "127.0.0.1", "port": port},
                "replicas": [{"url": f"http://127.0.0.1:{up_port}", "models": ["m"]}],
                "index": {"backend": redis_server.url},
                "policy": {"share_work": share, "claim": share},
                "tenants": {"allow_anonymous": True},
                "health": {"interval_s": 60},
            }, {"CACHEROUTE_SALT_SECRET": "shared-work-test-secret-0123"})
            async with running_gateway(build_app(config), "127.0.0.1", port), \
                    aiohttp.ClientSession() as session:
                async with session.post(f"http://127.0.0.1:{port}/v1/completions",
                                        json={"model": "m", "prompt": [1, 2, 3]}) as resp:
                    assert resp.status == 200, await resp.text()
                fields = await client.hkeys(b"cr:work")
                # Written at the decision, before the request was forwarded.
                if share:
                    assert len(fields) == 1, fields
                    assert fields[0].endswith(f"/127.0.0.1:{up_port}".encode()), fields
                    # Another gateway's change reaches it through the feed, timed in
                    # its metrics from that gateway's writing.
                    other = SharedWork(client, gateway_id="other")
                    other.publish("r9", WorkView(pending=1))
                    await other.flushed()

                    async def timed(url: str = f"http://127.0.0.1:{port}/metrics") -> bool:
                        async with session.get(url) as m:
                            text = await m.text()
                        return "cacheroute_shared_work_delay_seconds_count 1.0" in text
                    await wait_until_async(timed, 5.0, "the change timed", interval=0.02)
                    # With another gateway live, the next request's replica is claimed
                    # (the first one's was not: alone, nobody could take it unseen).
                    async with session.post(f"http://127.0.0.1:{port}/v1/completions",
                                            json={"model": "m", "prompt": [4, 5]}) as resp:
                        assert resp.status == 200, await resp.text()
                    async with session.get(f"http://127.0.0.1:{port}/metrics") as m:
                        text = await m.text()
                    assert 'cacheroute_shared_work_claims_total{outcome="kept"} 1.0' in text
                    await other.close()
                else:
                    assert fields == []
            assert await client.hkeys(b"cr:work") == []
    finally:
        await client.aclose()
        await runner.cleanup()


def _replicas(n: int) -> list[Replica]:
    out = []
    for i in range(n):
        source = ReplicaSource(name=f"r{i}", url=f"http://127.0.0.1:{9000 + i}", models=("m",),
                               hash_config=HashConfig(block_size=16))
        out.append(Replica(target=source.target(), healthy=True))
    return out


def _pipeline(shared: SharedWork | None) -> RoutingPipeline:
    return RoutingPipeline(tokenizers={}, chains=ChainCache(), index=MemoryIndex(),
                           policy=build_policy(PolicyConfig(seed=1, tolerance=0.0)),
                           index_deadline_s=1.0, shared=shared)


def _body(tokens: list[int]) -> Any:
    raw = json.dumps({"model": "m", "prompt": tokens}).encode()
    return parse_request(raw, "completions", served_models=(), limits=LimitsConfig(),
                         tenant=REGISTRY.identify(None), registry=REGISTRY)


async def test_a_gateway_alone_skips_reads_for_a_heartbeat_and_sees_one_that_joins(
        redis_server: Any) -> None:
    client = Redis.from_url(redis_server.url)
    clock = [1000.0]
    alone = SharedWork(client, gateway_id="alone", clock=lambda: clock[0], heartbeat_s=1.0)
    joiner = SharedWork(client, gateway_id="joiner", clock=lambda: clock[0])
    try:
        alone.publish("r0", WorkView(wait_s=1.0, pending=1))
        await alone.flushed()
        assert alone.read_due()
        assert await alone.read(1.0) == {}  # only its own fields
        assert not alone.read_due()  # nothing to find: no read per request
        joiner.publish("r0", WorkView(wait_s=5.0, pending=2))
        await joiner.flushed()
        clock[0] += 0.5
        assert not alone.read_due()  # the joiner is not seen within the heartbeat...
        clock[0] += 0.6
        assert alone.read_due()  # ...but after it
        assert (await alone.read(1.0))["r0"].pending == 2
        clock[0] += 0.1
        assert alone.read_due()  # with another gateway live, every request reads
        assert (await alone.read(1.0))["r0"].pending == 2
        assert alone.read_due()
    finally:
        await client.aclose()


async def test_a_gateway_alone_writes_on_its_heartbeat_and_at_once_when_another_appears(
        redis_server: Any) -> None:
    # Alone, a change per routed request would be a round trip nobody reads: it waits for
    # the heartbeat, or for the first sign of another gateway (here a read finding one).
    client = Redis.from_url(redis_server.url)
    clock = [1000.0]
    a = SharedWork(client, gateway_id="a", clock=lambda: clock[0], heartbeat_s=1.0)
    b = SharedWork(client, gateway_id="b", clock=lambda: clock[0])

    async def written() -> int:
        value = await client.hget(a.key, b"a/r0")
        return int(value.split()[1]) if value else -1  # its pending count

    try:
        a.publish("r0", WorkView(pending=1))
        await a.flushed()
        assert await written() == 1  # not known to be alone yet: written at once
        assert await a.read(1.0) == {} and a.alone
        a.publish("r0", WorkView(pending=2))
        await a.flushed()
        assert await written() == 1  # alone: held back
        await a.beat({"r0": WorkView(pending=3)})
        await a.flushed()
        assert await written() == 3  # the heartbeat writes alone too
        a.publish("r0", WorkView(pending=4))
        b.publish("r0", WorkView(pending=1))
        await b.flushed()
        clock[0] += 1.1  # the next read is due
        assert (await a.read(1.0))["r0"].pending == 1 and not a.alone
        await a.flushed()
        assert await written() == 4  # the change made while alone, for the newcomer
        a.publish("r0", WorkView(pending=5))
        await a.flushed()
        assert await written() == 5  # not alone: every change at once
    finally:
        await client.aclose()


async def test_a_follower_alone_writes_what_it_held_back_once_another_gateway_writes(
        redis_server: Any) -> None:
    client = Redis.from_url(redis_server.url)
    a = SharedWork(client, gateway_id="a", heartbeat_s=30.0)  # no heartbeat runs here
    b = SharedWork(client, gateway_id="b")
    job = asyncio.create_task(a.follow(retry_s=0.05))
    try:
        await _following(a, lambda p: p == {}, "the seed read")
        assert a.alone
        a.publish("r0", WorkView(pending=2))
        await a.flushed()
        assert await client.hget(a.key, b"a/r0") is None  # alone: held back
        b.publish("r1", WorkView(pending=1))
        await b.flushed()

        async def seen() -> bool:
            value = await client.hget(a.key, b"a/r0")
            return value is not None and value.split()[1] == b"2"
        # Written when b's change reaches a's feed, before any request here reads it.
        await wait_until_async(seen, 5.0, "a's held-back change", interval=0.01)
    finally:
        job.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await job
        await client.aclose()


async def test_a_burst_shares_one_read_and_a_gateway_alone_never_waits_for_its_recheck(
        redis_server: Any) -> None:
    client = Redis.from_url(redis_server.url)
    clock = [1000.0]
    shared = SharedWork(client, gateway_id="a", clock=lambda: clock[0], heartbeat_s=1.0)
    fleet = _replicas(2)
    gateway = _pipeline(shared)  # its lookup deadline: 1 s

    async def route_seconds(i: int) -> float:
        started = time.perf_counter()
        await gateway.route(_body([200 + i] * 64), fleet, time.monotonic(), tenant="t",
                            cache_salt=None)
        return time.perf_counter() - started

    def stalled() -> Any:
        """Redis stopped (SIGSTOP) for the block: it answers nothing until resumed."""
        @contextlib.contextmanager
        def stall() -> Iterator[None]:
            redis_server.proc.send_signal(signal.SIGSTOP)
            try:
                yield
            finally:
                redis_server.proc.send_signal(signal.SIGCONT)
        return stall()

    try:
        first, second = shared.refresh(1.0), shared.refresh(1.0)
        assert first is not None and first is second  # one read in flight, shared
        assert await first == {} and shared.alone
        assert shared.refresh(1.0) is None  # alone: nothing due within the heartbeat
        clock[0] += 1.5  # the re-check is due
        with stalled():
            # A request that waited for the re-check would wait its whole 1 s deadline.
            assert await route_seconds(0) < 0.5
            recheck = shared.refresh(1.0)
            assert recheck is not None and not recheck.done()  # in flight, not awaited
        assert await recheck == {}
        # Another gateway live: requests wait for the read again (the stall shows it).
        other = SharedWork(client, gateway_id="b", clock=lambda: clock[0])
        other.publish("r0", WorkView(wait_s=5.0, pending=1))
        await other.flushed()
        clock[0] += 1.5
        peers = shared.refresh(1.0)
        assert peers is not None and "r0" in await peers and not shared.alone
        with stalled():
            assert await route_seconds(1) >= 0.5
    finally:
        await client.aclose()



async def _following(shared: SharedWork, check: Any, what: str) -> None:
    async def ok() -> bool:
        peers = shared.followed()
        return peers is not None and bool(check(peers))
    await wait_until_async(ok, 5.0, what, interval=0.01)


async def test_a_follower_sees_each_change_without_a_read_and_drains_by_the_clock(
        redis_server: Any) -> None:
    client = Redis.from_url(redis_server.url)
    clock = [1000.0]
    # No heartbeat runs here: a long one keeps the silent feed from counting as broken.
    follower = SharedWork(client, gateway_id="a", clock=lambda: clock[0], heartbeat_s=30.0)
    others = [SharedWork(client, gateway_id=g, clock=lambda: clock[0]) for g in ("b", "c")]
    # Written before the follower starts: it must come from the seed read.
    others[0].publish("r0", WorkView(wait_s=5.0, pending=1))
    await others[0].flushed()
    assert follower.followed() is None  # not following yet: routing would read
    job = asyncio.create_task(follower.follow(retry_s=0.05))
    try:
        await _following(follower, lambda p: "r0" in p, "the seed read")
        # Written after: it comes from the change feed.
        others[1].publish("r0", WorkView(wait_s=0.2, pending=1))
        others[1].publish("r1", WorkView(decoding=2))
        await others[1].flushed()
        await _following(follower, lambda p: "r1" in p, "c's change")
        peers = follower.followed()
        assert peers is not None
        assert peers["r0"] == PeerWork(wait_s=pytest.approx(5.2), pending=2, busy=2)
        assert peers["r1"] == PeerWork(decoding=2)
        assert not follower.alone
        clock[0] += 0.1  # both queues on r0 a tenth of a second shorter, with no change
        peers = follower.followed()
        assert peers is not None and peers["r0"].wait_s == pytest.approx(5.0)
        # A gateway that stops takes its work away from the followers at once.
        await others[1].close()
        await _following(follower, lambda p: "r1" not in p and p["r0"].pending == 1,
                         "c's withdrawal")
    finally:
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
        await client.aclose()


async def test_a_follower_times_each_other_gateways_change_from_its_writing(
        redis_server: Any) -> None:
    # The metrics' cacheroute_shared_work_delay_seconds: the follower's clock when it
    # applies a change, minus the writer's when it wrote it. Not its own changes (the
    # feed carries them back too), nor a withdrawal (nothing written to time).
    client = Redis.from_url(redis_server.url)
    writer_clock, follower_clock = [1000.0], [1000.25]
    delays: list[float] = []
    follower = SharedWork(client, gateway_id="a", clock=lambda: follower_clock[0],
                          heartbeat_s=30.0)
    follower.delay_listeners.append(delays.append)
    writer = SharedWork(client, gateway_id="b", clock=lambda: writer_clock[0])
    job = asyncio.create_task(follower.follow(retry_s=0.05))
    try:
        await _following(follower, lambda p: True, "the seed read")
        follower.publish("r0", WorkView(wait_s=1.0, pending=1))  # its own: not timed
        await follower.flushed()
        writer.publish("r0", WorkView(wait_s=0.2, pending=1))
        await writer.flushed()
        await _following(follower, lambda p: "r0" in p, "b's change")
        assert delays == [pytest.approx(0.25)]
        writer_clock[0], follower_clock[0] = 1001.0, 1001.04
        writer.publish("r1", WorkView(decoding=2))
        await writer.flushed()
        await _following(follower, lambda p: "r1" in p, "b's second change")
        await writer.close()  # withdrawn: deleted fields, nothing timed
        await _following(follower, lambda p: not p, "b's withdrawal")
        assert delays == [pytest.approx(0.25), pytest.approx(0.04)]
    finally:
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
        await client.aclose()


async def test_routing_waits_for_no_read_while_following_and_reads_when_the_feed_breaks(
        redis_server: Any) -> None:
    client = Redis.from_url(redis_server.url)
    admin = Redis.from_url(redis_server.url)
    shared = SharedWork(client, gateway_id="a", heartbeat_s=30.0)
    other = SharedWork(client, gateway_id="b")
    other.publish("r0", WorkView(wait_s=5.0, pending=1))
    await other.flushed()
    gateway = _pipeline(shared)  # its lookup deadline: 1 s
    fleet = _replicas(2)

    async def route_seconds(i: int) -> tuple[float, str]:
        started = time.perf_counter()
        route = await gateway.route(_body([300 + i] * 2048), fleet, time.monotonic(),
                                    tenant="t", cache_salt=None)
        return time.perf_counter() - started, route.decision.replica_id

    job = asyncio.create_task(shared.follow(retry_s=0.05))
    try:
        await _following(shared, lambda p: "r0" in p, "the seed read")
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            # Redis answers nothing, yet the request neither waits nor routes blind:
            # r0 carries b's 5 s of queued prefill.
            seconds, replica = await route_seconds(0)
            assert seconds < 0.5 and replica == "r1"
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        # The feed's connection killed: the copy is dropped (routing reads per request
        # again, and still sees b's work) until the follower has subscribed and re-read.
        await admin.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
        await wait_until_async(_async(lambda: shared.followed() is None), 5.0,
                               "the follower to notice", interval=0.01)
        assert (await route_seconds(1))[1] == "r1"
        await _following(shared, lambda p: "r0" in p, "the follower to come back")
    finally:
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
        await client.aclose()
        await admin.aclose()


async def test_a_silent_feed_is_a_broken_one_while_the_own_heartbeat_keeps_it_alive(
        redis_server: Any) -> None:
    # A half-open connection raises nothing: the follower knows the feed must carry its
    # own heartbeat back every heartbeat_s, and drops the copy after three missed.
    client = Redis.from_url(redis_server.url)
    shared = SharedWork(client, gateway_id="a", heartbeat_s=0.1)
    job = asyncio.create_task(shared.follow(retry_s=0.05))
    beat: asyncio.Task[None] | None = None
    try:
        await _following(shared, lambda p: True, "the seed read")
        await wait_until_async(_async(lambda: shared.followed() is None), 5.0,
                               "a silent feed to count as broken", interval=0.01)
        beat = asyncio.create_task(shared.heartbeat(lambda: {"r0": WorkView(pending=1)}))
        await _following(shared, lambda p: True, "the feed to be followed again")
        # Past several of its timeouts (0.3 s) it is still followed: its own beats.
        heard = shared._copy_version
        await wait_until_async(_async(lambda: shared._copy_version >= heard + 8), 5.0,
                               "eight heartbeats back through the feed", interval=0.01)
        assert shared.followed() == {}  # its own fields are not others' work...
        assert shared.alone  # ...so it is alone, and asks no shared segments
    finally:
        for task in (job, beat):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await client.aclose()


def _async(check: Any) -> Any:
    async def predicate() -> bool:
        return bool(check())
    return predicate


async def test_a_request_gated_behind_another_gateways_queue_waits_out_its_predicted_time(
        redis_server: Any) -> None:
    # Gateway A has 300 ms of prefill queued on r0, its first byte not yet back. Gateway
    # B's long prompt routed there waits that long at B (policy.step_gate) rather than
    # join the step where A's queue ends; B sees no first bytes of A's, so it waits by
    # the clock, and for nothing once A's requests there are all past their first byte.
    client = Redis.from_url(redis_server.url)
    shared_a = SharedWork(client, gateway_id="a")
    shared_b = SharedWork(client, gateway_id="b")
    config = PolicyConfig(name="cache_aware", seed=1, step_gate=True)
    try:
        shared_a.publish("r0", WorkView(wait_s=0.3, pending=1, queued_s=0.3))
        await shared_a.flushed()
        gateway_b = RoutingPipeline(tokenizers={}, chains=ChainCache(), index=MemoryIndex(),
                                    policy=build_policy(config), index_deadline_s=1.0,
                                    shared=shared_b)
        fleet = _replicas(1)
        route = await gateway_b.route(_body(list(range(1, 4001))), fleet, time.monotonic(),
                                      tenant="t", cache_salt=None, reserve=True)
        assert 0.25 < route.peer_gate_s <= 0.3
        assert route.gate_s > route.peer_gate_s
        waited = await asyncio.wait_for(gateway_b.gate(route), 5.0)
        assert route.peer_gate_s - 0.01 <= waited < route.gate_s
        fleet[0].work.end(route.reserved["r0"], time.monotonic(), None)

        shared_a.publish("r0", WorkView(wait_s=0.0, pending=0, decoding=1))
        await shared_a.flushed()
        route = await gateway_b.route(_body(list(range(1, 4001))), fleet, time.monotonic(),
                                      tenant="t", cache_salt=None, reserve=True)
        assert route.peer_gate_s == 0.0 and route.gate_s == 0.0
        assert await gateway_b.gate(route) == 0.0
    finally:
        await client.aclose()


async def test_a_claim_writes_this_gateways_work_and_reads_everyones_at_once(
        redis_server: Any) -> None:
    client = Redis.from_url(redis_server.url)
    clock = [1000.0]
    a = SharedWork(client, gateway_id="a", clock=lambda: clock[0])
    b = SharedWork(client, gateway_id="b", clock=lambda: clock[0])
    try:
        b.publish("r0", WorkView(wait_s=2.0, pending=1, queued_s=2.0))
        await b.flushed()
        a.publish("r0", WorkView(pending=5))  # coalesced, not yet sent: the claim replaces it
        await a.read(1.0)  # b is live: its field on the claimed replica is read
        b.publish("r0", WorkView(wait_s=3.0, pending=2, queued_s=3.0))  # unseen by a
        await b.flushed()
        mine = WorkView(wait_s=0.5, pending=1, queued_s=0.5)
        theirs = await a.claim("r0", mine, 1.0)
        assert theirs is not None and theirs.pending == 2  # b's latest, read with the write
        assert await a.claim("r1", mine, 1.0) == PeerWork()  # b has nothing there
        await a.flushed()
        assert await client.hget(a.key, b"a/r0") == encode(mine, 1000.0)
    finally:
        await client.aclose()


async def test_a_claim_redis_does_not_answer_is_written_later_and_decides_nothing(
        redis_server: Any) -> None:
    client = Redis.from_url(redis_server.url)
    a = SharedWork(client, gateway_id="a")
    try:
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            assert await a.claim("r0", WorkView(pending=1), 0.2) is None
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        assert a.write_failures == 1
        await a.flushed()  # the coalesced writer takes it over
        raw = await client.hget(a.key, b"a/r0")
        assert raw is not None and raw.split()[1] == b"1"
    finally:
        await client.aclose()


def _claiming(shared: SharedWork, claim: bool, deadline_s: float = 1.0,
              pending: PendingChains | None = None) -> tuple[RoutingPipeline, list[str]]:
    """A pipeline sharing work through `shared`, with policy.claim as given, and the list
    its claims' outcomes go to."""
    gateway = RoutingPipeline(
        tokenizers={}, chains=ChainCache(), index=MemoryIndex(),
        policy=build_policy(PolicyConfig(seed=1, claim=claim)), index_deadline_s=deadline_s,
        shared=shared, pending=pending)
    outcomes: list[str] = []
    gateway.claim_listeners.append(outcomes.append)
    return gateway, outcomes


async def _collide(url: str, namespace: str, claim: bool) -> tuple[str, list[str], Any]:
    """Gateways a and b share 2 idle replicas; a has just sent a request to r1 (b's lane)
    whose change is still on its way to b's feed (written to the hash, not published).
    b then routes a cold prompt: where it went, its claims' outcomes, and b's field on r1
    as written afterwards."""
    client = Redis.from_url(url)
    a = SharedWork(client, namespace=namespace, gateway_id="a", heartbeat_s=30.0)
    b = SharedWork(client, namespace=namespace, gateway_id="b", heartbeat_s=30.0)
    fleet = _replicas(2)
    for r in fleet:
        r.work.listeners.append(lambda now, r=r: b.publish(r.replica_id, r.work.view(now)))
    job = asyncio.create_task(b.follow(retry_s=0.05))
    try:
        await a.beat({"r0": WorkView(), "r1": WorkView()})
        await a.flushed()
        await _following(b, lambda p: "r1" in p, "a's idle replicas")
        assert b.lane == (1, 2)  # r1 first for b's near-ties
        unseen = encode(WorkView(wait_s=2.0, pending=1, queued_s=2.0), time.time())
        await client.hset(a.key, b"a/r1", unseen)  # no change published: b cannot see it
        gateway, outcomes = _claiming(b, claim)
        route = await gateway.route(_body([7] * 2048), fleet, time.monotonic(), tenant="t",
                                    cache_salt=None, reserve=True)
        await b.flushed()
        return route.decision.replica_id, outcomes, await client.hget(b.key, b"b/r1")
    finally:
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
        await client.aclose()


async def test_a_claim_moves_a_request_off_a_replica_another_gateway_took_unseen(
        redis_server: Any) -> None:
    blind = await _collide(redis_server.url, "blind", claim=False)
    assert blind[:2] == ("r1", [])  # behind a's prefill: the collision the claim prevents
    chosen, outcomes, on_r1 = await _collide(redis_server.url, "claimed", claim=True)
    assert (chosen, outcomes) == ("r0", ["moved"])
    assert on_r1 is not None and on_r1.split()[1] == b"0"  # its claim there withdrawn


async def test_a_claim_that_finds_nothing_new_keeps_the_decision(redis_server: Any) -> None:
    client = Redis.from_url(redis_server.url)
    a = SharedWork(client, namespace="quiet", gateway_id="a")
    b = SharedWork(client, namespace="quiet", gateway_id="b")
    fleet = _replicas(2)
    try:
        await a.beat({"r0": WorkView(), "r1": WorkView()})
        await a.flushed()
        await b.read(1.0)  # not following: routing reads per request (sees a, idle)
        gateway, outcomes = _claiming(b, True)
        route = await gateway.route(_body([8] * 2048), fleet, time.monotonic(), tenant="t",
                                    cache_salt=None, reserve=True)
        assert outcomes == ["kept"]
        assert route.decision.replica_id in route.reserved
        # Alone, nothing is claimed: no other gateway could have taken a replica unseen.
        await a.close()
        await b.read(1.0)
        assert b.alone
        await gateway.route(_body([9] * 2048), fleet, time.monotonic(), tenant="t",
                            cache_salt=None, reserve=True)
        assert outcomes == ["kept"]
    finally:
        await client.aclose()


async def test_a_request_cancelled_during_its_claim_leaves_no_work_reserved(
        redis_server: Any) -> None:
    client = Redis.from_url(redis_server.url)
    a = SharedWork(client, namespace="cancel", gateway_id="a", heartbeat_s=30.0)
    b = SharedWork(client, namespace="cancel", gateway_id="b", heartbeat_s=30.0)
    fleet = _replicas(2)
    job = asyncio.create_task(b.follow(retry_s=0.05))
    try:
        await a.beat({"r0": WorkView(), "r1": WorkView()})
        await a.flushed()
        await _following(b, lambda p: "r1" in p, "a's idle replicas")
        gateway, _ = _claiming(b, True, deadline_s=5.0, pending=PendingChains(ttl_s=10.0))

        def reserved() -> int:
            return sum(r.work.view(time.monotonic()).pending for r in fleet)

        redis_server.proc.send_signal(signal.SIGSTOP)  # the claim waits for its answer
        try:
            routing = asyncio.create_task(gateway.route(
                _body([11] * 2048), fleet, time.monotonic(), tenant="t", cache_salt=None,
                reserve=True))
            await wait_until_async(_async(lambda: reserved() == 1), 5.0,
                                   "the decision's reservation", interval=0.01)
            routing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await routing
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        assert reserved() == 0
        assert gateway.pending is not None and len(gateway.pending) == 0
    finally:
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
        await client.aclose()
