"""MirroredIndex: lookups from this gateway's own mirror of the KV events, Redis for the
rest (router/index/mirror.py). Real Redis throughout; a stopped one where Redis is down."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from servers import RedisServer, free_port

from router.index import IndexUnavailable, MemoryIndex, MirroredIndex, RedisIndex

MODEL = "tiny"


@pytest.fixture
async def redis_index(redis_server: RedisServer) -> AsyncIterator[RedisIndex]:
    index = RedisIndex.from_url(redis_server.url)
    yield index
    await index.close()


async def test_event_fed_replicas_are_answered_from_the_mirror_alone(
        redis_index: RedisIndex) -> None:
    local = MemoryIndex()
    mirror = MirroredIndex(redis_index, local)
    await local.add(MODEL, "r1", [1, 2, 3])
    # What the separate indexer wrote to Redis does not count for an event-fed replica:
    # this gateway's own events say what it holds.
    await redis_index.add(MODEL, "r2", [1, 2, 3, 4])
    assert mirror.in_process
    assert await mirror.lookup(MODEL, [1, 2, 3, 4]) == {"r1": 3}


async def test_a_replica_without_events_is_answered_from_what_gateways_recorded(
        redis_index: RedisIndex) -> None:
    local = MemoryIndex()
    mirror = MirroredIndex(redis_index, local)
    mirror.answer_from_shared("rec", True)
    assert not mirror.in_process
    await local.add(MODEL, "ev", [1, 2])
    # Another gateway's record is in Redis: this one's mirror never saw it.
    other = MirroredIndex(redis_index, MemoryIndex())
    await other.record(MODEL, "rec", [1, 2, 3], ttl_s=60)
    assert await mirror.lookup(MODEL, [1, 2, 3]) == {"ev": 2, "rec": 3}
    # A stale local entry for a recorded replica is not believed either.
    await local.add(MODEL, "rec", [1, 2, 3])
    await redis_index.clear_replica("rec")
    assert await mirror.lookup(MODEL, [1, 2, 3]) == {"ev": 2}
    mirror.answer_from_shared("rec", False)
    assert mirror.in_process


async def test_lookups_go_on_while_redis_is_down_and_writes_say_it_is() -> None:
    # No server on this port: the shared index is down for real.
    down = RedisIndex.from_url(f"redis://127.0.0.1:{free_port()}/0", lookup_timeout_s=0.5,
                               op_timeout_s=0.5)
    local = MemoryIndex()
    mirror = MirroredIndex(down, local)
    try:
        await local.add(MODEL, "r1", [5, 6])
        assert await mirror.lookup(MODEL, [5, 6, 7]) == {"r1": 2}
        with pytest.raises(IndexUnavailable):
            await mirror.record(MODEL, "r1", [5, 6], ttl_s=60)
        mirror.answer_from_shared("rec", True)
        with pytest.raises(IndexUnavailable):
            await mirror.lookup(MODEL, [5, 6, 7])
    finally:
        await mirror.close()


async def test_probes_are_read_from_the_mirror_first_then_redis(redis_index: RedisIndex) -> None:
    local = MemoryIndex()
    mirror = MirroredIndex(redis_index, local)
    await local.put_probe("salt-local", "r1", 32, [11], list(range(32)), ttl_s=60)
    await redis_index.put_probe("salt-shared", "r2", 32, [12], list(range(32)), ttl_s=60)
    seen_local = await mirror.get_probe("salt-local")
    seen_shared = await mirror.get_probe("salt-shared")
    assert seen_local is not None and seen_local.keys == (11,)
    assert seen_shared is not None and seen_shared.keys == (12,)
    assert await mirror.get_probe("salt-none") is None
