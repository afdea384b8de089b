"""The policy's plain inputs and outputs: frozen snapshots in, one decision out.

Every value here is computed once per request before the policy runs (the request's
block chain and index matches, a snapshot of each replica's load), so a policy is a pure
function of its inputs plus its own random source and counters.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

POLICY_NAMES = ("random", "round_robin", "least_loaded", "session_affinity", "cache_aware")


@dataclass(frozen=True)
class PrefillProfile:
    """Seconds to prefill `uncached` new tokens of a `context`-token prompt.

    seconds = base_s + per_token_s * uncached + per_token_context_s * pairs
    pairs   = uncached * (cached + (uncached + 1) / 2),  cached = context - uncached

    The last term is attention, per (query, key) pair: prefill attention is causal, so
    new token j attends to the cached tokens and to the j new tokens up to itself, not to
    the whole prompt. This is the sim's pair count (replica/profiles.py) and what
    `replica calibrate` fits `attention_s` against; charging uncached * context instead
    over-estimated a cold prompt's attention by up to 2x, and by the 8-sim Mooncake
    synthetic window from 2,400 (2026-12-05) predicted the prompts over 15k tokens 1.27x
    too slow and those of 5-15k 1.09x (medians), a wrong shape that the learned bias
    (one factor a replica) cannot correct. Defaults are the tiny model measured here (58 ms cold,
    12 ms cached for a 2,000-token prompt).
    """

    base_s: float = 0.012
    per_token_s: float = 2.3e-5
    per_token_context_s: float = 0.0

    def seconds(self, uncached: int, context: int) -> float:
        """Predicted prefill time for `uncached` tokens of a `context`-token prompt."""
        cached = max(0, context - uncached)
        pairs = uncached * (cached + (uncached + 1) / 2)
        return self.base_s + self.per_token_s * uncached + self.per_token_context_s * pairs


@dataclass(frozen=True)
class PolicyConfig:
    """Which policy to run and the knobs of its scorers and picker.

    The cost terms (see docs/POLICY.md) are in seconds of predicted time to first token.
    The queue is the replica's outstanding work (router/outstanding.py); on top of it,
    load_cost_s per outstanding request (the scheduler's per-request overhead, and a
    tie-break between equally idle replicas), prefill_chunk_tokens is the replica's
    per-step prefill budget (vLLM's max_num_batched_tokens: a prefill of n uncached tokens
    shares ceil(n / budget) steps with every decoding sequence; set it to the replicas'),
    saturation_cost_s per request beyond a replica's
    capacity (saturation_load when the replica states none), kv_cost_s at full KV usage
    above kv_threshold, hot_cost_s per request above hot_ratio * fleet mean + hot_slack.
    `tolerance` is the cost slack, in units of the request's own cold prefill, within
    which cache_aware samples replicas instead of always taking the single best (several gateways deciding at once would
    otherwise herd onto one replica). `pending_ttl_s` is how long a routed chain counts as
    cached on its replica before that replica's KV events confirm it (router/pending.py;
    0 turns it off). `work_weight` scales what a request's own prefill costs the requests
    queued behind it (see router/policy/cost.py; 0 scores by its own TTFT alone);
    `work_relative` charges only the prefill above the least it could cost on any
    candidate (False, the default: all of it; see docs/POLICY.md for the measurement).
    `share_work`: with a Redis index, gateways share their outstanding work through it
    (router/shared_work.py), so each weighs the others' queues too (True, the default:
    4 gateways' p50 back to one's; False for fleets of hundreds of replicas behind many
    gateways, where the per-request read costs more; see docs/POLICY.md).
    `spread_ties`: among near-equal replicas cache_aware takes those with the least work
    queued ahead (True, the default; False samples them by score alone; docs/POLICY.md
    has the runs that decided it).
    `lanes`: with several gateways sharing the fleet (known through the shared work),
    each takes the near-equal replica first at or after its own place in the fleet (its
    lane), instead of the same draw from the same snapshot (True, the default; False:
    sampled as by one gateway; see pickers.ToleranceSampler).
    `claim`: with several gateways sharing the fleet, each request's replica is claimed
    in Redis before the request goes upstream: one atomic round trip writes this
    gateway's new work there and reads every gateway's, and where another gateway's
    request had reached that replica unseen (its change still on the way through the
    feed), the request is decided again on what the read shows (router/routing.py's
    `_claimed`; False, the default; see docs/POLICY.md for the runs).
    `shared_step`: charge a request the delay its first prefill chunk adds to the
    request ahead of it whose prefill ends in the step that chunk joins (vLLM's chunked
    prefill fills each step's budget, prefill_chunk_tokens, first come, first served);
    False, the default: on two 8-sim windows it moved TTFT both ways within the spread
    (router/policy/cost.py's shared_step_delay; docs/POLICY.md has the runs).
    `step_gate`: a request routed where this gateway's prefills are queued waits at the
    gateway until they have their first tokens (other gateways', known through the
    shared work, for their predicted time; at most the queue's predicted time and half
    again), where its first chunk would otherwise share their last step and delay each
    of them (router/policy/cost.py's step_gate_s; True, the default: on two 8-sim
    windows p50 0.84x and 0.88x of the gate off, level on a saturated 4-sim one, p99
    up to 1.04x; docs/POLICY.md has the runs).
    `fleet_waiting`: the requests a prefill delays are at least the fleet's mean waiting
    per replica, not only those waiting where it goes (False, the default; see
    router/policy/cost.py and docs/POLICY.md for the runs).
    `defer_cap`: of the least prefill a request could cost anywhere, charge the delay to
    at most this many waiting requests (0.5, the default; None: all of them; 0 is
    `work_relative`): a long cold prompt then waits at most half its own prefill beyond
    its soonest first token so that short ones stay quick (router/policy/cost.py;
    docs/POLICY.md has the runs that set it).
    `hold_cap`: while every replica has a full prefill step or more queued, the gateway
    holds new requests and lets them go, as a replica's queue falls under a step, in
    order of arrival plus hold_cap of their least prefill, and each at the latest then:
    short prompts overtake long ones at the gateway, where the replicas' own queues are
    first come, first served (cache_aware only; router/prefill_hold.py; 0.5, the
    default: docs/POLICY.md has the runs; None: no holding).
    `hold_step_tokens`: what the hold counts as a full prefill step, in tokens through
    the replica's profile and learned bias (2,048, the default). Not the replicas'
    budget: it is how much queued prefill is enough to keep a replica busy until the
    hold's next release, and it measured better at 2,048 on sims whose budget is 8,192
    (docs/POLICY.md); before it was a setting of its own, prefill_chunk_tokens served
    both, so a user who set that to the replicas' budget got a hold that reordered less.
    `weights` overrides the policy's scorer weights by
    scorer name.
    """

    name: str = "cache_aware"
    seed: int | None = None
    weights: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    prefill: PrefillProfile = field(default_factory=PrefillProfile)
    load_cost_s: float = 0.005
    prefill_chunk_tokens: int = 2048
    saturation_load: int = 64
    saturation_cost_s: float = 0.25
    kv_threshold: float = 0.9
    kv_cost_s: float = 0.5
    hot_ratio: float = 2.0
    hot_slack: float = 2.0
    hot_cost_s: float = 0.05
    tolerance: float = 0.1
    pending_ttl_s: float = 10.0
    work_weight: float = 1.0
    work_relative: bool = False
    share_work: bool = True
    spread_ties: bool = True
    lanes: bool = True
    claim: bool = False
    shared_step: bool = False
    step_gate: bool = True
    fleet_waiting: bool = False
    defer_cap: float | None = 0.5
    hold_cap: float | None = 0.5
    hold_step_tokens: int = 2048


@dataclass(frozen=True)
class RoutingRequest:
    """What the policy knows about one request: model, chain keys, size, who sent it."""

    model: str
    keys: tuple[int, ...] = ()
    num_prompt_tokens: int = 0
    tenant: str | None = None
    session_key: str | None = None
    # This gateway's place among the gateways sharing the fleet and their count
    # (router/shared_work.py's lane; 0 of 1 alone).
    lane: int = 0
    lanes: int = 1


# Not frozen: a frozen dataclass's __init__ sets each field through object.__setattr__,
# 3.1 us for this one against 0.75 with slots, and one is built per replica per decision
# (benchmarks/bench_policy.py). Policies treat it as read-only; dataclasses.replace
# makes a changed copy.
@dataclass(slots=True)
class ReplicaState:
    """A snapshot of one replica for one decision.

    inflight is counted by this gateway (exact, but blind to other gateways); running and
    waiting are scraped from the replica's /metrics (all gateways, but stale). matched_blocks
    is the index's count of leading chain blocks the replica holds; it is ignored unless
    `verified` (the gateway has confirmed it computes this replica's keys). `models` None
    means the replica serves every model; `capacity` None means the policy's
    saturation_load applies.
    """

    replica_id: str
    healthy: bool = True
    verified: bool = True
    inflight: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    matched_blocks: int = 0
    block_size: int = 16
    profile: PrefillProfile | None = None
    models: Collection[str] | None = None
    ejected: bool = False
    capacity: int | None = None
    # Outstanding work (router/outstanding.py): seconds of prefill this gateway has queued
    # ahead of a new request, its requests decoding there, what other clients have there
    # beyond ours (from the last scrape), the mean predicted prefill of requests sent
    # there, and the learned measured/predicted TTFT ratio.
    queued_prefill_s: float = 0.0
    pending: int = 0  # this gateway's requests there without a first byte yet
    decoding: int = 0
    external_waiting: int = 0
    external_running: int = 0
    mean_prefill_s: float = 0.0
    bias: float = 1.0
    scrape_age_s: float = 0.0  # how old the scraped running/waiting are
    # Other gateways' outstanding work there, shared through Redis (router/shared_work.py):
    # fresher than the scrape, which sees the same requests an interval later.
    peer_wait_s: float = 0.0
    peer_pending: int = 0
    peer_decoding: int = 0

    @property
    def load(self) -> int:
        """Outstanding requests: the larger of our own count and the scraped one."""
        # Our count is exact for our traffic but misses other gateways'; the scrape sees
        # everyone but lags. The larger is the safer estimate of the queue ahead.
        return max(self.inflight + self.peer_pending + self.peer_decoding,
                   self.running + self.waiting)


@dataclass(frozen=True)
class RoutingDecision:
    """The chosen replica, and every eligible replica best first for failover.

    `scores` maps replica id to its combined score in [0, 1]; `costs` (cache_aware only)
    to its predicted time to first token in seconds. `fallback` is True when a filter
    would have left no replica and was relaxed; `relaxed` names those filters.
    """

    replica_id: str
    predicted_cached_tokens: int
    policy: str
    scores: Mapping[str, float]
    ranked: tuple[str, ...]
    fallback: bool = False
    relaxed: tuple[str, ...] = ()
    costs: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    predicted_cached: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    # replica id -> (the prefill work it queues there, by the profile, less the per-step
    # base; predicted TTFT seconds before the replica's learned bias, which is learned
    # against it): what the proxy enters in the replica's
    # outstanding-work account when it sends there.
    predicted_work: Mapping[str, tuple[float, float]] = field(
        default_factory=lambda: MappingProxyType({}))
