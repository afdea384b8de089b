"""A rolling restart of every replica under closed-loop load loses no request.

Each sim is stopped with SIGTERM (it stops accepting, finishes what it is serving, then
exits) and started again on the same ports with an empty cache, one after the other,
while clients keep sending. A request that reaches a replica going away fails before its
first byte (connection refused, or a pooled connection closed under it) and is retried
on another replica; after a few such failures the replica is ejected until it is back.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from servers import free_port

from replica.fleet import AsyncSimFleet

from .conftest import GatewayClient, gateway_config
from .test_faults import (
    Tally,
    after,
    assert_failures_accounted,
    closed_loop,
    gateway_counters,
    labelled,
    rid,
    wait_replica_state,
)

MODEL = "sim"


async def test_rolling_restart_under_load_fails_no_request(
        start_gateway: Any, http: aiohttp.ClientSession) -> None:
    async with AsyncSimFleet(3, block_size=16, prefill_profile="unit", time_scale=5.0) as fleet:
        gw: GatewayClient = await start_gateway(gateway_config(
            fleet.replicas, model=MODEL, port=free_port(),
            health={"interval_s": 0.25, "eject_base_s": 0.5, "eject_max_s": 1.0}))
        tally = Tally()
        stop = asyncio.Event()
        load = asyncio.ensure_future(closed_loop(http, gw.url, tally, workers=6, stop=stop,
                                                 limit=100_000))
        restarts = []
        try:
            await after(20, tally)
            for i in range(len(fleet.replicas)):
                before = tally.sent
                await fleet.restart(i)
                # Back in rotation (healthy again) before the next one goes.
                await wait_replica_state(gw, rid(fleet.urls[i]), "healthy", 15.0)
                await after(tally.sent + 10, tally)
                restarts.append(tally.sent - before)
        finally:
            stop.set()
            await load
        tally.check()
        counters = await gateway_counters(gw)
        reasons = {reason: await labelled(gw, "cacheroute_upstream_failures_total", reason=reason)
                   for reason in ("connect", "reset", "status_5xx", "first_token_timeout")}
        print(f"\nrolling restart of 3 replicas: {tally.summary()}; requests during each "
              f"restart {restarts}; by replica {dict(tally.replicas)}; gateway retries "
              f"{counters['cacheroute_retries_total']:.0f}, upstream failures "
              f"{counters['cacheroute_upstream_failures_total']:.0f}, ejections "
              f"{counters['cacheroute_ejections_total']:.0f}; failures by reason "
              f"{ {k: int(v) for k, v in reasons.items() if v} }")
        assert tally.failed == 0, tally.summary()
        assert tally.ok == tally.sent
        assert_failures_accounted(counters, tally)
        # Every restarted replica serves again (it is really back in rotation).
        assert len(tally.replicas) == 3
