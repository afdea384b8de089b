"""Figures over repeated rounds: each policy's median and spread, and ours against the peers.

A comparison run with `--repeats N` runs every policy once per round, interleaved, each
run on emptied caches and index. One round on a shared machine can be lucky or unlucky
(a noisy neighbour lands on one policy's run); the median over rounds is what the report
compares, and the spread (min-max) says how far to trust it.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Prompt sizes (tokens the client sent: [low, high)) whose TTFT is reported apart: a
# router that loses milliseconds on every request shows on short prompts, one that
# queues badly on long ones; a window's p50 alone hides which.
PROMPT_SIZES: tuple[tuple[str, int, int | None], ...] = (
    ("<512", 0, 512), ("512-2k", 512, 2048), ("2k-8k", 2048, 8192),
    ("8k-16k", 8192, 16384), (">=16k", 16384, None))


def size_figure(label: str) -> str:
    """summarize()'s name for the TTFT p50 of one PROMPT_SIZES bin."""
    return f"ttft_p50_size_{label}_s"


# Figures that get a median and a spread, as summarize() names them.
FIGURES = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_mean_s", "ttft_outside_mean_s",
           "before_upstream_mean_s", "held_mean_s", "gated_mean_s", "router_cpu_per_request_s",
           "ttft_error_p10_s", "ttft_error_p50_s", "ttft_error_p90_s",
           "e2e_p50_s", "e2e_p99_s", "throughput_rps", "hit_rate", "imbalance_max_over_mean",
           "errors", *(size_figure(label) for label, _, _ in PROMPT_SIZES))
# Figures ours is held against the best peer policy, and which way is better.
RATIO_FIGURES = {"ttft_p50_s": "lower", "ttft_p99_s": "lower", "hit_rate": "higher"}


@dataclass(frozen=True)
class Spread:
    """One figure over rounds: median, min, max, and how many rounds had a value."""

    median: float
    low: float
    high: float
    rounds: int

    def as_dict(self) -> dict[str, float]:
        return {"median": self.median, "min": self.low, "max": self.high,
                "rounds": self.rounds}


def spread(values: Sequence[float | None]) -> Spread | None:
    """Median and range of the values that exist; None when none does."""
    present = [float(v) for v in values if v is not None]
    if not present:
        return None
    return Spread(statistics.median(present), min(present), max(present), len(present))


def aggregate(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per policy (in first-seen order): each figure's spread over that policy's rows."""
    by_policy: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        by_policy.setdefault(str(row["policy"]), []).append(row)
    out: list[dict[str, Any]] = []
    for policy, runs in by_policy.items():
        entry: dict[str, Any] = {"policy": policy, "rounds": len(runs)}
        for figure in FIGURES:
            s = spread([r.get(figure) for r in runs])
            entry[figure] = None if s is None else s.as_dict()
        out.append(entry)
    return out


def ratios_against_peers(aggregated: Sequence[Mapping[str, Any]], ours: str,
                         is_peer: Any) -> dict[str, dict[str, Any]]:
    """Our policy's median over the best peer policy's median, per figure.

    Best is the peer with the lowest median (TTFT) or the highest (hit rate), so a
    ratio below 1 (TTFT) or above 1 (hit rate) means ours did better than every peer.
    `is_peer(policy)` says which rows are peers. Empty when ours or every peer is missing.
    """
    mine = next((a for a in aggregated if a["policy"] == ours), None)
    peers = [a for a in aggregated if is_peer(a["policy"])]
    out: dict[str, dict[str, Any]] = {}
    if mine is None or not peers:
        return out
    for figure, better in RATIO_FIGURES.items():
        ours_value = (mine.get(figure) or {}).get("median")
        candidates = [(a[figure]["median"], a["policy"]) for a in peers if a.get(figure)]
        if ours_value is None or not candidates:
            continue
        best_value, best_policy = (min if better == "lower" else max)(candidates)
        out[figure] = {"ours": ours_value, "best_peer": best_policy,
                       "best_peer_value": best_value,
                       "ratio": ours_value / best_value if best_value else None}
    return out
