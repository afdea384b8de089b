"""Outstanding work per replica: pending prefills drain first come, first served."""

from __future__ import annotations

import math

import pytest

from router.outstanding import (
    BIAS_ALPHA,
    BIAS_MAX,
    PRIOR_LOG_VAR,
    FleetBias,
    OutstandingWork,
    ReadingCount,
    WorkView,
    fleet_bias,
    toward_fleet,
)


def test_idle_replica_has_no_wait() -> None:
    view = OutstandingWork().view(now=5.0)
    assert (view.wait_s, view.pending, view.decoding, view.bias) == (0.0, 0, 0, 1.0)


def test_pending_prefills_add_up_and_drain_with_time() -> None:
    work = OutstandingWork()
    work.begin(10.0, prefill_s=0.5, predicted_ttft_s=0.5, stream=True)
    work.begin(10.1, prefill_s=0.3, predicted_ttft_s=0.8, stream=True)
    # Both queued from the first one's dispatch at 10.0: 0.8 s of work ends at 10.8.
    assert work.view(10.1).wait_s == pytest.approx(0.7)
    assert work.view(10.5).wait_s == pytest.approx(0.3)
    assert work.view(11.0).wait_s == 0.0  # overdue: nothing predicted ahead, not negative
    assert work.view(10.5).pending == 2


def test_first_byte_reanchors_the_queue_at_a_measured_point() -> None:
    work = OutstandingWork()
    a = work.begin(0.0, prefill_s=1.0, predicted_ttft_s=1.0, stream=False)
    work.begin(0.0, prefill_s=1.0, predicted_ttft_s=2.0, stream=True)
    # The replica was slower than predicted: a's first byte at 1.5, not 1.0. What is
    # left (the second request) is counted from there, not from the old prediction.
    work.first_byte(a, 1.5)
    view = work.view(1.6)
    assert view.pending == 1 and view.decoding == 1
    assert view.wait_s == pytest.approx(1.5 + 1.0 - 1.6)


def test_end_removes_a_request_whatever_its_state() -> None:
    work = OutstandingWork()
    a = work.begin(0.0, 0.2, 0.2, stream=True)
    b = work.begin(0.0, 0.2, 0.4, stream=True)
    work.first_byte(a, 0.2)
    work.end(a, 0.3)
    work.end(b, 0.3)  # failed before its first byte
    work.end(b, 0.3)  # twice is harmless
    assert len(work) == 0 and work.view(0.3).wait_s == 0.0


def test_a_new_queue_starts_when_the_last_one_emptied() -> None:
    work = OutstandingWork()
    a = work.begin(0.0, 0.1, 0.1, stream=True)
    work.first_byte(a, 0.1)
    work.end(a, 5.0)
    work.begin(100.0, 0.4, 0.4, stream=True)
    assert work.view(100.0).wait_s == pytest.approx(0.4)


def test_non_streamed_requests_stop_counting_as_prefill_after_their_prediction() -> None:
    # A non-streamed answer shows its first byte only at the end; its prefill is
    # counted for the predicted time only, then it counts as decoding.
    work = OutstandingWork()
    work.begin(0.0, prefill_s=0.5, predicted_ttft_s=0.5, stream=False)
    assert work.view(0.2).pending == 1
    later = work.view(0.6)
    assert (later.pending, later.decoding, later.wait_s) == (0, 1, 0.0)


def test_bias_learns_a_replica_slower_than_its_profile() -> None:
    work = OutstandingWork()
    for i in range(60):
        t = float(i)
        # The policy's prediction before the bias, which is learned against it.
        token = work.begin(t, prefill_s=0.1, predicted_ttft_s=0.1, stream=True)
        work.first_byte(token, t + 0.3)  # always 3x slower than the profile says
        work.end(token, t + 0.5)
    assert work.bias == pytest.approx(3.0, rel=0.02)
    # And the queue ahead is scaled by it: 0.1 s of predicted work reads as 0.3 s.
    work.begin(100.0, prefill_s=0.1, predicted_ttft_s=0.3, stream=True)
    assert work.view(100.0).wait_s == pytest.approx(0.3, rel=0.02)


def test_the_bias_is_a_mean_of_recent_measurements_and_never_past_its_bounds() -> None:
    work = OutstandingWork()
    token = work.begin(0.0, 0.1, 0.1, stream=True)
    work.first_byte(token, 0.2)
    assert work.bias == 1.0  # learned when the request ends (its usage known)
    work.end(token, 0.3)
    # One measurement is all its own evidence (how far to trust it is toward_fleet's).
    assert work.bias == pytest.approx(2.0)
    token = work.begin(1.0, 0.1, 0.1, stream=True)
    work.first_byte(token, 1.05)
    work.end(token, 1.1)
    # Two: their weighted mean in log space, the newer weighing more.
    w_new = BIAS_ALPHA / (1 - (1 - BIAS_ALPHA) ** 2)
    assert math.log(work.bias) == pytest.approx(
        w_new * math.log(0.5) + (1 - w_new) * math.log(2.0))
    for i in range(200):
        token = work.begin(float(i), 0.01, 0.01, stream=True)
        work.first_byte(token, i + 10.0)  # 1000x slower, every time
        work.end(token, i + 10.5)
    assert work.bias == pytest.approx(BIAS_MAX)


@pytest.mark.parametrize(("cached", "learned"), [(4800, 2.0), (None, 2.0), (0, 1.0), (4816, 1.0)])
def test_a_reading_learns_only_where_the_replica_cached_what_was_predicted(
        cached: int | None, learned: float) -> None:
    # Predicted with 4,800 tokens cached, twice as slow as predicted. A replica reporting
    # other cached tokens (it had evicted the prefix, or held more of it) was timed on
    # other work: that says nothing about its speed. Not reported (None): taken as is.
    work = OutstandingWork()
    token = work.begin(0.0, 0.1, 0.1, stream=True, predicted_cached=4800)
    work.first_byte(token, 0.2)
    work.end(token, 0.5, cached_tokens=cached)
    assert work.bias == pytest.approx(learned)
    assert work.view(1.0).samples == (1 if learned != 1.0 else 0)


def test_non_streamed_requests_do_not_teach_the_bias() -> None:
    work = OutstandingWork()
    token = work.begin(0.0, 0.1, 0.1, stream=False)
    work.first_byte(token, 5.0)  # the whole answer, not its first token
    assert work.bias == 1.0


def test_mean_prefill_follows_recent_requests() -> None:
    work = OutstandingWork()
    work.begin(0.0, 1.0, 1.0, stream=True)
    assert work.view(0.0).mean_prefill_s == 1.0
    work.begin(0.0, 0.0, 0.0, stream=True)
    assert work.view(0.0).mean_prefill_s == pytest.approx(1.0 - BIAS_ALPHA)


def _learned(ratios: list[float], work: OutstandingWork | None = None) -> OutstandingWork:
    """A replica whose streamed requests took `ratios` times their prediction."""
    work = work if work is not None else OutstandingWork()
    for i, ratio in enumerate(ratios):
        token = work.begin(float(i), 0.1, 0.1, stream=True)
        work.first_byte(token, i + 0.1 * ratio)
        work.end(token, i + 0.5)
    return work


def test_an_untried_replica_takes_its_fleets_bias() -> None:
    # Two replicas learned the profile is ~4x slow; the third has served nothing (new,
    # or back from an ejection). On its own 1.0 it would look 4x faster than it is -- or
    # with peers 4x fast, 4x slower, and never get the traffic to learn otherwise.
    fast = [_learned([0.25] * 80).view(100.0) for _ in range(2)]
    fresh = OutstandingWork().view(100.0)
    fleet = fleet_bias([*fast, fresh])
    assert fleet.bias == pytest.approx(0.25, rel=0.02)
    assert toward_fleet(fresh, fleet).bias == pytest.approx(fleet.bias)


def test_a_replica_with_few_readings_is_as_fast_as_they_say() -> None:
    # The trap seen on 8 identical sims (2026-12-05): every replica measured at half its
    # prediction, but the two that had served 8 requests carried 0.67 (an exponential
    # mean started at 1.0 still holds 0.9^8 of its start), looked a third dearer than
    # their peers, got a third of the requests and so kept their start.
    peers = [_learned([0.5] * 80).view(100.0) for _ in range(3)]
    newer = _learned([0.5] * 8).view(100.0)
    fleet = fleet_bias([*peers, newer])
    assert newer.bias == pytest.approx(0.5)
    assert toward_fleet(newer, fleet).bias == pytest.approx(0.5)


def test_a_few_slow_readings_in_a_noisy_fleet_barely_move_a_replica() -> None:
    # Identical replicas whose readings scatter by 2x either way (a predicted queue is
    # a guess under load): one whose first eight came out 1.5x slow must not look 1.5x
    # dearer than its peers, or it gets few requests to correct that with.
    noisy = [0.5, 2.0] * 20
    peers = [_learned(noisy).view(100.0) for _ in range(5)]
    unlucky = _learned([1.5] * 8).view(100.0)
    fleet = fleet_bias([*peers, unlucky])
    assert fleet.log_var == pytest.approx(math.log(2.0) ** 2, rel=0.35)
    assert unlucky.bias / fleet.bias == pytest.approx(1.5, rel=0.05)
    assert toward_fleet(unlucky, fleet).bias / fleet.bias < 1.2


def test_a_replica_really_slower_than_its_peers_keeps_most_of_it() -> None:
    steady = [_learned([1.0, 1.1, 0.9] * 20).view(100.0) for _ in range(3)]
    slow = _learned([3.0, 3.3, 2.7] * 20).view(100.0)
    fleet = fleet_bias([*steady, slow])
    assert fleet.bias == pytest.approx(1.0, rel=0.1)
    assert toward_fleet(slow, fleet).bias > 2.8
    # And its peers, level with the fleet, stay where they are.
    assert toward_fleet(steady[0], fleet).bias == pytest.approx(steady[0].bias, rel=0.02)


def test_the_fleets_first_readings_count_for_little_against_each_other() -> None:
    # Every replica's first request at once, one of them slow: no replica has two
    # readings yet, so their spread is the prior's and the slow one stays near the rest.
    views = [_learned([1.0]).view(10.0) for _ in range(3)] + [_learned([2.0]).view(10.0)]
    fleet = fleet_bias(views)
    assert fleet.log_var == PRIOR_LOG_VAR
    assert toward_fleet(views[-1], fleet).bias < 1.25


def test_an_unlucky_start_ages_while_the_fleet_gets_the_readings() -> None:
    # The trap seen on 8 identical sims (2026-12-05): one sim's first two readings came
    # out 2-3x its peers', it looked dearer for everything and got no request for 27 s.
    # Its deviation ages by the readings it missed at a fair share of the fleet's.
    readings = ReadingCount(replicas=8)
    peers = [OutstandingWork(fleet_readings=readings) for _ in range(7)]
    for work in peers:
        _learned([0.5, 0.6] * 10, work)
    unlucky = _learned([1.45, 0.73], OutstandingWork(fleet_readings=readings))

    def drawn() -> float:
        views = [w.view(100.0) for w in [*peers, unlucky]]
        return toward_fleet(views[-1], fleet_bias(views)).bias / fleet_bias(views).bias

    assert unlucky.view(100.0).missed_readings == 0
    assert drawn() > 1.4  # fresh evidence, far outside the fleet's spread: kept
    for work in peers:
        _learned([0.5, 0.6] * 10, work)  # 20 more each: 17.5 missed at a fair share
    assert unlucky.view(100.0).missed_readings == 17.5  # 140 of the fleet's, over 8
    assert drawn() < 1.1
    # One new reading of its own, as slow: the deviation is back, fresh.
    _learned([1.45], unlucky)
    assert unlucky.view(100.0).missed_readings == 0
    assert drawn() > 1.4


def test_a_replica_really_slower_keeps_it_while_it_gets_its_share() -> None:
    readings = ReadingCount(replicas=4)
    steady = [OutstandingWork(fleet_readings=readings) for _ in range(3)]
    slow = OutstandingWork(fleet_readings=readings)
    for _ in range(20):  # readings interleaved across the fleet, as a router spreads them
        for work in steady:
            _learned([1.0, 1.1, 0.9], work)
        _learned([3.0, 3.3, 2.7], slow)
    views = [w.view(100.0) for w in [*steady, slow]]
    assert views[-1].missed_readings == 0
    assert toward_fleet(views[-1], fleet_bias(views)).bias > 2.8


def test_the_drawn_bias_rescales_the_queue_too() -> None:
    work = OutstandingWork()
    work.begin(0.0, 0.4, 0.4, stream=True)
    view = work.view(0.0)
    assert toward_fleet(view, FleetBias(math.log(0.5))).wait_s == pytest.approx(0.2)


def test_fleet_bias_is_one_until_some_replica_has_learned() -> None:
    assert fleet_bias([OutstandingWork().view(0.0)]) == FleetBias()


def test_a_view_drawn_toward_its_fleet_keeps_every_other_field() -> None:
    # toward_fleet builds the new view field by field (dataclasses.replace cost more,
    # per replica per decision): a field it left out would fall back to its default.
    import dataclasses

    view = WorkView(wait_s=0.3, pending=2, decoding=3, mean_prefill_s=0.04, bias=2.0,
                    samples=7, log_var=0.2, residuals=6, missed_readings=1.5,
                    queued_s=0.5, progress_age_s=0.2, oldest_age_s=0.4)
    assert all(getattr(view, f.name) != f.default for f in dataclasses.fields(WorkView))
    drawn = toward_fleet(view, FleetBias(log_bias=0.0, log_var=0.01))
    assert drawn.bias != view.bias
    # Its queue in seconds is rescaled with the bias, whole and in its parts.
    assert drawn == dataclasses.replace(view, bias=drawn.bias,
                                        wait_s=view.wait_s * drawn.bias / view.bias,
                                        queued_s=view.queued_s * drawn.bias / view.bias)


def test_a_view_counts_what_is_pending_and_what_decodes_in_one_pass() -> None:
    work = OutstandingWork()
    streamed = work.begin(0.0, prefill_s=0.2, predicted_ttft_s=0.2, stream=True)
    work.begin(0.1, prefill_s=0.4, predicted_ttft_s=0.6, stream=True)
    work.begin(0.2, prefill_s=0.3, predicted_ttft_s=0.9, stream=False)
    work.first_byte(streamed, 0.25)  # decoding now; the queue re-anchors at 0.25
    view = work.view(0.3)
    # Pending: the second (streamed) and the third (non-streamed, within its predicted
    # 0.3 s); their 0.7 s of prefill from the anchor at 0.25 end at 0.95.
    assert (view.pending, view.decoding) == (2, 1)
    assert view.wait_s == pytest.approx(0.65)
    # Past its predicted prefill a non-streamed request counts as decoding.
    later = work.view(0.55)
    assert (later.pending, later.decoding) == (1, 2)
    assert later.wait_s == pytest.approx(max(0.0, 0.25 + 0.4 - 0.55))
