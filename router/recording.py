"""Recording what a forwarded request did: predicted vs actual cached tokens, and for
replicas without KV events, the blocks they now hold (written to the index)."""

from __future__ import annotations

import asyncio
import logging

from router.deadlines import within
from router.gateway import INDEX_OP_TIMEOUT_S, Gateway
from router.index import IndexUnavailable
from router.replicas import Replica
from router.routing import Route, completion_keys

log = logging.getLogger(__name__)


def record_outcome(gw: Gateway, route: Route, replica: Replica, prompt_tokens: int | None,
                   cached_tokens: int | None) -> None:
    """Predicted vs actual cached tokens: metrics, and the replica's prediction record."""
    if cached_tokens is None:
        return
    predicted = route.predicted_for(replica.replica_id)
    gw.metrics.record_actual(replica.replica_id, route.decision.policy,
                             prompt_tokens or route.prompt.num_tokens, cached_tokens, predicted)
    assert gw.fleet is not None
    gw.fleet.record_prediction(replica, predicted, cached_tokens)


def holds_unannounced_blocks(replica: Replica, route: Route) -> bool:
    """Whether the gateway must write what `replica` now holds: it publishes no KV events."""
    return replica.mode == "record" and route.prompt.tokens is not None


async def record_blocks(gw: Gateway, route: Route, replica: Replica,
                        output_token_ids: list[int] | None) -> None:
    """Write the blocks a replica without KV events now holds (prompt and answer) to the
    index."""
    if not holds_unannounced_blocks(replica, route):
        return
    assert gw.index is not None and gw.pipeline is not None and route.prompt.tokens is not None
    config = replica.target.hash_config
    keys: list[int] | tuple[int, ...] = route.prompt.keys.get(config, ())
    if output_token_ids:
        loop = asyncio.get_running_loop()
        keys = await loop.run_in_executor(
            gw.executor, completion_keys, gw.pipeline.chains, config, route.prompt.tokens,
            output_token_ids, route.cache_salt)
    if not keys:
        return
    try:
        await within(
            gw.index.record(route.parsed.model, replica.replica_id, keys,
                            gw.config.index.record_ttl_s,
                            capacity_blocks=gw.config.index.record_capacity_blocks),
            INDEX_OP_TIMEOUT_S)
    except (TimeoutError, IndexUnavailable, OSError) as exc:
        gw.metrics.record_index_error(gw.index_backend, "record")
        log.warning("recording %d blocks for %s failed: %s", len(keys), replica.replica_id, exc)
