"""The KV-event transport against a real ZMQ publisher on loopback and both index backends.

The stream's rules (order, gaps, restarts, replay plans) are tested without sockets in
test_event_sequence.py, and what batches mean for the index in test_event_planning.py;
here, that the transport feeds them: SUB, replay DEALER, socket monitor, mark_stale,
an index outage, discovery, and vLLM's own publisher.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import zmq
import zmq.asyncio
from servers import RedisServer

from router.events import EventIndexer, ReplicaEventStream, ReplicaFeed
from router.index import MemoryIndex, PrefixIndex, RedisIndex
from router.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    encode_batch,
    encoded_ids,
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
        token_ids=encoded_ids(list(tokens) or [0] * (block_size * len(keys))),
        block_size=block_size,
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
        # The stream's first act: ask the replay socket for what it missed (nothing yet).
        async with asyncio.timeout(DEADLINE_S):
            await stream.caught_up.wait()
        assert pub.replay_requests == ([0] if replay else [])
        pub.replay_requests.clear()
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


class _GatedIndex:
    """An index whose first apply waits for `gate`: a busy process, behind which the
    replica's next batches queue in the socket."""

    def __init__(self, index: PrefixIndex) -> None:
        self._index = index
        self.gate = asyncio.Event()
        self.holding = asyncio.Event()

    async def apply(self, *args: Any, **kwargs: Any) -> None:
        if not self.gate.is_set():
            self.holding.set()
            await self.gate.wait()
        await self._index.apply(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._index, name)


async def test_batches_queued_behind_a_busy_stream_are_all_applied_in_order(
    publisher: KvPublisher, index: PrefixIndex, zctx: zmq.asyncio.Context
) -> None:
    # Queued messages are taken without a future each (up to 64 at a time, then the
    # loop runs): none may be lost, reordered or counted as a gap.
    gated = _GatedIndex(index)
    async with subscribed(publisher, gated, zctx) as stream:  # type: ignore[arg-type]
        await publisher.publish(stored([1]))
        async with asyncio.timeout(DEADLINE_S):
            await gated.holding.wait()
        for key in range(2, 302):  # 300 batches queue while the first is held
            await publisher.publish(stored([key], parent=key - 1))
        gated.gate.set()
        await applied_up_to(stream, 300)
        assert await index.lookup(MODEL, list(range(1, 302))) == {"r1": 301}
        assert (stream.stats.batches, stream.stats.gaps, stream.stats.replays) == (301, 0, 0)


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


async def test_what_a_quiet_replica_published_before_the_subscription_is_indexed_at_once(
    publisher: KvPublisher, index: PrefixIndex, zctx: zmq.asyncio.Context
) -> None:
    # An indexer that starts (or takes the lease) after a replica's last batch: PUB/SUB
    # delivers none of it, and the replica sends nothing more to show the gap.
    await publisher.publish(stored([1, 2]))
    await publisher.publish(stored([3], parent=2))
    async with subscribed(publisher, index, zctx) as stream:
        assert await index.lookup(MODEL, [1, 2, 3]) == {"r1": 3}
        assert (stream.stats.last_seq, stream.stats.replays, stream.stats.gaps) == (1, 1, 0)


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


@pytest.fixture(scope="module")
def vllm_kv_events() -> ModuleType:
    """vLLM's kv_events module, imported outside the event loop (the import takes seconds)."""
    return importlib.import_module("vllm.distributed.kv_events")


async def test_vllms_own_publisher_is_followed_through_replay_and_restart(
    tmp_path: Path, vllm_kv_events: ModuleType
) -> None:
    """The stream against vLLM 0.32's ZmqEventPublisher itself (no server: just its class)."""
    kv = vllm_kv_events

    def batch(keys: list[int], parent: int | None = None) -> Any:
        hashes: list[bytes | int] = list(keys)
        return kv.KVEventBatch(ts=time.time(), events=[kv.BlockStored(
            block_hashes=hashes, parent_block_hash=parent, token_ids=[0] * 4 * len(keys),
            block_size=4, lora_id=None, medium="GPU", lora_name=None)])

    # ipc endpoints: vLLM binds them (as it does tcp://*), and nothing leaves the machine.
    endpoint, replay = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/replay"
    index = MemoryIndex()
    publisher = kv.ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay)
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
        publisher = kv.ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay)
        publisher.publish(batch([7]))  # seq 0 of the restarted replica
        await eventually(lambda: heard(1))

        async def rebuilt() -> bool:
            return await index.lookup(MODEL, [7]) == {"r1": 1}

        await eventually(rebuilt)
        assert await index.lookup(MODEL, [1, 2, 3]) == {}
    finally:
        await stream.stop()
        await asyncio.to_thread(publisher.shutdown)
