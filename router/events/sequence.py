"""The order of one replica's KV-event stream, sans I/O: fed (seq, payload), returning plans.

vLLM numbers its batches; PUB/SUB drops messages when a subscriber falls behind the
high-water mark, and the sequence number restarts at 0 when the replica restarts, so the
index is only as right as this bookkeeping:

- seq == last + 1: apply the batch.
- seq <= last: a duplicate (replay overlaps), ignored; unless the batch is newer than
  anything seen (its timestamp; seq 0 when there is none to compare), which means the
  replica restarted with an empty cache: clear the replica's entries at once and follow
  the new stream.
- seq > last + 1: a gap. Ask the replay socket for last onwards, with a deadline. If the
  batch it returns under `last` is not the one we applied (another timestamp), the
  replica restarted while we were not listening: clear, and rebuild from its seq 0.
  If the replay is unavailable or does not cover the gap (its buffer rolled over), clear
  the replica and rebuild from new events. Under-claiming is safe (a missed hit); keeping
  blocks the replica evicted would send requests to a replica that must recompute them.
- The connection to the publisher dropped and came back (`disconnected`): the next batch
  may be a restarted replica's even if its seq follows ours, so it is checked through the
  replay as a gap would be (without replay: clear, follow).
- Resuming (`resume`: a leased indexer took over from another, which stored its position
  with its writes): as after a reconnect, from that position; the replay fills the rest.
- First contact (and after `lost_sync`: the index failed, or the gateway marked the
  replica stale): whatever the index holds for this replica may be stale, so clear it
  and replay from 0 to rebuild from the replica's buffer.
- Catching up (`catch_up`, when a subscription starts): PUB/SUB delivers nothing that
  was published before the subscriber listened, so a replica that went quiet before an
  indexer started, or while the lease passed between indexers, would stay missing from
  the index until its next batch showed the gap. The stream asks the replay socket at
  once: from 0 at first contact (after clearing), from the resumed position otherwise.
- Any replay applies its batches from the last one that clears the replica's blocks
  (AllBlocksCleared) on: what came before is wiped by it, and lookups would see it
  while the replay runs.

A payload that fails to decode is counted and skipped; its sequence number still counts
as received (its events are lost, as a dropped message's would be).

The tracker does no I/O. `receive(seq, payload)` returns a `Plan`: steps to perform in
order (`Clear` the replica's entries, `Apply` a batch to the index, then report it with
`applied`) and, when a replay is needed, `replay_from`: ask the replica's replay socket
for its kept batches from that seq on and hand them to `replayed`, which returns the
next plan. The ZMQ transport (stream.py) performs the plans.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from router.events.stats import StreamStats
from router.kv_events import AllBlocksCleared, EventBatch, EventDecodeError, decode_batch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Clear:
    """Forget what the replica holds: its index entries and the planner's view of them.

    `restart`: the replica restarted, so it may key blocks differently now.
    """

    restart: bool = False


@dataclass(frozen=True)
class Apply:
    """Write one batch to the index, then report it with `SequenceTracker.applied`.

    `batch` None: the payload did not decode; only its sequence number counts.
    """

    seq: int
    batch: EventBatch | None


Step = Clear | Apply


@dataclass(frozen=True)
class Plan:
    """Steps to perform in order; then, if `replay_from` is set, fetch the replay from there."""

    steps: tuple[Step, ...] = ()
    replay_from: int | None = None


@dataclass
class _Recovery:
    """A gap being filled: batches after `last` up to `upto` from the replay, then `incoming`."""

    last: int  # the last seq applied before the gap (-1: none since the last clear)
    # None while catching up: the replay's newest batch takes the incoming's place.
    upto: int | None
    incoming: Apply | None
    restarted: bool = False  # the replay showed a restart: rebuild from seq 0


class SequenceTracker:
    """One replica's stream position: which batches to apply, when to clear, what to replay.

    `has_replay`: the replica has a replay socket; without one a gap clears the replica.
    Sequence counters (duplicates, gaps, replays, restarts...) go to `stats`.
    """

    def __init__(self, replica_id: str, stats: StreamStats, *, has_replay: bool) -> None:
        self.replica_id = replica_id
        self.has_replay = has_replay
        self._stats = stats
        self._last: int | None = None
        self._ts_seq: int | None = None  # the seq whose batch stats.last_event_ts is from
        # Set when the connection to the publisher dropped: the next batch may come from
        # a restarted replica even if its seq happens to follow ours.
        self._reconnected = False
        self._recovery: _Recovery | None = None

    def receive(self, seq: int, payload: bytes) -> Plan:
        """The plan for a batch that arrived on the stream."""
        assert self._recovery is None, "receive() while a replay is pending"
        batch = self.decode(payload)
        last = self._last
        if last is not None and seq <= last and not self._is_restart(seq, last, batch):
            self._stats.duplicates += 1
            return Plan()
        reconnected, self._reconnected = self._reconnected, False
        if last is None or seq <= last:
            # First contact, or a restart: start over from what the replica still keeps.
            if last is not None:
                self._stats.restarts += 1
                log.info("replica %s restarted (seq %d after %d): clearing its entries",
                         self.replica_id, seq, last)
            self._last = -1
            steps: list[Step] = [Clear(restart=last is not None)]
            if seq == 0:
                return self._follow(steps, seq, batch)
            return self._recover(steps, seq, batch)
        if seq > last + 1:
            self._stats.gaps += 1
            return self._recover([], seq, batch)
        if reconnected:
            # The first batch after a reconnect: check through the replay that it follows
            # the batch we applied last (without replay, start over).
            return self._recover([], seq, batch)
        return self._follow([], seq, batch)

    def replayed(self, batches: Mapping[int, bytes]) -> Plan:
        """The plan once the replay asked for by `Plan.replay_from` answered.

        `batches`: seq -> payload of every batch the replica still keeps from there on;
        empty if the replay failed or timed out.
        """
        r = self._recovery
        assert r is not None, "replayed() without a replay pending"
        steps: list[Step] = []
        if (not r.restarted and r.last >= 0 and r.last in batches
                and self._restarted_since(r.last, batches[r.last])):
            self._stats.restarts += 1
            log.info("replica %s restarted during a gap: clearing its entries", self.replica_id)
            steps.append(Clear(restart=True))
            r.restarted = True
            self._last = -1
            if r.last > 0:
                # What we have starts at our old position: the new run needs all from 0.
                return Plan(tuple(steps), replay_from=0)
        if r.upto is None:
            # Catching up: the newest batch the replay holds is the one to follow. None
            # newer than our position (or a failed replay): stay, and let the stream
            # show any gap as usual.
            newest = max(batches, default=-1)
            if newest < (0 if r.restarted else r.last + 1):
                self._recovery = None
                return Plan(tuple(steps))
            r.upto, r.incoming = newest, Apply(newest, self.decode(batches[newest]))
        return self._finish_recovery(steps, batches)

    def catch_up(self) -> Plan:
        """The plan when the subscription starts: replay what the replica kept since our
        position (from 0, after clearing, at first contact). Nothing without replay."""
        assert self._recovery is None, "catch_up() while a replay is pending"
        if not self.has_replay:
            return Plan()
        steps: list[Step] = []
        if self._last is None:
            self._last = -1
            steps.append(Clear())
        self._recovery = _Recovery(self._last, None, None)
        return Plan(tuple(steps), replay_from=max(self._last, 0))

    def applied(self, seq: int, batch: EventBatch | None) -> None:
        """Report that an `Apply` step's writes are in the index."""
        if batch is not None:
            self._stats.last_event_ts = batch.ts
            self._ts_seq = seq
        # Published last: a reader seeing this seq finds the batch's writes in the index.
        self._stats.last_seq = seq

    def resume(self, seq: int, ts: float | None) -> None:
        """Start after a batch another indexer applied (its stored StreamPosition).

        As after a reconnect, the first batch is checked through the replay, which
        also returns every batch after `seq` that this stream never saw.
        """
        self._last = seq
        self._ts_seq = seq
        self._stats.last_seq = seq
        self._stats.last_event_ts = ts
        self._reconnected = True
        self._recovery = None

    def disconnected(self) -> None:
        """The connection to the publisher dropped (ZMQ reconnects by itself)."""
        self._stats.disconnects += 1
        self._reconnected = True

    def lost_sync(self) -> None:
        """The index may disagree with the replica now: resync on the next batch."""
        self._last = None
        self._recovery = None

    def decode(self, payload: bytes) -> EventBatch | None:
        """The batch in a payload, or None (counted in stats.decode_errors) if it is bad."""
        try:
            return decode_batch(payload)
        except EventDecodeError as exc:
            self._stats.decode_errors += 1
            log.warning("replica %s: skipping a bad KV-event payload: %s", self.replica_id, exc)
            return None

    def _follow(self, steps: list[Step], seq: int, batch: EventBatch | None) -> Plan:
        self._last = seq
        return Plan((*steps, Apply(seq, batch)))

    def _recover(self, steps: list[Step], upto: int, batch: EventBatch | None) -> Plan:
        """Fill (last, upto) from the replay socket, or clear and start over at upto."""
        assert self._last is not None
        self._recovery = _Recovery(self._last, upto, Apply(upto, batch))
        if not self.has_replay:
            return self._finish_recovery(steps, {})
        # Ask from the last batch seen, too: if the replica restarted while we were not
        # listening, its batch under that number is a different (newer) one.
        return Plan(tuple(steps), replay_from=max(self._last, 0))

    def _finish_recovery(self, steps: list[Step], batches: Mapping[int, bytes]) -> Plan:
        r = self._recovery
        assert r is not None and r.upto is not None and r.incoming is not None
        self._recovery = None
        start = 0 if r.restarted else r.last + 1
        # Without our last batch in the replay, continuity is not established.
        complete = self.has_replay and all(s in batches for s in range(start, r.upto)) and not (
            r.last >= 0 and start > 0 and r.last not in batches)
        if not complete:
            if self.has_replay:
                self._stats.replay_failures += 1
            # Loud: from here until its blocks are stored again, lookups miss whatever
            # the replica held before, as a cold replica's would.
            log.warning("replica %s: batches %d..%d not recovered (%s): clearing its entries",
                        self.replica_id, start, r.upto - 1,
                        "replay unavailable or rolled over" if self.has_replay else "no replay")
            # The replica's state before `upto` is unknown: forget it, follow new events.
            steps.append(Clear())
        else:
            self._stats.replays += 1
            replay = [Apply(s, self.decode(batches[s])) for s in range(start, r.upto)]
            steps.extend(replay[_from_last_clear([*replay, r.incoming]):])
        return self._follow(steps, r.upto, r.incoming.batch)

    def _is_restart(self, seq: int, last: int, batch: EventBatch | None) -> bool:
        if seq == last:
            return False
        # A duplicate carries its original timestamp; a restarted replica's batch is newer
        # than anything it sent before. Without timestamps to compare, seq 0 decides.
        last_ts = self._stats.last_event_ts
        if batch is None or last_ts is None:
            return seq == 0
        return batch.ts > last_ts

    def _restarted_since(self, seq: int, payload: bytes) -> bool:
        """Whether the replica's batch under `seq` is not the one we applied."""
        last_ts = self._stats.last_event_ts
        if last_ts is None or self._ts_seq != seq:
            return False
        try:
            return decode_batch(payload).ts != last_ts
        except EventDecodeError:
            return False


def _from_last_clear(applies: list[Apply]) -> int:
    """Where a replay may start: at the last batch that clears the replica's blocks.

    Everything before an AllBlocksCleared is wiped by it, and applying it anyway is not
    free: a replay from 0 re-applies every batch the replica kept (up to its whole
    buffer), one write at a time, and while it runs lookups see those older states. A
    sim reset between benchmark runs showed it: the next run's first requests were
    predicted hits on blocks the reset had dropped, for as long as the replay took.
    """
    for i in range(len(applies) - 1, -1, -1):
        batch = applies[i].batch
        if batch is not None and any(isinstance(e, AllBlocksCleared) for e in batch.events):
            return i
    return 0
