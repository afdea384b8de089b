"""The time to first token no router can beat on a simulated fleet: each request alone.

A router decides where a request waits and how much of its prompt is already cached
there; it cannot make a replica's step cheaper. On sims the step cost is known exactly
(replica/profiles.py), so each request has a floor: its TTFT on an idle replica holding
the longest prefix the pooled oracle (oracle.py) says any cache of the fleet's size
could have kept for it, prefilled in chunks of the scheduler's token budget as the sim
does. Every router's TTFT on the same stream sits above it by its queueing, its
misses against the oracle, and its own overhead (HTTP, deciding; the floor has none).

The oracle replays one request at a time, so requests that arrive together with the
first of their prefix are credited its blocks although it is still being computed: there
(an agent fleet's first turns) the floor's tail is below anything any router reaches.

The report prints the floor's percentiles beside the policies', so a ratio against a
peer reads with what was left to win: where the best peer is already 1.3x the floor at
p50, no router reaches 0.8x of it, and where it is 5x the floor, placement is what
decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from replica.engine import EngineConfig
from replica.profiles import SimCostProfile


@dataclass(frozen=True)
class TtftFloor:
    """Per-request floors (simulated seconds) and their percentiles."""

    per_request: tuple[float, ...]

    def percentile(self, q: float) -> float | None:
        return float(np.percentile(self.per_request, q)) if self.per_request else None

    def as_dict(self) -> dict[str, float | None]:
        return {"p50_s": self.percentile(50), "p90_s": self.percentile(90),
                "p99_s": self.percentile(99),
                "mean_s": float(np.mean(self.per_request)) if self.per_request else None}


def lone_ttft(profile: SimCostProfile, prompt_tokens: int, cached_tokens: int,
              budget: int = EngineConfig.max_num_batched_tokens) -> float:
    """Seconds to the first token of a request alone on a sim with `cached_tokens` of its
    prompt cached: its uncached tokens prefilled `budget` at a time, one step each (the
    sim's chunked prefill, replica/engine.py); the first token comes with the last chunk.
    At least one token is computed however much is cached (vLLM recomputes the last)."""
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be >= 1, got {prompt_tokens}")
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    done = min(max(cached_tokens, 0), prompt_tokens - 1)
    seconds = 0.0
    while done < prompt_tokens:
        chunk = min(budget, prompt_tokens - done)
        seconds += profile.step_cost([(chunk, done)], [])
        done += chunk
    return seconds


def ttft_floor(prompt_tokens: Sequence[int], cached_tokens: Sequence[int],
               profile: SimCostProfile,
               budget: int = EngineConfig.max_num_batched_tokens) -> TtftFloor:
    """The floor of each request of a stream, given the cached tokens it could have had
    (the pooled oracle's per_request, in the same order)."""
    if len(prompt_tokens) != len(cached_tokens):
        raise ValueError(f"{len(prompt_tokens)} prompts but {len(cached_tokens)} cached counts")
    return TtftFloor(tuple(lone_ttft(profile, n, c, budget)
                           for n, c in zip(prompt_tokens, cached_tokens, strict=True)))
