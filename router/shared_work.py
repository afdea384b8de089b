"""Outstanding work shared between gateways through Redis: each sees the others' queues.

A gateway knows its own outstanding work on each replica exactly (router/outstanding.py)
but not what other gateways sent there a moment ago: the scrape shows it up to an
interval late, and a burst's decisions all fall inside one interval. Deciding blind,
several gateways each put a cold prefill on the same idle replica, and the second waits
for the first (issue #16: agent TTFT p99 566 -> 697 ms from 1 to 4 gateways).

So each gateway writes, per replica, when its queue there ends, how many of its
requests are pending (no first byte yet) and decoding there, and what joins its queue
with the others' (`joined_wait`: its pending prefills' seconds, its last first byte
there, its oldest pending request), into one Redis hash (field "GATEWAY/REPLICA"),
whenever that changes, and publishes the same change on a channel in the same round
trip. Each gateway follows that channel (`follow`): it
subscribes, seeds a copy of the hash with one read, and applies every change as it
comes, so routing reads the others' work from memory and waits for no round trip (as
its prefix lookups read the mirror of the KV events). The others' work then counts
with its own, the queues joined into the one line the replica serves (`joined_wait`).

    value = "busy_until pending decoding written queued last_first_byte oldest_sent"
            (times wall-clock seconds, 0 for none; a 4-part value from an older
            gateway is read as its queue starting now)

`busy_until` is absolute, so a reader drains it by its own clock without the writer
writing again (gateways' clocks agree to NTP's milliseconds, small against a prefill).
A field not rewritten within `stale_s` is ignored (its gateway died or stalled): each
gateway rewrites all of its fields every `heartbeat_s`, deletes them when it stops, and
deletes other gateways' fields that have been stale for `forget_s`. Writes are
fire-and-forget and coalesced (the latest value per replica, one write in flight), so a
burst costs a few round trips, not one per request; a lost write is repaired by the next
change or the heartbeat. A gateway alone writes on the heartbeat only, and at once when
another appears (`publish` says why).

The feed carries each gateway's own heartbeat back to it, so a feed silent for three
heartbeats is broken (a half-open connection raises nothing): the copy is dropped and
rebuilt. While there is no copy, routing reads the whole hash beside each lookup, under
the lookup's deadline, one read in flight shared by a burst (`refresh`); a gateway whose
last read found no other gateway skips the read for `heartbeat_s` (`read_due`) and does
not hold requests for the re-check. With Redis away the gateway sees only its own work.

Cost: each change is delivered to every gateway (a few per routed request, coalesced,
plus every field once a heartbeat); after a change, the next request parses the copy,
gateways x replicas short fields, as a read did, and between changes drains the last
parse by the clock. Measured against the read per request it replaced, 4 gateways on
one core: the route step 1.66 against 2.15 ms at the median
(results/follow-shared-work-groups-x4-seed277).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from router.deadlines import within
from router.outstanding import WorkView

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerWork:
    """Other gateways' outstanding work on one replica, as of one read."""

    wait_s: float = 0.0  # seconds of their prefill still queued there, each queue alone
    pending: int = 0  # their requests there without a first byte yet
    decoding: int = 0  # theirs past the first byte, not finished
    busy: int = 0  # gateways whose queue there had not ended: wait_s drains this fast
    # What joined_wait needs (WorkView's fields of the same names, over the gateways):
    # their pending prefills' seconds, summed and undrained; seconds since the latest
    # first byte any of them saw there; and since the oldest request any has pending.
    queued_s: float = 0.0
    progress_age_s: float = math.inf
    oldest_age_s: float = 0.0

    def drained(self, seconds: float) -> PeerWork:
        """As `seconds` later: each busy gateway's queue a second shorter per second (an
        overestimate only where one of them ends within `seconds`), the ages older."""
        if seconds <= 0 or not (self.busy or self.pending):
            return self
        return PeerWork(max(0.0, self.wait_s - self.busy * seconds), self.pending,
                        self.decoding, self.busy, self.queued_s,
                        self.progress_age_s + seconds,
                        self.oldest_age_s + seconds if self.pending else 0.0)


def joined_wait(own: WorkView, peers: PeerWork) -> float:
    """Seconds of prefill queued on a replica ahead of a request sent now, by this
    gateway and the others together: one first-come-first-served line that drains a
    second a second from its latest proof of progress (a first byte, whoever's) or, if
    later, from when its oldest pending request was sent, as one gateway's queue does
    (router/outstanding.py).

    Not the sum of each gateway's own estimate (`wait_s`): each drains its queue from
    its own first bytes as if alone there, so two queues on one replica drained twice as
    fast as it works, and a request behind another gateway's prefill was predicted to
    start at once (with 4 gateways on 8 sims the measured TTFT over the predicted spread
    2.5x wider than with one, 2026-12-07)."""
    if not peers.pending:
        return own.wait_s
    since_progress = min(own.progress_age_s, peers.progress_age_s)
    since_oldest = max(own.oldest_age_s if own.pending else 0.0, peers.oldest_age_s)
    return max(0.0, own.queued_s + peers.queued_s - min(since_progress, since_oldest))


NO_PEER_WORK = PeerWork()

# A change message: field -> its new value, or None where the field was deleted.
_CHANGES = msgspec.msgpack.Encoder()
_CHANGES_DECODER = msgspec.msgpack.Decoder(dict[bytes, bytes | None])


def _retrieve(read: asyncio.Future[dict[str, PeerWork]]) -> None:
    """Mark a shared read's failure as seen: a waiter may have stopped waiting."""
    if not read.cancelled():
        read.exception()


def encode(view: WorkView, wall: float) -> bytes:
    """One field's value: when this gateway's queue there ends, its counts, and when;
    then its pending prefills' seconds, its last first byte there and its oldest pending
    request's sending (wall-clock; 0: none), for joined_wait."""
    progress = wall - view.progress_age_s if math.isfinite(view.progress_age_s) else 0.0
    oldest = wall - view.oldest_age_s if view.pending else 0.0
    return (f"{wall + view.wait_s:.4f} {view.pending} {view.decoding} {wall:.4f} "
            f"{view.queued_s:.4f} {progress:.4f} {oldest:.4f}").encode()


def parse(raw: Mapping[bytes, bytes], own_gateway: str, wall: float, stale_s: float,
          forget_s: float | None = None
          ) -> tuple[dict[str, PeerWork], list[bytes], set[str]]:
    """Other gateways' work per replica id from the hash's fields, the fields stale for
    longer than `forget_s` (to delete), and the other live gateways' ids (for lane_of).
    Own fields, stale and malformed ones are skipped: a bad field must not stop routing."""
    own = own_gateway.encode() + b"/"
    out: dict[str, PeerWork] = {}
    dead: list[bytes] = []
    live: set[str] = set()
    for name, value in raw.items():
        if name.startswith(own):
            continue
        gateway, sep, replica = name.partition(b"/")
        parts = value.split()
        try:
            busy, written = float(parts[0]), float(parts[3])
            pending, decoding = max(0, int(parts[1])), max(0, int(parts[2]))
            if len(parts) == 7:
                queued, progress, oldest = float(parts[4]), float(parts[5]), float(parts[6])
            elif len(parts) == 4:
                # Written by a gateway before joined_wait: its queue, as of now.
                queued, progress, oldest = max(0.0, busy - wall), 0.0, wall
            else:
                continue
        except (ValueError, IndexError):
            continue
        if not sep or not gateway or not replica:
            continue
        age = wall - written
        if age > stale_s:
            if forget_s is not None and age > forget_s:
                dead.append(name)
            continue
        live.add(gateway.decode(errors="replace"))
        rid = replica.decode(errors="replace")
        prev = out.get(rid, NO_PEER_WORK)
        progress_age = wall - progress if progress > 0 else math.inf
        oldest_age = wall - oldest if pending and oldest > 0 else 0.0
        out[rid] = PeerWork(prev.wait_s + max(0.0, busy - wall),
                            prev.pending + pending, prev.decoding + decoding,
                            prev.busy + (busy > wall),
                            prev.queued_s + (max(0.0, queued) if pending else 0.0),
                            min(prev.progress_age_s, progress_age),
                            max(prev.oldest_age_s, oldest_age))
    return out, dead, live


def _written_at(value: bytes) -> float | None:
    """When a field's value was written (encode's 4th part, wall seconds), or None for a
    malformed one (parse skips those as well)."""
    parts = value.split()
    try:
        return float(parts[3])
    except (IndexError, ValueError):
        return None


def lane_of(others: Iterable[str], own_gateway: str) -> tuple[int, int]:
    """This gateway's place among the live gateways (`others`, from parse(), and itself),
    ordered by id, and their count: how routing splits near-ties between gateways
    deciding from the same snapshot (policy.lanes)."""
    order = sorted({own_gateway, *others})
    return order.index(own_gateway), len(order)


class SharedWork:
    """This gateway's side of the shared hash: publish its own work, read the others'."""

    def __init__(self, client: Redis, *, namespace: str = "cr", gateway_id: str | None = None,
                 stale_s: float = 3.0, heartbeat_s: float = 1.0, forget_s: float = 60.0,
                 write_timeout_s: float = 0.5, clock: Callable[[], float] = time.time) -> None:
        self.key = f"{namespace}:work".encode()
        self.channel = f"{namespace}:work:changes".encode()
        self.gateway_id = gateway_id or secrets.token_hex(6)
        self.stale_s = stale_s
        self.heartbeat_s = heartbeat_s
        self.forget_s = forget_s
        self._redis = client
        self._write_timeout_s = write_timeout_s
        self._clock = clock
        self._dirty: dict[str, bytes] = {}
        self._published: set[str] = set()
        self._dead: list[bytes] = []
        self._flushing: asyncio.Task[None] | None = None
        self._alone_until = float("-inf")  # no read is due before this (read_due)
        self._reading: asyncio.Future[dict[str, PeerWork]] | None = None  # the one in flight
        # The hash as the change feed left it (`follow`); None while not following.
        self._copy: dict[bytes, bytes] | None = None
        self._copy_version = 0
        self._heard_at = 0.0  # time.monotonic() of the feed's last message
        self._parsed: tuple[int, float, dict[str, PeerWork]] | None = None
        self.alone = False  # the last read found no other live gateway
        self.lane = (0, 1)  # lane_of, as of the last read (routing's policy.lanes)
        self._live: set[str] = set()  # the other live gateways, as of the last read
        self.write_failures = 0
        # Told, for each other gateway's change the feed applies, the seconds since that
        # gateway wrote it (its wall clock against this one's): the metrics' histogram.
        self.delay_listeners: list[Callable[[float], None]] = []

    def _field(self, replica_id: str) -> bytes:
        return f"{self.gateway_id}/{replica_id}".encode()

    def publish(self, replica_id: str, view: WorkView) -> None:
        """Share this gateway's work on one replica (now, in the background).

        Alone (the last read or the followed copy showed no other live gateway), the
        change waits for the heartbeat, or for another gateway to appear (`_take`,
        `_apply`): nobody reads it, and each write is a round trip and a message back on
        the feed for every routed request, on the loop that routes and on the Redis the
        indexer writes to. A gateway that joins sees this one's work as of its last
        heartbeat until this one sees it, at its first change on the feed or the next
        read."""
        self._dirty[replica_id] = encode(view, self._clock())
        if not self.alone:
            self._schedule()

    def _schedule(self) -> None:
        if self._dirty and (self._flushing is None or self._flushing.done()):
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        while self._dirty:
            batch, self._dirty = self._dirty, {}
            fields: dict[Any, bytes] = {self._field(rid): v for rid, v in batch.items()}
            try:
                # The hash for whoever reads or seeds from it, the change for followers:
                # one round trip (a reader between the two sees the new value twice).
                pipe = self._redis.pipeline(transaction=False)
                pipe.hset(self.key, mapping=fields)
                pipe.publish(self.channel, _CHANGES.encode(fields))
                await within(pipe.execute(), self._write_timeout_s)
            except (RedisError, OSError, TimeoutError) as exc:
                # Lost: the next change or the heartbeat writes it again.
                self.write_failures += 1
                log.debug("shared work write failed: %s", exc)
                return
            self._published.update(batch)

    async def claim(self, replica_id: str, view: WorkView, timeout_s: float
                    ) -> PeerWork | None:
        """Write this gateway's work on one replica now (`view`, with the request just
        decided there) and read the other live gateways' work there, in one atomic round
        trip: their work on it as Redis holds it at this write (policy.claim).

        Redis runs the transaction as one step, so of two gateways claiming one replica
        in the same instant, the second's read holds the first's request, whatever order
        their changes reach each other's feeds in. Only that replica's fields of the
        gateways this one knows to be live are read (a gateway unknown here is seen
        within its first heartbeat): a read of the whole hash would cost gateways x
        replicas fields a request, the cost the feed was built to avoid. The change is
        published as every write is. None on a failed or late round trip: the write is
        then left to the coalesced writer (the next change or the heartbeat), as any
        lost write is."""
        wall = self._clock()
        value = encode(view, wall)
        # Written here: a coalesced write not yet sent would only write it again.
        self._dirty.pop(replica_id, None)
        # A write in flight may hold an older value of this field and land after this one
        # (another connection): then the newest is written once more after it.
        overtaken = self._flushing is not None and not self._flushing.done()
        field_name = self._field(replica_id)
        names = [f"{g}/{replica_id}".encode() for g in sorted(self._live)
                 if g != self.gateway_id]
        try:
            pipe = self._redis.pipeline(transaction=True)
            pipe.hset(self.key, field_name, value)
            pipe.publish(self.channel, _CHANGES.encode({field_name: value}))
            if names:
                pipe.hmget(self.key, names)
            answers = await within(pipe.execute(), timeout_s)
        except (RedisError, OSError, TimeoutError) as exc:
            self.write_failures += 1
            log.debug("shared work claim failed: %s", exc)
            self._dirty.setdefault(replica_id, value)
            self._schedule()
            return None
        self._published.add(replica_id)
        if overtaken:
            self._dirty.setdefault(replica_id, value)
            self._schedule()
        values = answers[2] if names else []
        raw = {name: v for name, v in zip(names, values, strict=True) if v is not None}
        peers = parse(raw, self.gateway_id, self._clock(), self.stale_s)[0]
        return peers.get(replica_id, NO_PEER_WORK)

    async def flushed(self) -> None:
        """Wait until what has been published so far is written (or failed)."""
        while self._flushing is not None and not self._flushing.done():
            await asyncio.gather(self._flushing, return_exceptions=True)

    def read_due(self) -> bool:
        """Whether routing should read: not for heartbeat_s after a read that found no
        other live gateway. Alone, the read would only return this gateway's own fields;
        a gateway that starts later is seen within a heartbeat (and itself sees this
        one's work at once)."""
        return self._clock() >= self._alone_until

    def refresh(self, timeout_s: float) -> asyncio.Future[dict[str, PeerWork]] | None:
        """The read in flight, or a new one if one is due (None: none is). One at a time:
        a burst's requests share it. Nobody cancels it (each waiter stops waiting at its
        own deadline); `timeout_s` bounds it."""
        if self._reading is not None and not self._reading.done():
            return self._reading
        if not self.read_due():
            return None
        reading = asyncio.ensure_future(self.read(timeout_s))
        reading.add_done_callback(_retrieve)
        self._reading = reading
        return reading

    async def read(self, timeout_s: float) -> dict[str, PeerWork]:
        """The other gateways' work per replica id; raises on a failed or late read."""
        raw = await within(self._redis.hgetall(self.key), timeout_s)
        # The index's client does not decode responses: fields and values are bytes.
        wall = self._clock()
        peers = self._take(cast(Mapping[bytes, bytes], raw), wall)
        self._alone_until = wall + self.heartbeat_s if self.alone else float("-inf")
        return peers

    def _take(self, raw: Mapping[bytes, bytes], wall: float) -> dict[str, PeerWork]:
        """parse() the hash (read, or the followed copy) and note what it says: the
        long-dead fields, deleted by the next heartbeat, and whether this gateway is
        alone (parse() reports every live gateway's replicas, idle ones too)."""
        peers, dead, live = parse(raw, self.gateway_id, wall, self.stale_s, self.forget_s)
        if dead:
            self._dead = dead
        was_alone, self.alone = self.alone, not peers
        if was_alone and not self.alone:
            self._schedule()  # what changed while alone: the newcomer reads it now
        self._live = live
        self.lane = (0, 1) if self.alone else lane_of(live, self.gateway_id)
        return peers

    def followed(self) -> dict[str, PeerWork] | None:
        """Other gateways' work per replica id from the followed copy of the hash (no
        round trip: routing waits for nothing), or None while not following (routing
        then reads per request). Parsed again only after a change: between changes the
        last parse is drained by the clock."""
        if self._copy is None or not self._feed_alive():
            return None
        wall = self._clock()
        if self._parsed is not None and self._parsed[0] == self._copy_version:
            _, at, peers = self._parsed
            return {rid: work.drained(wall - at) for rid, work in peers.items()}
        peers = self._take(self._copy, wall)
        for name in self._dead:
            self._copy.pop(name, None)
        self._parsed = (self._copy_version, wall, peers)
        return peers

    async def follow(self, retry_s: float = 1.0, read_timeout_s: float = 2.0) -> None:
        """Keep a copy of the hash: subscribe to its changes, seed the copy with one read,
        then apply each change as it comes. Runs until cancelled. On any failure the copy
        is dropped, so routing reads per request (the fallback) until it is rebuilt."""
        failures = 0
        while True:
            pubsub = self._redis.pubsub()
            try:
                await within(pubsub.subscribe(self.channel), read_timeout_s)
                # Subscribed first: a change made while the seed is read arrives after it
                # (a field written twice is set twice to the same value).
                raw = await within(self._redis.hgetall(self.key), read_timeout_s)
                self._copy = dict(cast(Mapping[bytes, bytes], raw))
                self._copy_version += 1
                self._heard_at = time.monotonic()
                failures = 0
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True,
                                                       timeout=retry_s)
                    if message is not None:
                        self._apply(message["data"])
                    elif not self._feed_alive():
                        raise TimeoutError(f"no change in {self._feed_timeout_s:g} s, "
                                           "not even this gateway's own heartbeat")
            except (RedisError, OSError, TimeoutError, msgspec.DecodeError) as exc:
                failures += 1
                # Once per outage, not once per retry (Redis away, or SUBSCRIBE denied).
                log.log(logging.WARNING if failures == 1 else logging.DEBUG,
                        "shared work: not following changes (%s); reading per request "
                        "until they are followed again", exc)
            finally:
                self._copy = None
                self._parsed = None
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()
            await asyncio.sleep(retry_s)

    @property
    def _feed_timeout_s(self) -> float:
        return 3 * self.heartbeat_s

    def _feed_alive(self) -> bool:
        """Whether the feed spoke lately. This gateway's heartbeat republishes its own
        fields every heartbeat_s and the feed carries them back, so a silent feed is a
        broken one (a half-open connection raises nothing), not an idle fleet."""
        return time.monotonic() - self._heard_at <= self._feed_timeout_s

    def _apply(self, data: bytes) -> None:
        assert self._copy is not None
        self._heard_at = time.monotonic()
        own = self.gateway_id.encode() + b"/"
        wall = self._clock()
        for name, value in _CHANGES_DECODER.decode(data).items():
            if value is None:
                self._copy.pop(name, None)
                continue
            self._copy[name] = value
            if self.alone and not name.startswith(own):
                # Another gateway wrote: this one's changes since its heartbeat go now,
                # before a request here has read the copy again and seen it.
                self._schedule()
            if self.delay_listeners and not name.startswith(own):
                written = _written_at(value)
                if written is not None:
                    for listener in self.delay_listeners:
                        listener(wall - written)
        self._copy_version += 1

    async def heartbeat(self, views: Callable[[], Mapping[str, WorkView]]) -> None:
        """Rewrite every replica's field each heartbeat_s (so live ones never look
        stale) and drop long-dead gateways' fields. Runs until cancelled."""
        while True:
            await self.beat(views())
            await asyncio.sleep(self.heartbeat_s)

    async def beat(self, views: Mapping[str, WorkView]) -> None:
        """One heartbeat: republish every replica's work, delete long-dead fields."""
        for replica_id, view in views.items():
            self.publish(replica_id, view)
        self._schedule()  # alone too: the fields must stay live for a gateway that joins
        dead, self._dead = self._dead, []
        if dead:
            try:
                await within(self._redis.hdel(self.key, *dead), self._write_timeout_s)
            except (RedisError, OSError, TimeoutError) as exc:
                log.debug("shared work cleanup failed: %s", exc)

    async def close(self) -> None:
        """Withdraw this gateway's fields: its work leaves with it."""
        if self._flushing is not None:
            self._flushing.cancel()
            await asyncio.gather(self._flushing, return_exceptions=True)
        fields = [self._field(rid) for rid in self._published | set(self._dirty)]
        if fields:
            try:
                pipe = self._redis.pipeline(transaction=False)
                pipe.hdel(self.key, *fields)
                pipe.publish(self.channel, _CHANGES.encode(dict.fromkeys(fields)))
                await within(pipe.execute(), self._write_timeout_s)
            except (RedisError, OSError, TimeoutError) as exc:
                log.warning("could not withdraw shared work (it goes stale in %.0f s): %s",
                            self.stale_s, exc)
