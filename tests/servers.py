"""Real servers for tests: free loopback ports and a redis-server the test owns.

The process helpers themselves live in replica/processes.py (shared with the benchmarks
and the harness); this module hands them to tests under a name that no conftest.py in
the tree can shadow (`from servers import RedisServer, free_port`).
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from replica.processes import RedisServer, free_port, wait_for_port, wait_until

REPO = Path(__file__).resolve().parent.parent

__all__ = ["REPO", "RedisServer", "free_port", "serving", "wait_for_port", "wait_until"]


@contextlib.asynccontextmanager
async def serving(app: web.Application,
                  ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[str]:
    """`app` served on a free loopback port for the block (over TLS with `ssl_context`);
    yields its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=ssl_context).start()
    try:
        yield f"{'https' if ssl_context else 'http'}://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
