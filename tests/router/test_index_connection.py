"""The index on Redis as operators run it: a password, TLS with a CA file, Sentinel.

Real redis-server processes (tests/e2e/redis_topology.py); the Sentinel failover under
load is tests/e2e/test_redis_failover.py.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
from collections.abc import Iterator

import pytest
from e2e.redis_topology import RedisTopology
from servers import RedisServer

from router.config import ConfigError, IndexConfig, build_config
from router.index import IndexUnavailable, RedisIndex
from router.index.connection import BadIndexURL, parse_sentinel_url, redis_client

MODEL = "m"


@pytest.fixture
def topology() -> Iterator[RedisTopology]:
    """Redis processes started by the test (sync: starting them blocks)."""
    topo = RedisTopology()
    try:
        yield topo
    finally:
        topo.stop()


async def works(index: RedisIndex) -> bool:
    try:
        await index.add(MODEL, "r1", [1, 2, 3])
        return await index.lookup(MODEL, [1, 2, 3]) == {"r1": 3}
    finally:
        await index.close()


def test_sentinel_urls_name_their_bad_part() -> None:
    assert parse_sentinel_url("redis+sentinel://127.0.0.1:26379,[::1]:26380/primary/2") == (
        [("127.0.0.1", 26379), ("::1", 26380)], "primary", 2)
    with pytest.raises(BadIndexURL, match="'h' is not HOST:PORT"):
        parse_sentinel_url("redis+sentinel://h/primary")
    with pytest.raises(BadIndexURL, match="/MASTER"):
        parse_sentinel_url("redis+sentinel://h:1")
    with pytest.raises(BadIndexURL, match="needs a rediss:// URL"):
        redis_client("redis://127.0.0.1:1", ca_file="/ca.pem")


def test_config_takes_sentinel_urls_and_a_ca_file_only_with_tls() -> None:
    def index(section: dict[str, object]) -> IndexConfig:
        raw = {"replicas": [{"url": "http://127.0.0.1:1"}], "index": section}
        return build_config(raw, env={}).index

    cfg = index({"backend": "redis+sentinel://127.0.0.1:26379/primary"})
    assert cfg.backend == "redis+sentinel://127.0.0.1:26379/primary"
    cfg = index({"backend": "rediss://127.0.0.1:6380", "tls_ca_file": "/etc/ca.pem"})
    assert cfg.tls_ca_file == "/etc/ca.pem"
    with pytest.raises(ConfigError, match=r"index\.tls_ca_file"):
        index({"backend": "redis://127.0.0.1:6379", "tls_ca_file": "/etc/ca.pem"})


async def test_a_password_protected_redis_needs_the_password(topology: RedisTopology) -> None:
    # Starting a process waits for its port: off the event loop.
    port = await asyncio.to_thread(topology.server, "auth", password="s3cret")
    url = f"redis://127.0.0.1:{port}/0"
    assert await works(RedisIndex.from_url(url, password="s3cret"))
    for password in (None, "wrong"):
        index = RedisIndex.from_url(url, password=password)
        with pytest.raises(IndexUnavailable):
            await works(index)


async def test_tls_with_the_servers_ca_and_refused_without(topology: RedisTopology) -> None:
    port, ca = await asyncio.to_thread(topology.tls_server, "tls")
    url = f"rediss://127.0.0.1:{port}/0"
    assert await works(RedisIndex.from_url(url, ca_file=str(ca)))
    with pytest.raises(IndexUnavailable, match="certificate"):
        await works(RedisIndex.from_url(url))  # the system CAs do not know the test CA


async def test_sentinel_finds_the_primary(topology: RedisTopology) -> None:
    primary = await asyncio.to_thread(topology.server, "primary", password="pw")
    await asyncio.to_thread(topology.server, "replica", password="pw", replica_of=primary)
    sentinel = await asyncio.to_thread(topology.sentinel, "sentinel", primary, password="pw")
    url = f"redis+sentinel://127.0.0.1:{sentinel}/primary"
    assert await works(RedisIndex.from_url(url, password="pw"))
    with pytest.raises(IndexUnavailable, match=r"No master found|not found"):
        await works(RedisIndex.from_url(f"redis+sentinel://127.0.0.1:{sentinel}/nosuch",
                                        password="pw"))


async def test_new_connections_do_not_read_package_metadata(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """redis-py would read its version from disk for each connection a lookup opens."""
    client = redis_client(redis_server.url)  # the identity is resolved here, or before
    reads: list[str] = []
    real = importlib.metadata.version

    def counting(name: str) -> str:
        reads.append(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", counting)
    try:
        await asyncio.gather(*(client.ping() for _ in range(8)))  # 8 new connections
        assert len(client.connection_pool._in_use_connections) + \
            len(client.connection_pool._available_connections) == 8
    finally:
        await client.aclose()
    assert reads == []
