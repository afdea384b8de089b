"""Scorers: each rates every eligible replica in [0, 1], higher is better.

A scorer reads a `Candidates` view computed once per request (the request, the eligible
replicas and each one's TTFT estimate) and returns replica id -> score. The pipeline
combines scorers as a weighted mean, so the combined score stays in [0, 1]. A new scorer
is one class here and one entry in `SCORERS`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from router.policy.cost import TtftEstimate
from router.policy.types import ReplicaState, RoutingRequest


@dataclass(frozen=True)
class Candidates:
    """Plain inputs every scorer shares: computed once per request, never mutated."""

    request: RoutingRequest
    replicas: tuple[ReplicaState, ...]
    estimates: Mapping[str, TtftEstimate]


class Scorer(Protocol):
    """Rates each candidate replica in [0, 1]."""

    name: str

    def score(self, candidates: Candidates) -> dict[str, float]: ...


class TtftScorer:
    """1 for the cheapest replica (predicted TTFT plus the delay its prefill adds for the
    requests queued behind it), 1/(1+x) for one whose cost exceeds it by x times this
    request's own cold prefill.

    The unit is the request's cold prefill (its largest predicted prefill over the
    candidates), not the best cost: what herding costs is one more prefill in a queue,
    and what a cache hit saves is a share of that prefill. Measured against the best
    cost instead, "within 10%" grows with the queue: on a fleet backed up by 4 s, a
    replica holding the prompt (4.05 s) and a cold one (4.45 s) looked near-equal and
    were sampled alike, spending cold prefills, and so capacity, exactly when the fleet
    had none to spare.
    """

    name = "ttft"

    def score(self, candidates: Candidates) -> dict[str, float]:
        costs = {rid: e.cost_s for rid, e in candidates.estimates.items()}
        best = min(costs.values())
        unit = max(e.prefill_s for e in candidates.estimates.values())
        if unit <= 0:
            unit = best
        if unit <= 0:
            return dict.fromkeys(costs, 1.0)
        return {rid: 1.0 / (1.0 + (c - best) / unit) for rid, c in costs.items()}


class PrefixScorer:
    """Share of the prompt the replica holds in cache (verified matches only)."""

    name = "prefix"

    def score(self, candidates: Candidates) -> dict[str, float]:
        n = candidates.request.num_prompt_tokens
        return {
            rid: (min(e.cached_tokens / n, 1.0) if n > 0 else 0.0)
            for rid, e in candidates.estimates.items()
        }


class LoadScorer:
    """1 / (1 + outstanding requests): idle scores 1, and every request lowers it."""

    name = "load"

    def score(self, candidates: Candidates) -> dict[str, float]:
        return {r.replica_id: 1.0 / (1.0 + r.load) for r in candidates.replicas}


class KvScorer:
    """1 - KV cache usage: room for a new request without preempting others."""

    name = "kv"

    def score(self, candidates: Candidates) -> dict[str, float]:
        return {r.replica_id: min(max(1.0 - r.kv_usage, 0.0), 1.0) for r in candidates.replicas}


def rendezvous_weight(key: str, replica_id: str) -> float:
    """A stable pseudo-random number in [0, 1) for (key, replica)."""
    digest = hashlib.blake2b(
        len(key).to_bytes(8, "big") + key.encode() + replica_id.encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "big") / 2.0**64


class AffinityScorer:
    """Rendezvous hashing of the session key (else tenant): the same key, the same replica.

    Rendezvous (highest random weight) hashing moves only the keys of a replica that
    leaves or joins; every other key keeps its replica. Requests with neither key score
    by load instead, so they do not all collapse onto one replica.
    """

    name = "affinity"

    def score(self, candidates: Candidates) -> dict[str, float]:
        key = candidates.request.session_key or candidates.request.tenant
        if not key:
            return LoadScorer().score(candidates)
        return {r.replica_id: rendezvous_weight(key, r.replica_id) for r in candidates.replicas}


SCORERS: dict[str, type[Scorer]] = {
    s.name: s for s in (TtftScorer, PrefixScorer, LoadScorer, KvScorer, AffinityScorer)
}


def combine(weighted: Sequence[tuple[Scorer, float]], candidates: Candidates) -> dict[str, float]:
    """The weighted mean of the scorers' scores (1.0 for every replica when there are none)."""
    ids = [r.replica_id for r in candidates.replicas]
    total_weight = sum(w for _, w in weighted if w > 0)
    if total_weight <= 0:
        return dict.fromkeys(ids, 1.0)
    combined = dict.fromkeys(ids, 0.0)
    for scorer, weight in weighted:
        if weight <= 0:
            continue
        scores = scorer.score(candidates)
        for rid in ids:
            combined[rid] += weight * min(max(scores[rid], 0.0), 1.0)
    return {rid: s / total_weight for rid, s in combined.items()}
