"""Outstanding work per replica: pending prefills drain first come, first served."""

from __future__ import annotations

import math

import pytest

from router.outstanding import (
    BIAS_ALPHA,
    BIAS_MAX,
    BIAS_PRIOR_SAMPLES,
    OutstandingWork,
    fleet_bias,
    with_prior,
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
        predicted = 0.1 * work.bias  # the policy's prediction carries the current bias
        token = work.begin(t, prefill_s=0.1, predicted_ttft_s=predicted, stream=True)
        work.first_byte(token, t + 0.3)  # always 3x slower than the profile says
        work.end(token, t + 0.5)
    assert work.bias == pytest.approx(3.0, rel=0.02)
    # And the queue ahead is scaled by it: 0.1 s of predicted work reads as 0.3 s.
    work.begin(100.0, prefill_s=0.1, predicted_ttft_s=0.3, stream=True)
    assert work.view(100.0).wait_s == pytest.approx(0.3, rel=0.02)


def test_one_measurement_moves_the_bias_by_a_share_and_never_past_its_bounds() -> None:
    work = OutstandingWork()
    token = work.begin(0.0, 0.1, 0.1, stream=True)
    work.first_byte(token, 0.2)
    assert math.log(work.bias) == pytest.approx(BIAS_ALPHA * math.log(2.0))
    for i in range(200):
        token = work.begin(float(i), 0.01, 0.01, stream=True)
        work.first_byte(token, i + 10.0)  # 1000x slower, every time
    assert work.bias == pytest.approx(BIAS_MAX)


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


def _learned(bias_ratio: float, n: int) -> OutstandingWork:
    work = OutstandingWork()
    for i in range(n):
        token = work.begin(float(i), 0.1, 0.1 * work.bias, stream=True)
        work.first_byte(token, i + 0.1 * bias_ratio)
        work.end(token, i + 0.5)
    return work


def test_an_untried_replica_borrows_its_fleets_bias() -> None:
    # Two replicas learned the profile is ~4x slow; the third has served nothing (new,
    # or back from an ejection). On its own 1.0 it would look 4x faster than it is -- or
    # with peers 4x fast, 4x slower, and never get the traffic to learn otherwise.
    fast = [_learned(0.25, 80).view(100.0) for _ in range(2)]
    fresh = OutstandingWork().view(100.0)
    prior = fleet_bias([*fast, fresh])
    assert prior == pytest.approx(0.25, rel=0.02)
    assert with_prior(fresh, prior).bias == pytest.approx(prior)
    # Its own measurements take over as they come: after 5 it is all its own.
    own = _learned(1.0, BIAS_PRIOR_SAMPLES).view(100.0)
    assert with_prior(own, prior) == own
    partial = _learned(1.0, 2).view(100.0)
    expected = math.exp(0.4 * math.log(partial.bias) + 0.6 * math.log(prior))
    assert with_prior(partial, prior).bias == pytest.approx(expected)


def test_the_borrowed_bias_rescales_the_queue_too() -> None:
    work = OutstandingWork()
    work.begin(0.0, 0.4, 0.4, stream=True)
    view = work.view(0.0)
    assert with_prior(view, 0.5).wait_s == pytest.approx(0.2)


def test_fleet_bias_is_one_until_some_replica_has_learned() -> None:
    assert fleet_bias([OutstandingWork().view(0.0), _learned(2.0, 3).view(10.0)]) == 1.0
