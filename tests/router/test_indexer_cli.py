"""`python -m router indexer` as a real process: ZMQ in, real Redis out, clean SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq.asyncio
from conftest import REPO, RedisServer
from test_events import KvPublisher, eventually, removed, stored

from router.index import RedisIndex
from router.indexer import parse_replica

MODEL = "tiny"


@pytest.fixture
async def publisher() -> AsyncIterator[KvPublisher]:
    ctx = zmq.asyncio.Context()
    pub = KvPublisher(ctx)
    try:
        yield pub
    finally:
        await pub.close()
        ctx.term()


async def start_indexer(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", "indexer", "--stats-interval", "0.2", *args,
        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


async def stop_indexer(proc: asyncio.subprocess.Process, *, terminate: bool = True
                       ) -> tuple[int, str]:
    """SIGTERM (unless told not to), then the exit code and log; kill past the deadline."""
    if terminate and proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    try:
        async with asyncio.timeout(15):
            _, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError("the indexer did not stop within 15 s") from None
    return proc.returncode if proc.returncode is not None else -1, err.decode()


async def follow_events(pub: KvPublisher, index: RedisIndex,
                        proc: asyncio.subprocess.Process) -> None:
    # The child imports, connects and subscribes; XPUB tells us when it has joined.
    async with asyncio.timeout(30):
        await pub.wait_subscribed()
    await pub.publish(stored([1, 2, 3]))
    await pub.publish(stored([4], parent=3), send=False)  # a gap, filled by replay
    await pub.publish(removed([3]))

    async def indexed() -> bool:
        return await index.lookup(MODEL, [1, 2, 3, 4], deadline_s=1.0) == {"r1": 2}

    await eventually(indexed, deadline_s=15)


async def test_indexer_flags_feed_redis_and_stop_on_sigterm(
    publisher: KvPublisher, redis_server: RedisServer
) -> None:
    index = RedisIndex.from_url(redis_server.url)
    proc = await start_indexer(
        "--index", redis_server.url,
        "--replica", f"r1={publisher.endpoint},replay={publisher.replay_endpoint},model={MODEL}")
    try:
        await follow_events(publisher, index, proc)
        assert publisher.replay_requests == [0]
        # The counters are logged periodically and once more on the way out.
        code, log = await stop_indexer(proc)
        assert code == 0, log
        assert "replica=r1" in log and "replays=1" in log, log
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await index.close()
    # Stopping keeps the index: another indexer (or this one restarted) resyncs it.
    index = RedisIndex.from_url(redis_server.url)
    try:
        assert await index.lookup(MODEL, [1, 2], deadline_s=1.0) == {"r1": 2}
    finally:
        await index.close()


async def test_indexer_reads_replicas_from_the_gateway_config(
    publisher: KvPublisher, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(
        f"index: {{backend: \"{redis_server.url}\"}}\n"
        "replicas:\n"
        "  - url: http://127.0.0.1:9\n"
        "    name: r1\n"
        f"    models: [{MODEL}]\n"
        f"    kv_events: {publisher.endpoint}\n"
        f"    kv_replay: {publisher.replay_endpoint}\n"
        "  - url: http://127.0.0.1:10\n"
        "    name: no-events\n"
        f"    models: [{MODEL}]\n")
    index = RedisIndex.from_url(redis_server.url)
    proc = await start_indexer("--config", str(config))
    try:
        await follow_events(publisher, index, proc)
        code, log = await stop_indexer(proc)
        assert code == 0, log
        assert "indexing 1 replica(s): r1=" in log, log
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await index.close()


async def test_indexer_rejects_bad_arguments() -> None:
    proc = await start_indexer("--index", "redis://127.0.0.1:1/0", "--replica", "r1=tcp://x:1")
    code, log = await stop_indexer(proc, terminate=False)
    assert code == 2
    assert "model=" in log
    proc = await start_indexer("--replica", "r1=nonsense")
    code, log = await stop_indexer(proc, terminate=False)
    assert code == 2
    assert "not a ZMQ endpoint" in log


def test_parse_replica_reads_every_option() -> None:
    spec = parse_replica("r1=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558,model=m,topic=kv")
    assert (spec.name, spec.endpoint, spec.replay, spec.model, spec.topic) == (
        "r1", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", "m", "kv")
    assert parse_replica("r2=tcp://h:1").replay is None
