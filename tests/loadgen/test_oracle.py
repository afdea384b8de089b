"""The oracle caches on a stream computed by hand (block size 4)."""

from __future__ import annotations

from loadgen.oracle import LruBlockCache, OracleRequest, bounds, replay

A = [1, 2, 3, 4]
B = [5, 6, 7, 8]
C = [9, 10, 11, 12]


def test_hits_are_leading_full_blocks_capped_at_n_minus_one() -> None:
    stream = [
        OracleRequest(A + B),          # 8 tokens, nothing cached -> 0; leaves A, B
        OracleRequest(A + B),          # cap (8 - 1) // 4 = 1 block -> 4
        OracleRequest(A + C + [13]),   # A hits, C misses -> 4; leaves A, C
        OracleRequest(A + B + [99]),   # cap 2: A, B -> 8
        OracleRequest([0, *A[1:], *B]),  # first token differs: chains never meet -> 0
    ]
    result = replay(stream, block_size=4, capacity_blocks=None)
    assert result.per_request == (0, 4, 4, 8, 0)
    assert result.prompt_tokens == 8 + 8 + 9 + 9 + 8
    assert result.cached_tokens == 16
    assert result.hit_rate == 16 / 42


def test_answers_are_cached_but_not_their_last_token() -> None:
    stream = [
        OracleRequest([*A, 5, 6], output_token_ids=[7, 8, 9]),   # computes 1..8 -> A, B
        OracleRequest(A + B + [9, 10]),                           # cap 2 -> 8
        OracleRequest([*A, 5, 6], output_token_ids=[7]),          # computes only 1..6 -> A
    ]
    assert replay(stream, 4, None).per_request == (0, 8, 4)


def test_lru_evicts_the_tail_of_the_least_recent_chain_first() -> None:
    stream = [
        OracleRequest(A + B),          # cache (oldest first): B, A
        OracleRequest(A + C + [13]),   # hit 4; stores C then A: B, C, A -> evicts B
        OracleRequest(A + B + [99]),   # A hits, B was evicted -> 4
    ]
    small = replay(stream, block_size=4, capacity_blocks=2)
    assert small.per_request == (0, 4, 4)
    assert small.evictions == 2        # B, then C when the third request stored B again
    assert replay(stream, 4, None).per_request == (0, 4, 8)


def test_salt_separates_chains() -> None:
    stream = [OracleRequest(A + B + [1], cache_salt="x"), OracleRequest(A + B + [1]),
              OracleRequest(A + B + [1], cache_salt="x")]
    assert replay(stream, 4, None).per_request == (0, 0, 8)


def test_bounds_pair() -> None:
    stream = [OracleRequest(A + B), OracleRequest(A + C + [13]), OracleRequest(A + B + [99])]
    b = bounds(stream, block_size=4, fleet_blocks=2)
    assert b.as_dict() == {"pooled_hit_rate": 8 / 26, "pooled_blocks": 2,
                           "unlimited_hit_rate": 12 / 26, "prompt_tokens": 26}


def test_cache_basics() -> None:
    cache = LruBlockCache(3)
    cache.store([10, 11, 12, 13])
    # Stored tail first, so the chain's last block (13) was the oldest and went first.
    assert len(cache) == 3 and cache.evictions == 1
    assert cache.leading_hits([10, 11, 12, 13]) == 3
    assert cache.leading_hits([11, 12]) == 2
    assert cache.leading_hits([99, 10]) == 0
