"""Fixtures for the router's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from servers import RedisServer

from router.index import MemoryIndex, PrefixIndex, RedisIndex


@pytest.fixture(params=["memory", "redis"])
def index_backend(request: pytest.FixtureRequest) -> RedisServer | None:
    """None for the in-memory index, else the test's redis-server.

    A sync fixture: starting redis-server blocks, so it must not run on the event loop.
    """
    if request.param == "memory":
        return None
    server: RedisServer = request.getfixturevalue("redis_server")
    return server


@pytest.fixture
async def index(index_backend: RedisServer | None) -> AsyncIterator[PrefixIndex]:
    """Each index backend in turn (Redis on its own redis-server): both must behave alike."""
    idx: PrefixIndex
    if index_backend is None:
        idx = MemoryIndex()
    else:
        idx = RedisIndex.from_url(index_backend.url)
    try:
        yield idx
    finally:
        await idx.close()
