"""Holding requests while every replica's prefill queue is full (router/prefill_hold.py):
nothing held while there is room, let go by deadline one at a time, at the deadline at the
latest, never lost to a cancellation; and through the routing pipeline, a short prompt
decided before a long one that came first."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from loop_steps import until

from router.config import LimitsConfig, TenantsConfig
from router.hashing import HashConfig, chain_hashes, event_key
from router.index import MemoryIndex
from router.policy.pipeline import build_policy
from router.policy.types import PolicyConfig, PrefillProfile
from router.prefill_hold import PrefillHold, Turn
from router.replicas import Replica, ReplicaSource
from router.request import parse_request
from router.routing import ChainCache, Route, RoutingPipeline
from router.tenants import TenantRegistry

FAR = 3600.0  # a deadline no test reaches


class Fleet:
    """A stand-in for the replicas' queues: seconds until one has room (<= 0: now)."""

    def __init__(self, room_s: float) -> None:
        self.room_s = room_s

    def room(self, now: float) -> float:
        return self.room_s


async def test_nothing_is_held_while_some_replica_has_room() -> None:
    hold = PrefillHold(time.monotonic)
    fleet = Fleet(room_s=0.0)
    turn = hold.turn("m", time.monotonic() + FAR, fleet.room, fleet.room(0.0))
    await asyncio.wait_for(turn.wait(), 1.0)
    assert not turn.held and hold.holding() == 0 and hold.held_total == 0
    turn.done()
    turn.done()  # idempotent: a second done must not hand on a turn it does not have
    nxt = hold.turn("m", time.monotonic() + FAR, fleet.room, 0.0)
    await asyncio.wait_for(nxt.wait(), 1.0)
    assert not nxt.held
    nxt.done()


async def test_held_requests_go_by_deadline_one_at_a_time() -> None:
    hold = PrefillHold(time.monotonic)
    fleet = Fleet(room_s=FAR)
    now = time.monotonic()
    order: list[str] = []
    counted = {name: asyncio.Event() for name in ("long", "mid", "short")}

    async def request(name: str, turn: Turn) -> None:
        try:
            await turn.wait()
            order.append(name)
            await counted[name].wait()  # its decision made, its work reserved
        finally:
            turn.done()

    # The long prompt arrives first, the short one last: deadlines say the reverse.
    tasks = [asyncio.create_task(request(name, hold.turn("m", now + slack, fleet.room,
                                                         fleet.room(now))))
             for name, slack in (("long", 300.0), ("mid", 200.0), ("short", 100.0))]
    await until(lambda: hold.holding() == 3)
    assert order == []
    fleet.room_s = 0.0
    hold.changed()
    await until(lambda: order == ["short"])
    # Room stays, and a replica's work changes, but the next waits until the one let go
    # is counted on its replica.
    hold.changed()
    for _ in range(20):
        await asyncio.sleep(0)
    assert order == ["short"] and hold.holding() == 2
    counted["short"].set()
    await until(lambda: order == ["short", "mid"])
    counted["mid"].set()
    await until(lambda: order == ["short", "mid", "long"])
    counted["long"].set()
    await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
    assert hold.holding() == 0 and hold.held_total == 3


async def test_a_request_goes_at_its_deadline_when_no_replica_makes_room() -> None:
    hold = PrefillHold(time.monotonic)
    fleet = Fleet(room_s=FAR)
    start = time.monotonic()
    soon = hold.turn("m", start + 0.05, fleet.room, FAR)
    later = hold.turn("m", start + FAR, fleet.room, FAR)
    waiting_later = asyncio.create_task(later.wait())
    await asyncio.wait_for(soon.wait(), 5.0)
    assert soon.held and time.monotonic() - start >= 0.05
    soon.done()
    await until(lambda: hold.holding() == 1)
    assert not waiting_later.done()
    waiting_later.cancel()
    await asyncio.gather(waiting_later, return_exceptions=True)
    await until(lambda: hold.holding() == 0)


async def test_a_cancelled_request_hands_its_turn_on() -> None:
    hold = PrefillHold(time.monotonic)
    fleet = Fleet(room_s=FAR)
    now = time.monotonic()
    # Cancelled while held: it leaves the queue.
    gone = hold.turn("m", now + 1.0, fleet.room, FAR)
    gone_task = asyncio.create_task(gone.wait())
    await until(lambda: hold.holding() == 1)
    gone_task.cancel()
    await asyncio.gather(gone_task, return_exceptions=True)
    gone.done()
    assert hold.holding() == 0
    # Let go, then cancelled before it ran: the next one is let go all the same.
    first = hold.turn("m", now + 10.0, fleet.room, FAR)
    second = hold.turn("m", now + 20.0, fleet.room, FAR)
    first_task = asyncio.create_task(first.wait())
    second_task = asyncio.create_task(second.wait())
    await until(lambda: hold.holding() == 2)
    fleet.room_s = 0.0
    hold._look()  # lets `first` go now, before its task runs again
    first_task.cancel()
    await asyncio.gather(first_task, return_exceptions=True)
    first.done()
    await asyncio.wait_for(second_task, 5.0)
    assert second.held
    second.done()


BLOCK = HashConfig(block_size=16)
REGISTRY = TenantRegistry.from_config(TenantsConfig(allow_anonymous=True))


async def test_a_short_prompt_is_decided_before_a_long_one_while_the_replica_is_full() -> None:
    # One replica, 10 s of prefill queued: far past its step (2048 tokens at 1 ms each).
    profile = PrefillProfile(base_s=0.01, per_token_s=1e-3, per_token_context_s=0.0)
    config = PolicyConfig(name="cache_aware", seed=1, prefill=profile, hold_cap=0.5)
    hold = PrefillHold(time.monotonic)
    pipeline = RoutingPipeline(tokenizers={}, chains=ChainCache(), index=MemoryIndex(),
                               policy=build_policy(config), index_deadline_s=1.0, hold=hold)
    source = ReplicaSource(name="r0", url="http://127.0.0.1:9000", models=("m",),
                           hash_config=BLOCK)
    replica = Replica(target=source.target(), healthy=True)
    replica.work.listeners.append(hold.changed)
    busy = replica.work.begin(time.monotonic(), 10.0, 10.0, True)
    decided: list[str] = []

    async def send(name: str, tokens: int) -> Route:
        raw = json.dumps({"model": "m", "prompt": list(range(1, tokens + 1)),
                          "max_tokens": 1}).encode()
        parsed = parse_request(raw, "completions", served_models=(), limits=LimitsConfig(),
                               tenant=REGISTRY.identify(None), registry=REGISTRY)
        route = await pipeline.route(parsed, [replica], time.monotonic(), None, None,
                                     offload=False, reserve=True)
        decided.append(name)
        return route

    # Deadlines: the long one (4k tokens, ~4 s of prefill) ~2 s out, the short one
    # (512 tokens) ~0.26 s: long enough for the test to make room first.
    long_task = asyncio.create_task(send("long", 4096))
    await until(lambda: hold.holding() == 1)
    short_task = asyncio.create_task(send("short", 512))
    await until(lambda: hold.holding() == 2)
    assert decided == []
    replica.work.first_byte(busy, time.monotonic())  # the queue ahead is done
    replica.work.end(busy, time.monotonic())
    short, long = await asyncio.wait_for(asyncio.gather(short_task, long_task), 5.0)
    assert decided == ["short", "long"]
    assert short.held_s > 0 and long.held_s > short.held_s
    assert hold.holding() == 0
    # Each is counted on the replica as it was decided: the long one queued behind.
    assert replica.work.view(time.monotonic()).pending == 2


async def test_a_held_request_is_decided_on_the_index_as_it_is_when_let_go() -> None:
    # Two replicas, each more than a step (200 tokens at 0.1 ms: 20 ms) of prefill behind:
    # r0 by 1.0 s, r1 by 1.2 s. The prompt (4k tokens, ~0.41 s cold) is held until its
    # deadline (half that), and meanwhile r1 stores its whole chain (another gateway's
    # request, say): decided then, it goes to r1, where it costs next to nothing.
    profile = PrefillProfile(base_s=0.01, per_token_s=1e-4, per_token_context_s=0.0)
    config = PolicyConfig(name="cache_aware", seed=1, prefill=profile, hold_cap=0.5,
                          hold_step_tokens=200)
    hold = PrefillHold(time.monotonic)
    index = MemoryIndex()
    pipeline = RoutingPipeline(tokenizers={}, chains=ChainCache(), index=index,
                               policy=build_policy(config), index_deadline_s=1.0, hold=hold)
    fleet = [Replica(target=ReplicaSource(name=f"r{i}", url=f"http://127.0.0.1:{9000 + i}",
                                          models=("m",), hash_config=BLOCK).target(),
                     healthy=True) for i in range(2)]
    now = time.monotonic()
    for replica, queued_s in zip(fleet, (1.0, 1.2), strict=True):
        replica.work.listeners.append(hold.changed)
        replica.work.begin(now, queued_s, queued_s, True)
    prompt = list(range(1, 4097))
    raw = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}).encode()
    parsed = parse_request(raw, "completions", served_models=(), limits=LimitsConfig(),
                           tenant=REGISTRY.identify(None), registry=REGISTRY)
    task = asyncio.create_task(pipeline.route(parsed, fleet, time.monotonic(), None, None,
                                              offload=False, reserve=True))
    await until(lambda: hold.holding() == 1)
    await index.add("m", "r1", [event_key(d) for d in chain_hashes(BLOCK, prompt)])
    route = await asyncio.wait_for(task, 5.0)
    assert route.held_s > 0
    assert route.matches == {"r1": 256}
    assert route.decision.replica_id == "r1"


@pytest.mark.parametrize(("chunk_tokens", "step_tokens", "held"),
                         [(8192, 2048, True), (2048, 8192, False)])
async def test_a_full_step_is_hold_step_tokens_not_the_replicas_budget(
        chunk_tokens: int, step_tokens: int, held: bool) -> None:
    # Two replicas with 0.5 s of prefill queued each: 5,000 tokens at 0.1 ms. The hold
    # counts them full against its own step (2,048 tokens: 0.2 s) whatever the replicas'
    # budget (prefill_chunk_tokens), and has room against 8,192 (0.82 s) even where the
    # budget is 2,048: the budget once served as the hold's step, so a user who set it to
    # the replicas' real 8,192 got a hold that held less.
    profile = PrefillProfile(base_s=0.01, per_token_s=1e-4, per_token_context_s=0.0)
    config = PolicyConfig(name="cache_aware", seed=1, prefill=profile, hold_cap=0.5,
                          prefill_chunk_tokens=chunk_tokens, hold_step_tokens=step_tokens)
    hold = PrefillHold(time.monotonic)
    pipeline = RoutingPipeline(tokenizers={}, chains=ChainCache(), index=MemoryIndex(),
                               policy=build_policy(config), index_deadline_s=1.0, hold=hold)
    fleet = [Replica(target=ReplicaSource(name=f"r{i}", url=f"http://127.0.0.1:{9000 + i}",
                                          models=("m",), hash_config=BLOCK).target(),
                     healthy=True) for i in range(2)]
    now = time.monotonic()
    for replica in fleet:
        replica.work.listeners.append(hold.changed)
        replica.work.begin(now, 0.5, 0.5, True)
    raw = json.dumps({"model": "m", "prompt": list(range(1, 1001)), "max_tokens": 1}).encode()
    parsed = parse_request(raw, "completions", served_models=(), limits=LimitsConfig(),
                           tenant=REGISTRY.identify(None), registry=REGISTRY)
    route = await asyncio.wait_for(pipeline.route(parsed, fleet, time.monotonic(), None, None,
                                                  offload=False, reserve=True), 5.0)
    assert (route.held_s > 0) is held
    assert hold.held_total == (1 if held else 0)
