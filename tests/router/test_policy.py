"""Routing policies: pipeline invariants and cache_aware's behaviour, with numbers."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.policy import (
    POLICY_NAMES,
    NoReplicasError,
    Policy,
    PolicyConfig,
    PrefillProfile,
    ReplicaState,
    RoutingRequest,
    build_policy,
    cached_tokens,
    estimate_ttft,
)
from router.policy.cost import shared_step_delay

PROMPT = 2000  # tokens; at block size 16, 124 blocks are cacheable ((2000 - 1) // 16)
FULL = 124


def fleet(n: int = 4, **kw: object) -> dict[str, ReplicaState]:
    return {f"r{i}": ReplicaState(f"r{i}", block_size=16, **kw) for i in range(n)}  # type: ignore[arg-type]


def request(tokens: int = PROMPT, **kw: object) -> RoutingRequest:
    return RoutingRequest("m", num_prompt_tokens=tokens, **kw)  # type: ignore[arg-type]


def policy(name: str = "cache_aware", seed: int = 0, **kw: object) -> Policy:
    return build_policy(PolicyConfig(name=name, **kw), random.Random(seed))  # type: ignore[arg-type]


def route_hot_prefix(config: PolicyConfig, n: int, holder_capacity: int | None = None) -> list[str]:
    """Send n identical requests, none finishing; each target caches the prefix."""
    p = build_policy(config, random.Random(0))
    states = fleet(4, capacity=holder_capacity)
    states["r0"] = replace(states["r0"], matched_blocks=FULL)
    chosen: list[str] = []
    for _ in range(n):
        rid = p.decide(request(), list(states.values())).replica_id
        chosen.append(rid)
        states[rid] = replace(states[rid], inflight=states[rid].inflight + 1, matched_blocks=FULL)
    return chosen


# ------------------------------------------------------------------------ the cost model


def test_ttft_estimate_numbers() -> None:
    config = PolicyConfig()  # prefill 0.012 + 2.3e-5/token; 0.005 s per outstanding request
    cold = estimate_ttft(request(), ReplicaState("a", block_size=16), 0.0, config)
    assert cold.cached_tokens == 0 and cold.prefill_s == pytest.approx(0.012 + 2.3e-5 * 2000)
    warm = estimate_ttft(
        request(), ReplicaState("a", block_size=16, matched_blocks=500, inflight=3), 3.0, config
    )
    # Matches beyond (2000 - 1) // 16 = 124 blocks cannot be used: the last token recomputes.
    assert warm.cached_tokens == 1984
    assert warm.prefill_s == pytest.approx(0.012 + 2.3e-5 * 16)
    assert warm.queue_s == pytest.approx(0.015)
    assert warm.hot_s == 0.0


def test_load_is_the_larger_of_own_count_and_scrape() -> None:
    assert ReplicaState("a", inflight=5, running=1, waiting=1).load == 5
    assert ReplicaState("a", inflight=1, running=4, waiting=3).load == 7


def test_saturation_kv_and_hot_terms() -> None:
    config = PolicyConfig(
        saturation_load=4,
        saturation_cost_s=0.25,
        kv_threshold=0.8,
        kv_cost_s=0.5,
        hot_ratio=2.0,
        hot_slack=2.0,
        hot_cost_s=0.05,
    )
    r = ReplicaState("a", inflight=10, kv_usage=0.9)
    e = estimate_ttft(request(0), r, fleet_mean_load=2.0, config=config)
    # 0.005*10 + 0.25*(10-4) + 0.5*(0.1/0.2); hot line 2*2+2 = 6 -> 0.05*4.
    assert e.queue_s == pytest.approx(0.05 + 1.5 + 0.25)
    assert e.hot_s == pytest.approx(0.2)
    own_capacity = estimate_ttft(request(0), replace(r, capacity=20, kv_usage=0.0), 2.0, config)
    assert own_capacity.queue_s == pytest.approx(0.05)


def test_context_term_of_the_prefill_profile() -> None:
    profile = PrefillProfile(base_s=0.0, per_token_s=0.0, per_token_context_s=1e-6)
    # Causal: 100 new tokens after 900 cached attend to 900 + 1..100 positions each.
    assert profile.seconds(100, 1000) == pytest.approx(1e-6 * (100 * 900 + 100 * 101 / 2))
    # A cold prompt's pairs are the triangle, about half the square.
    assert profile.seconds(1000, 1000) == pytest.approx(1e-6 * 1000 * 1001 / 2)
    r = ReplicaState("a", block_size=16, matched_blocks=50, profile=profile)
    e = estimate_ttft(request(1000), r, 0.0, PolicyConfig())
    assert e.prefill_s == pytest.approx(1e-6 * (200 * 800 + 200 * 201 / 2))


def test_unverified_replicas_count_no_cached_tokens() -> None:
    assert cached_tokens(request(), ReplicaState("a", block_size=16, matched_blocks=50)) == 800
    assert (
        cached_tokens(
            request(), ReplicaState("a", block_size=16, matched_blocks=50, verified=False)
        )
        == 0
    )


# --------------------------------------------------------------------------- cache_aware


def test_cache_aware_follows_the_longest_match() -> None:
    states = fleet()
    states["r1"] = replace(states["r1"], matched_blocks=10)
    states["r2"] = replace(states["r2"], matched_blocks=100)
    for seed in range(20):
        d = policy(seed=seed).decide(request(), list(states.values()))
        assert d.replica_id == "r2"
        assert d.predicted_cached_tokens == 1600
        assert d.ranked[:2] == ("r2", "r1")
        assert d.predicted_cached == {"r0": 0, "r1": 160, "r2": 1600, "r3": 0}


def test_unverified_replica_matches_are_ignored() -> None:
    states = fleet()
    states["r1"] = replace(states["r1"], matched_blocks=60)
    states["r2"] = replace(states["r2"], matched_blocks=120, verified=False)
    for seed in range(20):
        d = policy(seed=seed).decide(request(), list(states.values()))
        assert d.replica_id == "r1" and d.predicted_cached["r2"] == 0


def test_a_long_match_beats_a_little_load_but_not_a_saturated_replica() -> None:
    states = fleet(2)
    states["r0"] = replace(states["r0"], matched_blocks=FULL, inflight=4)
    assert policy().decide(request(), list(states.values())).replica_id == "r0"
    states["r0"] = replace(states["r0"], inflight=70)  # beyond saturation_load (64)
    assert policy().decide(request(), list(states.values())).replica_id == "r1"


def test_hot_prefix_spreads_once_its_holder_saturates() -> None:
    # The holder has capacity 3: it takes exactly 4 (loads 0..3), then the prefix spreads.
    chosen = route_hot_prefix(PolicyConfig(hot_cost_s=0.0, tolerance=0.0), 12, holder_capacity=3)
    assert chosen[:4] == ["r0"] * 4
    assert chosen[4] != "r0"
    assert max(Counter(chosen).values()) <= 4


def test_hot_guard_spreads_earlier_than_queue_cost_alone() -> None:
    without = route_hot_prefix(PolicyConfig(hot_cost_s=0.0, tolerance=0.0), 40)
    guarded = route_hot_prefix(PolicyConfig(tolerance=0.0), 40)
    # Queue cost alone: 0.005 s per request must outweigh a 0.046 s prefill saving -> 10.
    assert without[:10] == ["r0"] * 10 and without[10] != "r0"
    # With the guard (line at 2 * mean + 2), r0 stops after 5: load 5 vs mean 1.25.
    assert guarded[:5] == ["r0"] * 5 and guarded[5] != "r0"
    assert max(Counter(guarded).values()) <= 12
    assert len(set(guarded)) == 4


def test_cold_requests_spread_over_idle_replicas() -> None:
    p = policy(seed=7)
    states = list(fleet().values())
    counts = Counter(p.decide(request(), states).replica_id for _ in range(400))
    assert set(counts) == {"r0", "r1", "r2", "r3"}
    assert all(60 <= c <= 140 for c in counts.values()), counts


def test_cold_requests_go_to_the_least_loaded() -> None:
    states = fleet()
    for i, rid in enumerate(["r0", "r1", "r3"]):
        states[rid] = replace(states[rid], inflight=5 + i)
    p = policy()
    assert {p.decide(request(), list(states.values())).replica_id for _ in range(50)} == {"r2"}


def test_herding_sampled_within_tolerance_of_one_prefill_only() -> None:
    states = fleet(3)
    # r0 best; r1 one request more (5 ms, 8.6% of this prompt's 58 ms cold prefill);
    # r2 cold (36 ms, 62% of a prefill, dearer).
    states["r0"] = replace(states["r0"], matched_blocks=FULL, inflight=2)
    states["r1"] = replace(states["r1"], matched_blocks=FULL, inflight=3)
    d = policy().decide(request(), list(states.values()))
    assert d.costs["r1"] - d.costs["r0"] == pytest.approx(0.005)
    assert d.costs["r2"] == pytest.approx(0.058)
    p = policy(tolerance=0.1, spread_ties=False)  # the sampling by score itself
    counts = Counter(p.decide(request(), list(states.values())).replica_id for _ in range(300))
    assert set(counts) == {"r0", "r1"} and counts["r0"] > counts["r1"] > 50
    strict = policy(tolerance=0.05, spread_ties=False)
    assert {strict.decide(request(), list(states.values())).replica_id for _ in range(100)} == {
        "r0"
    }
    # Behind a 4 s queue everywhere the same prices hold: the hit still saves 62% of a
    # prefill, so the cold replica is not sampled (as a share of the 4 s cost it would be
    # 0.9% dearer, "near-equal").
    busy = {rid: replace(st, queued_prefill_s=4.0) for rid, st in states.items()}
    counts = Counter(p.decide(request(), list(busy.values())).replica_id for _ in range(300))
    assert set(counts) == {"r0", "r1"}


def test_gateways_deciding_from_one_snapshot_take_an_idle_fleet_in_lanes() -> None:
    # A burst on an idle fleet: every replica near-equal. 4 gateways deciding at once
    # from the same snapshot take 4 different replicas, each starting its own share of
    # the fleet along the ids; with lanes off (or one gateway) each draws by score.
    states = list(fleet(8).values())
    firsts = [policy(seed=7).decide(request(lane=k, lanes=4), states).replica_id
              for k in range(4)]
    assert firsts == ["r0", "r2", "r4", "r6"]
    # Each gateway's next choice, its own first one now queued, moves on along its lane.
    for k, first in enumerate(firsts):
        busier = [replace(st, inflight=1, pending=1, queued_prefill_s=0.05)
                  if st.replica_id == first else st for st in states]
        assert policy(seed=7).decide(request(lane=k, lanes=4), busier).replica_id == \
            f"r{2 * k + 1}"
    unlaned = {policy(seed=7, lanes=False).decide(request(lane=k, lanes=4), states).replica_id
               for k in range(4)}
    assert len(unlaned) == 1  # the same draw from the same snapshot: one replica, 4 times


def test_in_lanes_work_queued_within_tolerance_of_the_least_counts_as_least() -> None:
    # Mid-burst: r3's queue is a little shorter than the rest (10 ms of a 58 ms prefill,
    # its cost within tolerance). The least-queued rule alone would send all 4 gateways to r3;
    # in lanes the near-least replicas are shared along the lanes.
    states = {rid: replace(st, pending=1, queued_prefill_s=0.0 if rid == "r3" else 0.01)
              for rid, st in fleet(8).items()}
    laned = [policy(seed=7).decide(request(lane=k, lanes=4), list(states.values())).replica_id
             for k in range(4)]
    assert laned == ["r0", "r2", "r4", "r6"]
    # One gateway keeps the strict rule: the least-queued near-equal, every time.
    alone = {policy(seed=s).decide(request(), list(states.values())).replica_id
             for s in range(20)}
    assert alone == {"r3"}
    # Beyond tolerance the shorter queue wins in every lane.
    far = {rid: replace(st, queued_prefill_s=0.0 if rid == "r3" else 0.5)
           for rid, st in states.items()}
    assert {policy(seed=7).decide(request(lane=k, lanes=4), list(far.values())).replica_id
            for k in range(4)} == {"r3"}


def test_lanes_split_only_near_ties_a_clearly_better_replica_wins_in_every_lane() -> None:
    states = fleet(8)
    states["r5"] = replace(states["r5"], matched_blocks=FULL)
    for k in range(4):
        d = policy().decide(request(lane=k, lanes=4), list(states.values()))
        assert d.replica_id == "r5"


def test_spread_ties_takes_the_near_equal_with_less_work_ahead() -> None:
    # The first turn of a burst sharing one prefix: r0 holds it (pending) behind a cold
    # prefill's worth of queue; r1 is idle and cold. Near-equal costs: by score alone
    # both are sampled; with spread_ties the idle replica is always taken.
    states = fleet(2)
    states["r0"] = replace(states["r0"], matched_blocks=FULL, queued_prefill_s=0.046)
    d = policy().decide(request(), list(states.values()))
    assert abs(d.costs["r0"] - d.costs["r1"]) < 0.1 * d.costs["r1"]
    by_score, by_work = policy(seed=1, spread_ties=False), policy(seed=1, spread_ties=True)
    plain = Counter(by_score.decide(request(), list(states.values())).replica_id
                    for _ in range(600))
    spread = Counter(by_work.decide(request(), list(states.values())).replica_id
                     for _ in range(600))
    assert 0.7 < plain["r1"] / plain["r0"] < 1.4
    assert spread == {"r1": 600}
    # Not near-equal (r0's queue is short, its hit saves most of a prefill): the hit wins
    # with or without spread_ties; the setting only breaks near-ties.
    states["r0"] = replace(states["r0"], queued_prefill_s=0.005)
    assert {by_work.decide(request(), list(states.values())).replica_id
            for _ in range(100)} == {"r0"}


@pytest.mark.parametrize("seed", range(10))
def test_spread_ties_gives_every_idle_replica_a_session_of_a_burst(seed: int) -> None:
    # Eight agent sessions sharing a 4,800-token prefix (60 tokens each of their own)
    # arrive at once on four idle replicas, priced as the calibrated sims; each routed
    # request queues its predicted prefill there and its chain is pending there. A
    # follower's wait behind the first is within tolerance of a cold prefill elsewhere,
    # so by score alone the draw stacks them (seeds 0 and 9 leave a replica with none).
    # Each session then stays where its history is, so turn one decides the whole
    # run's balance: with spread_ties every replica gets two, every seed.
    prompt, shared = request(4860), 4800 // 16

    def burst(config: PolicyConfig) -> list[int]:
        p = build_policy(config, random.Random(seed))
        states = fleet(4)
        for _ in range(8):
            rid = p.decide(prompt, list(states.values())).replica_id
            st_ = states[rid]
            prefill = estimate_ttft(prompt, st_, 0.0, config).prefill_s
            states[rid] = replace(st_, matched_blocks=shared, inflight=st_.inflight + 1,
                                  queued_prefill_s=st_.queued_prefill_s + prefill)
        return sorted(s.inflight for s in states.values())

    calibrated = PrefillProfile(base_s=0.008, per_token_s=6.6e-5, per_token_context_s=4e-9)
    assert burst(PolicyConfig(prefill=calibrated)) == [2, 2, 2, 2]  # the default
    if seed in (0, 9):
        assert burst(PolicyConfig(prefill=calibrated, spread_ties=False))[0] == 0


def test_weights_add_scorers() -> None:
    states = fleet(2)
    states["r0"] = replace(states["r0"], kv_usage=0.85)
    states["r1"] = replace(states["r1"], inflight=1)
    assert (
        policy(weights={"ttft": 0.0, "kv": 1.0}).decide(request(), list(states.values())).replica_id
        == "r1"
    )
    assert policy(tolerance=0.0).decide(request(), list(states.values())).replica_id == "r0"
    with pytest.raises(ValueError, match="unknown scorer 'magic'"):
        policy(weights={"magic": 1.0})


# -------------------------------------------------------------------------- other policies


def test_least_loaded() -> None:
    states = fleet(3)
    states["r0"] = replace(states["r0"], inflight=3)
    states["r1"] = replace(states["r1"], running=1, waiting=1)
    d = policy("least_loaded").decide(request(), list(states.values()))
    assert d.ranked == ("r2", "r1", "r0") and d.policy == "least_loaded"


def test_round_robin_cycles_in_id_order() -> None:
    p = policy("round_robin")
    states = list(fleet(3).values())
    seen = [p.decide(request(), states) for _ in range(6)]
    assert [d.replica_id for d in seen] == ["r0", "r1", "r2", "r0", "r1", "r2"]
    assert seen[1].ranked == ("r1", "r2", "r0")


def test_random_covers_the_fleet() -> None:
    p = policy("random", seed=3)
    states = list(fleet().values())
    assert {p.decide(request(), states).replica_id for _ in range(100)} == {"r0", "r1", "r2", "r3"}


def test_session_affinity_is_stable_and_moves_only_a_departed_replicas_keys() -> None:
    p = policy("session_affinity")
    states = list(fleet(5).values())
    keys = [f"session-{i}" for i in range(200)]
    before = {k: p.decide(request(session_key=k), states).replica_id for k in keys}
    assert before == {k: p.decide(request(session_key=k), states).replica_id for k in keys}
    assert len(set(before.values())) == 5
    states[2] = replace(states[2], healthy=False)
    after = {k: p.decide(request(session_key=k), states).replica_id for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "r2"}


def test_session_affinity_falls_back_to_tenant_then_load() -> None:
    p = policy("session_affinity")
    states = fleet(4)
    by_tenant = {
        p.decide(request(tenant="acme"), list(states.values())).replica_id for _ in range(10)
    }
    assert len(by_tenant) == 1
    for rid in ("r0", "r1", "r2"):
        states[rid] = replace(states[rid], inflight=2)
    assert p.decide(request(), list(states.values())).replica_id == "r3"


# ------------------------------------------------------------------------ filters, fallback


def test_filters_drop_unhealthy_ejected_and_wrong_model() -> None:
    states = fleet(4)
    states["r0"] = replace(states["r0"], healthy=False, matched_blocks=FULL)
    states["r1"] = replace(states["r1"], ejected=True, matched_blocks=FULL)
    states["r2"] = replace(states["r2"], models=frozenset({"other"}), matched_blocks=FULL)
    d = policy().decide(request(), list(states.values()))
    assert d.replica_id == "r3" and d.ranked == ("r3",) and not d.fallback


def test_never_empty_when_everything_is_filtered() -> None:
    states = [ReplicaState("a", healthy=False), ReplicaState("b", healthy=False, ejected=True)]
    for name in POLICY_NAMES:
        d = policy(name).decide(request(), states)
        assert d.fallback and "healthy" in d.relaxed
        # After relaxing health, not-ejected still applies.
        assert d.ranked == ("a",)
    d = policy().decide(RoutingRequest("unknown"), [ReplicaState("a", models=frozenset({"m"}))])
    assert d.replica_id == "a" and d.relaxed == ("serves_model",)


def test_no_replicas_and_duplicate_ids() -> None:
    with pytest.raises(NoReplicasError):
        policy().decide(request(), [])
    with pytest.raises(ValueError, match="unique"):
        policy().decide(request(), [ReplicaState("a"), ReplicaState("a")])


def test_policies_are_independent_instances() -> None:
    a, b = policy("round_robin"), policy("round_robin")
    states = list(fleet(3).values())
    a.decide(request(), states)
    assert b.decide(request(), states).replica_id == "r0"


def test_seeded_policy_is_reproducible() -> None:
    states = list(fleet(6).values())
    run1 = [policy(seed=11).decide(request(), states).ranked for _ in range(5)]
    p1, p2 = policy(seed=11), policy(seed=11)
    assert [p1.decide(request(), states).ranked for _ in range(20)] == [
        p2.decide(request(), states).ranked for _ in range(20)
    ]
    assert len(set(run1)) == 1


# -------------------------------------------------------------------------------- properties

replica_states = st.builds(
    ReplicaState,
    replica_id=st.sampled_from([f"r{i}" for i in range(8)]),
    healthy=st.booleans(),
    verified=st.booleans(),
    inflight=st.integers(0, 200),
    running=st.integers(0, 200),
    waiting=st.integers(0, 200),
    kv_usage=st.floats(0.0, 1.0),
    matched_blocks=st.integers(0, 300),
    block_size=st.sampled_from([1, 16, 32]),
    models=st.none() | st.just(frozenset({"m"})) | st.just(frozenset({"x"})),
    ejected=st.booleans(),
    capacity=st.none() | st.integers(1, 64),
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(replica_states, min_size=1, max_size=8, unique_by=lambda r: r.replica_id),
    st.sampled_from(POLICY_NAMES),
    st.integers(0, 5000),
    st.none() | st.text(max_size=8),
    st.integers(0, 2**32),
)
def test_decision_invariants(
    states: list[ReplicaState], name: str, tokens: int, session: str | None, seed: int
) -> None:
    d = policy(name, seed=seed).decide(request(tokens, session_key=session), states)
    ids = {s.replica_id for s in states}
    assert d.ranked and d.ranked[0] == d.replica_id
    assert len(set(d.ranked)) == len(d.ranked) and set(d.ranked) <= ids
    assert set(d.scores) == set(d.ranked)
    assert all(0.0 <= s <= 1.0 for s in d.scores.values())
    by_id = {s.replica_id: s for s in states}
    for rid in d.ranked:
        assert 0 <= d.predicted_cached[rid] <= max(tokens - 1, 0)
        if not by_id[rid].verified:
            assert d.predicted_cached[rid] == 0
    # Every replica that passes all filters is ranked; none that fails one is, unless relaxed.
    passing = {
        s.replica_id
        for s in states
        if s.healthy and not s.ejected and (s.models is None or "m" in s.models)
    }
    if passing:
        assert set(d.ranked) == passing and not d.fallback
    else:
        assert d.fallback
    if name in ("least_loaded", "cache_aware", "session_affinity"):
        # After the chosen one, the ranking is by score, best first.
        rest = [d.scores[r] for r in d.ranked[1:]]
        assert rest == sorted(rest, reverse=True)


# --------------------------------------------------------------- load as outstanding work


def test_queue_is_seconds_of_work_not_a_count() -> None:
    # r0 has one 16k-token cold prefill queued (0.38 s); r1 has five cached follow-ups
    # queued (5 x 0.0124 s). The old count-based queue preferred r0 (1 request < 5).
    config = PolicyConfig()
    long_cold = config.prefill.seconds(16_000, 16_000)
    short_cached = config.prefill.seconds(16, 2000)
    states = [
        ReplicaState("r0", block_size=16, inflight=1, queued_prefill_s=long_cold),
        ReplicaState("r1", block_size=16, inflight=5, queued_prefill_s=5 * short_cached),
    ]
    assert policy().decide(request(), states).replica_id == "r1"
    assert estimate_ttft(request(), states[0], 3.0, config).queue_s == pytest.approx(
        long_cold + config.load_cost_s * 1)


def test_a_cache_hit_behind_a_long_queue_loses_to_a_cold_idle_replica() -> None:
    # r0 holds the whole prompt but has 2 s of prefill queued: a cold prefill elsewhere
    # (0.058 s) is the faster first token.
    states = [
        ReplicaState("r0", block_size=16, matched_blocks=FULL, inflight=4, queued_prefill_s=2.0),
        ReplicaState("r1", block_size=16),
    ]
    assert policy(tolerance=0.0).decide(request(), states).replica_id == "r1"
    # With only 20 ms queued, the hit still wins.
    states[0] = replace(states[0], queued_prefill_s=0.02)
    assert policy(tolerance=0.0).decide(request(), states).replica_id == "r0"


def test_other_clients_waiting_requests_cost_the_typical_prefill() -> None:
    config = PolicyConfig()
    r = ReplicaState("a", block_size=16, waiting=3, external_waiting=3, mean_prefill_s=0.2)
    est = estimate_ttft(request(), r, 3.0, config)
    assert est.queue_s == pytest.approx(3 * 0.2 + config.load_cost_s * 3)
    # Never seen a request there: charge each this request's own cold prefill.
    fresh = replace(r, mean_prefill_s=0.0)
    assert estimate_ttft(request(), fresh, 3.0, config).queue_s == pytest.approx(
        3 * config.prefill.seconds(PROMPT, PROMPT) + config.load_cost_s * 3)
    # What the scrape saw has been draining since: 0.5 s later, 0.1 s of it is left.
    aged = replace(r, scrape_age_s=0.5)
    assert estimate_ttft(request(), aged, 3.0, config).queue_s == pytest.approx(
        0.1 + config.load_cost_s * 3)
    old = replace(r, scrape_age_s=2.0)
    assert estimate_ttft(request(), old, 3.0, config).queue_s == pytest.approx(
        config.load_cost_s * 3)


def test_decoding_sequences_share_every_prefill_step() -> None:
    config = PolicyConfig(prefill_chunk_tokens=512)
    r = ReplicaState("a", block_size=16, decoding=6, external_running=4, inflight=6, running=10)
    est = estimate_ttft(request(), r, 10.0, config)
    steps = 4  # ceil(2000 / 512)
    decode = 10 * config.prefill.per_token_s * steps
    # And it first waits out the step in progress: half of one, on average.
    step_wait = 0.5 * (config.prefill.base_s + 10 * config.prefill.per_token_s)
    assert est.queue_s == pytest.approx(step_wait + decode + config.load_cost_s * 10)


def test_a_request_waits_half_the_step_in_progress_on_a_busy_replica() -> None:
    config = PolicyConfig()
    base = config.prefill.base_s
    idle = ReplicaState("idle", block_size=16)
    assert estimate_ttft(request(40), idle, 0.0, config).queue_s == 0.0
    # One of ours decoding there, or one of another client's: its step is under way.
    for busy in (ReplicaState("b", block_size=16, decoding=1, inflight=1),
                 ReplicaState("b", block_size=16, external_running=1, running=1)):
        est = estimate_ttft(request(40), busy, 0.5, config)
        assert est.queue_s == pytest.approx(
            0.5 * (base + config.prefill.per_token_s) + config.prefill.per_token_s
            + config.load_cost_s)
    # Scaled by what the replica has shown of its speed, like everything it predicts.
    slow = ReplicaState("b", block_size=16, decoding=1, inflight=1, bias=2.0)
    assert estimate_ttft(request(40), slow, 0.5, config).queue_s == pytest.approx(
        2.0 * (0.5 * (base + config.prefill.per_token_s) + config.prefill.per_token_s)
        + config.load_cost_s)
    # Prefill queued ahead ends on a step boundary: no half step on top of it.
    queued = ReplicaState("b", block_size=16, pending=1, inflight=1, queued_prefill_s=0.3)
    assert estimate_ttft(request(40), queued, 0.5, config).queue_s == pytest.approx(
        0.3 + config.load_cost_s)


def test_a_short_prompt_skips_a_small_hit_on_a_busy_replica_for_an_idle_one() -> None:
    # Two of a 40-token prompt's blocks cached where a sequence is decoding save ~0.7 ms
    # of prefill; waiting out that replica's step in progress costs ~6 ms.
    states = [ReplicaState("busy", block_size=16, decoding=1, inflight=1, matched_blocks=2),
              ReplicaState("idle", block_size=16)]
    for order in (states, states[::-1]):
        assert policy(load_cost_s=0.0, tolerance=0.0).decide(request(40), order).replica_id == "idle"
    # Not so for a long prompt's large hit: the half step is worth less than the prefill.
    hit = replace(states[0], matched_blocks=FULL)
    assert policy(load_cost_s=0.0, tolerance=0.0).decide(request(), [hit, states[1]]).replica_id == "busy"


def test_learned_bias_scales_prefill_and_the_others_queue() -> None:
    config = PolicyConfig()
    slow = ReplicaState("a", block_size=16, bias=2.0, external_waiting=1, waiting=1,
                        mean_prefill_s=0.1)
    est = estimate_ttft(request(), slow, 1.0, config)
    assert est.prefill_s == pytest.approx(2.0 * config.prefill.seconds(PROMPT, PROMPT))
    assert est.queued_work_s == pytest.approx(
        config.prefill.seconds(PROMPT, PROMPT) - config.prefill.base_s)
    assert est.queue_s == pytest.approx(2.0 * 0.1 + config.load_cost_s)


def test_decision_carries_each_replicas_predicted_work_for_the_proxy() -> None:
    config = PolicyConfig()
    states = [ReplicaState("r0", block_size=16, matched_blocks=FULL), ReplicaState("r1", block_size=16)]
    d = policy().decide(request(), states)
    base = config.prefill.base_s  # shared by requests prefilled in one step: not queued
    assert d.predicted_work["r0"][0] == pytest.approx(config.prefill.seconds(16, PROMPT) - base)
    assert d.predicted_work["r1"][0] == pytest.approx(config.prefill.seconds(PROMPT, PROMPT) - base)
    assert d.predicted_work["r0"][1] == pytest.approx(d.costs["r0"])


def test_a_backed_up_replica_weighs_the_prefill_a_request_makes_others_wait_for() -> None:
    # r0 holds the prompt but has 0.1 s more queued than cold r1. Alone, r1's first token
    # is sooner (the cold prefill, 0.058 s, is under 0.1 s); with 3 requests waiting at
    # r1 the 0.046 s of prefill it would spend there delays each of them, so r0.
    config = PolicyConfig()
    holder = ReplicaState("r0", block_size=16, matched_blocks=FULL, queued_prefill_s=0.1)
    cold = ReplicaState("r1", block_size=16)
    assert policy().decide(request(), [holder, cold]).replica_id == "r1"
    # Three waiting at each.
    busy = [replace(holder, pending=3), replace(cold, pending=3)]
    assert policy().decide(request(), busy).replica_id == "r0"
    est = estimate_ttft(request(), busy[1], 1.5, config)
    work = config.prefill.seconds(PROMPT, PROMPT) - config.prefill.base_s
    assert est.delay_to_others_s == pytest.approx(3.0 * work)
    assert est.cost_s == pytest.approx(est.total_s + 3.0 * work)
    # It is scored, not predicted: the TTFT the proxy learns against excludes it.
    d = policy().decide(request(), busy)
    assert d.predicted_work["r1"][1] == pytest.approx(d.costs["r1"])
    assert d.costs["r1"] == pytest.approx(est.total_s)
    # work_weight 0 turns it off: the sooner first token wins again.
    assert policy(work_weight=0.0).decide(request(), busy).replica_id == "r1"


def test_other_clients_waiting_in_an_old_scrape_are_counted_as_served() -> None:
    # One of ours and two of other clients' wait at r1, as of the last scrape. Served
    # first come first served since, they neither queue ahead of this request (the queue
    # term) nor wait behind it (the delay to others): a scrape up to an interval old.
    config = PolicyConfig()
    work = config.prefill.seconds(PROMPT, PROMPT) - config.prefill.base_s
    each = config.prefill.seconds(PROMPT, PROMPT)  # no mean measured yet: this prompt's
    seen = ReplicaState("r1", block_size=16, pending=1, external_waiting=2, waiting=3)

    def delay(age_s: float) -> float:
        return estimate_ttft(request(), replace(seen, scrape_age_s=age_s), 1.5,
                             config).delay_to_others_s

    assert delay(0.0) == pytest.approx(3.0 * work)
    assert delay(each) == pytest.approx(2.0 * work)  # one of theirs served since
    assert delay(10.0) == pytest.approx(1.0 * work)  # both: only ours still waits


def test_an_idle_replica_takes_a_cold_prefill_without_a_penalty() -> None:
    # The holder is backed up; an idle replica delays no one by prefilling cold.
    config = PolicyConfig()
    holder = ReplicaState("r0", block_size=16, matched_blocks=FULL, pending=6,
                          queued_prefill_s=0.3)
    idle = ReplicaState("r1", block_size=16)
    assert estimate_ttft(request(), idle, 3.0, config).delay_to_others_s == 0.0
    assert policy().decide(request(), [holder, idle]).replica_id == "r1"


def test_fleet_waiting_counts_the_queue_an_idle_replica_will_have() -> None:
    # A fleet past its capacity: the holder and two more replicas each have three
    # requests waiting, one replica is idle. By its own queue the idle one delays no one
    # with a cold prefill and wins; with fleet_waiting it delays the fleet's mean (2.25),
    # which the router will soon send it, and the holder's cheap hit wins.
    holder = ReplicaState("r0", block_size=16, matched_blocks=FULL, pending=3,
                          queued_prefill_s=0.1)
    busy = [ReplicaState(f"r{i}", block_size=16, pending=3, queued_prefill_s=0.1)
            for i in (1, 2)]
    idle = ReplicaState("r3", block_size=16)
    fleet = [holder, *busy, idle]
    assert policy(tolerance=0.0).decide(request(), fleet).replica_id == "r3"
    d = policy(tolerance=0.0, fleet_waiting=True).decide(request(), fleet)
    assert d.replica_id == "r0"
    # An idle fleet has no mean to count: the choice is as without it.
    calm = [replace(r, pending=0, queued_prefill_s=0.0) for r in fleet]
    assert (policy(fleet_waiting=True, seed=3).decide(request(), calm).replica_id
            == policy(seed=3).decide(request(), calm).replica_id)


def test_delay_to_others_is_charged_only_above_the_least_work_it_could_cost() -> None:
    # work_relative: a long cold prompt, cold everywhere, costs the same prefill wherever
    # it goes, so no choice saves anyone anything, and it goes where its first token comes soonest
    # (r1: four small requests, 0.15 s, queued) even though more requests wait there than
    # at r0 (one request, 0.2 s). Charging its whole prefill per waiting request sent
    # every long prompt to the shortest line, not the soonest: the long prompts' TTFT
    # was the tail (p99) of a trace where nothing could be cached.
    long_prompt = request(8000)
    r0 = ReplicaState("r0", block_size=16, pending=1, queued_prefill_s=0.2)
    r1 = ReplicaState("r1", block_size=16, pending=4, queued_prefill_s=0.15)
    d = policy(tolerance=0.0, work_relative=True).decide(long_prompt, [r0, r1])
    assert d.replica_id == "r1" and d.costs["r1"] < d.costs["r0"]
    # Uncapped, the whole prefill is charged per waiting request: the shorter line wins.
    absolute = policy(tolerance=0.0, defer_cap=None).decide(long_prompt, [r0, r1])
    assert absolute.replica_id == "r0"
    # Where a replica holds the prompt the others are charged the work they add above it.
    config = PolicyConfig(work_relative=True)
    hit = replace(r0, matched_blocks=(8000 - 1) // 16)
    least = config.prefill.seconds(8000 - 499 * 16, 8000) - config.prefill.base_s
    est = estimate_ttft(long_prompt, r1, 0.0, config, least)
    cold = config.prefill.seconds(8000, 8000) - config.prefill.base_s
    assert est.delay_to_others_s == pytest.approx(4 * (cold - least))
    assert policy(tolerance=0.0, work_relative=True).decide(long_prompt, [hit, r1]).replica_id == "r0"


def test_shared_step_charges_the_chunk_a_request_adds_to_the_step_ahead_of_it() -> None:
    # vLLM fills a step's budget first come, first served: a request's first chunk
    # fills what the queue ahead leaves of its last step, and the request ending there
    # waits for all of it.
    p = PrefillProfile(base_s=0.01, per_token_s=1e-4)
    # 441 tokens ahead: a 9,000-token prompt's first chunk is the other 1,607 tokens.
    assert shared_step_delay(9000, 441e-4, p, 1.0, 2048) == pytest.approx(1607e-4)
    # A short prompt adds only itself; the learned bias scales both sides.
    assert shared_step_delay(300, 2 * 441e-4, p, 2.0, 2048) == pytest.approx(2 * 300e-4)
    # A queue of whole steps (two here) fills its last one: nothing is shared.
    assert shared_step_delay(9000, 4096e-4, p, 1.0, 2048) == pytest.approx(0.0)
    # Past one step the new chunk joins the last: 2,100 tokens leave 1,996 of a second.
    assert shared_step_delay(9000, 2100e-4, p, 1.0, 2048) == pytest.approx(1996e-4)


def test_shared_step_keeps_a_long_prompt_off_a_short_one_about_to_start() -> None:
    # A burst: a 950-token prompt has just gone to r0, idle until then; an 8,000-token
    # prompt comes next. r1 is idle but a tenth slower (its learned bias). By its own
    # first token r0 is sooner (the short prompt's 441 uncached tokens ahead against
    # r1's 800 tokens' worth of slowness), but there the long prompt's first chunk joins
    # the short one's step and makes it wait for 1,607 tokens more.
    config = PolicyConfig(work_relative=True, tolerance=0.0, shared_step=True)
    short_ahead = config.prefill.per_token_s * 441
    r0 = ReplicaState("r0", block_size=16, pending=1, queued_prefill_s=short_ahead)
    r1 = ReplicaState("r1", block_size=16, bias=1.1)
    long_prompt = request(8000)
    off = build_policy(replace(config, shared_step=False), random.Random(0))
    assert off.decide(long_prompt, [r0, r1]).replica_id == "r0"
    d = build_policy(config, random.Random(0)).decide(long_prompt, [r0, r1])
    assert d.replica_id == "r1"
    least = estimate_ttft(long_prompt, r1, 0.0, config).queued_work_s  # cold everywhere
    est = estimate_ttft(long_prompt, r0, 0.0, config, least)
    assert est.delay_to_others_s == pytest.approx(config.prefill.per_token_s * (2048 - 441))


def test_defer_cap_bounds_how_long_a_cold_prompt_waits_for_the_short_ones() -> None:
    # A long prompt, cold everywhere: r0 has one request waiting behind 2 prefills of
    # this prompt's length of queued work, r1 four behind less. Charging its prefill per
    # waiting request (defer_cap None) sends it to r0, the shorter line, where its own
    # first token comes two of its prefills later than on r1; `defer_cap` 0.5 charges
    # the prefill to at most half a waiting request, so it cannot wait more than half its
    # prefill longer for the others' sake and goes to r1.
    long_prompt = request(8000)
    config = PolicyConfig(defer_cap=None)
    own = config.prefill.seconds(8000, 8000)
    r1 = ReplicaState("r1", block_size=16, pending=4, queued_prefill_s=0.1)
    r0 = ReplicaState("r0", block_size=16, pending=1, queued_prefill_s=0.1 + 2 * own)
    unbounded = policy(tolerance=0.0, defer_cap=None).decide(long_prompt, [r0, r1])
    assert unbounded.replica_id == "r0"
    assert unbounded.costs["r0"] - unbounded.costs["r1"] > own
    assert policy(tolerance=0.0, defer_cap=0.5).decide(long_prompt, [r0, r1]).replica_id == "r1"
    # The cap leaves a cache hit its worth: the work a cold prefill adds above the hit's
    # is still charged for every request waiting.
    hit = replace(r0, queued_prefill_s=0.3, matched_blocks=(8000 - 1) // 16)
    cold = replace(r1, queued_prefill_s=0.0)
    with_hit = policy(tolerance=0.0, defer_cap=0.5).decide(long_prompt, [hit, cold])
    assert with_hit.replica_id == "r0" and with_hit.costs["r0"] > with_hit.costs["r1"]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 12), st.floats(0.0, 5.0), st.integers(0, 16),
                       st.floats(0.5, 2.0)), min_size=1, max_size=8),
    st.integers(1, 32000),
    st.sampled_from([0.0, 0.25, 0.5, 1.0, 3.0]),
    st.booleans(),
    st.booleans(),
)
def test_defer_cap_bounds_the_wait_beyond_the_soonest_first_token(
    lines: list[tuple[int, float, int, float]], tokens: int, cap: float, fleet_waiting: bool,
    shared: bool,
) -> None:
    # Cold everywhere, the prompt's own prefill is the same work wherever it goes; what
    # the delay to others may cost it, over the soonest predicted first token, is at
    # most `defer_cap` of that prefill (at the largest learned bias), and with
    # shared_step the step it shares with the request ahead: at most its first chunk.
    states = [ReplicaState(f"r{i}", block_size=16, pending=pending, queued_prefill_s=queued,
                           decoding=decoding, bias=bias)
              for i, (pending, queued, decoding, bias) in enumerate(lines)]
    config = PolicyConfig(tolerance=0.0, defer_cap=cap, fleet_waiting=fleet_waiting,
                          shared_step=shared)
    d = build_policy(config, random.Random(0)).decide(request(tokens), states)
    work = config.prefill.seconds(tokens, tokens) - config.prefill.base_s
    bias = max(s.bias for s in states)
    chunk = bias * config.prefill.per_token_s * min(tokens, config.prefill_chunk_tokens)
    slack = cap * bias * work + (chunk if config.shared_step else 0.0)
    assert d.costs[d.replica_id] <= min(d.costs.values()) + slack + 1e-9
