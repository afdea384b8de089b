"""Pickers: turn combined scores into a ranking, chosen replica first.

The whole ranking matters: the proxy fails over down it. After the chosen replica, the
rest follow by score, ties in random order (so failover load spreads too).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Protocol

# Scores closer than this are ties: float noise must not decide between equal replicas.
_TIE_EPSILON = 1e-12


class Picker(Protocol):
    """Orders replica ids by preference, chosen first. `queued`: each replica's work
    queued ahead, in units of the request's cold prefill, for pickers that weigh it
    (None when the policy does not ask them to). `lane`: this gateway's place among the
    gateways sharing the fleet and their count, for pickers that split near-ties by it."""

    def rank(self, scores: Mapping[str, float], rng: random.Random,
             queued: Mapping[str, float] | None = None,
             lane: tuple[int, int] = (0, 1)) -> tuple[str, ...]: ...


def _by_score(ids: list[str], scores: Mapping[str, float], rng: random.Random) -> list[str]:
    ids = sorted(ids)  # a deterministic start, so a seeded rng gives a reproducible shuffle
    rng.shuffle(ids)
    return sorted(ids, key=lambda rid: -scores[rid])


class BestPicker:
    """The highest score; equal best scores are broken at random."""

    def rank(self, scores: Mapping[str, float], rng: random.Random,
             queued: Mapping[str, float] | None = None,
             lane: tuple[int, int] = (0, 1)) -> tuple[str, ...]:
        best = max(scores.values())
        tied = sorted(rid for rid, s in scores.items() if s >= best - _TIE_EPSILON)
        chosen = rng.choice(tied)
        rest = _by_score([rid for rid in scores if rid != chosen], scores, rng)
        return (chosen, *rest)


class RandomPicker:
    """Uniformly at random, ignoring scores."""

    def rank(self, scores: Mapping[str, float], rng: random.Random,
             queued: Mapping[str, float] | None = None,
             lane: tuple[int, int] = (0, 1)) -> tuple[str, ...]:
        ids = sorted(scores)
        rng.shuffle(ids)
        return tuple(ids)


class RoundRobinPicker:
    """Each replica in turn, by id. Holds a counter: one per policy instance."""

    def __init__(self) -> None:
        self._next = 0

    def rank(self, scores: Mapping[str, float], rng: random.Random,
             queued: Mapping[str, float] | None = None,
             lane: tuple[int, int] = (0, 1)) -> tuple[str, ...]:
        ids = sorted(scores)
        start = self._next % len(ids)
        self._next += 1
        return tuple(ids[start:] + ids[:start])


class ToleranceSampler:
    """Sample, weighted by score, among replicas within `tolerance` of the best.

    With the ttft score (1 / (1 + excess cost / the request's cold prefill)), score >=
    best / (1 + tolerance) means "cost within tolerance x its own cold prefill of the
    best". Always taking the single best would herd: gateways
    deciding in the same instant from the same snapshot all pick the same replica, and it
    overloads before any scrape shows it. Sampling among near-equals spreads them at a
    bounded price (at most `tolerance` of one prefill of predicted cost).
    """

    def __init__(self, tolerance: float) -> None:
        self.tolerance = tolerance

    def rank(self, scores: Mapping[str, float], rng: random.Random,
             queued: Mapping[str, float] | None = None,
             lane: tuple[int, int] = (0, 1)) -> tuple[str, ...]:
        """`queued` (policy.spread_ties): each replica's work queued ahead, in units of
        the request's cold prefill; among the near-equal replicas only those with the
        least of it are sampled, so a near-tie goes to the replica with less work ahead.

        Why not weigh by it instead: a burst sharing one prefix (turn one of many
        sessions) ties between waiting behind the prefix's first request and a cold
        prefill on an idle replica, and each session then stays where its history is. A
        weighted draw (1 / (1 + queued), tried first) still left one of four idle
        replicas without a session in about one burst in three, and idle for the whole
        run; the least-queued near-equal fills every idle replica first.

        `lane` (policy.lanes): with several gateways, each takes the first near-equal
        replica at or after its own place in the fleet (the ids in order, gateway k of G
        starting k/G of the way along), not a draw. A burst's requests reach different
        gateways within a millisecond, before any of them has shared its choice, and
        every gateway sees the same snapshot: by score, or by the least-queued rule,
        they all took the same idle replica first (on Mooncake conversation windows at
        time scale 2, 253 of 300 requests came within 5 ms of the one before; with 4
        gateways a third of the 51 requests that took over e times their predicted TTFT
        had another gateway's request sent to the same replica within 20 ms before). In
        lanes, 4 gateways' bursts over 8 idle replicas take them two each, and each
        gateway's next choice, with its own first one queued, moves on along its lane.
        The price is what sampling already pays: a near-equal replica, not the best."""
        best = max(scores.values())
        line = best / (1.0 + self.tolerance) - _TIE_EPSILON
        near = sorted(rid for rid, s in scores.items() if s >= line)
        place, lanes = lane
        if queued:
            # In lanes, work queued within `tolerance` of the least counts as least: the
            # single least-queued replica would otherwise be every gateway's choice in a
            # burst before any lane rule ran (4 gateways sent requests 193-196 of one
            # window all to one replica that way).
            slack = self.tolerance if lanes > 1 else 0.0
            least = min(queued.get(rid, 0.0) for rid in near)
            near = [rid for rid in near
                    if queued.get(rid, 0.0) <= least + slack + _TIE_EPSILON]
        if lanes > 1 and len(near) > 1:
            chosen = _in_lane(sorted(scores), set(near), place, lanes)
        else:
            weights = [max(scores[rid], _TIE_EPSILON) for rid in near]
            chosen = rng.choices(near, weights=weights, k=1)[0]
        rest = _by_score([rid for rid in scores if rid != chosen], scores, rng)
        return (chosen, *rest)


def _in_lane(order: list[str], near: set[str], place: int, lanes: int) -> str:
    """The first of `near` at or after `place`/`lanes` of the way along `order`."""
    start = place * len(order) // lanes
    for rid in order[start:] + order[:start]:
        if rid in near:
            return rid
    raise ValueError("no near-equal replica in the order")  # near is a subset of order
