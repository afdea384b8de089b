"""The TTFT floor: each request alone on a sim holding the pooled oracle's prefix.

The floor is only worth printing if it is what the sim really does for a lone request,
so every case is checked against the simulated engine itself (its own clock, no wall
time): cached or cold, chunked by the token budget or not, under the 8B profile.
"""

from __future__ import annotations

import pytest

from loadgen.floor import lone_ttft, ttft_floor
from replica.engine import Engine, EngineConfig, EngineRequest
from replica.profiles import UNIT, load_profile
from router.hashing import HashConfig

H100 = load_profile("h100-llama3.1-8b")


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 10 for i in range(n)]


def _engine_ttft(prompt: list[int], warm: list[int] | None, budget: int) -> tuple[float, int]:
    """The TTFT and cached tokens the sim gives `prompt` alone, after `warm` (if any)
    has run to completion on the same engine."""
    engine = Engine(EngineConfig(hash=HashConfig(block_size=16), num_blocks=4096,
                                 max_model_len=32768, max_num_batched_tokens=budget,
                                 profile=H100))
    if warm is not None:
        engine.add_request(EngineRequest("warm", warm, 1))
        engine.run_until_idle()
    engine.add_request(EngineRequest("lone", prompt, 1, arrival=engine.now + 1.0))
    (result,) = engine.run_until_idle()
    assert result.ttft is not None
    return result.ttft, result.cached_tokens


@pytest.mark.parametrize(("size", "shared", "budget"), [
    (5000, 0, 8192),      # cold, one step
    (5000, 4928, 8192),   # an agent's next turn: 72 new tokens after 4,928 cached
    (20000, 0, 8192),     # cold and chunked: 8192 + 8192 + 3616
    (20000, 12000, 4096), # cached, then chunked by a smaller budget
    (17, 16, 8192),       # all but the last token cached: one token computed
])
def test_lone_ttft_is_what_the_sim_takes_for_a_request_alone(size: int, shared: int,
                                                             budget: int) -> None:
    prompt = _tokens(1, size)
    warm = prompt[:shared] + _tokens(2, 40) if shared else None
    measured, cached = _engine_ttft(prompt, warm, budget)
    assert cached == shared - shared % 16
    assert lone_ttft(H100, size, cached, budget) == pytest.approx(measured, rel=1e-9)


def test_more_cached_tokens_never_raise_the_floor_and_the_last_token_is_always_computed(
        ) -> None:
    floors = [lone_ttft(H100, 9000, c) for c in range(0, 9001, 500)]
    assert floors == sorted(floors, reverse=True)
    # Cached tokens past the prompt's last (a caller's mistake, or an answer's blocks)
    # still leave one token to compute: one step, never zero.
    assert lone_ttft(UNIT, 100, 100) == lone_ttft(UNIT, 100, 99) == pytest.approx(0.002)


def test_a_stream_floor_pairs_prompts_with_their_cached_counts() -> None:
    floor = ttft_floor([100, 100, 50], [0, 96, 48], UNIT)
    # unit profile: 1 ms a step + 1 ms a new token.
    assert floor.per_request == pytest.approx((0.101, 0.005, 0.003))
    assert floor.as_dict()["p50_s"] == pytest.approx(0.005)
    with pytest.raises(ValueError, match="3 prompts but 2 cached counts"):
        ttft_floor([1, 2, 3], [0, 0], UNIT)
    with pytest.raises(ValueError, match="prompt_tokens must be >= 1, got 0"):
        lone_ttft(UNIT, 0, 0)
