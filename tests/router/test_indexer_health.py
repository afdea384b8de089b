"""The indexer's /healthz (router/indexer_health.py): a real indexer process over a real
redis-server and a real ZMQ publisher answers 200, then 503 naming the index while Redis
is down, and 200 again once it is back; a stream that stopped applying events is a 503."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
import zmq.asyncio
from servers import RedisServer, free_port
from test_events import KvPublisher
from test_indexer_cli import MODEL, start_indexer, stop_indexer

from router.cli.arg_types import tcp_port
from router.events import EventIndexer, ReplicaFeed
from router.index import MemoryIndex
from router.indexer_health import IndexerHealth, serving_health


@pytest.fixture
async def publisher() -> AsyncIterator[KvPublisher]:
    ctx = zmq.asyncio.Context()
    pub = KvPublisher(ctx)
    try:
        yield pub
    finally:
        await pub.close()
        ctx.term()


async def healthz(session: aiohttp.ClientSession, port: int) -> tuple[int, dict[str, object]]:
    async with session.get(f"http://127.0.0.1:{port}/healthz",
                           timeout=aiohttp.ClientTimeout(total=5)) as resp:
        return resp.status, await resp.json()


async def until(session: aiohttp.ClientSession, port: int, status: int) -> dict[str, object]:
    """Poll /healthz until it answers `status` (a refused connection means not yet)."""
    async with asyncio.timeout(20):
        while True:
            try:
                got, body = await healthz(session, port)
                if got == status:
                    return body
            except aiohttp.ClientConnectorError:
                pass
            await asyncio.sleep(0.1)


async def test_indexer_process_reports_redis_down_and_back(
        publisher: KvPublisher, redis_server: RedisServer) -> None:
    port = free_port()
    proc = await start_indexer(
        "--index", redis_server.url, "--health-port", str(port),
        "--replica", f"r1={publisher.endpoint},replay={publisher.replay_endpoint},model={MODEL}")
    try:
        async with aiohttp.ClientSession() as session:
            body = await until(session, port, 200)
            assert body == {"healthy": True, "problems": [], "streams": 1, "leading": True}
            await asyncio.to_thread(redis_server.stop)
            body = await until(session, port, 503)
            problems = body["problems"]
            assert isinstance(problems, list) and problems[0].startswith("index: "), body
            await asyncio.to_thread(redis_server.start)
            await until(session, port, 200)
        code, log = await stop_indexer(proc)
        assert code == 0, log
        assert "indexer unhealthy: index:" in log and "indexer healthy" in log, log
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_a_stream_that_stopped_applying_events_is_unhealthy(
        publisher: KvPublisher) -> None:
    index = MemoryIndex()
    indexer = EventIndexer(index)
    health = IndexerHealth(index, indexer=indexer)
    port = free_port()
    try:
        stream = await indexer.add_replica(ReplicaFeed("r1", publisher.endpoint, MODEL))
        async with serving_health(health, "127.0.0.1", port), aiohttp.ClientSession() as session:
            assert (await healthz(session, port))[0] == 200
            # The stream's task ending is what an unhandled error in it looks like.
            task = stream._task
            assert task is not None
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            status, body = await healthz(session, port)
            assert status == 503
            assert body["problems"] == ["replica r1: event stream stopped"]
    finally:
        await indexer.stop()


def test_health_port_must_be_a_port() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="'70000' is not a TCP port"):
        tcp_port("70000")
