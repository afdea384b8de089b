"""Upper bounds on a fleet's prefix-cache hit rate, for a request stream.

Two oracles replay the same stream a policy ran, one request at a time in stream order:

- `pooled`: one LRU cache as large as the whole fleet's (N replicas x blocks each),
  as if every request could reach every cached block. No router over N separate caches
  beats it by much: it is the cache the fleet would be with perfect routing and no
  duplication.
- `unlimited`: a cache that never evicts: only the stream itself limits reuse.

Both follow vLLM's rules: only full blocks are keyed (salted chains, router/hashing.py);
a hit is the leading run of cached blocks, capped at (n - 1) // B blocks because the
last prompt token is always recomputed; a finished request leaves its prompt's and its
answer's full blocks cached (all but the last sampled token, which was never computed);
freed blocks join the LRU tail-first, so the end of a chain is evicted before its start
(vLLM's free queue order).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from router.hashing import HashConfig, chain_hashes, event_key, max_cacheable_blocks


@dataclass(frozen=True)
class OracleRequest:
    """What an oracle needs of one request: its prompt, answer and salt."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int] = ()
    cache_salt: str | None = None


@dataclass(frozen=True)
class OracleResult:
    """Tokens an oracle cache would have served, per request and in all."""

    prompt_tokens: int
    cached_tokens: int
    per_request: tuple[int, ...]
    evictions: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class LruBlockCache:
    """Block keys in LRU order; capacity None means unlimited."""

    def __init__(self, capacity_blocks: int | None) -> None:
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def leading_hits(self, keys: Sequence[int]) -> int:
        """How many of the chain's leading keys are cached (a miss ends the run)."""
        n = 0
        for k in keys:
            if k not in self._blocks:
                break
            n += 1
        return n

    def store(self, keys: Sequence[int]) -> None:
        """Cache a finished request's chain as most recently used, its tail the older end."""
        for k in reversed(keys):
            self._blocks[k] = None
            self._blocks.move_to_end(k)
        if self.capacity is None:
            return
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
            self.evictions += 1


def replay(
    requests: Iterable[OracleRequest], block_size: int, capacity_blocks: int | None
) -> OracleResult:
    """The hits one cache of `capacity_blocks` (None: unlimited) gives the stream."""
    config = HashConfig(block_size=block_size)
    cache = LruBlockCache(capacity_blocks)
    per_request: list[int] = []
    prompt_total = 0
    for req in requests:
        n = len(req.prompt_token_ids)
        # Computed tokens when the request finishes: its prompt and all but the last
        # sampled token, whose KV no forward pass ever wrote.
        computed = list(req.prompt_token_ids) + list(req.output_token_ids)[:-1]
        keys = [event_key(d) for d in chain_hashes(config, computed, cache_salt=req.cache_salt)]
        prompt_keys = keys[: max_cacheable_blocks(n, block_size)]
        hit_blocks = cache.leading_hits(prompt_keys)
        per_request.append(hit_blocks * block_size)
        prompt_total += n
        cache.store(keys)
    return OracleResult(prompt_total, sum(per_request), tuple(per_request), cache.evictions)


@dataclass(frozen=True)
class OracleBounds:
    """The two bounds printed beside each policy."""

    pooled: OracleResult
    unlimited: OracleResult
    pooled_blocks: int

    def as_dict(self) -> dict[str, float | int]:
        return {
            "pooled_hit_rate": self.pooled.hit_rate,
            "pooled_blocks": self.pooled_blocks,
            "unlimited_hit_rate": self.unlimited.hit_rate,
            "prompt_tokens": self.pooled.prompt_tokens,
        }


def bounds(
    requests: Sequence[OracleRequest], block_size: int, fleet_blocks: int
) -> OracleBounds:
    """Hit rates of one fleet-sized LRU cache and of an unlimited one on the same stream."""
    return OracleBounds(
        pooled=replay(requests, block_size, fleet_blocks),
        unlimited=replay(requests, block_size, None),
        pooled_blocks=fleet_blocks,
    )
