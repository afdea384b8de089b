"""A request waits at the gateway for this gateway's prefills queued ahead on its replica
to reach their first tokens (policy.step_gate): when, for how long at most, and that
nothing is left behind however the wait ends."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from loop_steps import until

from router.config import LimitsConfig, TenantsConfig
from router.hashing import HashConfig
from router.index import MemoryIndex
from router.policy.cost import peer_gate_s, step_gate_s
from router.policy.pipeline import build_policy
from router.policy.types import PolicyConfig, PrefillProfile, ReplicaState
from router.replicas import Replica, ReplicaSource
from router.request import parse_request
from router.routing import ChainCache, Route, RoutingPipeline
from router.tenants import TenantRegistry

BLOCK = HashConfig(block_size=16)
REGISTRY = TenantRegistry.from_config(TenantsConfig(allow_anonymous=True))
# 1 ms a token, 10 ms a step's base; a step's budget of 2,048 tokens.
PROFILE = PrefillProfile(base_s=0.01, per_token_s=1e-3, per_token_context_s=0.0)
CONFIG = PolicyConfig(name="cache_aware", seed=1, prefill=PROFILE, step_gate=True,
                      prefill_chunk_tokens=2048)


def test_a_prompt_waits_where_our_prefill_is_queued_unless_it_costs_less_than_a_base() -> None:
    ahead = ReplicaState("r0", pending=1, queued_prefill_s=0.5)  # 500 tokens queued
    # Its first chunk would join the step where those 500 tokens end and delay them; it
    # waits up to the queue's time and half again, plus a step's 10 ms base.
    assert step_gate_s(4000, ahead, CONFIG) == pytest.approx(1.5 * 0.5 + 0.01)
    assert step_gate_s(11, ahead, CONFIG) == pytest.approx(1.5 * 0.5 + 0.01)
    # A prompt whose whole prefill costs no more than a step's base goes at once.
    assert step_gate_s(10, ahead, CONFIG) == 0.0
    # Nothing queued there that a gateway sent: nothing to wait for (what only the
    # scrape shows is not timed well enough to wait on).
    assert step_gate_s(4000, ReplicaState("r0"), CONFIG) == 0.0
    assert step_gate_s(4000, ReplicaState("r0", pending=0, queued_prefill_s=0.5,
                                          external_waiting=3), CONFIG) == 0.0
    # Other gateways' queue (shared work) counts as ours does, while they have requests
    # there without a first byte; their decoding alone is no queue.
    peers = ReplicaState("r0", peer_pending=2, peer_wait_s=0.4)
    assert step_gate_s(4000, peers, CONFIG) == pytest.approx(1.5 * 0.4 + 0.01)
    assert peer_gate_s(peers) == pytest.approx(0.4)
    both = ReplicaState("r0", pending=1, queued_prefill_s=0.5, peer_pending=1, peer_wait_s=0.2)
    assert step_gate_s(4000, both, CONFIG) == pytest.approx(1.5 * 0.7 + 0.01)
    decoding = ReplicaState("r0", peer_pending=0, peer_decoding=3, peer_wait_s=0.4)
    assert step_gate_s(4000, decoding, CONFIG) == 0.0 and peer_gate_s(decoding) == 0.0
    # The learned bias scales the queue and the base alike.
    slow = ReplicaState("r0", pending=1, queued_prefill_s=1.0, bias=2.0)
    assert step_gate_s(4000, slow, CONFIG) == pytest.approx(1.5 * 1.0 + 0.02)


def _replica() -> Replica:
    source = ReplicaSource(name="r0", url="http://127.0.0.1:9000", models=("m",),
                           hash_config=BLOCK)
    return Replica(target=source.target(), healthy=True)


async def _route(pipeline: RoutingPipeline, replica: Replica, tokens: int) -> Route:
    raw = json.dumps({"model": "m", "prompt": list(range(1, tokens + 1)), "max_tokens": 1,
                      "stream": True}).encode()
    parsed = parse_request(raw, "completions", served_models=(), limits=LimitsConfig(),
                           tenant=REGISTRY.identify(None), registry=REGISTRY)
    return await pipeline.route(parsed, [replica], time.monotonic(), None, None,
                                offload=False, reserve=True)


def _pipeline(config: PolicyConfig) -> RoutingPipeline:
    return RoutingPipeline(tokenizers={}, chains=ChainCache(), index=MemoryIndex(),
                           policy=build_policy(config), index_deadline_s=1.0)


async def test_a_long_prompt_goes_once_the_short_one_ahead_has_its_first_token() -> None:
    pipeline, replica = _pipeline(CONFIG), _replica()
    short = await _route(pipeline, replica, 300)  # nothing ahead: it goes at once
    assert short.gate_s == 0.0 and await pipeline.gate(short) == 0.0
    long = await _route(pipeline, replica, 4000)
    assert long.gate_s > 0.0
    listeners = len(replica.work.listeners)
    task = asyncio.create_task(pipeline.gate(long))
    await until(lambda: len(replica.work.listeners) == listeners + 1)  # waiting
    assert not task.done()
    replica.work.first_byte(short.reserved["r0"], time.monotonic())
    waited = await asyncio.wait_for(task, 5.0)
    assert 0.0 < waited < long.gate_s
    assert len(replica.work.listeners) == listeners  # nothing left behind
    # Its own entry stays where the decision put it: pending, queued behind nothing now.
    assert replica.work.ahead(long.reserved["r0"], time.monotonic()) == 0
    assert replica.work.view(time.monotonic()).pending == 1


async def test_off_when_set_so_and_never_longer_than_its_bound() -> None:
    assert PolicyConfig().step_gate  # on by default
    pipeline, replica = _pipeline(PolicyConfig(name="cache_aware", seed=1, prefill=PROFILE,
                                               step_gate=False,
                                               prefill_chunk_tokens=2048)), _replica()
    await _route(pipeline, replica, 300)
    plain = await _route(pipeline, replica, 4000)
    assert plain.gate_s == 0.0 and await pipeline.gate(plain) == 0.0
    # The request ahead never answers (a prediction far too short): the request goes at
    # its bound, the queue's 80 ms (800 tokens at 0.1 ms) and half again plus a base.
    fast = PrefillProfile(base_s=0.01, per_token_s=1e-4, per_token_context_s=0.0)
    pipeline, replica = _pipeline(PolicyConfig(name="cache_aware", seed=1, prefill=fast,
                                               step_gate=True, prefill_chunk_tokens=2048)), \
        _replica()
    ahead = await _route(pipeline, replica, 800)
    long = await _route(pipeline, replica, 4000)
    assert long.gate_s == pytest.approx(1.5 * 0.08 + 0.01, abs=0.005)  # drained a little
    waited = await asyncio.wait_for(pipeline.gate(long), 5.0)
    assert long.gate_s * 0.9 <= waited < long.gate_s + 1.0
    assert replica.work.ahead(long.reserved["r0"], time.monotonic()) == 1
    assert ahead.reserved  # still its own


async def test_a_cancelled_wait_leaves_no_listener() -> None:
    pipeline, replica = _pipeline(CONFIG), _replica()
    await _route(pipeline, replica, 300)
    long = await _route(pipeline, replica, 4000)
    listeners = len(replica.work.listeners)
    task = asyncio.create_task(pipeline.gate(long))
    await until(lambda: len(replica.work.listeners) == listeners + 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(replica.work.listeners) == listeners
