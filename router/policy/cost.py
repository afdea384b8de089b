"""Predicted time to first token on each replica: the quantity cache_aware minimises.

    cached    = min(matched_blocks * block_size, max cacheable)   (0 if unverified)
    uncached  = num_prompt_tokens - cached
    prefill   = base_s + per_token_s * uncached + per_token_context_s * uncached * num_prompt_tokens
    load      = max(inflight, running + waiting)
    queue     = load_cost_s * load
              + saturation_cost_s * max(0, load - capacity)
              + kv_cost_s * max(0, kv_usage - kv_threshold) / (1 - kv_threshold)
    hot       = hot_cost_s * max(0, load - (hot_ratio * mean_load + hot_slack))
    ttft      = queue + hot + prefill

"max cacheable" is (num_prompt_tokens - 1) // block_size blocks: vLLM always recomputes
the last prompt token, so a fully cached prompt still prefills one block's worth.

The hot term is the guard against hot-spotting. Left to the queue term alone, a popular
prefix keeps landing on the one replica holding it until that replica's queue costs more
than a whole cold prefill; well before that, copying the prefix to a second replica is
cheap (one cold prefill) and halves the queue. So a replica far above the fleet's mean
load pays extra, and the prefix spreads once its holder saturates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.hashing import max_cacheable_blocks
from router.policy.types import PolicyConfig, PrefillProfile, ReplicaState, RoutingRequest


@dataclass(frozen=True)
class TtftEstimate:
    """The parts of one replica's predicted time to first token, in seconds."""

    cached_tokens: int
    queue_s: float
    hot_s: float
    prefill_s: float

    @property
    def total_s(self) -> float:
        return self.queue_s + self.hot_s + self.prefill_s


def cached_tokens(request: RoutingRequest, replica: ReplicaState) -> int:
    """Prompt tokens the replica would skip: its verified leading match, capped by vLLM's rule."""
    if not replica.verified or replica.matched_blocks <= 0:
        # An unverified replica's keys may not be ours (different seed, algorithm, or a
        # gap in its events): a match there is a guess, and a wrong guess costs a prefill.
        return 0
    cacheable = max_cacheable_blocks(request.num_prompt_tokens, replica.block_size)
    return min(replica.matched_blocks, cacheable) * replica.block_size


def mean_load(replicas: Sequence[ReplicaState]) -> float:
    """The fleet's mean outstanding requests per replica (0 for no replicas)."""
    return sum(r.load for r in replicas) / len(replicas) if replicas else 0.0


def estimate_ttft(
    request: RoutingRequest, replica: ReplicaState, fleet_mean_load: float, config: PolicyConfig
) -> TtftEstimate:
    """Predicted TTFT of `request` on `replica` (see the module docstring for the formula)."""
    cached = cached_tokens(request, replica)
    uncached = max(request.num_prompt_tokens - cached, 0)
    profile: PrefillProfile = replica.profile or config.prefill
    prefill_s = profile.seconds(uncached, request.num_prompt_tokens)

    load = replica.load
    capacity = replica.capacity or config.saturation_load
    kv_over = max(0.0, replica.kv_usage - config.kv_threshold) / (1.0 - config.kv_threshold)
    queue_s = (
        config.load_cost_s * load
        + config.saturation_cost_s * max(0, load - capacity)
        + config.kv_cost_s * kv_over
    )
    hot_line = config.hot_ratio * fleet_mean_load + config.hot_slack
    hot_s = config.hot_cost_s * max(0.0, load - hot_line)
    return TtftEstimate(cached, queue_s, hot_s, prefill_s)
