"""Faults with real processes: replicas killed, paused, stalled or cut off; Redis stopped,
restarted or black-holed; under load, with every request accounted for.

Each test drives requests through a real gateway and classifies every answer: a
success, or a well-formed error (an OpenAI error body, or a stream that ends with an SSE
error event and `data: [DONE]`). Anything else (a dropped connection, a truncated
stream, a body that is not an error) is a request lost silently, and fails the test.
The gateway's own counters must tell the same story: every upstream failure it counted
was either retried, or answered as an error.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from servers import RedisServer, free_port

from replica.fleet import AsyncSimFleet, is_healthy
from router.handshake import make_probe

from .conftest import (
    GatewayClient,
    chain_keys,
    gateway_config,
    tenant_salt,
    wait_indexed,
    wait_until,
)
from .tcp_proxy import TcpProxy

MODEL = "sim"
AUTH = {"Authorization": "Bearer sk-alpha"}


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 3000) for _ in range(n)]


# ------------------------------------------------------------------- accounting


@dataclass
class Tally:
    """What happened to every request a test sent."""

    sent: int = 0
    ok: int = 0
    errors: Counter[str] = field(default_factory=Counter)  # well-formed, by kind
    lost: list[str] = field(default_factory=list)  # anything else: must stay empty
    latencies: list[float] = field(default_factory=list)
    replicas: Counter[str] = field(default_factory=Counter)

    @property
    def failed(self) -> int:
        return sum(self.errors.values())

    def check(self) -> None:
        """Every request either succeeded or got a well-formed error; none vanished."""
        assert not self.lost, self.lost[:5]
        assert self.ok + self.failed == self.sent, self

    def summary(self) -> str:
        return (f"sent={self.sent} ok={self.ok} failed={self.failed} "
                f"errors={dict(self.errors)} lost={len(self.lost)}")


def _is_error_body(data: Any) -> bool:
    err = data.get("error") if isinstance(data, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and \
        isinstance(err.get("type"), str)


def classify(tally: Tally, status: int, text: str, stream: bool) -> str:
    """Record one answer in `tally`; returns its kind ("ok" or an error kind)."""
    if status != 200:
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        if _is_error_body(data):
            kind = f"http_{status}"
            tally.errors[kind] += 1
            return kind
        tally.lost.append(f"HTTP {status} without an error body: {text[:200]!r}")
        return "lost"
    if not stream:
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        if isinstance(data, dict) and data.get("choices"):
            tally.ok += 1
            return "ok"
        tally.lost.append(f"200 without choices: {text[:200]!r}")
        return "lost"
    if not text.endswith("data: [DONE]\n\n"):
        tally.lost.append(f"stream without [DONE]: {text[-200:]!r}")
        return "lost"
    events = [json.loads(b[6:]) for b in text.split("\n\n")
              if b.startswith("data: ") and b != "data: [DONE]"]
    if any(_is_error_body(e) for e in events):
        tally.errors["sse_error"] += 1
        return "sse_error"
    if any(c.get("finish_reason") for e in events for c in e.get("choices") or ()):
        tally.ok += 1
        return "ok"
    tally.lost.append(f"stream ended without finish_reason or error: {text[-200:]!r}")
    return "lost"


async def send(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
               tally: Tally) -> str:
    """POST one completion and classify the answer; a transport error is a lost request."""
    tally.sent += 1
    started = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body, headers=AUTH) as resp:
            text = await resp.text()
            replica = resp.headers.get("x-cacheroute-replica")
            status = resp.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        tally.lost.append(f"{type(exc).__name__}: {exc}")
        return "lost"
    # A stream's head goes out naming the replica that accepted it; after a failover, an
    # SSE comment names the one that answered (router/proxy.py).
    answered_by = re.findall(r"^: x-cacheroute-replica: (\S+)$", text, re.M)
    replica = answered_by[-1] if answered_by else replica
    tally.latencies.append(time.perf_counter() - started)
    if replica:
        tally.replicas[replica] += 1
    return classify(tally, status, text, bool(body.get("stream")))


def request_body(i: int, max_tokens: int = 8) -> dict[str, Any]:
    """Request i of a mixed load: a few shared prefixes, every other one streamed."""
    prompt = [*tokens(i % 5, 64), *tokens(10_000 + i, 24)]
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
            "stream": i % 2 == 1, "return_token_ids": True}


def unique_body(i: int) -> dict[str, Any]:
    """Request i with a prompt shared with no other request (a cold request anywhere)."""
    return {**request_body(i), "prompt": tokens(50_000 + i, 48)}


async def closed_loop(session: aiohttp.ClientSession, url: str, tally: Tally, *,
                      workers: int, stop: asyncio.Event, limit: int,
                      body: Callable[[int], dict[str, Any]] = request_body) -> None:
    """`workers` clients, each sending its next request when the last one is answered,
    until `stop` is set or `limit` requests have been sent."""
    counter = iter(range(limit))

    async def worker() -> None:
        for i in counter:
            if stop.is_set():
                return
            await send(session, url, body(i), tally)

    await asyncio.gather(*(worker() for _ in range(workers)))


# ------------------------------------------------------------------- gateway counters


async def gateway_counters(gw: GatewayClient) -> dict[str, float]:
    """Totals of the gateway's fault counters, summed over labels."""
    _, text = await gw.get("/metrics")
    wanted = ("cacheroute_retries_total", "cacheroute_upstream_failures_total",
              "cacheroute_ejections_total", "cacheroute_retry_budget_exhausted_total",
              "cacheroute_index_fallbacks_total", "cacheroute_suspect_refusals_total")
    out = dict.fromkeys(wanted, 0.0)
    for line in str(text).splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


async def report(gw: GatewayClient, name: str, tally: Tally, extra: str = "") -> dict[str, float]:
    """Print the test's counts beside the gateway's; returns the gateway's counters."""
    counters = await gateway_counters(gw)
    print(f"\n{name}: {tally.summary()}; gateway: retried="
          f"{counters['cacheroute_retries_total']:.0f} upstream_failures="
          f"{counters['cacheroute_upstream_failures_total']:.0f} ejections="
          f"{counters['cacheroute_ejections_total']:.0f} budget_exhausted="
          f"{counters['cacheroute_retry_budget_exhausted_total']:.0f} index_fallbacks="
          f"{counters['cacheroute_index_fallbacks_total']:.0f}{extra}")
    return counters


async def labelled(gw: GatewayClient, name: str, **labels: str) -> float:
    """One labelled sample of the gateway's metrics (0 when absent)."""
    _, text = await gw.get("/metrics")
    total = 0.0
    for line in str(text).splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def assert_failures_accounted(counters: dict[str, float], tally: Tally) -> None:
    """Each upstream failure the gateway counted was retried or answered as an error.

    A failure before the first byte is followed by exactly one retry or, when the
    attempts or the retry budget run out, by the error answer; a failure after it ends
    that stream with an SSE error event. So the counts must add up exactly.
    """
    upstream_errors = sum(v for k, v in tally.errors.items() if k in ("http_502", "http_504"))
    assert counters["cacheroute_upstream_failures_total"] == \
        counters["cacheroute_retries_total"] + upstream_errors + tally.errors["sse_error"], \
        (counters, tally.summary())


async def wait_replica_state(gw: GatewayClient, replica_id: str, state: str,
                             within_s: float = 10.0) -> None:
    async def reached() -> bool:
        _, ready = await gw.get("/ready")
        return any(r["id"] == replica_id and r["state"] == state for r in ready["replicas"])

    await wait_until(reached, within_s, f"{replica_id} to be {state}")


def rid(url: str) -> str:
    return url.split("//", 1)[1]


async def after(n: int, tally: Tally, within_s: float = 30.0) -> None:
    """Wait until `n` answers have come back."""
    async def done() -> bool:
        return tally.ok + tally.failed + len(tally.lost) >= n

    await wait_until(done, within_s, f"{n} answers")


# ----------------------------------------------------------------------- replicas


async def test_replica_killed_mid_load_loses_no_request(
        start_gateway: Callable[[dict[str, Any]], Awaitable[GatewayClient]],
        http: aiohttp.ClientSession) -> None:
    async with AsyncSimFleet(3, block_size=16) as fleet:
        # Health checks are slow here: only the proxy's failover can save the requests.
        gw = await start_gateway(gateway_config(fleet.replicas, model=MODEL, port=free_port(),
                                                health={"interval_s": 60}))
        tally = Tally()
        stop = asyncio.Event()
        load = asyncio.ensure_future(closed_loop(http, gw.url, tally, workers=6, stop=stop,
                                                 limit=160))
        await after(40, tally)
        fleet.kill(1)
        await load
        tally.check()
        counters = await report(gw, "kill mid-load", tally)
        assert tally.sent == 160
        # Non-streamed requests and streams not yet started fail over; a stream the kill
        # cut after its first byte ends in an SSE error; and when more requests fail at
        # once than the retry budget allows (at least 3 retries at a time), the rest get
        # a 502 rather than a retry storm: each such 502 is counted by the gateway.
        assert set(tally.errors) <= {"sse_error", "http_502"}, tally.summary()
        assert tally.errors["http_502"] == \
            counters["cacheroute_retry_budget_exhausted_total"], (tally.summary(), counters)
        assert tally.ok >= tally.sent - 6  # at most one failure per client, at the kill
        assert counters["cacheroute_retries_total"] >= 1, counters
        killed = rid(fleet.urls[1])
        assert await labelled(gw, "cacheroute_ejections_total", replica=killed) >= 1
        assert_failures_accounted(counters, tally)
        await wait_replica_state(gw, killed, "ejected", 1.0)


# tokens() draws ids from 10 up and the gateway's hash-handshake probe from 3 up
# (router/handshake.py make_probe): neither holds 2. With 7 the probe itself killed a
# sim about one run in ten, before the poisoned request was sent.
POISON = 2


async def test_a_poisoned_request_costs_at_most_one_replica(
        start_gateway: Callable[[dict[str, Any]], Awaitable[GatewayClient]],
        http: aiohttp.ClientSession) -> None:
    # Three sims whose engines die on a prompt holding POISON, as vLLM's EngineCore dies on
    # some inputs: in-flight requests get 500, /health 503, then the process exits.
    # Neither the load nor the gateway's own handshake probes may hold the poison.
    assert not any(POISON in make_probe(16).token_ids for _ in range(200))
    assert not any(POISON in tokens(seed, 200) for seed in range(50))
    async with AsyncSimFleet(3, block_size=16, crash_on_token=POISON) as fleet:
        gw = await start_gateway(gateway_config(fleet.replicas, model=MODEL, port=free_port()))
        warm = Tally()
        for i in range(6):
            await send(http, gw.url, request_body(i), warm)
        warm.check()
        assert warm.ok == 6

        # Ordinary load runs throughout; only requests in flight on the dying replica may fail.
        tally = Tally()
        stop = asyncio.Event()
        load = asyncio.ensure_future(closed_loop(http, gw.url, tally, workers=3, stop=stop,
                                                 limit=10_000))
        try:
            await after(6, tally)
            poison = {"model": MODEL, "prompt": [*tokens(1, 40), POISON, *tokens(2, 40)],
                      "max_tokens": 4}
            async with http.post(gw.url + "/v1/completions", json=poison, headers=AUTH) as resp:
                status, error = resp.status, (await resp.json())["error"]
            assert status == 502, error
            assert error["type"] == "upstream_error"
            assert "failed its health check" in error["message"]
            assert "may be what killed it" in error["message"]

            procs = [r.proc for r in fleet.replicas]

            async def one_exited() -> bool:
                return sum(p.poll() is not None for p in procs) >= 1

            await wait_until(one_exited, 15.0, "the poisoned replica to exit")
            dead = [rid(r.url) for r in fleet.replicas if r.proc.poll() is not None]
            assert len(dead) == 1

            # The client's own retries, the same prompt streamed too, are refused at the gateway.
            for body in (poison, {**poison, "stream": True}, poison):
                async with http.post(gw.url + "/v1/completions", json=body, headers=AUTH) as resp:
                    status, error = resp.status, (await resp.json())["error"]
                assert status == 422, error
                assert f"when replica {dead[0]} died (HTTP 500, then /health" in error["message"]

            await after(tally.sent + 12, tally)
        finally:
            stop.set()
            await load
        tally.check()
        # No other replica was lost: both still answer their health checks.
        alive = [r for r in fleet.replicas if rid(r.url) not in dead]
        assert all(r.proc.poll() is None for r in alive)
        assert all(await asyncio.gather(*(asyncio.to_thread(is_healthy, r.url) for r in alive)))
        _, text = await gw.get("/metrics")
        suspects = [ln for ln in str(text).splitlines()
                    if ln.startswith("cacheroute_suspect_requests_total{")]
        counters = await report(gw, "poisoned request", tally, f"; suspects {suspects}")
        # In-flight ordinary requests on the dying replica are suspects too (502); none
        # elsewhere failed, and every later one succeeded.
        assert set(tally.errors) <= {"http_502"}, tally.summary()
        assert tally.failed <= 3, tally.summary()
        assert tally.ok >= 12
        assert await labelled(gw, "cacheroute_suspect_requests_total", replica=dead[0],
                              outcome="refused") == 1 + tally.failed
        assert counters["cacheroute_suspect_refusals_total"] == 3, counters
        # The poisoned request's own 502 is the one failure the load's tally lacks.
        assert_failures_accounted(counters, Tally(errors=tally.errors + Counter(http_502=1)))
        after_poison = Tally()
        for i in range(6):
            await send(http, gw.url, unique_body(1000 + i), after_poison)
        after_poison.check()
        assert after_poison.ok == 6 and dead[0] not in after_poison.replicas


async def test_replica_killed_mid_stream_ends_its_streams_with_an_sse_error(
        start_gateway: Callable[[dict[str, Any]], Awaitable[GatewayClient]],
        http: aiohttp.ClientSession) -> None:
    # Slow decoding (unit profile at half speed): streams are still running at the kill.
    async with AsyncSimFleet(2, block_size=16, prefill_profile="unit", time_scale=0.5) as fleet:
        gw = await start_gateway(gateway_config(fleet.replicas, model=MODEL, port=free_port(),
                                                health={"interval_s": 60}))
        tally = Tally()
        streams: list[tuple[aiohttp.ClientResponse, str]] = []
        try:
            for i in range(6):
                body = {"model": MODEL, "prompt": tokens(100 + i, 40), "max_tokens": 400,
                        "stream": True, "return_token_ids": True}
                resp = await http.post(gw.url + "/v1/completions", json=body, headers=AUTH)
                tally.sent += 1
                assert resp.status == 200
                head = await resp.content.readuntil(b"\n\n")  # the client has seen a byte
                streams.append((resp, head.decode()))
            on = Counter(resp.headers["x-cacheroute-replica"] for resp, _ in streams)
            victim = on.most_common(1)[0][0]
            fleet.kill([rid(u) for u in fleet.urls].index(victim))
            kinds: Counter[tuple[str, str]] = Counter()
            for resp, first in streams:
                rest = (await resp.content.read()).decode()
                kind = classify(tally, 200, first + rest, stream=True)
                kinds[(resp.headers["x-cacheroute-replica"], kind)] += 1
        finally:
            for resp, _ in streams:
                resp.close()
        tally.check()
        await report(gw, "kill mid-stream", tally, f"; by replica: {dict(kinds)}")
        # Every stream on the killed replica ended with an error event; none elsewhere.
        assert kinds[(victim, "sse_error")] == on[victim]
        assert tally.errors["sse_error"] == on[victim]
        counters = await gateway_counters(gw)
        assert counters["cacheroute_retries_total"] == 0  # never retried after a byte
        assert await labelled(gw, "cacheroute_upstream_failures_total", replica=victim) == \
            on[victim]
        assert_failures_accounted(counters, tally)
        # New requests still succeed, on the survivor.
        after_kill = Tally()
        for i in range(8):
            await send(http, gw.url, request_body(i, max_tokens=2), after_kill)
        after_kill.check()
        assert after_kill.ok == 8 and victim not in after_kill.replicas


async def test_paused_replica_is_ejected_then_readmitted(
        start_gateway: Callable[[dict[str, Any]], Awaitable[GatewayClient]],
        http: aiohttp.ClientSession) -> None:
    async with AsyncSimFleet(2, block_size=16) as fleet:
        gw = await start_gateway(gateway_config(
            fleet.replicas, model=MODEL, port=free_port(),
            health={"interval_s": 60, "eject_base_s": 2.0, "eject_after_failures": 2},
            proxy={"first_token_timeout_s": 0.5, "idle_timeout_s": 0.2}))
        paused = rid(fleet.urls[0])
        fleet.pause(0)  # SIGSTOP: the kernel still accepts its connections; nothing answers
        try:
            tally = Tally()
            stop = asyncio.Event()
            # Unique prompts: nothing cached anywhere, so the paused replica looks as good
            # as the other whenever its stuck attempts have timed out, until it is ejected.
            load = asyncio.ensure_future(closed_loop(http, gw.url, tally, workers=3, stop=stop,
                                                     limit=2000, body=unique_body))
            try:
                await wait_replica_state(gw, paused, "ejected", 20.0)
            finally:
                stop.set()
                await load
            tally.check()
            await report(gw, "paused replica", tally)
            assert tally.ok == tally.sent  # each stall failed over to the other replica
            assert paused not in tally.replicas
            assert await labelled(gw, "cacheroute_retries_total", replica=paused,
                                  reason="first_token_timeout") >= 1
            counters = await gateway_counters(gw)
            assert await labelled(gw, "cacheroute_ejections_total", replica=paused) == 1
            assert_failures_accounted(counters, tally)
        finally:
            fleet.resume(0)
        # After its ejection ends it is tried again, and serves.
        again = Tally()

        async def served_again() -> bool:
            await send(http, gw.url, unique_body(10_000 + again.sent), again)
            return paused in again.replicas

        await wait_until(served_again, 15.0, "the resumed replica to serve again")
        again.check()


async def test_replica_that_stalls_while_its_health_answers_200_counts_as_failing(
        start_gateway: Callable[[dict[str, Any]], Awaitable[GatewayClient]],
        http: aiohttp.ClientSession) -> None:
    # One replica whose first token takes ~40 s (unit profile at 1% speed) beside a fast one.
    async with AsyncSimFleet(1, block_size=16, prefill_profile="unit", time_scale=0.01,
                             name_prefix="slow") as slow, \
            AsyncSimFleet(1, block_size=16, name_prefix="fast") as fast:
        gw = await start_gateway(gateway_config(
            [*slow.replicas, *fast.replicas], model=MODEL, port=free_port(),
            health={"interval_s": 0.25, "eject_base_s": 30.0, "eject_after_failures": 2},
            proxy={"first_token_timeout_s": 0.5, "idle_timeout_s": 0.2}))
        stalled = rid(slow.urls[0])
        tally = Tally()

        async def ejected() -> bool:
            # Unique prompts, one at a time: both replicas look alike to the policy, so
            # the stalled one keeps being tried until the stalls eject it.
            await send(http, gw.url, unique_body(tally.sent), tally)
            _, ready = await gw.get("/ready")
            return any(r["id"] == stalled and r["state"] == "ejected" for r in ready["replicas"])

        await wait_until(ejected, 30.0, "the stalled replica to be ejected")
        tally.check()
        await report(gw, "stalled replica", tally)
        assert tally.ok == tally.sent and stalled not in tally.replicas
        assert await labelled(gw, "cacheroute_ejections_total", replica=stalled) == 1
        # Its health checks kept passing throughout: only the stalls ejected it.
        _, ready = await gw.get("/ready")
        state = {r["id"]: r for r in ready["replicas"]}[stalled]
        assert state["state"] == "ejected" and state["last_error"] == "first_token_timeout"
        assert_failures_accounted(await gateway_counters(gw), tally)


async def test_severed_connections_before_and_after_the_first_byte(
        start_gateway: Callable[[dict[str, Any]], Awaitable[GatewayClient]],
        http: aiohttp.ClientSession) -> None:
    async with AsyncSimFleet(2, block_size=16, prefill_profile="unit", time_scale=0.5) as fleet:
        proxy = TcpProxy("127.0.0.1", fleet.replicas[0].port)
        await proxy.start()
        try:
            # Round robin: half the requests are sent through the proxy first, for sure.
            raw = gateway_config(fleet.replicas, model=MODEL, port=free_port(),
                                 policy={"name": "round_robin"},
                                 health={"interval_s": 60, "eject_after_failures": 100},
                                 proxy={"first_token_timeout_s": 1.0, "idle_timeout_s": 1.0})
            cut = f"127.0.0.1:{proxy.port}"
            raw["replicas"][0]["url"] = f"http://{cut}"  # replica 0 only through the proxy
            gw = await start_gateway(raw)
            tally = Tally()

            # After the first byte: streams through the proxy are cut mid-generation.
            streams: list[tuple[aiohttp.ClientResponse, str]] = []
            elsewhere: list[tuple[aiohttp.ClientResponse, str]] = []
            try:
                while len(streams) < 3:
                    body = {"model": MODEL, "prompt": tokens(tally.sent, 40),
                            "max_tokens": 1000, "stream": True, "return_token_ids": True}
                    resp = await http.post(gw.url + "/v1/completions", json=body, headers=AUTH)
                    tally.sent += 1
                    first = (await resp.content.readuntil(b"\n\n")).decode()
                    on_cut = resp.headers["x-cacheroute-replica"] == cut
                    (streams if on_cut else elsewhere).append((resp, first))
                await proxy.sever()
                for resp, first in streams:
                    rest = (await resp.content.read()).decode()
                    assert classify(tally, 200, first + rest, True) == "sse_error"
                for resp, first in elsewhere:  # the other replica's streams finish
                    rest = (await resp.content.read()).decode()
                    assert classify(tally, 200, first + rest, True) == "ok"
            finally:
                for resp, _ in [*streams, *elsewhere]:
                    resp.close()

            # Before the first byte: a black-holed replica times out and is retried.
            proxy.mode = "blackhole"
            for i in range(6):
                await send(http, gw.url, unique_body(i), tally)
            tally.check()
            await report(gw, "severed/black-holed", tally)
            assert tally.errors == Counter({"sse_error": 3}), tally.summary()
            counters = await gateway_counters(gw)
            retried = await labelled(gw, "cacheroute_retries_total", replica=cut,
                                     reason="first_token_timeout")
            # Every request the policy sent to the black hole was retried elsewhere.
            assert retried == 3 and cut not in tally.replicas
            assert_failures_accounted(counters, tally)
        finally:
            await proxy.stop()


# --------------------------------------------------------------------------- Redis


def _redis_gateway(fleet: AsyncSimFleet, url: str) -> dict[str, Any]:
    # Without KV events the gateway records what it sent into Redis itself, so every
    # request reads and writes the index.
    raw = gateway_config(fleet.replicas, model=MODEL, port=free_port(), events=False,
                         index=url)
    raw["index"]["deadline_ms"] = 200
    return raw


async def index_status(gw: GatewayClient) -> str:
    _, ready = await gw.get("/ready")
    return str(ready["index"]["status"])


async def test_redis_stopped_and_restarted_under_load(
        start_gateway: Callable[[dict[str, Any]], Awaitable[GatewayClient]],
        http: aiohttp.ClientSession) -> None:
    redis = RedisServer(port=free_port())
    redis.start()
    try:
        async with AsyncSimFleet(2, block_size=16, kv_events=False) as fleet:
            gw = await start_gateway(_redis_gateway(fleet, redis.url))
            assert await index_status(gw) == "ok"
            tally = Tally()
            stop = asyncio.Event()
            load = asyncio.ensure_future(closed_loop(http, gw.url, tally, workers=4, stop=stop,
                                                     limit=100_000))
            try:
                await after(30, tally)
                redis.stop()

                async def down() -> bool:
                    return (await index_status(gw)).startswith("down")

                await wait_until(down, 5.0, "/ready to report the index down")
                assert await labelled(gw, "cacheroute_index_up") == 0
                during = tally.sent
                await after(during + 30, tally)  # requests keep flowing without Redis
                await asyncio.to_thread(redis.start)

                async def back() -> bool:
                    return await index_status(gw) == "ok"

                await wait_until(back, 10.0, "the gateway to reconnect to Redis")
                await after(tally.sent + 20, tally)
            finally:
                stop.set()
                await load
            tally.check()
            counters = await report(gw, "redis stop/restart", tally,
                                    f"; max latency {max(tally.latencies) * 1000:.0f} ms")
            assert tally.failed == 0, tally.summary()
            assert counters["cacheroute_index_fallbacks_total"] >= 1
            assert await labelled(gw, "cacheroute_index_fallbacks_total",
                                  reason="index_down") >= 1
            # The loss and the reconnection show in metrics, each counted once.
            assert await labelled(gw, "cacheroute_index_up") == 1
            assert await labelled(gw, "cacheroute_index_transitions_total", to="down") == 1
            assert await labelled(gw, "cacheroute_index_transitions_total", to="up") == 1
            # Refused connections fail fast: no request waited on Redis for long.
            assert max(tally.latencies) < 2.0
    finally:
        redis.stop()


async def test_blackholed_redis_never_holds_a_request_past_the_deadline(
        start_gateway: Callable[[dict[str, Any]], Awaitable[GatewayClient]],
        http: aiohttp.ClientSession) -> None:
    redis = RedisServer(port=free_port())
    redis.start()
    proxy = TcpProxy("127.0.0.1", redis.port)
    await proxy.start()
    try:
        async with AsyncSimFleet(2, block_size=16, kv_events=False) as fleet:
            gw = await start_gateway(_redis_gateway(fleet, f"redis://127.0.0.1:{proxy.port}/0"))
            healthy = Tally()
            for i in range(10):
                await send(http, gw.url, request_body(i), healthy)
            assert healthy.ok == 10 and await index_status(gw) == "ok"

            proxy.mode = "blackhole"  # packets vanish: only deadlines end the waits
            held = Tally()
            for i in range(20):
                await send(http, gw.url, request_body(100 + i), held)
            held.check()
            status = await index_status(gw)
            await report(gw, "black-holed redis", held,
                         f"; max latency {max(held.latencies) * 1000:.0f} ms; "
                         f"/ready index: {status}")
            assert held.ok == 20
            # The lookup deadline is 200 ms, recording waits at most as long: one request
            # never waits on the index for much more than both.
            assert max(held.latencies) < 1.5, max(held.latencies)
            assert status.startswith("down")
            assert await labelled(gw, "cacheroute_index_fallbacks_total") >= 20

            proxy.mode = "pass"
            await proxy.sever()  # connections stuck in the black hole are gone for good

            async def back() -> bool:
                return await index_status(gw) == "ok"

            await wait_until(back, 10.0, "the gateway to reconnect to Redis")
            recovered = Tally()
            for i in range(5):
                await send(http, gw.url, request_body(200 + i), recovered)
            assert recovered.ok == 5
    finally:
        await proxy.stop()
        redis.stop()


# ------------------------------------------------------------------ KV-event stream


async def test_a_silent_event_stream_drops_the_replicas_entries(
        start_gateway: Callable[[dict[str, Any]], Awaitable[GatewayClient]],
        http: aiohttp.ClientSession) -> None:
    async with AsyncSimFleet(2, block_size=16) as fleet:
        events = fleet.replicas[0].kv_events_endpoint
        assert events is not None
        proxy = TcpProxy("127.0.0.1", int(events.rsplit(":", 1)[1]))
        await proxy.start()
        try:
            raw = gateway_config(fleet.replicas, model=MODEL, port=free_port(),
                                 health={"interval_s": 0.5})  # silence limit: 2 s
            raw["replicas"][0]["kv_events"] = f"tcp://127.0.0.1:{proxy.port}"
            gw = await start_gateway(raw)
            assert gw.app_gateway is not None and gw.app_gateway.index is not None
            index = gw.app_gateway.index
            watched = rid(fleet.urls[0])
            salt = tenant_salt("alpha")

            # A prompt the watched replica holds, known to the index through its events.
            seed = 0
            while True:
                base = tokens(70_000 + seed, 96)
                seed += 1
                reply = await gw.post("/v1/completions", {"model": MODEL, "prompt": base,
                                                          "max_tokens": 2})
                assert reply.status == 200
                if reply.replica == watched:
                    break
            await wait_indexed(index, MODEL, watched, base, salt)

            # Its event stream goes silent (packets dropped), then it serves a longer
            # prompt: it stores new blocks and announces them, but nothing arrives.
            proxy.mode = "blackhole"
            longer = [*base, *tokens(80_000, 64)]
            reply = await gw.post("/v1/completions", {"model": MODEL, "prompt": longer,
                                                      "max_tokens": 2})
            assert reply.status == 200 and reply.replica == watched
            assert reply.cached == 96 and reply.predicted == 96
            forwarded = proxy.forwarded

            keys = chain_keys(base, salt)

            async def dropped() -> bool:
                return (await index.lookup(MODEL, keys)).get(watched, 0) == 0

            # Never trusted stale: its entries go within the silence limit (plus slack).
            await wait_until(dropped, 6.0, "the silent replica's entries to be dropped")
            assert proxy.swallowed > 0 and proxy.forwarded == forwarded  # it really was cut
            assert await labelled(gw, "cacheroute_event_silences_total", replica=watched) == 1
            # The other replica's stream is fine and was left alone.
            assert await labelled(gw, "cacheroute_event_silences_total",
                                  replica=rid(fleet.urls[1])) == 0
            after_drop = await gw.post("/v1/completions", {"model": MODEL, "prompt": base,
                                                           "max_tokens": 2})
            assert after_drop.status == 200 and after_drop.predicted == 0
        finally:
            await proxy.stop()
