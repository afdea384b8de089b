"""The event-silence watch: drop the index entries of an event-fed replica whose KV-event
stream went quiet while it owed events.

A replica publishes a request's stored blocks during its prefill; the completion handler
notes the debt (`expect_events`) when an answer shows new blocks were computed, and the
watch (`watch_event_silence`, one task owned by the in-gateway indexer's context) marks
the stream stale when the events do not come.
"""

from __future__ import annotations

import asyncio
import logging

from router.config import GatewayConfig
from router.events import EventIndexer
from router.gateway import Gateway, ignore_errors
from router.replicas import Replica

log = logging.getLogger(__name__)

def _event_silence_s(config: GatewayConfig) -> float:
    # A replica publishes a request's stored blocks during its prefill, long before the
    # answer is done; a few health intervals of silence after that is not lag.
    return max(2.0, 4 * config.health.interval_s)


def expect_events(gw: Gateway, replica: Replica, sent_at: float, prompt_tokens: int | None,
                   cached_tokens: int | None) -> None:
    """Note that `replica` owes KV events: its answer says it computed (so stored) at
    least one new full prompt block, which vLLM always announces with a BlockStored."""
    if gw.indexer is None or replica.mode != "events" or prompt_tokens is None or \
            cached_tokens is None:
        return
    block = replica.target.hash_config.block_size
    if cached_tokens >= (prompt_tokens // block) * block:
        return  # a full hit stores nothing new, and publishes nothing
    due = gw.events_due.get(replica.replica_id)
    if due is not None and not _heard_since(gw.indexer, replica.replica_id, due[0]):
        return  # an older debt is still open: its deadline is the one that counts
    assert gw.fleet is not None
    gw.events_due[replica.replica_id] = (sent_at, gw.fleet.now() + _event_silence_s(gw.config))


def _heard_since(indexer: EventIndexer, replica_id: str, since: float) -> bool:
    stream = indexer.streams.get(replica_id)
    heard = stream.stats.last_received_at if stream is not None else None
    return heard is not None and heard >= since


async def watch_event_silence(gw: Gateway, indexer: EventIndexer) -> None:
    """Drop the entries of a replica whose event stream went silent while events were
    due (a cut or black-holed socket, a stuck publisher): the index would otherwise go
    on trusting what the replica held when its events stopped. Silence alone proves
    nothing (an idle replica sends nothing), so only owed events count."""
    assert gw.fleet is not None
    while True:
        await asyncio.sleep(0.25)  # the watch's resolution; deadlines are seconds
        now = gw.fleet.now()
        streams = indexer.streams
        for rid, (sent_at, deadline) in list(gw.events_due.items()):
            stream = streams.get(rid)
            if stream is None or _heard_since(indexer, rid, sent_at):
                del gw.events_due[rid]
            elif now > deadline:
                del gw.events_due[rid]
                gw.metrics.record_event_silence(rid)
                log.warning("replica %s served requests but sent no KV events for %.1fs; "
                            "dropping its index entries until its stream resyncs", rid,
                            _event_silence_s(gw.config))
                gw.spawn(ignore_errors(stream.mark_stale()), f"silent-{rid}")
