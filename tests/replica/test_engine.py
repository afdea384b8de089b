"""The simulated engine: scheduling, timing and the prefix-cache mechanics a router relies on.

Every expected number is derived by hand from vLLM's block rules (block size 16 unless
said otherwise): a repeat hits (n - 1) // 16 blocks; only full blocks cache; eviction
pops the LRU head; a finished request's tail is evicted before its head.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from replica.engine import (
    Engine,
    EngineConfig,
    EngineDead,
    EngineRequest,
    RequestRejected,
    run_requests,
)
from replica.profiles import UNIT, load_profile
from router.hashing import HashConfig
from router.kv_events import BlockStored

BS16 = HashConfig(block_size=16)


def _config(**kw: Any) -> EngineConfig:
    base: dict[str, Any] = dict(hash=BS16, num_blocks=1025, max_model_len=4096)
    base.update(kw)
    return EngineConfig(**base)


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 10 for i in range(n)]


def test_repeat_hits_all_but_the_last_block() -> None:
    prompt = _tokens(1, 100)
    results, stats = run_requests(_config(), [
        EngineRequest("a", prompt, 1), EngineRequest("b", prompt, 1, arrival=1.0)])
    assert [r.cached_tokens for r in results] == [0, 96]
    assert (stats.queries, stats.hits, stats.requests) == (200, 96, 2)


def test_per_request_preamble_ahead_of_shared_prompt_drops_hits_to_zero() -> None:
    shared = _tokens(2, 400)
    good = [EngineRequest(f"g{i}", shared + _tokens(100 + i, 20), 1, arrival=i) for i in range(4)]
    bad = [EngineRequest(f"b{i}", _tokens(200 + i, 20) + shared, 1, arrival=i) for i in range(4)]
    good_results, good_stats = run_requests(_config(), good)
    bad_results, bad_stats = run_requests(_config(), bad)
    # Shared first: requests 2-4 hit the 25 full blocks of the shared 400 tokens.
    assert [r.cached_tokens for r in good_results] == [0, 400, 400, 400]
    assert good_stats.hits == 1200 and good_stats.queries == 4 * 420
    # Preamble first: block 0 differs per request, so every later key differs too.
    assert [r.cached_tokens for r in bad_results] == [0, 0, 0, 0]
    assert bad_stats.hit_rate == 0.0


def test_shared_prefix_shorter_than_a_block_is_never_reused() -> None:
    shared = _tokens(3, 15)
    reqs = [EngineRequest(f"r{i}", shared + _tokens(300 + i, 60), 1, arrival=i) for i in range(5)]
    results, stats = run_requests(_config(), reqs)
    assert all(r.cached_tokens == 0 for r in results)
    assert stats.hits == 0


def test_pool_smaller_than_working_set_thrashes() -> None:
    # Three 64-token prompts (4 blocks each) cycled twice. A big pool hits 48 tokens on
    # each of the second round's 3 requests. An 8-block pool holds two prompts: each new
    # prompt evicts the least recently used one, leaf first, and the cyclic order means
    # the evicted prompt is always the next one asked for: zero hits, 4 evictions each
    # from the third request on.
    prompts = [[k] * 64 for k in (11, 12, 13)]
    reqs = [EngineRequest(f"r{i}", prompts[i % 3], 1, arrival=i) for i in range(6)]
    _, big = run_requests(_config(num_blocks=1025, max_model_len=128), reqs)
    _, small = run_requests(_config(num_blocks=9, max_model_len=128), reqs)
    assert (big.hits, big.evictions) == (144, 0)
    assert (small.hits, small.evictions) == (0, 16)


def test_salt_keeps_reuse_inside_a_conversation_only() -> None:
    system = _tokens(4, 200)
    reqs = [
        EngineRequest("c1-t1", system + _tokens(40, 10), 1, cache_salt="conv-1", arrival=0),
        EngineRequest("c1-t2", system + _tokens(41, 10), 1, cache_salt="conv-1", arrival=1),
        EngineRequest("c2-t1", system + _tokens(42, 10), 1, cache_salt="conv-2", arrival=2),
        EngineRequest("c2-t2", system + _tokens(43, 10), 1, cache_salt="conv-2", arrival=3),
    ]
    results, _ = run_requests(_config(), reqs)
    # 200 shared tokens = 12 full blocks = 192 tokens, inside the same salt only.
    assert [r.cached_tokens for r in results] == [0, 192, 0, 192]


def test_next_turn_hits_the_previous_answer() -> None:
    engine = Engine(_config())
    prompt = _tokens(5, 30)
    engine.add_request(EngineRequest("t1", prompt, 20))
    (first,) = engine.run_until_idle()
    assert len(first.output_token_ids) == 20
    # 30 + 20 tokens, the last never computed: 49 computed -> 3 full blocks cached.
    turn2 = prompt + first.output_token_ids + _tokens(6, 14)  # 64 tokens
    engine.add_request(EngineRequest("t2", turn2, 1, arrival=engine.now))
    (second,) = engine.run_until_idle()
    assert second.cached_tokens == 48


def test_generated_tokens_are_deterministic_and_in_vocab() -> None:
    cfg = _config(vocab_size=50, reserved_token_ids=frozenset({0, 1, 2}), seed=7)
    a, _ = run_requests(cfg, [EngineRequest("x", _tokens(7, 20), 30)])
    b, _ = run_requests(cfg, [EngineRequest("y", _tokens(7, 20), 30)])
    c, _ = run_requests(_config(vocab_size=50, seed=8), [EngineRequest("x", _tokens(7, 20), 30)])
    assert a[0].output_token_ids == b[0].output_token_ids
    assert a[0].output_token_ids != c[0].output_token_ids
    assert all(3 <= t < 50 for t in a[0].output_token_ids)


def test_replayed_output_tokens_are_used_verbatim() -> None:
    out = [5, 6, 7, 8]
    (r,), _ = run_requests(_config(), [EngineRequest("x", _tokens(8, 20), 10, output_token_ids=out)])
    assert r.output_token_ids == out


def test_unit_profile_times_by_hand() -> None:
    # unit profile: 1 ms per step + 1 ms per new token.
    engine = Engine(_config(profile=UNIT))
    prompt = _tokens(9, 100)
    engine.add_request(EngineRequest("a", prompt, 3))
    (a,) = engine.run_until_idle()
    assert a.ttft == pytest.approx(0.101)  # one 100-token prefill step
    assert a.finish_time == pytest.approx(0.105)  # + two decode steps of 2 ms
    engine.add_request(EngineRequest("b", prompt, 1, arrival=1.0))
    (b,) = engine.run_until_idle()
    assert b.ttft == pytest.approx(0.005)  # 96 cached: 4 new tokens


def test_chunked_prefill_splits_by_the_token_budget() -> None:
    engine = Engine(_config(profile=UNIT, max_num_batched_tokens=32))
    engine.add_request(EngineRequest("a", _tokens(10, 100), 1))
    (a,) = engine.run_until_idle()
    assert engine.stats.steps == 4  # 32 + 32 + 32 + 4
    assert a.ttft == pytest.approx(0.104)


def test_max_num_seqs_queues_fcfs() -> None:
    engine = Engine(_config(profile=UNIT, max_num_seqs=1))
    for i in range(3):
        engine.add_request(EngineRequest(f"r{i}", _tokens(20 + i, 10), 2))
    engine.step()
    assert (engine.num_running, engine.num_waiting) == (1, 2)
    done = engine.run_until_idle()
    assert [r.request_id for r in done] == ["r0", "r1", "r2"]


def test_preemption_frees_the_last_running_request_and_recomputes_it() -> None:
    # 6 usable blocks. Both 32-token requests decode in lockstep; at 48 computed tokens
    # r1 needs a 4th block with none free, so r2 (last running) is preempted. r2's three
    # cached blocks go to the free queue tail (its tail first); r1 then takes two of them
    # as it grows to 71 tokens, leaving r2 only its first block to hit when resumed.
    cfg = _config(num_blocks=7, max_model_len=96, profile=UNIT)
    results, stats = run_requests(cfg, [EngineRequest("r1", _tokens(30, 32), 40),
                                        EngineRequest("r2", _tokens(31, 32), 40)])
    assert [(r.request_id, r.num_preemptions, len(r.output_token_ids)) for r in results] == [
        ("r1", 0, 40), ("r2", 1, 40)]
    assert stats.preemptions == 1
    assert (stats.preempted_queries, stats.preempted_hits) == (49, 16)
    alone, _ = run_requests(_config(), [EngineRequest("r2", _tokens(31, 32), 40)])
    assert results[1].output_token_ids == alone[0].output_token_ids


def test_rejections_use_vllms_messages() -> None:
    engine = Engine(_config(max_model_len=128))
    with pytest.raises(RequestRejected, match=r"maximum context length is 128 tokens\. However, "
                       "your prompt contains 129 input tokens"):
        engine.add_request(EngineRequest("a", _tokens(1, 129), 1))
    with pytest.raises(RequestRejected, match=r"prompt \(length 128\) plus the number of "
                       "requested output tokens"):
        engine.add_request(EngineRequest("b", _tokens(1, 128), 1))
    engine.add_request(EngineRequest("c", _tokens(1, 100), 500))  # clamped to 28, not refused
    (c,) = engine.run_until_idle()
    assert len(c.output_token_ids) == 28


def test_a_poisoned_prompt_kills_the_engine_when_scheduled() -> None:
    engine = Engine(_config(crash_on_token=7))
    engine.add_request(EngineRequest("ok", _tokens(1, 40), 50))
    engine.step()  # the healthy request is running
    engine.add_request(EngineRequest("bad", [1, 2, 7, 3], 1))  # queued: nothing dies yet
    with pytest.raises(EngineDead, match=r"request bad holds token id 7"):
        engine.step()
    # Dead for good: no step, no new request, whatever it holds.
    with pytest.raises(EngineDead):
        engine.step()
    with pytest.raises(EngineDead):
        engine.add_request(EngineRequest("later", _tokens(2, 10), 1))
    # Without the flag, the same prompt is just a prompt.
    (done,) = run_requests(_config(), [EngineRequest("bad", [1, 2, 7, 3], 1)])[0]
    assert done.finish_reason == "length"


def test_model_len_beyond_pool_refuses_to_start() -> None:
    with pytest.raises(ValueError, match="estimated maximum model length is 160"):
        EngineConfig(hash=BS16, num_blocks=11, max_model_len=4096)


def test_abort_frees_blocks_and_counts() -> None:
    engine = Engine(_config())
    engine.add_request(EngineRequest("a", _tokens(1, 64), 100))
    engine.step()
    assert engine.num_running == 1 and engine.kv_usage() > 0
    result = engine.abort("a")
    assert result is not None and result.finish_reason == "abort"
    assert engine.num_running == 0 and engine.kv_usage() == 0.0


def test_future_arrivals_advance_the_clock() -> None:
    engine = Engine(_config(profile=UNIT))
    engine.add_request(EngineRequest("late", _tokens(1, 10), 1, arrival=5.0))
    assert engine.num_waiting == 1
    (r,) = engine.run_until_idle()
    assert r.first_token_time == pytest.approx(5.011)
    assert r.ttft == pytest.approx(0.011)


def test_profile_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(UNIT.to_json())
    assert load_profile(str(path)) == UNIT
    with pytest.raises(ValueError, match="unknown prefill profile"):
        load_profile("no-such-profile")


def test_prompt_logprobs_requests_skip_the_cache_and_its_stats() -> None:
    prompt = _tokens(11, 64)
    results, stats = run_requests(_config(), [
        EngineRequest("a", prompt, 1),
        EngineRequest("b", prompt, 1, arrival=1, skip_prefix_cache=True),
        EngineRequest("c", prompt, 1, arrival=2)])
    assert [r.cached_tokens for r in results] == [0, 0, 48]
    # b neither looked up nor counted: queries are a's and c's 64 tokens each.
    assert (stats.queries, stats.hits, stats.prompt_tokens) == (128, 48, 192)


def test_full_report_mode_reannounces_the_hit_prefix() -> None:
    engine = Engine(_config())
    prompt = _tokens(12, 40)  # 2 full blocks
    engine.add_request(EngineRequest("a", prompt, 1))
    first = engine.run_step()
    engine.add_request(EngineRequest("b", prompt, 1, arrival=engine.now, report_cached_blocks=True))
    second = engine.run_step()
    (stored,) = first.events
    (reported,) = second.events  # (40 - 1) // 16 = 2 blocks hit, nothing new fills
    assert isinstance(stored, BlockStored) and isinstance(reported, BlockStored)
    assert reported.block_hashes == stored.block_hashes
    assert reported.parent_block_hash is None
