"""The KV-event subscriber against a real ZMQ publisher on loopback and both index backends."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio
from servers import RedisServer

from router.events import EventIndexer, ReplicaEventStream, ReplicaFeed
from router.handshake import ObservedBlocks, compare, make_probe
from router.hashing import BlockChain, HashConfig, LoraRef
from router.index import MemoryIndex, PrefixIndex, RedisIndex
from router.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    encode_batch,
    seq_bytes,
)

MODEL = "tiny"
DEADLINE_S = 10.0


async def eventually(check: Callable[[], Awaitable[bool] | bool], deadline_s: float = DEADLINE_S
                     ) -> None:
    """Poll a condition until it holds, failing after the deadline."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        await asyncio.sleep(0.01)  # polling interval, not synchronisation
    raise AssertionError(f"condition not met within {deadline_s}s")


def stored(keys: Sequence[int], parent: int | None = None, *, tokens: Sequence[int] = (),
           block_size: int = 4, lora: str | None = None,
           extra_keys: list[list[Any] | None] | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=list(keys), parent_block_hash=parent,
        token_ids=list(tokens) or [0] * (block_size * len(keys)), block_size=block_size,
        lora_id=1 if lora else None, medium="GPU", lora_name=lora, extra_keys=extra_keys,
    )


def removed(keys: Sequence[int]) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(keys), medium="GPU")


class KvPublisher:
    """A replica's KV-event side, as vLLM's ZmqEventPublisher behaves: PUB + ROUTER replay.

    XPUB instead of PUB (same wire protocol to a SUB) so a test can wait until the
    subscriber has joined instead of losing its first messages to the slow-joiner race.
    """

    def __init__(self, ctx: zmq.asyncio.Context, topic: bytes = b"") -> None:
        self.ctx = ctx
        self.topic = topic
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        rport = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self.buffer: list[tuple[int, bytes]] = []
        self.next_seq = 0
        self.replay_floor = 0  # batches below this were dropped from the replay buffer
        self.answer_replays = True
        self.replay_requests: list[int] = []
        self._replay_task = asyncio.create_task(self._serve_replay())

    async def wait_subscribed(self) -> None:
        async with asyncio.timeout(DEADLINE_S):
            msg = await self.pub.recv()
        assert msg[:1] == b"\x01", msg

    async def publish(self, *events: KVEvent, seq: int | None = None, ts: float | None = None,
                      payload: bytes | None = None, send: bool = True) -> int:
        """Publish one batch (send=False: keep it for replay only, as if PUB dropped it)."""
        seq = self.next_seq if seq is None else seq
        self.next_seq = seq + 1
        if payload is None:
            payload = encode_batch(EventBatch(ts=time.time() if ts is None else ts,
                                              events=list(events)))
        self.buffer.append((seq, payload))
        if send:
            await self.pub.send_multipart([self.topic, seq_bytes(seq), payload])
        return seq

    def restart(self) -> None:
        """A restarted replica: sequence numbers from 0, an empty replay buffer."""
        self.buffer.clear()
        self.next_seq = 0

    async def rebind(self) -> None:
        """Close the PUB socket and bind a new one on the same endpoint: the connection drops."""
        self.pub.close(linger=0)
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        end = time.monotonic() + DEADLINE_S
        while True:
            try:
                self.pub.bind(self.endpoint)  # ZMQ releases the old port asynchronously
                return
            except zmq.ZMQError:
                if time.monotonic() > end:
                    raise
                await asyncio.sleep(0.01)  # polling for the port, not synchronisation

    async def _serve_replay(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            if not self.answer_replays:
                continue
            for seq, payload in list(self.buffer):
                if seq >= start_seq and seq >= self.replay_floor:
                    await self.router.send_multipart(
                        [client, b"", self.topic, seq_bytes(seq), payload])
            await self.router.send_multipart([client, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        self._replay_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._replay_task
        self.pub.close(linger=0)
        self.router.close(linger=0)


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    try:
        yield ctx
    finally:
        ctx.term()


@pytest.fixture
async def publisher(zctx: zmq.asyncio.Context) -> AsyncIterator[KvPublisher]:
    pub = KvPublisher(zctx)
    try:
        yield pub
    finally:
        await pub.close()


@contextlib.asynccontextmanager
async def subscribed(
    pub: KvPublisher, index: PrefixIndex, ctx: zmq.asyncio.Context, *, replica: str = "r1",
    replay: bool = True, **kwargs: Any
) -> AsyncIterator[ReplicaEventStream]:
    stream = ReplicaEventStream(replica, pub.endpoint, pub.replay_endpoint if replay else None,
                                index, MODEL, context=ctx, **kwargs)
    stream.start()
    try:
        await pub.wait_subscribed()
        yield stream
    finally:
        await stream.stop()


async def applied_up_to(stream: ReplicaEventStream, seq: int) -> None:
    await eventually(lambda: stream.stats.last_seq is not None and stream.stats.last_seq >= seq)


async def test_stored_removed_and_cleared_follow_the_replica(
    publisher: KvPublisher, index: PrefixIndex, zctx: zmq.asyncio.Context
) -> None:
    async with subscribed(publisher, index, zctx) as stream:
        await publisher.publish(stored([1, 2, 3]))
        await publisher.publish(stored([4], parent=3))
        await applied_up_to(stream, 1)
        assert await index.lookup(MODEL, [1, 2, 3, 4]) == {"r1": 4}
        await publisher.publish(removed([4]), removed([3]))
        await applied_up_to(stream, 2)
        assert await index.lookup(MODEL, [1, 2, 3, 4]) == {"r1": 2}
        await publisher.publish(AllBlocksCleared(), stored([7]))
        await applied_up_to(stream, 3)
        assert await index.lookup(MODEL, [1, 2]) == {}
        assert await index.lookup(MODEL, [7]) == {"r1": 1}
        assert stream.stats.batches == 4
        assert stream.stats.events_applied == 6
        assert stream.stats.gaps == 0
        assert stream.stats.lag_s() is not None


async def test_lora_blocks_live_in_their_own_scope_and_are_removed_there(
    publisher: KvPublisher, index: PrefixIndex, zctx: zmq.asyncio.Context
) -> None:
    async with subscribed(publisher, index, zctx) as stream:
        await publisher.publish(stored([1, 2], lora="sql"), stored([5, 6]))
        await applied_up_to(stream, 0)
        assert await index.lookup(f"{MODEL}@sql", [1, 2]) == {"r1": 2}
        assert await index.lookup(MODEL, [1, 2]) == {}
        assert await index.lookup(MODEL, [5, 6]) == {"r1": 2}
        await publisher.publish(removed([2]), removed([6]))
        await applied_up_to(stream, 1)
        assert await index.lookup(f"{MODEL}@sql", [1, 2]) == {"r1": 1}
        assert await index.lookup(MODEL, [5, 6]) == {"r1": 1}


async def test_a_gap_is_filled_from_the_replay_socket(
    publisher: KvPublisher, index: PrefixIndex, zctx: zmq.asyncio.Context
) -> None:
    async with subscribed(publisher, index, zctx) as stream:
        await publisher.publish(stored([1]))
        await publisher.publish(stored([2], parent=1), send=False)  # lost by PUB
        await publisher.publish(stored([3], parent=2), send=False)
        await publisher.publish(stored([4], parent=3))
        await applied_up_to(stream, 3)
        assert await index.lookup(MODEL, [1, 2, 3, 4]) == {"r1": 4}
        assert publisher.replay_requests == [0]  # from the last batch seen, to check it
        assert (stream.stats.gaps, stream.stats.replays, stream.stats.replay_failures) == (1, 1, 0)
        assert stream.stats.restarts == 0


async def test_a_gap_without_replay_clears_the_replica(
    publisher: KvPublisher, index: PrefixIndex, zctx: zmq.asyncio.Context
) -> None:
    await index.add(MODEL, "r2", [1])
    async with subscribed(publisher, index, zctx, replay=False) as stream:
        await publisher.publish(stored([1, 2]))
        await publisher.publish(removed([2]), send=False)
        await publisher.publish(stored([9]))
        await applied_up_to(stream, 2)
        # What r1 held before the gap is unknown, so it is forgotten; new events count.
        assert await index.lookup(MODEL, [1, 2]) == {"r2": 1}
        assert await index.lookup(MODEL, [9]) == {"r1": 1}
        assert stream.stats.gaps == 1
        assert stream.stats.replays == 0


async def test_an_incomplete_replay_clears_the_replica(
    publisher: KvPublisher, index: PrefixIndex, zctx: zmq.asyncio.Context
) -> None:
    async with subscribed(publisher, index, zctx) as stream:
        await publisher.publish(stored([1, 2]))
        await publisher.publish(removed([2]), send=False)
        await publisher.publish(stored([5]), send=False)
        publisher.replay_floor = 2  # the replica's buffer rolled over: seq 1 is gone
        await publisher.publish(stored([9]))
        await applied_up_to(stream, 3)
        assert await index.lookup(MODEL, [1, 2]) == {}
        assert await index.lookup(MODEL, [5]) == {}
        assert await index.lookup(MODEL, [9]) == {"r1": 1}
        assert (stream.stats.replays, stream.stats.replay_failures) == (0, 1)


async def test_a_silent_replay_socket_times_out_and_clears(
    publisher: KvPublisher, index: PrefixIndex, zctx: zmq.asyncio.Context
) -> None:
    async with subscribed(publisher, index, zctx, replay_timeout_s=0.3) as stream:
        await publisher.publish(stored([1, 2]))
        await applied_up_to(stream, 0)
        publisher.answer_replays = False
        await publisher.publish(removed([2]), send=False)
        started = time.monotonic()
        await publisher.publish(stored([9]))
        await applied_up_to(stream, 2)
        assert time.monotonic() - started < 2.0
        assert await index.lookup(MODEL, [1, 2]) == {}
        assert await index.lookup(MODEL, [9]) == {"r1": 1}
        assert stream.stats.replay_failures == 1


async def test_sequence_back_to_zero_means_restart_and_clears(
    publisher: KvPublisher, index: PrefixIndex, zctx: zmq.asyncio.Context
) -> None:
    async with subscribed(publisher, index, zctx) as stream:
        await publisher.publish(stored([1, 2]))
        await publisher.publish(stored([3], parent=2))
        await applied_up_to(stream, 1)
        publisher.restart()
        await publisher.publish(stored([7]))  # seq 0 again
        await eventually(lambda: stream.stats.restarts == 1)
        await eventually(lambda: stream.stats.batches == 3)
        assert await index.lookup(MODEL, [1, 2, 3]) == {}
        assert await index.lookup(MODEL, [7]) == {"r1": 1}
        await publisher.publish(stored([8], parent=7))  # seq 1 of the new run: no gap
        await eventually(lambda: stream.stats.batches == 4)
        assert await index.lookup(MODEL, [7, 8]) == {"r1": 2}
        assert stream.stats.gaps == 0


async def test_a_restart_hidden_in_a_gap_is_found_through_the_replay(
    publisher: KvPublisher, index: PrefixIndex, zctx: zmq.asyncio.Context
) -> None:
    async with subscribed(publisher, index, zctx) as stream:
        await publisher.publish(stored([1, 2]))
        await publisher.publish(stored([3], parent=2))
        await applied_up_to(stream, 1)
        publisher.restart()  # the replica restarts, and its first batches are lost to us
        await publisher.publish(stored([7]), send=False)
        await publisher.publish(stored([8], parent=7), send=False)
        await publisher.publish(stored([9], parent=8), send=False)
        await publisher.publish(stored([10], parent=9))  # seq 3: looks like a plain gap
        await applied_up_to(stream, 3)
        assert publisher.replay_requests == [1, 0]  # seq 1 is not ours: all from 0
        assert stream.stats.restarts == 1
        assert await index.lookup(MODEL, [1, 2, 3]) == {}
        assert await index.lookup(MODEL, [7, 8, 9, 10]) == {"r1": 4}


async def test_a_restart_whose_seq_happens_to_follow_ours_is_found_after_the_reconnect(
    publisher: KvPublisher, index: PrefixIndex, zctx: zmq.asyncio.Context
) -> None:
    async with subscribed(publisher, index, zctx) as stream:
        await publisher.publish(stored([1, 2]))
        await publisher.publish(stored([3], parent=2))
        await applied_up_to(stream, 1)
        publisher.restart()
        await publisher.rebind()
        await eventually(lambda: stream.stats.disconnects == 1)
        await publisher.wait_subscribed()
        # The restarted replica's seq 0 and 1 went out before we reconnected; its seq 2
        # is exactly what we expect next.
        await publisher.publish(stored([7]), send=False)
        await publisher.publish(stored([8], parent=7), send=False)
        await publisher.publish(stored([9], parent=8))
        await applied_up_to(stream, 2)
        assert stream.stats.restarts == 1
        assert stream.stats.gaps == 0
        assert await index.lookup(MODEL, [1, 2, 3]) == {}
        assert await index.lookup(MODEL, [7, 8, 9]) == {"r1": 3}


async def test_a_reconnect_to_the_same_run_keeps_the_entries(
    publisher: KvPublisher, index: PrefixIndex, zctx: zmq.asyncio.Context
) -> None:
    async with subscribed(publisher, index, zctx) as stream:
        await publisher.publish(stored([1, 2]))
        await applied_up_to(stream, 0)
        await publisher.rebind()  # a network blip: same replica, same sequence
        await eventually(lambda: stream.stats.disconnects == 1)
        await publisher.wait_subscribed()
        await publisher.publish(stored([3], parent=2))
        await applied_up_to(stream, 1)
        assert publisher.replay_requests == [0]  # the continuity check
        assert (stream.stats.restarts, stream.stats.replays) == (0, 1)
        assert await index.lookup(MODEL, [1, 2, 3]) == {"r1": 3}


async def test_duplicates_are_ignored(
    publisher: KvPublisher, index: PrefixIndex, zctx: zmq.asyncio.Context
) -> None:
    async with subscribed(publisher, index, zctx) as stream:
        ts = time.time()
        await publisher.publish(stored([1]), ts=ts)
        await publisher.publish(removed([1]), ts=ts + 1)
        await publisher.publish(stored([1]), seq=0, ts=ts)  # re-sent old batches
        await publisher.publish(removed([1]), seq=1, ts=ts + 1)
        await publisher.publish(stored([5]), seq=2, ts=ts + 2)
        await publisher.publish(stored([1]), seq=0, ts=ts)
        await publisher.publish(stored([6], parent=5), seq=3, ts=ts + 3)
        await applied_up_to(stream, 3)
        assert await index.lookup(MODEL, [1]) == {}
        assert await index.lookup(MODEL, [5, 6]) == {"r1": 2}
        assert (stream.stats.duplicates, stream.stats.restarts) == (3, 0)


async def test_a_garbage_payload_is_counted_and_skipped(
    publisher: KvPublisher, index: PrefixIndex, zctx: zmq.asyncio.Context
) -> None:
    async with subscribed(publisher, index, zctx) as stream:
        await publisher.publish(stored([1]))
        await publisher.publish(payload=b"\x93not msgpack at all")
        await publisher.pub.send_multipart([b"", b"short"])  # malformed seq frame
        await publisher.publish(stored([2], parent=1))
        await applied_up_to(stream, 2)
        assert await index.lookup(MODEL, [1, 2]) == {"r1": 2}
        assert stream.stats.decode_errors == 2
        assert stream.stats.gaps == 0
        assert stream.stats.batches == 2


async def test_a_store_lost_to_a_bad_payload_leaves_a_hole_the_lookup_sees(
    publisher: KvPublisher, index: PrefixIndex, zctx: zmq.asyncio.Context
) -> None:
    chain = list(range(1, 41))
    async with subscribed(publisher, index, zctx) as stream:
        await publisher.publish(stored(chain[:10]))
        # The batch storing blocks 10..19 arrives unreadable: its seq counts, its blocks
        # are lost, and the next batch continues the chain from block 19.
        await publisher.publish(payload=b"\x93not msgpack at all")
        await publisher.publish(stored(chain[20:], parent=chain[19]))
        await applied_up_to(stream, 2)
        assert stream.stats.decode_errors == 1
        # The bisecting lookup (the default) gives the run up to the hole, as a walk does.
        assert await index.lookup(MODEL, chain) == {"r1": 10}


async def test_first_contact_rebuilds_from_the_replay_buffer(
    publisher: KvPublisher, index: PrefixIndex, zctx: zmq.asyncio.Context
) -> None:
    await index.add(MODEL, "r1", [42])  # stale: left by an earlier indexer
    # The replica was busy before anyone subscribed.
    await publisher.publish(stored([1, 2]), send=False)
    await publisher.publish(stored([3], parent=2), send=False)
    async with subscribed(publisher, index, zctx) as stream:
        await publisher.publish(stored([4], parent=3))
        await applied_up_to(stream, 2)
        assert publisher.replay_requests == [0]
        assert await index.lookup(MODEL, [1, 2, 3, 4]) == {"r1": 4}
        assert await index.lookup(MODEL, [42]) == {}


async def test_mark_stale_drops_entries_until_the_replica_speaks_again(
    publisher: KvPublisher, index: PrefixIndex, zctx: zmq.asyncio.Context
) -> None:
    async with subscribed(publisher, index, zctx) as stream:
        await publisher.publish(stored([1, 2]))
        await applied_up_to(stream, 0)
        await stream.mark_stale()
        assert await index.lookup(MODEL, [1, 2]) == {}
        await publisher.publish(stored([3], parent=2))
        await applied_up_to(stream, 1)
        # Back: the whole buffer is replayed, so blocks from before the outage return.
        assert await index.lookup(MODEL, [1, 2, 3]) == {"r1": 3}


async def test_clear_on_one_replica_leaves_the_others(
    zctx: zmq.asyncio.Context, index: PrefixIndex
) -> None:
    pub1, pub2 = KvPublisher(zctx), KvPublisher(zctx)
    try:
        async with subscribed(pub1, index, zctx, replica="r1") as s1, \
                subscribed(pub2, index, zctx, replica="r2") as s2:
            await pub1.publish(stored([1, 2]))
            await pub2.publish(stored([1, 2, 3]))
            await applied_up_to(s1, 0)
            await applied_up_to(s2, 0)
            assert await index.lookup(MODEL, [1, 2, 3]) == {"r1": 2, "r2": 3}
            await pub1.publish(AllBlocksCleared())
            await applied_up_to(s1, 1)
            assert await index.lookup(MODEL, [1, 2, 3]) == {"r2": 3}
    finally:
        await pub1.close()
        await pub2.close()


async def test_rekey_indexes_a_differently_seeded_replica_under_the_gateways_keys(
    publisher: KvPublisher, index: PrefixIndex, zctx: zmq.asyncio.Context
) -> None:
    gateway = HashConfig("sha256", block_size=4)
    replica = HashConfig("sha256", block_size=4, seed="other-seed")
    tokens = list(range(100, 112))  # 3 blocks
    lora = LoraRef("sql", "/adapters/sql")
    theirs = BlockChain(replica, cache_salt="tenant-A", tokens=tokens).event_keys()
    ours = BlockChain(gateway, cache_salt="tenant-A", tokens=tokens).event_keys()
    theirs_lora = BlockChain(replica, lora=lora, tokens=tokens[:8]).event_keys()
    ours_lora = BlockChain(gateway, lora=lora, tokens=tokens[:8]).event_keys()
    assert not set(theirs) & set(ours)
    async with subscribed(publisher, index, zctx, rekey=gateway,
                          lora_paths={"sql": "/adapters/sql"}) as stream:
        # Two events along one chain: the second's parent must map to our digest.
        await publisher.publish(
            stored(theirs[:2], tokens=tokens[:8], extra_keys=[["tenant-A"], None]))
        await publisher.publish(stored(theirs[2:], parent=theirs[1], tokens=tokens[8:]))
        await publisher.publish(
            stored(theirs_lora, tokens=tokens[:8], lora="sql", extra_keys=[["sql"], ["sql"]]))
        await applied_up_to(stream, 2)
        assert await index.lookup(MODEL, ours) == {"r1": 3}
        assert await index.lookup(MODEL, theirs) == {}
        assert await index.lookup(f"{MODEL}@sql", ours_lora) == {"r1": 2}
        await publisher.publish(removed([theirs[2]]), removed([theirs_lora[1]]))
        await applied_up_to(stream, 3)
        assert await index.lookup(MODEL, ours) == {"r1": 2}
        assert await index.lookup(f"{MODEL}@sql", ours_lora) == {"r1": 1}
        # A block whose parent was never seen, and another block size: skipped, counted.
        await publisher.publish(stored([555], parent=999, tokens=[1, 2, 3, 4]))
        await publisher.publish(stored([556], tokens=[1] * 8, block_size=8))
        await applied_up_to(stream, 5)
        assert (stream.stats.rekey_misses, stream.stats.rekey_unsupported) == (1, 1)


async def test_event_indexer_follows_discovery_and_stops_cleanly(
    zctx: zmq.asyncio.Context, index: PrefixIndex
) -> None:
    pub1, pub2 = KvPublisher(zctx), KvPublisher(zctx)
    indexer = EventIndexer(index)
    feed1 = ReplicaFeed("r1", pub1.endpoint, MODEL, replay_endpoint=pub1.replay_endpoint)
    feed2 = ReplicaFeed("r2", pub2.endpoint, MODEL)
    try:
        await indexer.sync([feed1, feed2])
        await pub1.wait_subscribed()
        await pub2.wait_subscribed()
        await pub1.publish(stored([1, 2]))
        await pub2.publish(stored([1]))
        await applied_up_to(indexer.streams["r1"], 0)
        await applied_up_to(indexer.streams["r2"], 0)
        assert await index.lookup(MODEL, [1, 2]) == {"r1": 2, "r2": 1}
        await indexer.sync([feed2])  # r1 left the fleet
        assert set(indexer.streams) == {"r2"}
        assert await index.lookup(MODEL, [1, 2]) == {"r2": 1}
        assert set(indexer.stats()) == {"r2"}
    finally:
        await indexer.stop()
        await pub1.close()
        await pub2.close()
    assert indexer.streams == {}
    assert await index.lookup(MODEL, [1]) == {"r2": 1}  # stop keeps the index's entries


async def test_index_outage_is_counted_and_resynced_when_redis_returns(
    publisher: KvPublisher, redis_server: RedisServer, zctx: zmq.asyncio.Context
) -> None:
    index = RedisIndex.from_url(redis_server.url, op_timeout_s=0.5)
    try:
        async with subscribed(publisher, index, zctx) as stream:
            await publisher.publish(stored([1]))
            await applied_up_to(stream, 0)
            redis_server.stop()
            await publisher.publish(stored([2], parent=1))
            await eventually(lambda: stream.stats.index_errors >= 1)
            redis_server.start()  # empty: everything must come back from the replay buffer
            await publisher.publish(stored([3], parent=2))

            async def rebuilt() -> bool:
                return await index.lookup(MODEL, [1, 2, 3]) == {"r1": 3}

            await eventually(rebuilt)
    finally:
        await index.close()


async def test_vllms_own_publisher_is_followed_through_replay_and_restart(
    tmp_path: Path,
) -> None:
    """The stream against vLLM 0.32's ZmqEventPublisher itself (no server: just its class)."""
    from vllm.distributed.kv_events import BlockStored as VllmBlockStored
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    def batch(keys: list[int], parent: int | None = None) -> KVEventBatch:
        hashes: list[bytes | int] = list(keys)
        return KVEventBatch(ts=time.time(), events=[VllmBlockStored(
            block_hashes=hashes, parent_block_hash=parent, token_ids=[0] * 4 * len(keys),
            block_size=4, lora_id=None, medium="GPU", lora_name=None)])

    # ipc endpoints: vLLM binds them (as it does tcp://*), and nothing leaves the machine.
    endpoint, replay = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/replay"
    index = MemoryIndex()
    publisher = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay)
    stream = ReplicaEventStream("r1", endpoint, replay, index, MODEL)
    stream.start()
    try:
        publisher.publish(batch([1, 2, 3]))

        # A plain PUB drops what it sends before the subscription lands; the replica keeps
        # stepping until the stream hears it, and the replay brings back what it missed.
        async def heard(restarts: int) -> bool:
            if stream.stats.restarts >= restarts and stream.stats.last_seq is not None:
                return True
            publisher.publish(batch([50]))
            return False

        await eventually(lambda: heard(0))
        assert await index.lookup(MODEL, [1, 2, 3]) == {"r1": 3}
        assert stream.stats.decode_errors == 0

        await asyncio.to_thread(publisher.shutdown)
        publisher = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay)
        publisher.publish(batch([7]))  # seq 0 of the restarted replica
        await eventually(lambda: heard(1))

        async def rebuilt() -> bool:
            return await index.lookup(MODEL, [7]) == {"r1": 1}

        await eventually(rebuilt)
        assert await index.lookup(MODEL, [1, 2, 3]) == {}
    finally:
        await stream.stop()
        await asyncio.to_thread(publisher.shutdown)


async def test_a_probe_is_kept_for_the_handshake_and_never_indexed(
    publisher: KvPublisher, index: PrefixIndex, zctx: zmq.asyncio.Context
) -> None:
    salt = "cacheroute-probe-0123"
    tokens = list(range(50, 58))
    async with subscribed(publisher, index, zctx) as stream:
        await publisher.publish(stored([1, 2], tokens=tokens, extra_keys=[[salt], None]))
        await publisher.publish(stored([3], parent=2))  # decode filled a block under it
        await publisher.publish(stored([5], extra_keys=[["tenant-salt"]]), removed([3]))
        await applied_up_to(stream, 2)
        assert await index.get_probe(salt) == ObservedBlocks(4, (1, 2), tuple(tokens),
                                                              replica="r1", rekeyed=False)
        assert await index.lookup(MODEL, [1, 2, 3]) == {}
        assert await index.lookup(MODEL, [5]) == {"r1": 1}
        assert stream.stats.probes == 2
        assert stream.stats.events_applied == 4


async def test_auto_rekey_indexes_an_agreeing_replica_as_it_is(
    publisher: KvPublisher, index: PrefixIndex, zctx: zmq.asyncio.Context
) -> None:
    config = HashConfig("sha256", block_size=4, seed="0")
    tokens = list(range(200, 212))
    keys = BlockChain(config, tokens=tokens).event_keys()
    async with subscribed(publisher, index, zctx, rekey=config, rekey_mode="auto") as stream:
        await publisher.publish(stored(keys[:2], tokens=tokens[:8]))
        # Parent stored before we subscribed: passthrough indexes it all the same.
        await publisher.publish(stored([777], parent=999))
        await publisher.publish(stored(keys[2:], parent=keys[1], tokens=tokens[8:]))
        await applied_up_to(stream, 2)
        assert stream.stats.key_check == "agree" and not stream.rekeying
        assert await index.lookup(MODEL, keys) == {"r1": 3}
        assert await index.lookup(MODEL, [777]) == {"r1": 1}
        assert stream.stats.rekey_misses == 0
        await publisher.publish(removed([keys[2]]))
        await applied_up_to(stream, 3)
        assert await index.lookup(MODEL, keys) == {"r1": 2}


async def test_auto_rekey_turns_on_for_a_differing_replica_and_marks_its_probes(
    publisher: KvPublisher, index: PrefixIndex, zctx: zmq.asyncio.Context
) -> None:
    gateway = HashConfig("sha256", block_size=4, seed="0")
    replica = HashConfig("sha256", block_size=4, seed="1")
    tokens = list(range(300, 312))
    theirs = BlockChain(replica, tokens=tokens).event_keys()
    ours = BlockChain(gateway, tokens=tokens).event_keys()
    probe = make_probe(4, vocab_size=500)
    probe_keys = BlockChain(replica, cache_salt=probe.cache_salt,
                            tokens=list(probe.token_ids)).event_keys()
    async with subscribed(publisher, index, zctx, rekey=gateway, rekey_mode="auto") as stream:
        assert not stream.rekeying  # undecided: nothing compared yet
        await publisher.publish(stored(theirs[:2], tokens=tokens[:8]))
        await publisher.publish(stored(theirs[2:], parent=theirs[1], tokens=tokens[8:]))
        await publisher.publish(stored(probe_keys, tokens=probe.token_ids[:8],
                                       extra_keys=[[probe.cache_salt], None]))
        await applied_up_to(stream, 2)
        assert stream.stats.key_check == "differ" and stream.rekeying
        assert await index.lookup(MODEL, ours) == {"r1": 3}
        assert await index.lookup(MODEL, theirs) == {}
        observed = await index.get_probe(probe.cache_salt)
        assert observed is not None and observed.rekeyed and observed.keys == tuple(probe_keys)
        result = compare(probe, gateway, observed)
        assert (result.verified, result.mismatch, result.rekeyed) == (False, "hash_seed", True)
        assert result.routable_by_prefix
        await publisher.publish(removed([theirs[2]]))
        await applied_up_to(stream, 3)
        assert await index.lookup(MODEL, ours) == {"r1": 2}


async def test_auto_rekey_compares_again_after_the_replica_restarts(
    publisher: KvPublisher, index: PrefixIndex, zctx: zmq.asyncio.Context
) -> None:
    gateway = HashConfig("sha256", block_size=4, seed="0")
    tokens = list(range(400, 408))
    before = BlockChain(gateway, tokens=tokens).event_keys()
    # Restarted with another PYTHONHASHSEED: its keys no longer agree.
    after = BlockChain(HashConfig("sha256", block_size=4, seed="9"), tokens=tokens).event_keys()
    async with subscribed(publisher, index, zctx, rekey=gateway, rekey_mode="auto") as stream:
        await publisher.publish(stored(before, tokens=tokens))
        await publisher.publish(removed([555]))  # (a restart shows as seq 0 after seq > 0)
        await applied_up_to(stream, 1)
        assert stream.stats.key_check == "agree"
        publisher.restart()
        await publisher.publish(stored(after, tokens=tokens))  # seq 0 again
        await eventually(lambda: stream.stats.restarts == 1 and stream.stats.batches == 3)
        assert stream.stats.key_check == "differ" and stream.rekeying
        assert await index.lookup(MODEL, before) == {"r1": 2}  # re-keyed into our keys
        assert await index.lookup(MODEL, after) == {}
