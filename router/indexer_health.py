"""The indexer's health endpoint: GET /healthz, 200 while it can do its work, else 503.

The indexer serves no other HTTP, so without this a wedged indexer (its event streams
dead, its Redis unreachable) is never restarted and the index silently goes stale. The
answer is computed when asked, from what the indexer is doing now:

- its event loop answers at all (a blocked loop answers nothing: the probe times out);
- every replica's event-stream task is still running (a task that ended on an error
  will never apply another event);
- the index answers a lookup within `deadline_s` (Redis reachable, not black-holed).

A standby indexer (--lease) has no streams; it is healthy while Redis answers, since
Redis is where it waits for the lease. Bound by --health-host (default loopback; the
chart binds the pod IP for the kubelet) and --health-port.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web

from router.deadlines import within
from router.events import EventIndexer
from router.index import IndexUnavailable, PrefixIndex

log = logging.getLogger(__name__)

_PROBE_SCOPE = "cacheroute-indexer-health"


@dataclass
class IndexerHealth:
    """What /healthz checks: the index, and the event indexer while one is leading."""

    index: PrefixIndex
    deadline_s: float = 2.0
    indexer: EventIndexer | None = None  # None while starting or standing by
    _last: list[str] = field(default_factory=list)

    async def problems(self) -> list[str]:
        """Why the indexer cannot do its work now (empty when it can)."""
        found = []
        if self.indexer is not None:
            found += [f"replica {rid}: event stream stopped"
                      for rid in self.indexer.stopped_streams()]
        try:
            await within(self.index.lookup(_PROBE_SCOPE, [0]), self.deadline_s)
        except (TimeoutError, IndexUnavailable, OSError) as exc:
            found.append(f"index: {type(exc).__name__}: {exc}"[:200])
        if found != self._last:  # log a change once, not every probe
            if found:
                log.warning("indexer unhealthy: %s", "; ".join(found))
            else:
                log.info("indexer healthy")
            self._last = found
        return found

    async def handle(self, request: web.Request) -> web.Response:
        found = await self.problems()
        streams = len(self.indexer.streams) if self.indexer is not None else 0
        return web.json_response({"healthy": not found, "problems": found, "streams": streams,
                                  "leading": self.indexer is not None},
                                 status=503 if found else 200)


@contextlib.asynccontextmanager
async def serving_health(health: IndexerHealth, host: str, port: int) -> AsyncIterator[None]:
    """Serve GET /healthz on host:port while the block runs."""
    app = web.Application()
    app.router.add_get("/healthz", health.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        log.info("indexer health on http://%s:%d/healthz", host, port)
        yield
    finally:
        await runner.cleanup()
