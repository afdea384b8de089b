"""The KV-event sequence tracker, sans I/O: batches in, plans out (no sockets, no index).

A plan is described as a list: "clear" / "restart" (clear the replica's entries), a
seq (apply that batch), "skip N" (seq N counts but its payload did not decode) and
last "replay from N" (fetch the replica's replay buffer from N, then `replayed`).
"""

from __future__ import annotations

import time

from router.events.sequence import Apply, Clear, Plan, SequenceTracker
from router.events.stats import StreamStats
from router.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    encode_batch,
    encoded_ids,
)


def stored(key: int, parent: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=[key], parent_block_hash=parent, token_ids=encoded_ids([0] * 4),
                       block_size=4, lora_id=None, medium="GPU", lora_name=None)


class Replica:
    """A replica's publishing side as the tracker sees it: numbered payloads, a replay buffer."""

    def __init__(self) -> None:
        self.buffer: dict[int, bytes] = {}
        self.next_seq = 0
        self.replay_floor = 0  # batches below this were dropped from the replay buffer
        self.clock = time.time()

    def publish(self, *events: KVEvent, seq: int | None = None, ts: float | None = None
                ) -> tuple[int, bytes]:
        """The next batch (seq, payload); each newer than the last unless `ts` says."""
        seq = self.next_seq if seq is None else seq
        self.next_seq = seq + 1
        self.clock += 1
        payload = encode_batch(EventBatch(ts=self.clock if ts is None else ts,
                                          events=list(events) or [stored(seq + 100)]))
        self.buffer[seq] = payload
        return seq, payload

    def replay(self, start: int) -> dict[int, bytes]:
        """What its replay socket answers for `start`."""
        return {s: p for s, p in self.buffer.items() if s >= max(start, self.replay_floor)}

    def restart(self) -> None:
        """Sequence numbers from 0, an empty replay buffer."""
        self.buffer.clear()
        self.next_seq = 0


def tracking(*, replay: bool = True) -> tuple[SequenceTracker, StreamStats]:
    stats = StreamStats()
    return SequenceTracker("r1", stats, has_replay=replay), stats


def described(plan: Plan) -> list[object]:
    out: list[object] = []
    for step in plan.steps:
        if isinstance(step, Clear):
            out.append("restart" if step.restart else "clear")
        else:
            out.append(step.seq if step.batch is not None else f"skip {step.seq}")
    if plan.replay_from is not None:
        out.append(f"replay from {plan.replay_from}")
    return out


def performed(tracker: SequenceTracker, plan: Plan) -> list[object]:
    """Report a plan's batches applied, as the stream does once they are in the index."""
    for step in plan.steps:
        if isinstance(step, Apply):
            tracker.applied(step.seq, step.batch)
    return described(plan)


def receive(tracker: SequenceTracker, message: tuple[int, bytes]) -> list[object]:
    return performed(tracker, tracker.receive(*message))


def replayed(tracker: SequenceTracker, batches: dict[int, bytes]) -> list[object]:
    return performed(tracker, tracker.replayed(batches))


def test_first_contact_clears_then_batches_follow_in_order() -> None:
    replica, (tracker, stats) = Replica(), tracking()
    assert receive(tracker, replica.publish()) == ["clear", 0]
    assert receive(tracker, replica.publish()) == [1]
    assert receive(tracker, replica.publish()) == [2]
    assert stats.last_seq == 2
    assert (stats.gaps, stats.replays, stats.duplicates, stats.restarts) == (0, 0, 0, 0)


def test_a_gap_is_filled_from_the_replay() -> None:
    replica, (tracker, stats) = Replica(), tracking()
    assert receive(tracker, replica.publish()) == ["clear", 0]
    replica.publish()  # lost by PUB
    replica.publish()
    # From the last batch seen, too, to check that it is still ours.
    assert receive(tracker, replica.publish()) == ["replay from 0"]
    assert replayed(tracker, replica.replay(0)) == [1, 2, 3]
    assert (stats.gaps, stats.replays, stats.replay_failures) == (1, 1, 0)
    assert stats.restarts == 0


def test_a_gap_without_replay_clears_the_replica() -> None:
    replica, (tracker, stats) = Replica(), tracking(replay=False)
    assert receive(tracker, replica.publish()) == ["clear", 0]
    replica.publish()  # lost
    # What the replica held before the gap is unknown, so it is forgotten; new events count.
    assert receive(tracker, replica.publish()) == ["clear", 2]
    assert (stats.gaps, stats.replays, stats.replay_failures) == (1, 0, 0)


def test_an_incomplete_replay_clears_the_replica() -> None:
    replica, (tracker, stats) = Replica(), tracking()
    receive(tracker, replica.publish())
    replica.publish()
    replica.publish()
    replica.replay_floor = 2  # the replica's buffer rolled over: seq 1 is gone
    assert receive(tracker, replica.publish()) == ["replay from 0"]
    assert replayed(tracker, replica.replay(0)) == ["clear", 3]
    assert (stats.replays, stats.replay_failures) == (0, 1)


def test_a_replay_that_failed_clears_the_replica() -> None:
    replica, (tracker, stats) = Replica(), tracking()
    receive(tracker, replica.publish())
    replica.publish()
    assert receive(tracker, replica.publish()) == ["replay from 0"]
    assert replayed(tracker, {}) == ["clear", 2]  # the socket timed out: nothing came
    assert stats.replay_failures == 1


def test_sequence_back_to_zero_means_restart_and_clears() -> None:
    replica, (tracker, stats) = Replica(), tracking()
    receive(tracker, replica.publish())
    receive(tracker, replica.publish())
    replica.restart()
    assert receive(tracker, replica.publish()) == ["restart", 0]
    assert stats.restarts == 1
    assert receive(tracker, replica.publish()) == [1]  # seq 1 of the new run: no gap
    assert stats.gaps == 0


def test_a_restart_hidden_in_a_gap_is_found_through_the_replay() -> None:
    replica, (tracker, stats) = Replica(), tracking()
    receive(tracker, replica.publish())
    receive(tracker, replica.publish())
    replica.restart()  # the replica restarts, and its first batches are lost to us
    replica.publish()
    replica.publish()
    replica.publish()
    assert receive(tracker, replica.publish()) == ["replay from 1"]  # looks like a plain gap
    # Its seq 1 is not ours (a newer batch): everything from 0 is the new run's.
    assert replayed(tracker, replica.replay(1)) == ["restart", "replay from 0"]
    assert replayed(tracker, replica.replay(0)) == [0, 1, 2, 3]
    assert stats.restarts == 1


def test_a_restart_whose_seq_happens_to_follow_ours_is_found_after_a_reconnect() -> None:
    replica, (tracker, stats) = Replica(), tracking()
    receive(tracker, replica.publish())
    receive(tracker, replica.publish())
    tracker.disconnected()
    replica.restart()
    # The restarted replica's seq 0 and 1 went out before we reconnected; its seq 2
    # is exactly what we expect next.
    replica.publish()
    replica.publish()
    assert receive(tracker, replica.publish()) == ["replay from 1"]
    assert replayed(tracker, replica.replay(1)) == ["restart", "replay from 0"]
    assert replayed(tracker, replica.replay(0)) == [0, 1, 2]
    assert (stats.restarts, stats.gaps, stats.disconnects) == (1, 0, 1)


def test_a_reconnect_to_the_same_run_keeps_the_entries() -> None:
    replica, (tracker, stats) = Replica(), tracking()
    receive(tracker, replica.publish())
    tracker.disconnected()  # a network blip: same replica, same sequence
    assert receive(tracker, replica.publish()) == ["replay from 0"]  # the continuity check
    assert replayed(tracker, replica.replay(0)) == [1]  # no clear: entries stay
    assert (stats.restarts, stats.replays) == (0, 1)
    assert receive(tracker, replica.publish()) == [2]  # checked once per reconnect


def test_a_reconnect_without_replay_starts_over() -> None:
    replica, (tracker, _) = Replica(), tracking(replay=False)
    receive(tracker, replica.publish())
    tracker.disconnected()
    assert receive(tracker, replica.publish()) == ["clear", 1]


def test_duplicates_are_ignored() -> None:
    replica, (tracker, stats) = Replica(), tracking()
    ts = time.time()
    first = replica.publish(stored(1), ts=ts)
    second = replica.publish(BlockRemoved(block_hashes=[1], medium="GPU"), ts=ts + 1)
    assert receive(tracker, first) == ["clear", 0]
    assert receive(tracker, second) == [1]
    assert receive(tracker, first) == []  # re-sent old batches
    assert receive(tracker, second) == []
    assert receive(tracker, replica.publish(stored(5), seq=2, ts=ts + 2)) == [2]
    assert receive(tracker, first) == []
    assert receive(tracker, replica.publish(stored(6, parent=5), seq=3, ts=ts + 3)) == [3]
    assert (stats.duplicates, stats.restarts) == (3, 0)


def test_a_garbage_payload_is_counted_and_its_seq_still_counts() -> None:
    replica, (tracker, stats) = Replica(), tracking()
    receive(tracker, replica.publish())
    assert receive(tracker, (1, b"\x93not msgpack at all")) == ["skip 1"]
    replica.next_seq = 2
    assert receive(tracker, replica.publish()) == [2]
    assert (stats.decode_errors, stats.gaps) == (1, 0)


def test_first_contact_rebuilds_from_the_replay_buffer() -> None:
    replica, (tracker, _) = Replica(), tracking()
    replica.publish()  # the replica was busy before anyone subscribed
    replica.publish()
    # The clear drops whatever an earlier indexer left; the replay rebuilds the rest.
    assert receive(tracker, replica.publish()) == ["clear", "replay from 0"]
    assert replayed(tracker, replica.replay(0)) == [0, 1, 2]


def test_a_replay_starts_at_the_last_batch_that_clears_the_replica() -> None:
    # Batches before an AllBlocksCleared change nothing once it is applied; replaying
    # them would only show lookups the replica's old blocks while the replay runs.
    replica, (tracker, stats) = Replica(), tracking()
    replica.publish()
    replica.publish(AllBlocksCleared(), stored(7))
    replica.publish()
    assert receive(tracker, replica.publish()) == ["clear", "replay from 0"]
    assert replayed(tracker, replica.replay(0)) == [1, 2, 3]
    # The batch that made contact clears the replica itself (the first step after a
    # reset): nothing before it is replayed.
    replica, (tracker, stats) = Replica(), tracking()
    replica.publish()
    replica.publish()
    assert receive(tracker, replica.publish(AllBlocksCleared(), stored(9))) == [
        "clear", "replay from 0"]
    assert replayed(tracker, replica.replay(0)) == [2]
    assert (stats.replays, stats.last_seq) == (1, 2)
    # A gap is filled the same way.
    replica, (tracker, stats) = Replica(), tracking()
    receive(tracker, replica.publish())
    replica.publish()  # lost by PUB
    replica.publish(AllBlocksCleared())  # lost by PUB
    assert receive(tracker, replica.publish()) == ["replay from 0"]
    assert replayed(tracker, replica.replay(0)) == [2, 3]


def test_after_losing_sync_the_next_batch_rebuilds_from_the_replay_buffer() -> None:
    replica, (tracker, _) = Replica(), tracking()
    receive(tracker, replica.publish())
    tracker.lost_sync()  # the gateway marked the replica stale, or the index failed
    assert receive(tracker, replica.publish()) == ["clear", "replay from 0"]
    # Back: the whole buffer is replayed, so blocks from before the outage return.
    assert replayed(tracker, replica.replay(0)) == [0, 1]


def test_a_batch_is_published_as_applied_only_when_reported() -> None:
    replica, (tracker, stats) = Replica(), tracking()
    plan = tracker.receive(*replica.publish())
    assert stats.last_seq is None  # its writes are not in the index yet
    step = plan.steps[-1]
    assert isinstance(step, Apply) and step.batch is not None
    tracker.applied(step.seq, step.batch)
    assert (stats.last_seq, stats.last_event_ts) == (0, step.batch.ts)


def caught_up(tracker: SequenceTracker) -> list[object]:
    return performed(tracker, tracker.catch_up())


def test_a_new_subscription_replays_what_was_published_before_it_listened() -> None:
    replica, (tracker, stats) = Replica(), tracking()
    for _ in range(3):
        replica.publish()  # before the SUB listened: PUB delivered none of them
    assert caught_up(tracker) == ["clear", "replay from 0"]
    assert replayed(tracker, replica.replay(0)) == [0, 1, 2]
    assert stats.last_seq == 2
    assert receive(tracker, replica.publish()) == [3]  # live batches follow on
    assert (stats.gaps, stats.replays, stats.replay_failures) == (0, 1, 0)


def test_catching_up_with_a_quiet_replica_changes_nothing() -> None:
    replica, (tracker, stats) = Replica(), tracking()
    assert caught_up(tracker) == ["clear", "replay from 0"]
    assert replayed(tracker, replica.replay(0)) == []
    assert stats.last_seq is None
    assert receive(tracker, replica.publish()) == [0]  # its first batch, in order
    assert (stats.gaps, stats.replays, stats.replay_failures) == (0, 0, 0)


def test_a_failed_catch_up_leaves_the_next_batch_to_show_the_gap() -> None:
    replica, (tracker, stats) = Replica(), tracking()
    replica.publish()
    assert caught_up(tracker) == ["clear", "replay from 0"]
    assert replayed(tracker, {}) == []  # the replay socket did not answer
    assert receive(tracker, replica.publish()) == ["replay from 0"]
    assert replayed(tracker, replica.replay(0)) == [0, 1]
    assert (stats.gaps, stats.replays) == (1, 1)


def test_a_resumed_subscription_catches_up_from_its_predecessors_position() -> None:
    replica, (tracker, stats) = Replica(), tracking()
    for _ in range(5):
        replica.publish()
    tracker.resume(2, replica.clock - 2)  # the predecessor applied 0..2, then the lease passed
    assert caught_up(tracker) == ["replay from 2"]
    assert replayed(tracker, replica.replay(2)) == [3, 4]  # no clear: 0..2 stay
    assert (stats.last_seq, stats.restarts, stats.replays) == (4, 0, 1)


def test_a_replica_that_restarted_while_the_lease_passed_is_rebuilt_when_caught_up() -> None:
    replica, (tracker, stats) = Replica(), tracking()
    for _ in range(4):
        replica.publish()
    tracker.resume(3, replica.clock)
    replica.restart()
    for _ in range(5):
        replica.publish()  # the new run's seq 3 is another batch than the one applied
    assert caught_up(tracker) == ["replay from 3"]
    assert replayed(tracker, replica.replay(3)) == ["restart", "replay from 0"]
    assert replayed(tracker, replica.replay(0)) == [0, 1, 2, 3, 4]
    assert stats.restarts == 1


def test_without_replay_there_is_nothing_to_catch_up() -> None:
    replica, (tracker, _) = Replica(), tracking(replay=False)
    assert caught_up(tracker) == []
    assert receive(tracker, replica.publish()) == ["clear", 0]
