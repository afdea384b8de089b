"""Batched completion prompts: what the replica will report as the batch's cached tokens.

A batch (`"prompt": ["a", "b"]` or a list of token-id lists) is forwarded whole: vLLM
answers it as one request with one choice per prompt, and the gateway routes it by its
first prompt's blocks. But vLLM's usage reports ONE prompt's cached tokens for the whole
batch, not a sum (replica/openai_api.py `usage`): the LAST prompt's in a full response
(vllm/entrypoints/openai/completion/serving.py keeps the last output's
num_cached_tokens), the first arriving output's in a stream. So for a non-streamed batch
the prediction the gateway compares with that report is the last prompt's: the leading
blocks the chosen replica holds for it, or shares with an earlier prompt of the same
batch (prompts of one request are scheduled in order, each hitting the blocks those
before it just filled). A stream keeps the first prompt's prediction: its outputs
usually arrive first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from router.arrival_order import NO_TURN, TurnLike
from router.gateway import Gateway
from router.hashing import HashConfig
from router.replicas import Replica
from router.request import ParsedRequest
from router.routing import Route, lookup_matches, predicted_cached_tokens
from router.vllm_rules import skips_prefix_cache


def is_batch(parsed: ParsedRequest) -> bool:
    """Whether a request is a completions batch (several prompts, as text or id lists)."""
    prompt = parsed.body.get("prompt") if parsed.endpoint == "completions" else None
    return isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str | list)


def batch_prompts(gw: Gateway, route: Route) -> list[list[int]] | None:
    """Every prompt's ids of a batched completions request, as the replica sees them;
    None for a single prompt, or where the gateway cannot tokenize the batch."""
    parsed = route.parsed
    if not is_batch(parsed):
        return None
    prompt = parsed.body["prompt"]
    tokenizer = gw.tokenizers.get(parsed.model)
    if tokenizer is not None:
        return tokenizer.completion_prompts(parsed.body)
    if all(isinstance(p, list) for p in prompt):
        return [list(p) for p in prompt]
    return None


def _shared_blocks(last: Sequence[int], earlier: Sequence[Sequence[int]], block: int) -> int:
    """Leading full blocks `last` has in common with any earlier prompt of the batch."""
    best = 0
    for other in earlier:
        n = 0
        limit = min(len(last), len(other))
        while n < limit and last[n] == other[n]:
            n += 1
        best = max(best, n // block)
    return best


def _last_prompt_keys(gw: Gateway, route: Route, configs: list[HashConfig],
                      ) -> tuple[list[int], list[list[int]], dict[HashConfig, tuple[int, ...]]] | None:
    """(last prompt, earlier prompts, the last prompt's keys per hash group), or None."""
    prompts = batch_prompts(gw, route)
    if prompts is None or len(prompts) < 2:
        return None
    assert gw.pipeline is not None
    last = prompts[-1]
    keys = {config: tuple(gw.pipeline.chains.event_keys(config, last, route.cache_salt))
            for config in configs}
    return last, prompts[:-1], keys


async def predict_batch(gw: Gateway, route: Route, replicas: Sequence[Replica],
                        turn: TurnLike = NO_TURN) -> None:
    """Set `route.predicted` to what each replica would report for this batch (see the
    module docstring). A no-op for a single prompt, a stream, or a cache-skipping request."""
    parsed = route.parsed
    # Checked here, not in the thread: a hop to the executor and back costs a thread
    # wake-up and a GIL hand-off, which every non-streamed request paid for nothing.
    if parsed.stream or not is_batch(parsed) or skips_prefix_cache(parsed.body, chat=False) \
            or route.prompt.tokens is None:
        return
    members: dict[HashConfig, set[str]] = {}
    for r in replicas:
        members.setdefault(r.target.hash_config, set()).add(r.replica_id)
    # Tokenizing and hashing every prompt is the long part: off the loop.
    async with turn.away():  # a thread, then the index: the next request computes
        loop = asyncio.get_running_loop()
        keyed = await loop.run_in_executor(gw.executor, _last_prompt_keys, gw, route, list(members))
        if keyed is None:
            return
        last, earlier, keys = keyed
        assert gw.pipeline is not None
        lookup = await lookup_matches(gw.pipeline.index, parsed.model, keys, members,
                                      gw.config.index.deadline_ms / 1000.0)
    for r in replicas:
        block = r.target.hash_config.block_size
        matched = max(lookup.matches.get(r.replica_id, 0), _shared_blocks(last, earlier, block))
        route.predicted[r.replica_id] = predicted_cached_tokens(matched, len(last), block)
