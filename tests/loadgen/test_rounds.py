"""Figures over rounds: medians, spreads, and our policy against the best peer."""

from __future__ import annotations

import pytest

from loadgen.report import is_peer
from loadgen.rounds import aggregate, ratios_against_peers, spread


def _row(policy: str, p50: float, p99: float, hit: float | None) -> dict[str, object]:
    return {"policy": policy, "ttft_p50_s": p50, "ttft_p99_s": p99, "hit_rate": hit,
            "errors": 0}


def test_spread_is_median_and_range_of_present_values() -> None:
    s = spread([0.3, None, 0.1, 0.2])
    assert s is not None
    assert (s.median, s.low, s.high, s.rounds) == (0.2, 0.1, 0.3, 3)
    assert spread([None, None]) is None


def test_aggregate_groups_rounds_per_policy_in_first_seen_order() -> None:
    rows = [_row("cache_aware", 0.10, 0.5, 0.9), _row("vllm-router:kv_aware", 0.20, 0.4, 0.8),
            _row("cache_aware", 0.30, 0.7, 0.7), _row("vllm-router:kv_aware", 0.10, 0.6, 0.8),
            _row("cache_aware", 0.20, 0.6, 0.8)]
    agg = aggregate(rows)
    assert [a["policy"] for a in agg] == ["cache_aware", "vllm-router:kv_aware"]
    ours = agg[0]
    assert ours["rounds"] == 3
    assert ours["ttft_p50_s"] == {"median": 0.2, "min": 0.1, "max": 0.3, "rounds": 3}
    assert agg[1]["ttft_p50_s"]["median"] == pytest.approx(0.15)
    assert ours["ttft_p90_s"] is None  # never measured


def test_ratios_take_the_best_peer_per_figure() -> None:
    rows = [_row("cache_aware", 0.08, 0.5, 0.9), _row("round_robin", 0.01, 0.1, 0.1),
            _row("vllm-router:kv_aware", 0.10, 0.4, 0.6),
            _row("smg:cache_aware", 0.20, 1.0, 0.95)]
    ratios = ratios_against_peers(aggregate(rows), "cache_aware", is_peer)
    # Our own round_robin is not a peer, however fast it was.
    assert ratios["ttft_p50_s"]["best_peer"] == "vllm-router:kv_aware"
    assert ratios["ttft_p50_s"]["ratio"] == pytest.approx(0.8)
    assert ratios["ttft_p99_s"]["best_peer"] == "vllm-router:kv_aware"
    assert ratios["ttft_p99_s"]["ratio"] == pytest.approx(1.25)
    assert ratios["hit_rate"]["best_peer"] == "smg:cache_aware"
    assert ratios["hit_rate"]["ratio"] == pytest.approx(0.9 / 0.95)
    assert ratios_against_peers(aggregate(rows[:2]), "cache_aware", is_peer) == {}
