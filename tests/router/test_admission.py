"""Admission: limits, a bounded FIFO queue and its timeout, with real asyncio tasks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from loop_steps import until
from servers import free_port

from router.admission import Admission, Overloaded, Slot
from router.app import GATEWAY, build_app, running_gateway
from router.config import LimitsConfig, build_config


def queued_is(a: Admission, n: int) -> Callable[[], bool]:
    return lambda: a.queued == n


def admission(
    global_: int = 10, per_replica: int = 2, queue: int = 10, timeout: float = 30.0, **kw: object
) -> Admission:
    return Admission(global_, per_replica, queue, timeout, **kw)  # type: ignore[arg-type]


async def test_per_replica_limit_falls_through_the_ranking() -> None:
    a = admission(per_replica=2)
    s1, s2 = await a.acquire(["A", "B"]), await a.acquire(["A", "B"])
    s3 = await a.acquire(["A", "B"])
    assert [s.replica_id for s in (s1, s2, s3)] == ["A", "A", "B"]
    assert a.try_acquire(["A"]) is None
    assert (a.inflight("A"), a.inflight("B"), a.inflight()) == (2, 1, 3)


async def test_global_limit_spans_replicas() -> None:
    a = admission(global_=3, per_replica=5)
    slots = [a.try_acquire([r]) for r in "ABC"]
    assert all(slots) and a.try_acquire(["D"]) is None
    slots[0].release()  # type: ignore[union-attr]
    assert a.try_acquire(["D"]) is not None


async def test_queue_is_fifo() -> None:
    a = admission(global_=1, per_replica=1)
    held = await a.acquire(["A"])
    order: list[int] = []

    async def waiter(i: int) -> None:
        async with await a.acquire(["A"]):
            order.append(i)
            assert a.inflight() == 1

    tasks = []
    for i in range(3):
        tasks.append(asyncio.create_task(waiter(i)))
        await until(queued_is(a, i + 1))
    held.release()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    assert a.inflight() == 0 and a.queued == 0


async def test_full_queue_is_rejected_at_once_with_retry_after() -> None:
    a = admission(global_=1, per_replica=1, queue=1)
    held = await a.acquire(["A"])
    queued = asyncio.create_task(a.acquire(["A"]))
    await until(lambda: a.queued == 1)
    with pytest.raises(Overloaded) as info:
        await a.acquire(["A"])
    assert info.value.reason == "queue_full" and info.value.retry_after >= 1.0
    assert info.value.retry_after_header.isdigit()
    assert a.stats().rejected_queue_full == 1
    held.release()
    (await queued).release()
    assert a.inflight() == 0


async def test_no_queue_means_immediate_rejection() -> None:
    a = admission(global_=1, queue=0)
    held = await a.acquire(["A"])
    with pytest.raises(Overloaded, match="0 requests already queued"):
        await a.acquire(["B"])
    held.release()


async def test_queue_timeout() -> None:
    a = admission(global_=1, per_replica=1, timeout=0.05)
    held = await a.acquire(["A"])
    with pytest.raises(Overloaded) as info:
        await a.acquire(["A"])
    assert info.value.reason == "queue_timeout" and "0.05s" in str(info.value)
    assert a.queued == 0 and a.stats().rejected_timeout == 1
    held.release()
    assert a.inflight() == 0
    # A per-call timeout overrides the configured one.
    held = await a.acquire(["A"])
    with pytest.raises(Overloaded, match=r"0\.01s"):
        await a.acquire(["A"], timeout_s=0.01)
    held.release()


async def test_cancelled_waiter_leaks_nothing_and_the_next_gets_the_slot() -> None:
    a = admission(global_=1, per_replica=1)
    held = await a.acquire(["A"])
    first = asyncio.create_task(a.acquire(["A"]))
    await until(lambda: a.queued == 1)
    second = asyncio.create_task(a.acquire(["A"]))
    await until(lambda: a.queued == 2)
    first.cancel()
    await until(lambda: first.done())
    assert a.queued == 1
    held.release()
    slot = await second
    assert a.inflight("A") == 1
    slot.release()
    assert a.inflight() == 0


async def test_cancel_after_grant_passes_the_slot_on() -> None:
    a = admission(global_=1, per_replica=1)
    held = await a.acquire(["A"])
    first = asyncio.create_task(a.acquire(["A"]))
    second = asyncio.create_task(a.acquire(["A"]))
    await until(lambda: a.queued == 2)
    held.release()  # granted to `first` synchronously, before it runs
    first.cancel()
    slot = await second
    assert first.cancelled() and a.inflight() == 1
    slot.release()
    assert a.inflight() == 0


async def test_waiters_for_a_full_replica_do_not_block_another() -> None:
    a = admission(global_=10, per_replica=1)
    on_a = await a.acquire(["A"])
    on_b = await a.acquire(["B"])
    wait_a = asyncio.create_task(a.acquire(["A"]))
    wait_b = asyncio.create_task(a.acquire(["B"]))
    await until(lambda: a.queued == 2)
    on_b.release()
    slot_b = await wait_b
    assert slot_b.replica_id == "B" and not wait_a.done()
    on_a.release()
    (await wait_a).release()
    slot_b.release()


async def test_a_waiter_takes_whichever_candidate_frees_first() -> None:
    a = admission(per_replica=1)
    on_a, on_b = await a.acquire(["A"]), await a.acquire(["B"])
    waiting = asyncio.create_task(a.acquire(["A", "B"]))
    await until(lambda: a.queued == 1)
    on_b.release()
    assert (await waiting).replica_id == "B"
    on_a.release()


async def test_slot_context_manager_and_idempotent_release() -> None:
    a = admission()
    async with await a.acquire(["A"]) as slot:
        assert isinstance(slot, Slot) and a.inflight("A") == 1
    assert a.inflight() == 0
    slot.release()
    assert a.inflight() == 0 and a.stats().per_replica == {}


async def test_raising_a_replica_limit_admits_waiters() -> None:
    a = admission(per_replica=1)
    held = await a.acquire(["A"])
    waiting = asyncio.create_task(a.acquire(["A"]))
    await until(lambda: a.queued == 1)
    a.set_replica_limit("A", 2)
    (await waiting).release()
    held.release()
    a.set_replica_limit("A", None)
    assert a.limit("A") == 1


async def test_retry_after_follows_measured_hold_time() -> None:
    now = [0.0]
    a = admission(global_=1, per_replica=1, queue=0, clock=lambda: now[0])
    for _ in range(30):
        slot = await a.acquire(["A"])
        now[0] += 10.0
        slot.release()
    held = await a.acquire(["A"])
    with pytest.raises(Overloaded) as info:
        await a.acquire(["A"])
    assert 9.0 <= info.value.retry_after <= 10.0 and info.value.retry_after_header == "10"
    held.release()


def test_from_config_and_bad_limits() -> None:
    a = Admission.from_config(
        LimitsConfig(
            global_concurrency=5, per_replica_concurrency=2, queue_size=3, queue_timeout_s=1.5
        ),
        {"big": 4},
    )
    assert (a.global_concurrency, a.limit("x"), a.limit("big"), a.queue_size) == (5, 2, 4, 3)
    with pytest.raises(ValueError):
        Admission(0, 1, 1, 1.0)


@given(st.lists(st.tuples(st.booleans(), st.sampled_from("ABC")), max_size=60))
def test_limits_hold_under_any_sequence(ops: list[tuple[bool, str]]) -> None:
    a = Admission(4, 2, 0, 1.0)
    held: list[Slot] = []
    for take, replica in ops:
        if take:
            slot = a.try_acquire([replica])
            if slot is not None:
                held.append(slot)
        elif held:
            held.pop(0).release()
        assert a.inflight() == len(held) <= 4
        assert all(a.inflight(r) <= 2 for r in "ABC")


async def test_refuse_if_full_answers_as_acquire_would_without_queueing() -> None:
    a = admission(global_=1, per_replica=1, queue=1)
    a.refuse_if_full(["A"])  # room: nothing to refuse
    held = await a.acquire(["A"])
    a.refuse_if_full(["A"])  # no room, but the queue has a place
    waiting = asyncio.create_task(a.acquire(["A"]))
    await until(queued_is(a, 1))
    with pytest.raises(Overloaded) as info:
        a.refuse_if_full(["A", "B"])
    assert info.value.reason == "queue_full" and a.stats().rejected_queue_full == 1
    assert a.queued == 1  # the check itself never queues
    held.release()
    (await waiting).release()


async def test_an_overloaded_gateway_refuses_before_it_tokenizes() -> None:
    """A full gateway answers 429 without rendering, tokenizing or looking up the body."""
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({"choices": [{"index": 0, "text": "x", "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 32, "completion_tokens": 1}})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    upstream = web.Application()
    upstream.router.add_post("/v1/completions", slow)
    upstream.router.add_get("/health", health)
    up_runner = web.AppRunner(upstream)
    await up_runner.setup()
    up_port, port = free_port(), free_port()
    await web.TCPSite(up_runner, "127.0.0.1", up_port).start()
    config = build_config({
        "listen": {"host": "127.0.0.1", "port": port},
        "replicas": [{"url": f"http://127.0.0.1:{up_port}", "models": ["m"]}],
        "tenants": {"allow_anonymous": True},
        "limits": {"global_concurrency": 1, "queue_size": 0},
    })
    app = build_app(config)
    body = {"model": "m", "prompt": list(range(64)), "max_tokens": 1}
    try:
        async with running_gateway(app, "127.0.0.1", port), aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{port}/v1/completions"
            first = asyncio.create_task(session.post(url, json=body))
            metrics = app[GATEWAY].metrics
            await until(lambda: app[GATEWAY].admission is not None
                        and app[GATEWAY].admission.inflight() == 1, rounds=100_000)
            prepared = metrics.tokenize_latency._sum.get()  # type: ignore[attr-defined]
            async with session.post(url, json=body) as second:
                assert second.status == 429 and second.headers["Retry-After"]
                assert (await second.json())["error"]["type"] == "rate_limit_error"
            assert metrics.tokenize_latency._sum.get() == prepared  # type: ignore[attr-defined]
            release.set()
            async with await first as resp:
                assert resp.status == 200
    finally:
        release.set()
        await up_runner.cleanup()
