"""Sentinel failover of the index's Redis under load, with AUTH on every node.

issue #16: a primary and its replica (both --requirepass), one sentinel; a gateway and an
indexer process reach the primary through `redis+sentinel://` with the password from
password_env. The primary is killed with SIGKILL under closed-loop load. Required: no
request lost (lookups fail fast and route on load alone while the index is away), and
once the sentinel promoted the replica the index is rebuilt from the replicas' replay
buffers (the indexer resyncs after an index failure) and predicts hits again.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator

import aiohttp
import pytest
import redis.asyncio as aioredis
from servers import free_port

from replica.fleet import AsyncSimFleet
from router.index import RedisIndex

from .conftest import (
    GatewayClient,
    ProcessGroup,
    chain_keys,
    gateway_config,
    tenant_salt,
    wait_until,
)
from .redis_topology import RedisTopology
from .test_faults import Tally, after, closed_loop
from .test_gateway import completion, output_ids, tokens

MODEL = "sim"
PASSWORD = "e2e-redis-password"
PASSWORD_ENV = "CACHEROUTE_TEST_REDIS_PASSWORD"


@pytest.fixture
def topology() -> Iterator[RedisTopology]:
    topo = RedisTopology()
    try:
        yield topo
    finally:
        topo.stop()


async def primary_port(sentinel_port: int) -> int | None:
    client = aioredis.Redis(host="127.0.0.1", port=sentinel_port, socket_timeout=1.0)
    try:
        addr = await client.execute_command("SENTINEL", "get-master-addr-by-name", "primary")
        return None if addr is None else int(addr[1])
    finally:
        await client.aclose()


@pytest.mark.parametrize("leased", [False, True], ids=["indexer", "leased-indexer"])
async def test_sentinel_failover_under_load_loses_no_request(
        topology: RedisTopology, processes: ProcessGroup, http: aiohttp.ClientSession,
        monkeypatch: pytest.MonkeyPatch, leased: bool) -> None:
    # Starting a process waits for its port: off the event loop.
    primary = await asyncio.to_thread(topology.server, "primary", password=PASSWORD)
    replica = await asyncio.to_thread(topology.server, "replica", password=PASSWORD,
                                      replica_of=primary)
    sentinel = await asyncio.to_thread(topology.sentinel, "sentinel", primary,
                                       password=PASSWORD)
    url = f"redis+sentinel://127.0.0.1:{sentinel}/primary"
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)  # the gateway and indexer processes inherit it
    async with AsyncSimFleet(3, block_size=16, num_blocks=4000) as fleet:
        raw = gateway_config(fleet.replicas, model=MODEL, port=free_port(), index=url)
        raw["index"]["password_env"] = PASSWORD_ENV
        # Leased: the lease and positions live in Redis too, and fail over with it; the
        # holder steps down when it cannot renew, and leads again on the new primary.
        lease = ["--lease", "--lease-ttl", "1"] if leased else []
        processes.spawn(["indexer", "--config", str(processes.write_config(raw, "indexer")),
                         "--stats-interval", "5", *lease], "indexer")
        gw = GatewayClient(await processes.start_gateway(raw, "gateway"), http)
        index = RedisIndex.from_url(url, password=PASSWORD)
        salt = tenant_salt("alpha")

        async def indexed(replica: str, keys: list[int]) -> bool:
            try:
                return (await index.lookup(MODEL, keys)).get(replica, 0) >= len(keys)
            except Exception:
                return False  # the index is away: not yet

        async def turn(history: list[int]) -> tuple[list[int], bool]:
            reply = await gw.post("/v1/completions", completion(history))
            assert reply.status == 200, reply.body
            held = chain_keys([*history, *output_ids(reply)][:-1], salt)
            try:
                await wait_until(lambda: indexed(reply.replica, held), 15.0, "the turn indexed")
            except TimeoutError:
                # Which stream stayed silent, and why: the indexer's per-replica stats and
                # its lease, in logs that go with the test's temporary directory.
                print(f"turn on {reply.replica} not indexed:\n{processes.logs()}",
                      file=sys.stderr)
                raise
            return ([*history, *output_ids(reply), *tokens(len(history), 24)],
                    reply.predicted == reply.cached)

        try:
            histories = {c: tokens(900 + c, 300) for c in range(3)}
            before = [matched for c in histories
                      for histories[c], matched in [await turn(histories[c])]]
            tally = Tally()
            stop = asyncio.Event()
            load = asyncio.ensure_future(closed_loop(http, gw.url, tally, workers=4,
                                                     stop=stop, limit=100_000))
            try:
                await after(30, tally)
                await asyncio.to_thread(topology.kill, "primary")
                killed_at = time.monotonic()

                async def promoted() -> bool:
                    return await primary_port(sentinel) == replica

                await wait_until(promoted, 30.0, "the sentinel to promote the replica")
                promoted_s = time.monotonic() - killed_at
                fresh = tokens(777, 400)
                reply = await gw.post("/v1/completions", completion(fresh))
                assert reply.status == 200, reply.body
                keys = chain_keys([*fresh, *output_ids(reply)][:-1], salt)
                await wait_until(lambda: indexed(reply.replica, keys), 20.0,
                                 "the index to be current on the new primary")
                current_s = time.monotonic() - killed_at
                after_turns = [matched for c in histories
                               for histories[c], matched in [await turn(histories[c])]]
                await after(tally.sent + 20, tally)
            finally:
                stop.set()
                await load
            tally.check()
            print(f"\nsentinel failover under load ({'leased ' if leased else ''}indexer): promoted {promoted_s:.2f}s after the kill, "
                  f"index current {current_s:.2f}s after; {tally.summary()}; turns predicted = "
                  f"cached before {sum(before)}/{len(before)}, after "
                  f"{sum(after_turns)}/{len(after_turns)}")
            assert tally.failed == 0 and tally.ok == tally.sent, tally.summary()
            assert all(after_turns), after_turns
        finally:
            await index.close()
