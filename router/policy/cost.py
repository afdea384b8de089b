"""Predicted time to first token on each replica: the quantity cache_aware minimises.

    cached    = min(matched_blocks * block_size, max cacheable)   (0 if unverified)
    uncached  = num_prompt_tokens - cached
    prefill   = bias * (base_s + per_token_s * uncached
                        + per_token_context_s * uncached * (cached + (uncached + 1) / 2))
    work      = queued_prefill_s                             # ours, ahead of it (outstanding.py)
              + max(peer_wait_s,                             # other gateways' (shared_work.py)
                    bias * external_waiting * typical_prefill - scrape_age_s)  # all others'
    decoders  = decoding + max(external_running, peer_decoding)
    decode    = bias * decoders * per_token_s * steps
    steps     = max(1, ceil(uncached / prefill_chunk_tokens))
    step_wait = 0.5 * bias * (base_s + decoders * per_token_s)  # if work == 0 and
                                                    # decoders + pending > 0, else 0
    load      = max(inflight + peer_pending + peer_decoding, running + waiting)
    queue     = work + step_wait + decode
              + load_cost_s * load
              + saturation_cost_s * max(0, load - capacity)
              + kv_cost_s * max(0, kv_usage - kv_threshold) / (1 - kv_threshold)
    hot       = hot_cost_s * max(0, load - (hot_ratio * mean_load + hot_slack))
    ttft      = queue + hot + prefill

"max cacheable" is (num_prompt_tokens - 1) // block_size blocks: vLLM always recomputes
the last prompt token, so a fully cached prompt still prefills one block's worth.

The queue is seconds of work, not a count: a replica with one 16k-token cold prefill
queued is busier than one with five cached follow-ups. `work` is what this gateway sent
there and has not seen a first byte for, drained first come first served from the last
measured first byte; other clients' requests (other gateways, from the scrape) are
charged the mean predicted prefill of what this gateway sends there (`typical_prefill`),
since gateways behind one load balancer see the same traffic. Each decoding sequence
shares every step of the new prefill and adds its one token of compute to each.
`bias` is the replica's learned measured/predicted TTFT ratio, so a profile that is off
by a constant factor is corrected from the replica's own answers. `step_wait` is the
step in progress: vLLM admits a request only between steps, so one arriving at a busy
replica waits out about half of the current step first, and an idle replica is a step's
half quicker for a short prompt (on the 8-sim Mooncake synthetic window from 450, the
118 prompts under 100 tokens took 1.38x vllm-router cache_aware's TTFT without it).

What cache_aware minimises is that TTFT plus the delay its prefill adds for others:

    cost      = ttft + work_weight * bias * (waiting * max(0, work - least_work)
                                             + min(waiting, defer_cap) * min(work, least_work))
              + work_weight * shared     # if work > 0 (queued ahead), with `shared_step` (off)
    shared    = bias * per_token_s * min(uncached, budget - leftover)
    leftover  = the queue ahead's tokens in its last step: work / (bias * per_token_s)
                less its whole steps before it, in (0, budget]; budget = prefill_chunk_tokens
    work      = prefill - base_s               # (unbiased) what it adds to the queue there
    least_work = min over the candidates of work   # where its best cache match is
    waiting   = pending + max(external_left, peer_pending)  # waiting for a prefill there
              (with `fleet_waiting`: at least the mean of that over the candidates)
    external_left = the scraped external_waiting less those served since (as in `work`)

Every second of prefill a replica spends on this request delays each request that queues
behind it there, and a replica's queue now is the best guess of how many will. An idle
replica delays no one by taking a cold prefill, so an idle fleet scores by TTFT alone;
on a backed-up one a cache hit (little prefill) is worth more than its own TTFT says,
because recomputing a cold prefix there costs everyone queued after it. A hot replica's
growing queue also makes it dearer for everything, so a popular prefix still spreads.

`shared` is what the request's first prefill chunk adds to the request ahead of it whose
prefill ends in the step that chunk joins: vLLM fills each step's budget first come,
first served, so the end of the queue ahead shares a step with the new request's first
chunk, and the request finishing there waits for the whole step (shared_step_delay).

The work above the least is fleet capacity spent (a cold prefill where a hit was
possible), charged for every request waiting. The least itself is spent wherever the
request goes: charging it per waiting request sends long cold prompts to short lines,
a bet that short requests come next (those waiting are ahead of it, first come first
served), which keeps the many short prompts quick at the long ones' expense. `defer_cap`
(None: no cap) charges it for at most that many waiting requests, so a prompt is made to
wait at most defer_cap of its own least prefill beyond its soonest first token
(`work_relative` is a cap of 0: it then goes where its first token comes soonest).
docs/POLICY.md has the runs.

With `fleet_waiting` the requests a prefill delays are at least the fleet's mean waiting
per replica: on a fleet past its capacity an idle replica does not stay idle (the
router itself sends the next requests where the queue is shortest), so a cold prefill
there delays about as many requests as anywhere, and a cache hit on a busier holder
saves that fleet's capacity. Off by default (docs/POLICY.md has the runs).

The hot term is the guard against hot-spotting. A popular prefix keeps landing on the one
replica holding it until that replica's queue costs more than a whole cold prefill; well
before that, copying the prefix to a second replica is cheap (one cold prefill) and halves
the queue. So a replica far above the fleet's mean load pays extra, and the prefix
spreads once its holder saturates.
"""

from __future__ import annotations

import math
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
    # What this request adds to the replica's queue: its prefill before the learned bias,
    # less the per-step base (requests queued together share steps, and each step's base).
    queued_work_s: float = 0.0

    # What this request's prefill costs the requests that will queue behind it there
    # (scored, not predicted: it is not part of this request's own TTFT).
    delay_to_others_s: float = 0.0

    @property
    def total_s(self) -> float:
        """The predicted time to first token."""
        return self.queue_s + self.hot_s + self.prefill_s

    @property
    def cost_s(self) -> float:
        """What cache_aware minimises: its own TTFT plus the delay it adds for others."""
        return self.total_s + self.delay_to_others_s


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


def queued_work(request: RoutingRequest, replica: ReplicaState, config: PolicyConfig) -> float:
    """What `request` adds to the replica's queue: its prefill there before the learned
    bias, less the per-step base (requests queued together share steps)."""
    profile: PrefillProfile = replica.profile or config.prefill
    n = request.num_prompt_tokens
    uncached = max(n - cached_tokens(request, replica), 0)
    return _queued(profile, profile.seconds(uncached, n))


def _queued(profile: PrefillProfile, prefill_s: float) -> float:
    """queued_work of a prefill of `prefill_s` (unbiased) by `profile`."""
    return max(0.0, prefill_s - profile.base_s)


def least_work(request: RoutingRequest, replicas: Sequence[ReplicaState],
               config: PolicyConfig) -> float:
    """The least prefill work `request` could add anywhere among `replicas` (its best
    cache match's): the baseline the delay to others is charged above."""
    return min((queued_work(request, r, config) for r in replicas), default=0.0)


def _others_waiting(request: RoutingRequest, replica: ReplicaState,
                    config: PolicyConfig) -> tuple[float, float]:
    """Other clients' waiting requests on the replica as seconds of queue and as a count,
    both drained since the scrape: (external_s, external_now)."""
    profile: PrefillProfile = replica.profile or config.prefill
    n = request.num_prompt_tokens
    typical = replica.mean_prefill_s or profile.seconds(n, n)
    # Others' waiting requests as the scrape saw them, drained since (first come, first
    # served, like ours): a scrape up to an interval old must not keep a replica that has
    # long since served them looking busy.
    each_s = replica.bias * typical
    external_s = max(0.0, replica.external_waiting * each_s - replica.scrape_age_s)
    external_now = external_s / each_s if each_s > 0 else float(replica.external_waiting)
    return external_s, external_now


def _waiting(replica: ReplicaState, external_now: float) -> float:
    """Requests waiting for a prefill on the replica now: ours without a first byte, and
    the larger of others' from the scrape (`external_now`) and other gateways' count."""
    return replica.pending + max(external_now, replica.peer_pending)


def waiting_for_prefill(request: RoutingRequest, replica: ReplicaState,
                        config: PolicyConfig) -> float:
    """_waiting with others' scraped requests drained since the scrape."""
    return _waiting(replica, _others_waiting(request, replica, config)[1])


def mean_waiting(request: RoutingRequest, replicas: Sequence[ReplicaState],
                 config: PolicyConfig) -> float:
    """The mean of waiting_for_prefill over `replicas` (0 for none)."""
    if not replicas:
        return 0.0
    return sum(waiting_for_prefill(request, r, config) for r in replicas) / len(replicas)


def queue_ahead(request: RoutingRequest, replica: ReplicaState, config: PolicyConfig) -> float:
    """Predicted seconds of prefill queued on the replica ahead of a request sent now:
    ours (outstanding.py) and the larger of other gateways' (shared through Redis: fresh,
    theirs only) and every other client's (the scrape: late, drained since). The same
    requests twice over: the larger, not the sum."""
    external_s, _ = _others_waiting(request, replica, config)
    return replica.queued_prefill_s + max(external_s, replica.peer_wait_s)


def step_s(replica: ReplicaState, config: PolicyConfig) -> float:
    """Predicted seconds of what the prefill hold counts as a full step on the replica
    (hold_step_tokens through its profile and learned bias, less the step's base, as
    queued work is counted). Not the replica's budget, prefill_chunk_tokens: the hold
    needs enough queued there to keep it busy until its next release, and measured
    better at 2,048 tokens than at the sims' 8,192 (docs/POLICY.md)."""
    profile: PrefillProfile = replica.profile or config.prefill
    return replica.bias * profile.per_token_s * config.hold_step_tokens


def seconds_to_room(request: RoutingRequest, replicas: Sequence[ReplicaState],
                    config: PolicyConfig) -> float:
    """Predicted seconds until some replica has less than a full step of prefill queued
    (<= 0: one has now): when a request held at the gateway may go (prefill_hold.py).
    The queues drain as time passes, one second a second; no replica: room now."""
    return min((queue_ahead(request, r, config) - step_s(r, config) for r in replicas),
               default=0.0)


def defer_cap(config: PolicyConfig) -> float | None:
    """How many waiting requests the least prefill a request could cost is charged for
    (None: all of them); `work_relative` is a cap of 0."""
    return 0.0 if config.work_relative else config.defer_cap


def estimate_ttft(
    request: RoutingRequest, replica: ReplicaState, fleet_mean_load: float, config: PolicyConfig,
    least_work_s: float = 0.0, floor_waiting: float = 0.0,
) -> TtftEstimate:
    """Predicted TTFT of `request` on `replica` (see the module docstring for the formula)."""
    cached = cached_tokens(request, replica)
    n = request.num_prompt_tokens
    uncached = max(n - cached, 0)
    profile: PrefillProfile = replica.profile or config.prefill
    bias = replica.bias
    unbiased_s = profile.seconds(uncached, n)
    prefill_s = bias * unbiased_s
    queued_work_s = _queued(profile, unbiased_s)  # queued_work, its prefill computed once

    external_s, external_now = _others_waiting(request, replica, config)
    # Other gateways' queue twice over: shared through Redis (fresh, theirs only) and in
    # the scrape (late, every client's). The same requests: take the larger, not the sum
    # (queue_ahead, its parts computed once).
    work_s = replica.queued_prefill_s + max(external_s, replica.peer_wait_s)
    steps = max(1, -(-uncached // max(1, config.prefill_chunk_tokens)))
    others_running = max(replica.external_running, replica.peer_decoding)
    decoders = replica.decoding + others_running
    decode_s = bias * decoders * profile.per_token_s * steps
    # vLLM admits a new request only between steps: arriving at a replica that is
    # running anything, it first waits out the step in progress, half a step on average
    # (the mean residual of steps of about equal length). An idle replica starts it at
    # once. Where prefill is queued ahead (work_s) that queue's end is a step boundary,
    # and the wait is in work_s already.
    step_wait_s = 0.5 * bias * (profile.base_s + decoders * profile.per_token_s) if (
        work_s <= 0.0 and decoders + replica.pending > 0) else 0.0

    load = replica.load
    capacity = replica.capacity or config.saturation_load
    kv_over = max(0.0, replica.kv_usage - config.kv_threshold) / (1.0 - config.kv_threshold)
    queue_s = (
        work_s
        + step_wait_s
        + decode_s
        + config.load_cost_s * load
        + config.saturation_cost_s * max(0, load - capacity)
        + config.kv_cost_s * kv_over
    )
    hot_line = config.hot_ratio * fleet_mean_load + config.hot_slack
    hot_s = config.hot_cost_s * max(0.0, load - hot_line)
    # The requests waiting there now stand for those that will queue behind this one:
    # an idle replica delays no one by taking a cold prefill, a backed-up one does.
    # Others' from the scrape count as drained as the queue term drains them: a request
    # the replica served since the scrape waits behind no one. `floor_waiting`
    # (fleet_waiting): at least the fleet's mean, which an idle replica soon has too.
    waiting_there = max(_waiting(replica, external_now), floor_waiting)
    # The work above the least it could cost anywhere is fleet capacity spent (a cold
    # prefill where a cache hit was possible): charged for every request waiting. The
    # least itself is spent wherever it goes; charging it sends long prompts to short
    # lines (the requests waiting there are ahead of it, first come first served, so
    # this is a bet on who comes next), which keeps the many short prompts quick at the
    # long ones' expense: `defer_cap` bounds that bet to so many of its own prefills.
    cap = defer_cap(config)
    above = max(0.0, queued_work_s - least_work_s)
    base = min(queued_work_s, least_work_s)
    base_waiting = waiting_there if cap is None else min(waiting_there, cap)
    delay_s = config.work_weight * bias * (waiting_there * above + base_waiting * base)
    if config.shared_step and work_s > 0.0:
        delay_s += config.work_weight * shared_step_delay(uncached, work_s, profile, bias,
                                                          config.prefill_chunk_tokens)
    return TtftEstimate(cached, queue_s, hot_s, prefill_s, queued_work_s, delay_s)


def shared_step_delay(uncached: int, work_s: float, profile: PrefillProfile, bias: float,
                      budget: int) -> float:
    """What a request's first prefill chunk adds to the request ahead of it whose prefill
    ends in the step that chunk joins (policy.shared_step).

    vLLM's chunked prefill fills each step's token budget first come, first served: what
    is queued ahead is prefilled step by step, and the new request's first chunk fills
    what the last of those steps leaves, min(uncached, budget - leftover) tokens, where
    leftover is the queue's tokens in that step. The request whose prefill ends there
    waits for the whole step, so its first token comes that chunk's time later. The
    delay term above counts only the requests that will queue behind a request; this is
    one ahead of it, and not a bet: in a burst of prompts arriving together (the
    Mooncake traces' timestamps hold several), a 953-token prompt predicted at 23 ms came
    back in 374 ms, a 9,317-token prompt having gone to the same replica 2 ms after it
    and into the same step (the sim steps as vLLM's scheduler does; alone it comes back
    in 40 ms). In that run (results/hold-cap-mooncake-conversation-300-from6600-8sims-
    seed923) 14 of 27 prompts under 1k tokens came back over 1.5x their prediction, 230
    ms late on average, and 28 of 30 such prompts under 4k had a longer one sent to
    their replica within 50 ms after them.

    The queue ahead is seconds (`work_s`, biased); in tokens it is about work_s over the
    biased per-token cost, which ignores the queue's attention and step bases: the
    leftover is an estimate, the chunk's bound (the budget) is not."""
    per_token = bias * profile.per_token_s
    if per_token <= 0.0 or uncached <= 0 or budget <= 0:
        return 0.0
    ahead = work_s / per_token
    # The queue's tokens in its last step, in (0, budget]: a queue of whole steps fills
    # its last one, and the new request starts a step of its own.
    leftover = ahead - budget * (math.ceil(ahead / budget) - 1)
    return per_token * min(uncached, max(0.0, budget - leftover))


def step_gate_s(uncached: int, replica: ReplicaState, config: PolicyConfig) -> float:
    """How long a request routed to `replica` may wait at the gateway before it is sent,
    for the prefills queued there (this gateway's, and other gateways') to finish
    (policy.step_gate); 0: send it now.

    A request sent while prefill is queued ahead of it joins the step where that queue
    ends: vLLM fills each step's token budget first come, first served, so its first
    chunk fills what the queue leaves of the budget (shared_step_delay), and every
    request finishing its prefill in that step gets its first token that much later. The
    new request gains nothing by joining early: its own first token comes after the
    queue ahead and its own whole prefill either way, so sent once the queue ahead has
    its first bytes, it loses only the hop back and one more step's base, while the
    requests ahead lose nothing. A request whose whole prefill costs less than that base
    goes at once (a chunk that small delays no one by more than a step of its own would).

    The chunk is min(uncached, the budget less the queue's part of its last step), and
    the gateway knows neither term well (the queue in tokens is its seconds over a
    per-token cost; the budget is the replica's max_num_batched_tokens, which
    `prefill_chunk_tokens` need not be: the hold measured better at 2,048 on sims with
    8,192, docs/POLICY.md). So the test is the prompt's own uncached prefill against
    the base, and a chunk the budget leaves nearly nothing of (a queue ending at a step's
    end) is held too: it waits a hop for nothing.

    This gateway's queue is waited for until its first bytes (what it sees); other
    gateways' (shared through Redis, router/shared_work.py) for its predicted time as of
    the decision (peer_gate_s), since their first bytes are not seen here. At most the
    whole queue's predicted time and half again plus a step's base: a prediction far too
    short lets the request go as it would have gone without the gate."""
    own = replica.pending >= 1 and replica.queued_prefill_s > 0.0
    peers = peer_gate_s(replica)
    if not (own or peers > 0.0) or uncached <= 0:
        return 0.0
    profile: PrefillProfile = replica.profile or config.prefill
    if profile.per_token_s * uncached <= profile.base_s:
        return 0.0
    queued = (replica.queued_prefill_s if own else 0.0) + peers
    return 1.5 * queued + replica.bias * profile.base_s


def peer_gate_s(replica: ReplicaState) -> float:
    """Seconds of other gateways' prefill queued on `replica` that a gated request waits
    out (policy.step_gate): their predicted drain as of the decision, where they have
    requests there without a first byte (0 with one gateway). Only work published before
    the decision counts, so two gateways gating on each other's queue each wait a
    finite, shrinking time and never for one another."""
    if replica.peer_pending < 1:
        return 0.0
    return replica.peer_wait_s
