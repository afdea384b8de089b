"""Routing policies: filters, weighted scorers returning [0, 1], one picker.

Inputs are frozen snapshots built once per request (`RoutingRequest`, one `ReplicaState`
per replica); the output is a `RoutingDecision` whose `ranked` lists every eligible
replica best first. cache_aware minimises the predicted time to first token:

    cached   = min(matched_blocks, (n - 1) // block_size) * block_size   (0 if unverified)
    prefill  = bias * (base_s + per_token_s * (n - cached)
                       + per_token_context_s * (n - cached) * (cached + (n - cached + 1) / 2))
    work     = prefill seconds queued ahead of it there (ours, router/outstanding.py)
             + others' waiting requests x the typical prefill there
    load     = max(inflight, running + waiting)
    queue    = work + decode pressure + load_cost_s * load
             + saturation_cost_s * max(0, load - capacity)
             + kv_cost_s * max(0, kv_usage - kv_threshold) / (1 - kv_threshold)
    hot      = hot_cost_s * max(0, load - (hot_ratio * mean_load + hot_slack))
    ttft     = queue + hot + prefill
    cost     = ttft + the delay its prefill adds for the requests waiting there
               (the least prefill it could cost, for at most defer_cap of them)
    score    = 1 / (1 + (cost - best cost) / its cold prefill)   in (0, 1]

and samples, weighted by score, among replicas within `tolerance` x its own cold
prefill of the best cost.
router/policy/cost.py and docs/POLICY.md give the reasons for each term.
"""

from router.policy.cost import TtftEstimate, cached_tokens, estimate_ttft
from router.policy.pipeline import (
    DEFAULT_WEIGHTS,
    NoReplicasError,
    Policy,
    build_policy,
    policy_weights,
)
from router.policy.scorers import SCORERS
from router.policy.types import (
    POLICY_NAMES,
    PolicyConfig,
    PrefillProfile,
    ReplicaState,
    RoutingDecision,
    RoutingRequest,
)

__all__ = [
    "DEFAULT_WEIGHTS",
    "POLICY_NAMES",
    "SCORERS",
    "NoReplicasError",
    "Policy",
    "PolicyConfig",
    "PrefillProfile",
    "ReplicaState",
    "RoutingDecision",
    "RoutingRequest",
    "TtftEstimate",
    "build_policy",
    "cached_tokens",
    "estimate_ttft",
    "policy_weights",
]
