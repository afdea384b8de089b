"""The indexer lease, fenced writes and stored stream positions, on a real redis-server.

issue #16: a second indexer takes over when the active one is lost; the deposed one
must not write after that, and the successor resumes after the last batch applied.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from servers import RedisServer
from test_event_sequence import Replica, described, stored, tracking
from test_index import eventually

from router.events import lead_while_holding
from router.index import (
    IndexerLease,
    IndexFenced,
    IndexOp,
    LeaseSettings,
    RedisIndex,
    StreamPosition,
)
from router.index.lease import lease_keys

MODEL = "m"


@pytest.fixture
async def redis_url(redis_server: RedisServer) -> AsyncIterator[str]:
    yield redis_server.url


async def test_one_holder_at_a_time_and_each_grant_a_newer_token(redis_url: str) -> None:
    client = RedisIndex.from_url(redis_url)
    a = IndexerLease(client.client, LeaseSettings("a", ttl_s=30))
    b = IndexerLease(client.client, LeaseSettings("b", ttl_s=30))
    try:
        first = await a.acquire()
        assert first is not None
        assert await b.acquire() is None
        assert await a.renew(first)
        assert not await b.renew(first)  # the token alone is not enough: the holder too
        await b.release(first)  # not b's to release
        assert await b.acquire() is None
        await a.release(first)
        second = await b.acquire()
        assert second is not None and second > first
        assert not await a.renew(first)
    finally:
        await client.close()


async def test_a_grant_after_the_counter_was_lost_is_still_newer(redis_url: str) -> None:
    # A replica promoted before its first sync holds neither the lease nor the counter
    # (seen in tests/e2e/test_redis_failover.py): the next grant must not repeat the
    # deposed holder's token, or that holder's writes would pass the fence.
    client = RedisIndex.from_url(redis_url)
    a = IndexerLease(client.client, LeaseSettings("a", ttl_s=30))
    b = IndexerLease(client.client, LeaseSettings("b", ttl_s=30))
    first = await a.acquire()
    assert first is not None
    deposed = RedisIndex.from_url(redis_url, fence_token=first)
    try:
        await client.client.delete(*lease_keys("cr"))  # what the failover lost
        second = await b.acquire()
        assert second is not None and second > first
        with pytest.raises(IndexFenced):
            await deposed.add(MODEL, "r1", [1])
        assert await client.lookup(MODEL, [1]) == {}
    finally:
        await deposed.close()
        await client.close()


async def test_an_unrenewed_lease_expires_and_a_standby_gets_it(redis_url: str) -> None:
    client = RedisIndex.from_url(redis_url)
    a = IndexerLease(client.client, LeaseSettings("a", ttl_s=0.2))
    b = IndexerLease(client.client, LeaseSettings("b", ttl_s=0.2))
    try:
        assert await a.acquire() is not None
        got: list[int] = []

        async def b_took_over() -> bool:
            token = await b.acquire()
            if token is not None:
                got.append(token)
            return bool(got)

        await eventually(b_took_over, 3.0)
    finally:
        await client.close()


async def test_a_deposed_indexer_cannot_write(redis_url: str) -> None:
    plain = RedisIndex.from_url(redis_url)
    a = IndexerLease(plain.client, LeaseSettings("a", ttl_s=30))
    b = IndexerLease(plain.client, LeaseSettings("b", ttl_s=30))
    token_a = await a.acquire()
    assert token_a is not None
    old = RedisIndex.from_url(redis_url, fence_token=token_a)
    try:
        await old.apply("r1", [IndexOp("add", MODEL, (1, 2))], position=StreamPosition(0, 1.5))
        await a.release(token_a)
        token_b = await b.acquire()
        assert token_b is not None
        new = RedisIndex.from_url(redis_url, fence_token=token_b)
        try:
            for write in (old.add(MODEL, "r1", [3]), old.remove(MODEL, "r1", [1]),
                          old.clear_replica("r1"),
                          old.apply("r1", [IndexOp("add", MODEL, (1, 2, 3))],
                                    position=StreamPosition(1, 2.5))):
                with pytest.raises(IndexFenced):
                    await write
            assert await plain.lookup(MODEL, [1, 2, 3]) == {"r1": 2}
            assert await new.stream_position("r1") == StreamPosition(0, 1.5)
            await new.apply("r1", [IndexOp("add", MODEL, (3,), parent=2)],
                            position=StreamPosition(1, 2.5))
            assert await plain.lookup(MODEL, [1, 2, 3]) == {"r1": 3}
            assert await new.stream_position("r1") == StreamPosition(1, 2.5)
        finally:
            await new.close()
    finally:
        await old.close()
        await plain.close()


async def test_positions_are_kept_only_by_a_fenced_index_and_go_with_a_clear(
        redis_url: str) -> None:
    plain = RedisIndex.from_url(redis_url)
    lease = IndexerLease(plain.client, LeaseSettings("a", ttl_s=30))
    token = await lease.acquire()
    assert token is not None
    fenced = RedisIndex.from_url(redis_url, fence_token=token)
    try:
        await plain.apply("r1", [IndexOp("add", MODEL, (1,))], position=StreamPosition(4, 1.0))
        assert await fenced.stream_position("r1") is None
        assert await plain.stream_position("r1") is None
        # A batch with nothing to write still moves the position.
        await fenced.apply("r1", [], position=StreamPosition(5, 2.0))
        assert await fenced.stream_position("r1") == StreamPosition(5, 2.0)
        await fenced.apply("r1", [IndexOp("clear")], position=StreamPosition(6, 3.0))
        assert await fenced.stream_position("r1") == StreamPosition(6, 3.0)
        await fenced.clear_replica("r1")
        assert await fenced.stream_position("r1") is None
        assert await plain.lookup(MODEL, [1]) == {}
    finally:
        await fenced.close()
        await plain.close()


def test_a_resumed_tracker_replays_only_what_its_predecessor_did_not_apply() -> None:
    replica = Replica()
    batches, clocks = [], []
    for i in range(6):
        batches.append(replica.publish(stored(100 + i)))
        clocks.append(replica.clock)
    tracker, stats = tracking()
    # The predecessor applied up to seq 3; seq 4 was published while nobody listened.
    tracker.resume(3, clocks[3])
    seq, payload = batches[5]
    plan = tracker.receive(seq, payload)
    assert described(plan) == ["replay from 3"]
    plan = tracker.replayed(replica.replay(3))
    assert described(plan) == [4, 5]
    assert stats.replays == 1 and stats.restarts == 0


def test_a_resumed_tracker_starts_over_if_the_replica_restarted_meanwhile() -> None:
    replica = Replica()
    for i in range(4):
        replica.publish(stored(100 + i))
    tracker, stats = tracking()
    tracker.resume(3, replica.clock)
    replica.restart()
    batches = [replica.publish(stored(200 + i)) for i in range(5)]
    plan = tracker.receive(*batches[4])
    # The replica's seq 3 now is another batch: clear, rebuild from its seq 0.
    assert described(plan)[:1] == ["replay from 3"]
    plan = tracker.replayed(replica.replay(3))
    assert described(plan) == ["restart", "replay from 0"]
    plan = tracker.replayed(replica.replay(0))
    assert described(plan) == [0, 1, 2, 3, 4]
    assert stats.restarts == 1


async def test_leadership_moves_to_the_standby_when_the_lease_is_taken(redis_url: str) -> None:
    client = RedisIndex.from_url(redis_url)
    leases = {name: IndexerLease(client.client, LeaseSettings(name, ttl_s=0.4))
              for name in ("a", "b")}
    leading: dict[str, int] = {}
    stopped: list[str] = []
    stops = {name: asyncio.Event() for name in leases}

    def leader(name: str):  # type: ignore[no-untyped-def]
        async def lead(token: int) -> None:
            leading[name] = token
            try:
                await asyncio.Event().wait()  # leads until cancelled
            finally:
                stopped.append(name)
                leading.pop(name, None)
        return lead

    loops = {name: asyncio.create_task(lead_while_holding(lease, leader(name), stops[name]))
             for name, lease in leases.items()}
    try:
        async def one_leads() -> bool:
            return len(leading) == 1

        await eventually(one_leads, 5.0)
        first = next(iter(leading))
        other = "b" if first == "a" else "a"
        # Depose the leader as a stall past its TTL would: its lease goes, the other takes it.
        await client.client.delete(b"cr:lease")

        async def other_leads() -> bool:
            return list(leading) == [other]

        await eventually(other_leads, 5.0)
        assert stopped == [first]
        for event in stops.values():
            event.set()
        await asyncio.gather(*loops.values())
        assert stopped == [first, other]
        # A clean stop releases the lease: a standby need not wait out its TTL.
        assert await client.client.get(b"cr:lease") is None
    finally:
        for event in stops.values():
            event.set()
        await asyncio.gather(*loops.values())
        await client.close()
