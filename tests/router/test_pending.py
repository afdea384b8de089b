"""Pending chains: a routed prefix counts on its replica until events can confirm it."""

from __future__ import annotations

from router.pending import PendingChains, merge_matches


def test_a_routed_chain_matches_its_leading_run_on_that_replica_only() -> None:
    pending = PendingChains(ttl_s=10.0)
    pending.add("m", "r0", [1, 2, 3, 4], now=0.0)
    assert pending.matches("m", [1, 2, 3, 4, 5], ["r0", "r1"], now=1.0) == {"r0": 4}
    assert pending.matches("m", [1, 2, 9, 4], ["r0"], now=1.0) == {"r0": 2}
    assert pending.matches("m", [9, 1, 2], ["r0"], now=1.0) == {}
    assert pending.matches("other-model", [1, 2], ["r0"], now=1.0) == {}


def test_pending_keys_continue_the_indexed_run_of_their_replica() -> None:
    # The index knows r0 holds blocks 1, 2; the gateway routed 3, 4 (only the new tail).
    pending = PendingChains(ttl_s=10.0)
    pending.add("m", "r0", [3, 4], now=0.0)
    assert pending.blocks == 2
    chain = [1, 2, 3, 4, 5]
    assert pending.matches("m", chain, ["r0", "r1"], now=1.0, known={"r0": 2}) == {"r0": 4}
    # Without the indexed prefix the tail is not a leading run: nothing to add.
    assert pending.matches("m", chain, ["r0"], now=1.0) == {}
    assert pending.matches("m", chain, ["r0"], now=1.0, known={"r0": 1}) == {}
    # Another replica's indexed run is not continued by r0's pending keys.
    assert pending.matches("m", chain, ["r1"], now=1.0, known={"r1": 2}) == {}


def test_entries_expire_after_the_ttl() -> None:
    pending = PendingChains(ttl_s=2.0)
    pending.add("m", "r0", [1, 2], now=0.0)
    pending.add("m", "r1", [1, 2], now=1.0)
    assert pending.matches("m", [1, 2], ["r0", "r1"], now=1.9) == {"r0": 2, "r1": 2}
    assert pending.matches("m", [1, 2], ["r0", "r1"], now=2.5) == {"r1": 2}
    assert pending.matches("m", [1, 2], ["r0", "r1"], now=3.0) == {}
    assert len(pending) == 0


def test_dropping_a_failed_route_keeps_other_routes_of_the_same_prefix() -> None:
    pending = PendingChains(ttl_s=10.0)
    first = pending.add("m", "r0", [1, 2, 3], now=0.0)
    pending.add("m", "r0", [1, 2], now=0.5)
    pending.drop(first)
    assert pending.matches("m", [1, 2, 3], ["r0"], now=1.0) == {"r0": 2}
    pending.drop(first)  # twice is harmless


def test_capacity_evicts_the_oldest_routes_first() -> None:
    pending = PendingChains(ttl_s=10.0, capacity_blocks=5)
    pending.add("m", "r0", [1, 2, 3], now=0.0)
    pending.add("m", "r1", [7, 8, 9], now=0.1)  # 6 blocks > 5: r0's route goes
    assert pending.matches("m", [1, 2, 3], ["r0"], now=0.2) == {}
    assert pending.matches("m", [7, 8, 9], ["r1"], now=0.2) == {"r1": 3}


def test_zero_ttl_turns_it_off() -> None:
    pending = PendingChains(ttl_s=0.0)
    pending.add("m", "r0", [1, 2], now=0.0)
    assert pending.matches("m", [1, 2], ["r0"], now=0.0) == {}


def test_merge_takes_the_longer_match_per_replica() -> None:
    assert merge_matches({"a": 3, "b": 1}, {"b": 4, "c": 2}) == {"a": 3, "b": 4, "c": 2}


def test_extending_a_route_continues_its_chain_and_counts_towards_capacity() -> None:
    pending = PendingChains(ttl_s=10.0, capacity_blocks=6)
    handle = pending.add("m", "r0", [1, 2], now=0.0)
    pending.extend(handle, [3, 4])
    assert pending.matches("m", [1, 2, 3, 4, 5], ["r0"], now=1.0) == {"r0": 4}
    assert pending.blocks == 4
    other = pending.add("m", "r1", [7, 8], now=0.5)
    pending.extend(other, [9])  # 7 blocks > 6: the oldest route, extended, goes whole
    assert pending.matches("m", [1, 2], ["r0"], now=1.0) == {}
    assert pending.matches("m", [7, 8, 9], ["r1"], now=1.0) == {"r1": 3}
    pending.drop(other)
    pending.extend(other, [10])  # a route that is gone stays gone
    assert pending.blocks == 0 and len(pending) == 0


def test_an_unfinished_route_is_finished_by_the_first_request_sharing_its_last_key() -> None:
    pending = PendingChains(ttl_s=10.0)
    finished: list[str] = []
    a = pending.add("m", "r0", [1, 2], now=0.0,
                    unfinished=lambda: (finished.append("a"), pending.extend(a, [3, 4])))
    dropped = pending.add("m", "r1", [7, 8], now=0.0, unfinished=lambda: finished.append("x"))
    pending.drop(dropped)  # a route that is gone is never finished
    assert not pending.finish_overlapping([1, 9])  # shares block 1 only: not the probe's end
    assert not pending.finish_overlapping([7, 8, 9])
    assert pending.finish_overlapping([1, 2, 5])
    assert finished == ["a"]
    assert pending.matches("m", [1, 2, 3, 4], ["r0"], now=1.0) == {"r0": 4}
    assert not pending.finish_overlapping([1, 2, 5])  # once only
    # Expiry forgets the callback as well.
    pending.add("m", "r0", [5, 6], now=0.0, unfinished=lambda: finished.append("late"))
    pending.add("m", "r2", [9], now=20.0)
    assert not pending.finish_overlapping([5, 6]) and finished == ["a"]


def test_an_unfinished_route_with_no_keys_yet_is_kept_for_its_rest() -> None:
    # A chat whose keyed blocks its replica holds already, decided before its newest
    # text was encoded: nothing to hold yet, but the rest, keyed after sending, must
    # still go pending there (continuing the replica's indexed run).
    pending = PendingChains(ttl_s=10.0)
    handle = pending.add("m", "r0", [], now=0.0, unfinished=lambda: None)
    assert pending.blocks == 0 and len(pending) == 1
    assert not pending.finish_overlapping([1, 2])  # no last key: nothing to share
    pending.extend(handle, [3, 4])
    assert pending.matches("m", [1, 2, 3, 4, 5], ["r0"], now=1.0, known={"r0": 2}) == {"r0": 4}
    pending.drop(handle)
    assert pending.blocks == 0 and len(pending) == 0
    # without a rest to come, no keys make no route; expiry of an empty one is clean
    assert pending.add("m", "r0", [], now=0.0) >= 0 and len(pending) == 0
    pending.add("m", "r1", [], now=0.0, unfinished=lambda: None)
    pending.add("m", "r2", [9], now=20.0)
    assert len(pending) == 1 and pending.blocks == 1
