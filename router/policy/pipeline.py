"""The policy pipeline: filters, then weighted scorers, then one picker.

    decide(request, replicas):
        eligible  = filters(replicas)            # relaxed, never emptied
        estimates = TTFT estimate per eligible   # computed once, shared by scorers
        scores    = weighted mean of scorers     # each in [0, 1]
        ranked    = picker(scores)               # chosen first; the proxy fails over down it

Each named policy is a choice of scorer weights and picker:

    random            no scorers          RandomPicker
    round_robin       no scorers          RoundRobinPicker
    least_loaded      load: 1             BestPicker (random tie-break)
    session_affinity  affinity: 1         BestPicker
    cache_aware       ttft: 1             ToleranceSampler(tolerance)

`PolicyConfig.weights` adds or reweights scorers (e.g. {ttft: 1, prefix: 0.2}).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from router.policy.cost import defer_cap, estimate_ttft, least_work, mean_load, mean_waiting
from router.policy.filters import DEFAULT_FILTERS, Filter, apply_filters
from router.policy.pickers import (
    BestPicker,
    Picker,
    RandomPicker,
    RoundRobinPicker,
    ToleranceSampler,
)
from router.policy.scorers import SCORERS, Candidates, Scorer, combine
from router.policy.types import (
    POLICY_NAMES,
    PolicyConfig,
    ReplicaState,
    RoutingDecision,
    RoutingRequest,
)


class NoReplicasError(LookupError):
    """The fleet has no replica at all to route to (the app answers 503)."""


DEFAULT_WEIGHTS: dict[str, dict[str, float]] = {
    "random": {},
    "round_robin": {},
    "least_loaded": {"load": 1.0},
    "session_affinity": {"affinity": 1.0},
    "cache_aware": {"ttft": 1.0},
}


class Policy:
    """One configured pipeline; an instance owns its rng and counters (never a singleton)."""

    def __init__(
        self,
        name: str,
        config: PolicyConfig,
        scorers: Sequence[tuple[Scorer, float]],
        picker: Picker,
        rng: random.Random,
        filters: Sequence[Filter] = DEFAULT_FILTERS,
    ) -> None:
        self.name = name
        self.config = config
        self.scorers = tuple(scorers)
        self.picker = picker
        self.rng = rng
        self.filters = tuple(filters)

    def decide(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> RoutingDecision:
        """Rank the eligible replicas for `request`, best first."""
        if not replicas:
            raise NoReplicasError("no replicas are configured or discovered")
        ids = [r.replica_id for r in replicas]
        if len(set(ids)) != len(ids):
            raise ValueError(f"replica ids must be unique, got {sorted(ids)}")
        eligible, relaxed = apply_filters(self.filters, request, replicas)
        fleet_mean = mean_load(eligible)
        least = least_work(request, eligible, self.config) if defer_cap(self.config) is not None \
            else 0.0
        floor = mean_waiting(request, eligible, self.config) if self.config.fleet_waiting else 0.0
        estimates = {
            r.replica_id: estimate_ttft(request, r, fleet_mean, self.config, least, floor)
            for r in eligible
        }
        candidates = Candidates(request, tuple(eligible), MappingProxyType(estimates))
        scores = combine(self.scorers, candidates)
        queued = None
        if self.config.spread_ties:
            unit = max((e.prefill_s for e in estimates.values()), default=0.0) or 1.0
            queued = {rid: e.queue_s / unit for rid, e in estimates.items()}
        lane = (request.lane, request.lanes) if self.config.lanes else (0, 1)
        ranked = self.picker.rank(scores, self.rng, queued, lane)
        chosen = ranked[0]
        return RoutingDecision(
            replica_id=chosen,
            predicted_cached_tokens=estimates[chosen].cached_tokens,
            policy=self.name,
            scores=MappingProxyType(scores),
            ranked=ranked,
            fallback=bool(relaxed),
            relaxed=relaxed,
            costs=MappingProxyType({rid: e.total_s for rid, e in estimates.items()}),
            predicted_cached=MappingProxyType(
                {rid: e.cached_tokens for rid, e in estimates.items()}
            ),
            # The TTFT before the learned bias: what the bias is learned against.
            predicted_work=MappingProxyType(
                {r.replica_id: (estimates[r.replica_id].queued_work_s,
                                estimates[r.replica_id].total_s / (r.bias or 1.0))
                 for r in eligible}
            ),
        )


def policy_weights(config: PolicyConfig) -> dict[str, float]:
    """The policy's default scorer weights with config.weights applied over them."""
    if config.name not in DEFAULT_WEIGHTS:
        raise ValueError(
            f"unknown policy {config.name!r}; expected one of {', '.join(POLICY_NAMES)}"
        )
    weights = dict(DEFAULT_WEIGHTS[config.name])
    for name, weight in config.weights.items():
        if name not in SCORERS:
            raise ValueError(f"unknown scorer {name!r}; expected one of {', '.join(SCORERS)}")
        weights[name] = float(weight)
    return weights


def _picker(config: PolicyConfig) -> Picker:
    if config.name == "random":
        return RandomPicker()
    if config.name == "round_robin":
        return RoundRobinPicker()
    if config.name == "cache_aware":
        return ToleranceSampler(config.tolerance)
    return BestPicker()


def build_policy(config: PolicyConfig, rng: random.Random | None = None) -> Policy:
    """A fresh policy for `config`; rng defaults to random.Random(config.seed)."""
    weights: Mapping[str, float] = policy_weights(config)
    scorers = [(SCORERS[name](), w) for name, w in weights.items() if w > 0]
    rng = random.Random(config.seed) if rng is None else rng
    return Policy(config.name, config, scorers, _picker(config), rng)
