"""MirroredIndex: lookups from this gateway's own mirror of the KV events, Redis for the
rest; MirrorFeed: a starting stream seeds the mirror from Redis (router/index/mirror.py).
Real Redis throughout; a port with no server where Redis is down."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from servers import RedisServer, free_port

from router.index import (
    IndexerLease,
    IndexOp,
    IndexUnavailable,
    LeaseSettings,
    MemoryIndex,
    MirroredIndex,
    MirrorFeed,
    RedisIndex,
    StreamPosition,
)

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


# --- a starting stream seeds the mirror from Redis -------------------------------------


async def leased_index(redis_server: RedisServer) -> RedisIndex:
    """A RedisIndex writing as the leased indexer does: fenced, so it stores positions."""
    plain = RedisIndex.from_url(redis_server.url)
    try:
        token = await IndexerLease(plain.client, LeaseSettings("test", ttl_s=30)).acquire()
    finally:
        await plain.close()
    assert token is not None
    return RedisIndex.from_url(redis_server.url, fence_token=token)


async def test_a_starting_stream_resumes_after_the_indexers_position_with_its_blocks(
        redis_server: RedisServer, redis_index: RedisIndex) -> None:
    indexer = await leased_index(redis_server)
    try:
        await indexer.apply("r1", [IndexOp("add", MODEL, (1, 2, 3)),
                                   IndexOp("add", "tiny@lora", (7, 8))],
                            position=StreamPosition(41, 5.0))
        await indexer.apply("r1", [IndexOp("add", MODEL, (4,), parent=3)],
                            position=StreamPosition(42, 6.0))
    finally:
        await indexer.close()
    snapshot = await redis_index.snapshot("r1")
    assert snapshot is not None and snapshot.position == StreamPosition(42, 6.0)
    # Least recently touched first: the second batch's block last, each chain tail first.
    assert snapshot.held == {MODEL: (3, 2, 1, 4), "tiny@lora": (8, 7)}
    assert snapshot.holed == frozenset()

    local = MemoryIndex()
    feed = MirrorFeed(local, redis_index)
    assert await feed.stream_position("r1") == StreamPosition(42, 6.0)
    assert await local.lookup(MODEL, [1, 2, 3, 4, 5]) == {"r1": 4}
    assert await local.lookup("tiny@lora", [7, 8]) == {"r1": 2}
    # The stream goes on from there: a block whose parent came from the snapshot.
    await feed.apply("r1", [IndexOp("add", MODEL, (5,), parent=4)])
    assert await local.lookup(MODEL, [1, 2, 3, 4, 5]) == {"r1": 5}
    assert local.holes(MODEL, "r1") == 0
    # Evicted leaf first, as vLLM does: the run shortens, nothing is left dangling.
    await feed.apply("r1", [IndexOp("remove", MODEL, (5, 4))])
    assert await local.lookup(MODEL, [1, 2, 3, 4, 5]) == {"r1": 3}


async def test_a_snapshot_with_the_hole_flag_is_verified_block_by_block(
        redis_server: RedisServer, redis_index: RedisIndex) -> None:
    indexer = await leased_index(redis_server)
    try:
        await indexer.apply("r1", [IndexOp("add", MODEL, (1, 2, 3, 4, 5))],
                            position=StreamPosition(1, 1.0))
        await indexer.apply("r1", [IndexOp("remove", MODEL, (3,))],  # a hole: flag up
                            position=StreamPosition(2, 1.0))
    finally:
        await indexer.close()
    local = MemoryIndex()
    assert await MirrorFeed(local, redis_index).stream_position("r1") == StreamPosition(2, 1.0)
    # 1, 2, 4, 5 held: a bisection trusting prefix closure could claim 5 blocks.
    assert await local.lookup(MODEL, [1, 2, 3, 4, 5]) == {"r1": 2}


async def test_without_a_stored_position_a_stream_starts_over(
        redis_server: RedisServer, redis_index: RedisIndex) -> None:
    # An indexer without a lease stores no position: nothing says what the entries cover.
    await redis_index.apply("r1", [IndexOp("add", MODEL, (1, 2))],
                            position=StreamPosition(3, 1.0))
    assert await redis_index.snapshot("r1") is None
    local = MemoryIndex()
    assert await MirrorFeed(local, redis_index).stream_position("r1") is None
    assert await local.lookup(MODEL, [1, 2]) == {}
    # Recorded entries expire: never seeded, a mirror would keep them for good.
    indexer = await leased_index(redis_server)
    try:
        await indexer.record(MODEL, "r2", [1, 2], ttl_s=60)
        await indexer.apply("r2", [], position=StreamPosition(1, 1.0))
    finally:
        await indexer.close()
    assert await redis_index.snapshot("r2") is None
