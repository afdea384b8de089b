"""Fixtures for the router's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from servers import RedisServer

from router.index import MemoryIndex, PrefixIndex, RedisIndex


@pytest.fixture(params=["memory", "redis"])
async def index(request: pytest.FixtureRequest) -> AsyncIterator[PrefixIndex]:
    """Each index backend in turn (Redis on its own redis-server): both must behave alike."""
    idx: PrefixIndex
    if request.param == "memory":
        idx = MemoryIndex()
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        idx = RedisIndex.from_url(server.url)
    try:
        yield idx
    finally:
        await idx.close()
