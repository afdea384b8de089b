"""The sim's KV-event publisher: vLLM's ZmqEventPublisher on the wire, without its thread.

Frames and replay follow vllm/distributed/kv_events.py (and router/kv_events.py):

- PUB: one message per engine step that produced events, [topic, seq (8 bytes,
  big-endian, from 0 per publisher), msgpack EventBatch with data_parallel_rank 0].
- ROUTER (replay): a request [identity, b"", start_seq] is answered with one
  [identity, b"", topic, seq, payload] per kept batch with seq >= start_seq, then the
  end marker [identity, b"", b"", END_SEQ, b""]. The last `buffer_steps` batches are kept.

The sim binds both endpoints (subscribers connect to it). Publishing happens on the
event loop that drives the engine: a PUB send never blocks (ZMQ drops beyond the high
water mark, as vLLM's does), and the replay socket is served by an asyncio task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio

from router.kv_events import END_SEQ, EventBatch, KVEvent, encode_batch, seq_bytes

log = logging.getLogger(__name__)


class KVEventPublisher:
    """PUB socket plus replay ROUTER with a bounded buffer of past batches."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *,
                 buffer_steps: int = 10_000, hwm: int = 100_000, topic: str = "",
                 data_parallel_rank: int = 0) -> None:
        # PUB on a plain socket (its sends never block); replay on an asyncio one.
        self._pub_ctx = zmq.Context()
        self._ctx = zmq.asyncio.Context()
        self._pub = self._pub_ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._replay: zmq.asyncio.Socket | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._next_seq = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def start(self) -> None:
        """Start serving replay requests on the running event loop."""
        if self._replay is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> int:
        """Send one batch; returns its sequence number."""
        batch = EventBatch(ts=time.time() if ts is None else ts, events=list(events),
                           data_parallel_rank=self._rank)
        payload = encode_batch(batch)
        seq = self._next_seq
        self._next_seq += 1
        # PUB drops rather than blocks beyond its high water mark, as vLLM's does.
        self._pub.send_multipart([self._topic, seq_bytes(seq), payload], flags=zmq.NOBLOCK)
        self._buffer.append((seq, payload))
        return seq

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("ignoring malformed replay request with %d frames", len(frames))
                continue
            identity, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart(
                        [identity, b"", self._topic, seq_bytes(seq), payload])
            await self._replay.send_multipart([identity, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        """Stop the replay task and close both sockets."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
        self._pub_ctx.term()
