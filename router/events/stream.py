"""The ZMQ transport of one replica's KV events: a SUB for the stream, a DEALER for replay.

vLLM binds a ZMQ PUB socket (and, optionally, a ROUTER for replay) and we connect a SUB.
This module only moves bytes: it splits each message into its frames, hands (seq,
payload) to the sequence tracker (sequence.py) and performs the plan it returns:
clearing the replica's entries, asking the replay socket for missed batches (with a
deadline) and writing each batch the planner (planning.py) turns into index operations.
A socket monitor tells the tracker when the connection to the publisher dropped.

An index failure, or any other error while applying a message, makes the tracker lose
sync: the next message starts over as at first contact (clear, replay from 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from router.events.planning import DEFAULT_MEDIA, BatchPlanner, RekeyMode
from router.events.sequence import Clear, Plan, SequenceTracker
from router.events.stats import StreamStats
from router.hashing import HashConfig
from router.index import IndexUnavailable, PrefixIndex, StreamPosition
from router.kv_events import END_SEQ, EventBatch, EventDecodeError, parse_seq, seq_bytes

log = logging.getLogger(__name__)

DEFAULT_REPLAY_TIMEOUT_S = 2.0
# A probe's observation is read by the gateway within its handshake deadline (seconds).
DEFAULT_PROBE_TTL_S = 120.0
# vLLM publishes with hwm 100,000; a SUB with a smaller queue would drop what vLLM kept.
_SUB_HWM = 100_000
# Queued messages taken at once before the loop runs anything else (router requests).
_DRAIN_AT_ONCE = 64


def _has_message(sock: zmq.Socket[bytes]) -> bool:
    """Whether `sock` holds a message to receive (reading EVENTS also lets ZMQ process
    what its fd signalled)."""
    return bool(cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN)


class ReplayUnavailable(RuntimeError):
    """The replica's replay socket did not answer in time."""


class ReplicaEventStream:
    """One replica's KV-event subscription, applied to the index by an asyncio task.

    `model`, `rekey`, `rekey_mode`, `lora_paths` and `media` say how batches become
    index writes (planning.BatchPlanner). Handshake probes are never indexed: they are
    stored with `index.put_probe` for `probe_ttl_s`, under the replica's own keys.
    `start()` connects and returns; `stop()` closes; `stats` is read at any time.
    """

    def __init__(
        self,
        replica_id: str,
        endpoint: str,
        replay_endpoint: str | None,
        index: PrefixIndex,
        model: str,
        *,
        topic: str = "",
        rekey: HashConfig | None = None,
        rekey_mode: RekeyMode = "always",
        lora_paths: Mapping[str, str] | None = None,
        media: frozenset[str | None] = DEFAULT_MEDIA,
        replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
        probe_ttl_s: float = DEFAULT_PROBE_TTL_S,
        context: zmq.asyncio.Context | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.replica_id = replica_id
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.model = model
        self.stats = StreamStats()
        self._planner = BatchPlanner(replica_id, model, self.stats, rekey=rekey,
                                     rekey_mode=rekey_mode, lora_paths=lora_paths, media=media)
        self._tracker = SequenceTracker(replica_id, self.stats,
                                        has_replay=replay_endpoint is not None)
        self._index = index
        self._topic = topic.encode()
        self._probe_ttl_s = probe_ttl_s
        self._replay_timeout_s = replay_timeout_s
        self._own_context = context is None
        self._ctx = context or zmq.asyncio.Context()
        self._clock = clock
        # A plain (not asyncio) socket read when its fd says so: see _run.
        self._sub: zmq.Socket[bytes] | None = None
        self._wake: asyncio.Future[None] | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._monitor_task: asyncio.Task[None] | None = None
        # Serialises message handling with mark_stale(), which the gateway calls.
        self._lock = asyncio.Lock()
        # Set once the stream knows where it starts (a stored position, or over): a
        # gateway seeding its mirror waits for it before serving (router/app.py).
        self.resumed = asyncio.Event()
        # Set once the replay of what was published before the SUB listened is applied.
        self.caught_up = asyncio.Event()

    def start(self) -> None:
        """Connect the SUB socket and start applying events."""
        if self._task is not None:
            return
        self._stopping = False
        sub: zmq.Socket[bytes] = zmq.Socket(self._ctx, zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, _SUB_HWM)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        # Made by the SUB's context, which is asyncio's: an asyncio socket.
        self._monitor = cast(zmq.asyncio.Socket,
                             sub.get_monitor_socket(zmq.EVENT_DISCONNECTED))
        sub.connect(self.endpoint)  # vLLM binds; ZMQ reconnects by itself after a restart
        self._sub = sub
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.replica_id}")
        self._monitor_task = asyncio.create_task(
            self._watch_connection(), name=f"kv-events-monitor-{self.replica_id}")

    @property
    def running(self) -> bool:
        """Whether the stream is applying events (started, and its task has not ended)."""
        return self._task is not None and not self._task.done()

    async def stop(self) -> None:
        """Stop the task and close the sockets (the index keeps its entries)."""
        # The flag ends the loop even if a cancellation were lost inside a library call:
        # the task would otherwise run on, and this await would never return.
        self._stopping = True
        for task in (self._task, self._monitor_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._monitor_task = None
        if self._sub is not None:
            self._sub.disable_monitor()
            self._sub.close(linger=0)
            self._sub = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None
        if self._own_context:
            self._ctx.term()

    @property
    def rekeying(self) -> bool:
        """Whether this stream re-keys the replica's blocks with the gateway's settings."""
        return self._planner.rekeying

    async def mark_stale(self) -> None:
        """Drop the replica's entries now (it failed health checks); resync on its next event."""
        async with self._lock:
            self._tracker.lost_sync()
            await self._clear(restart=False)

    async def _resume(self) -> None:
        """Continue after the position the index kept for this replica, if it kept one."""
        try:
            position = await self._index.stream_position(self.replica_id)
        except IndexUnavailable as exc:
            log.warning("replica %s: no stored position (%s): starting over", self.replica_id,
                        exc)
            return
        if position is not None:
            self._tracker.resume(position.seq, position.ts)
            log.info("replica %s: resuming after seq %d", self.replica_id, position.seq)

    async def _run(self) -> None:
        assert self._sub is not None
        async with self._lock:
            try:
                await self._resume()
            finally:
                self.resumed.set()
            # Whatever the replica published before this SUB listened is not delivered:
            # fetch it now rather than at its next batch, which a quiet replica may not
            # send for a long time (an indexer that started, or took the lease, late).
            try:
                await self._guarded(self._perform(self._tracker.catch_up()))
            finally:
                self.caught_up.set()
        # The SUB is a plain socket whose fd the loop watches, drained without blocking
        # once ZMQ's EVENTS says a message is queued: pyzmq's asyncio socket made a
        # future, a poll registration and a callback for every message that found the
        # loop idle (benchmarks/bench_event_transport.py --spaced).
        sub = self._sub
        loop = asyncio.get_running_loop()
        fd = sub.FD
        loop.add_reader(fd, self._on_fd)
        try:
            # No deadline: an idle replica legitimately sends nothing. Liveness is judged
            # by the gateway's health checks and stats.last_received_at.
            while not self._stopping:
                await self._readable(loop)
                async with self._lock:
                    for _ in range(_DRAIN_AT_ONCE):
                        # One zmq.Again a drain (3 us) costs less than reading EVENTS
                        # before every message (1.8 us each) where many are queued.
                        try:
                            frames = sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        await self._guarded(self._on_message(frames))
                    else:  # more may wait: back to the loop first, for fairness
                        await asyncio.sleep(0)
        finally:
            loop.remove_reader(fd)

    async def _readable(self, loop: asyncio.AbstractEventLoop) -> None:
        """Until the SUB holds a message. ZMQ's fd only says that EVENTS may have changed
        (and stays readable until EVENTS or a receive is read), so EVENTS decides."""
        assert self._sub is not None
        while not _has_message(self._sub):
            self._wake = loop.create_future()
            try:
                await self._wake
            finally:
                self._wake = None

    def _on_fd(self) -> None:
        """The SUB's fd is readable: reading EVENTS lets ZMQ clear it (else the loop would
        call this on every iteration while messages wait), and wakes a waiting _run."""
        sub, wake = self._sub, self._wake
        if sub is None or sub.closed:
            return
        if _has_message(sub) and wake is not None and not wake.done():
            wake.set_result(None)

    async def _guarded(self, work: Coroutine[object, object, None]) -> None:
        """Perform a message's (or the catch-up's) plan; on failure, resync next time."""
        try:
            await work
        except IndexUnavailable as exc:
            # Some of the batch may be missing from the index: resync from the replay
            # buffer on the next message, when the index may be back.
            self.stats.index_errors += 1
            self._tracker.lost_sync()
            log.warning("replica %s: index unavailable, will resync: %s",
                        self.replica_id, exc)
        except Exception:
            # One bad message must not end the subscription; the index may now disagree
            # with the replica, so resync as after an index failure.
            self._tracker.lost_sync()
            log.exception("replica %s: failed to apply a KV-event message, will resync",
                          self.replica_id)

    async def _watch_connection(self) -> None:
        assert self._monitor is not None
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._tracker.disconnected()

    async def _on_message(self, frames: list[bytes]) -> None:
        """One [topic, seq, payload] message: the tracker's plan, performed step by step."""
        if len(frames) != 3:
            self.stats.decode_errors += 1
            return
        try:
            seq = parse_seq(frames[1])
        except EventDecodeError:
            self.stats.decode_errors += 1
            return
        self.stats.last_received_at = self._clock()
        await self._perform(self._tracker.receive(seq, frames[2]))

    async def _perform(self, plan: Plan) -> None:
        """Perform a tracker's plan, and the plans its replays lead to."""
        while True:
            for step in plan.steps:
                if isinstance(step, Clear):
                    await self._clear(restart=step.restart)
                else:
                    await self._apply(step.seq, step.batch)
            if plan.replay_from is None:
                return
            plan = self._tracker.replayed(await self._replay_from(plan.replay_from))

    async def _clear(self, *, restart: bool) -> None:
        self._planner.forget(restart=restart)
        self.stats.clears += 1
        await self._index.clear_replica(self.replica_id)

    async def _apply(self, seq: int, batch: EventBatch | None) -> None:
        if batch is not None:
            plan = self._planner.plan(batch)
            # One call for the whole batch: the Redis index writes it in one round trip.
            await self._index.apply(self.replica_id, plan.ops,
                                    position=StreamPosition(seq, batch.ts))
            self.stats.clears += sum(1 for op in plan.ops if op.kind == "clear")
            for probe in plan.probes:
                await self._index.put_probe(
                    probe.salt, self.replica_id, probe.block_size, probe.keys,
                    probe.token_ids, self._probe_ttl_s, rekeyed=probe.rekeyed)
            self.stats.batches += 1
            self.stats.events_applied += plan.applied
        self._tracker.applied(seq, batch)

    async def _replay_from(self, start: int) -> Mapping[int, bytes]:
        """The replica's kept batches from `start` on, by seq ({} if the replay failed)."""
        try:
            return dict(await self._request_replay(start))
        except ReplayUnavailable as exc:
            log.warning("replica %s: %s", self.replica_id, exc)
            return {}

    async def _request_replay(self, start: int) -> list[tuple[int, bytes]]:
        """Every batch the replica still keeps from `start` on, as (seq, payload)."""
        assert self.replay_endpoint is not None
        # A fresh DEALER per request: a late reply to an abandoned request can then never
        # be mistaken for the answer to the next one.
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            dealer.connect(self.replay_endpoint)
            async with asyncio.timeout(self._replay_timeout_s):
                await dealer.send_multipart([b"", seq_bytes(start)])
                while True:
                    frames = await dealer.recv_multipart()
                    if len(frames) != 4:
                        raise ReplayUnavailable(f"malformed replay reply ({len(frames)} frames)")
                    _, _topic, seq_frame, payload = frames
                    if seq_frame == END_SEQ:
                        return out
                    out.append((parse_seq(seq_frame), payload))
        except TimeoutError as exc:
            raise ReplayUnavailable(
                f"replay from {self.replay_endpoint} did not finish within "
                f"{self._replay_timeout_s}s"
            ) from exc
        except (zmq.ZMQError, EventDecodeError) as exc:
            raise ReplayUnavailable(f"replay from {self.replay_endpoint} failed: {exc}") from exc
        finally:
            dealer.close(linger=0)

