"""Active/standby indexers: run the indexing work only while this process holds the lease.

Every indexer of a fleet runs the same loop. The one that gets the lease (lease.py) runs
`lead(token)`: its streams write through an index fenced with that token and resume each
replica after the position its predecessor stored with its last writes (stream.py). The
others ask again every `renew_s`. The holder renews every `renew_s`; when a renewal says
the lease is someone else's, or no renewal succeeded for a whole TTL (Redis away), it
stops leading at once, since a successor may already be writing. Its in-flight writes
are refused by the fence either way, so stepping down late costs nothing but log lines.

Writes stay ordered per replica: one active indexer, one stream task per replica, one
batch pipeline at a time, its position written last; a successor starts after that
position and the replica's replay socket supplies the rest in seq order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from router.deadlines import within
from router.index import IndexerLease, IndexUnavailable

log = logging.getLogger(__name__)


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    """Sleep `seconds` (a lease period, not synchronisation) or until stop is set."""
    with contextlib.suppress(TimeoutError):
        await within(stop.wait(), seconds)


async def _hold(lease: IndexerLease, token: int, work: asyncio.Task[None],
                stop: asyncio.Event) -> bool:
    """Renew while `work` runs; True when the lease was lost (work must stop)."""
    ttl, every = lease.settings.ttl_s, lease.settings.renew_s
    held_until = time.monotonic() + ttl
    while not work.done() and not stop.is_set():
        await _wait(stop, every)
        if work.done() or stop.is_set():
            return False
        try:
            if not await lease.renew(token):
                log.warning("lost the indexer lease (token %d): another indexer holds it",
                            token)
                return True
            held_until = time.monotonic() + ttl
        except IndexUnavailable as exc:
            if time.monotonic() >= held_until:
                log.warning("could not renew the indexer lease for %.1fs (%s): standing by",
                            ttl, exc)
                return True
    return False


async def lead_while_holding(lease: IndexerLease, lead: Callable[[int], Awaitable[object]],
                             stop: asyncio.Event) -> None:
    """Run `lead(token)` whenever this process holds the lease, until stop or lead returns.

    `lead` returning on its own (it was told to stop) ends the loop; losing the lease
    cancels it and goes back to standing by.
    """
    while not stop.is_set():
        try:
            token = await lease.acquire()
        except IndexUnavailable as exc:
            log.warning("indexer lease unavailable: %s", exc)
            token = None
        if token is None:
            await _wait(stop, lease.settings.renew_s)
            continue
        log.info("took the indexer lease as %s (token %d)", lease.settings.holder, token)

        async def run(token: int = token) -> None:
            await lead(token)

        work = asyncio.create_task(run(), name=f"indexer-lead-{token}")
        lost = await _hold(lease, token, work, stop)
        if lost or stop.is_set():
            work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        if not lost:
            with contextlib.suppress(IndexUnavailable):
                await lease.release(token)  # a standby need not wait out the TTL
            return
