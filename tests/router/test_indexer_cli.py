"""`python -m router indexer` as a real process: ZMQ in, real Redis out, clean SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import zmq.asyncio
from servers import REPO, RedisServer
from test_events import KvPublisher, applied_up_to, eventually, removed, stored

from router.app import replica_sources
from router.cli.indexer import parse_replica
from router.config import load_config
from router.discovery import (
    ReplicaSource,
    dns_replica_id,
    endpoint_at,
    resolve_addresses,
    url_host,
)
from router.events import EventIndexer
from router.hashing import BlockChain, HashConfig
from router.index import MemoryIndex, RedisIndex
from router.indexer import DnsFollower, DnsReplicas, feeds_from_config
from router.replicas import Fleet

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


async def start_indexer(*args: str, env: dict[str, str] | None = None
                        ) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", "indexer", "--stats-interval", "0.2", *args,
        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)


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


async def test_indexer_says_caught_up_once_the_replicas_history_is_in_redis(
    publisher: KvPublisher, redis_server: RedisServer
) -> None:
    """A load test starts its clients on the "caught up" line, an operator reads it: the
    replica's history from before the indexer subscribed is in Redis by then, its last
    batch included (the replay applies it oldest first, and takes a while)."""
    for i in range(300):  # published before anyone listened: only the replay has them
        await publisher.publish(stored([1000 + i]), send=False)
    await publisher.publish(stored([1, 2]), send=False)
    index = RedisIndex.from_url(redis_server.url)
    proc = await start_indexer(
        "--index", redis_server.url,
        "--replica", f"r1={publisher.endpoint},replay={publisher.replay_endpoint},model={MODEL}")
    try:
        assert proc.stderr is not None
        lines: list[str] = []
        async with asyncio.timeout(30):
            while not lines or "caught up with" not in lines[-1]:
                line = (await proc.stderr.readline()).decode()
                assert line, "the indexer exited:\n" + "".join(lines)
                lines.append(line)
        assert "caught up with 1 replica(s)" in lines[-1], lines
        assert await index.lookup(MODEL, [1, 2], deadline_s=1.0) == {"r1": 2}
        assert publisher.replay_requests == [0]
    finally:
        await stop_indexer(proc)
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


async def test_indexer_needs_only_the_seed_and_redis_settings(
    publisher: KvPublisher, redis_server: RedisServer, tmp_path: Path
) -> None:
    """The whole gateway config, its tenant keys and salt secret in variables that are not
    set: the indexer reads only replicas and index, so it starts and indexes."""
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "listen: {host: 127.0.0.1, port: 8000}\n"
        f"index: {{backend: \"{redis_server.url}\", password_env: INDEX_PASSWORD}}\n"
        "policy: {name: cache_aware}\n"
        "tenants:\n"
        "  secret_env: CACHEROUTE_SALT_SECRET\n"
        "  keys:\n"
        "    - {key_env: KEY_A, tenant: a}\n"
        "    - {key_env: KEY_B, tenant: b}\n"
        "proxy: {max_retries: 1}\n"
        "replicas:\n"
        "  - url: http://127.0.0.1:9\n"
        "    name: r1\n"
        f"    models: [{MODEL}]\n"
        "    hash_seed: placeholder\n"
        f"    kv_events: {publisher.endpoint}\n"
        f"    kv_replay: {publisher.replay_endpoint}\n")
    # Only what the indexer is trusted with: the seed (as the chart passes it) and the
    # Redis password (this test's Redis has none: redis-py sends it and goes on).
    env = {"PATH": "/usr/bin:/bin", "CACHEROUTE_REPLICAS__0__HASH_SEED": "0",
           "INDEX_PASSWORD": "unused"}
    for name in ("KEY_A", "KEY_B", "CACHEROUTE_SALT_SECRET"):
        assert name not in env
    index = RedisIndex.from_url(redis_server.url)
    proc = await start_indexer("--config", str(config), env=env)
    try:
        await follow_events(publisher, index, proc)
        code, log = await stop_indexer(proc)
        assert code == 0, log
        assert "indexing 1 replica(s): r1=" in log, log
        assert "KEY_A" not in log and "SALT_SECRET" not in log, log
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


def test_dns_replicas_are_named_and_reached_at_their_own_address() -> None:
    source = ReplicaSource(name="vllm", models=(MODEL,), hash_config=HashConfig(),
                           dns="vllm.ns.svc:8000", kv_events="tcp://vllm.ns.svc:5557",
                           kv_replay="tcp://{host}:5558")
    for address in ("10.0.0.5", "fd00::7"):
        assert dns_replica_id(address, 8000) == source.target(address).replica_id
    v4, v6 = source.target("10.0.0.5"), source.target("fd00::7")
    assert (v4.replica_id, v4.base_url, v4.kv_events, v4.kv_replay) == (
        "10.0.0.5:8000", "http://10.0.0.5:8000", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558")
    assert (v6.replica_id, v6.base_url, v6.kv_events, v6.kv_replay) == (
        "[fd00::7]:8000", "http://[fd00::7]:8000", "tcp://[fd00::7]:5557",
        "tcp://[fd00::7]:5558")
    assert endpoint_at("tcp://{host}:5557", "10.0.0.5") == "tcp://10.0.0.5:5557"
    with pytest.raises(ValueError, match="take the replica's address"):
        endpoint_at("ipc:///tmp/kv", "10.0.0.5")


async def test_gateway_and_indexer_derive_the_same_replicas(tmp_path: Path) -> None:
    """Static (IPv4 and IPv6 URLs), DNS over a real name and DNS with IPv4 + IPv6 answers:
    the gateway's fleet and the indexer's feeds name and reach every replica alike."""
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "index: memory\n"
        "replicas:\n"
        f"  - {{url: 'http://127.0.0.1:9001', name: a, models: [{MODEL}],\n"
        "     kv_events: 'tcp://{host}:5557', kv_replay: 'tcp://127.0.0.1:5558'}\n"
        f"  - {{url: 'http://[::1]:9002', name: b, models: [{MODEL}],\n"
        "     kv_events: 'tcp://{host}:5557'}\n"
        f"  - {{dns: 'vllm.ns.svc:8000', models: [{MODEL}],\n"
        "     kv_events: 'tcp://vllm.ns.svc:5557', kv_replay: 'tcp://{host}:5558'}\n"
        f"  - {{dns: 'localhost:8100', models: [{MODEL}], kv_events: 'tcp://localhost:5557'}}\n")

    async def resolver(host: str, port: int) -> list[str]:
        # A cluster name cannot resolve here; localhost goes through the real resolver.
        if host == "vllm.ns.svc":
            return ["10.0.0.5", "fd00::7"]
        return await resolve_addresses(host, port)

    gateway_config = load_config(str(config), {}, [])
    async with aiohttp.ClientSession() as session:
        fleet = Fleet(replica_sources(gateway_config), gateway_config.health, session,
                      resolver=resolver)
        await fleet.refresh_discovery()
    gateway = sorted((r.replica_id, r.target.kv_events, r.target.kv_replay)
                     for r in fleet.all())

    read = feeds_from_config(str(config))
    follower = DnsFollower(EventIndexer(MemoryIndex()), read.static, read.dns, resolver=resolver)
    indexer = sorted((f.replica_id, f.endpoint, f.replay_endpoint) for f in await follower.feeds())

    assert indexer == gateway
    localhost = await resolve_addresses("localhost", 8100)
    assert localhost  # the real name resolved
    assert gateway == sorted([
        ("a", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"),
        ("b", "tcp://[::1]:5557", None),
        ("10.0.0.5:8000", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558"),
        ("[fd00::7]:8000", "tcp://[fd00::7]:5557", "tcp://[fd00::7]:5558"),
        *((dns_replica_id(a, 8100), f"tcp://{url_host(a)}:5557", None) for a in localhost),
    ])


def test_config_replicas_get_their_rekey_mode_and_dns_sources(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "index: redis://127.0.0.1:1/0\n"
        "replicas:\n"
        "  - {url: 'http://127.0.0.1:9', name: r1, models: [tiny], block_size: 4,\n"
        "     hash_seed: '0', kv_events: 'tcp://127.0.0.1:5557'}\n"
        "  - {dns: 'vllm.ns.svc:8000', models: [tiny], dns_refresh_s: 3,\n"
        "     kv_events: 'tcp://{host}:5557', kv_replay: 'tcp://vllm.ns.svc:5558'}\n")
    never = feeds_from_config(str(config))
    assert [f.rekey for f in never.static] == [None]
    auto = feeds_from_config(str(config), "auto")
    (r1,) = auto.static
    assert (r1.rekey, r1.rekey_mode) == (HashConfig("sha256", 4, "0"), "auto")
    (dns,) = auto.dns
    assert (dns.source.dns, dns.refresh_s) == ("vllm.ns.svc:8000", 3.0)
    feed = dns.feed_at("10.1.2.3")
    assert (feed.replica_id, feed.endpoint, feed.replay_endpoint, feed.rekey_mode) == (
        "10.1.2.3:8000", "tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558", "auto")
    assert feeds_from_config(str(config), "always").static[0].rekey_mode == "always"


async def test_dns_follower_tracks_the_resolved_set(publisher: KvPublisher) -> None:
    """Streams follow what the name resolves to; a failed resolution keeps the last set.

    The resolver is a stand-in: changing what a real name resolves to needs a DNS server.
    """
    answers: list[list[str] | OSError] = [["127.0.0.1"], OSError("SERVFAIL"), []]
    asked: list[tuple[str, int]] = []

    async def resolver(host: str, port: int) -> list[str]:
        asked.append((host, port))
        answer = answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return answer

    port = publisher.endpoint.rsplit(":", 1)[1]
    source = ReplicaSource(
        name="vllm", models=(MODEL,), hash_config=HashConfig(), dns="vllm.ns.svc:8000",
        kv_events=f"tcp://vllm.ns.svc:{port}",
        kv_replay=publisher.replay_endpoint.replace("127.0.0.1", "{host}"))
    index = MemoryIndex()
    indexer = EventIndexer(index)
    follower = DnsFollower(indexer, [], [DnsReplicas(source, MODEL, None, "always", 5)],
                           resolver=resolver)
    try:
        assert follower.interval_s == 5
        feeds = await follower.refresh()
        assert [(f.replica_id, f.endpoint) for f in feeds] == [
            ("127.0.0.1:8000", publisher.endpoint)]
        await publisher.wait_subscribed()
        await publisher.publish(stored([1, 2]))
        await applied_up_to(indexer.streams["127.0.0.1:8000"], 0)
        assert await index.lookup(MODEL, [1, 2]) == {"127.0.0.1:8000": 2}
        await follower.refresh()  # SERVFAIL: keep following the known address
        assert set(indexer.streams) == {"127.0.0.1:8000"}
        assert await index.lookup(MODEL, [1, 2]) == {"127.0.0.1:8000": 2}
        await follower.refresh()  # the address is gone: its stream and entries go too
        assert indexer.streams == {}
        assert await index.lookup(MODEL, [1, 2]) == {}
        assert asked == [("vllm.ns.svc", 8000)] * 3
    finally:
        await indexer.stop()


async def test_indexer_follows_a_dns_replica_and_rekeys_it(
    publisher: KvPublisher, redis_server: RedisServer, tmp_path: Path
) -> None:
    """A real name (localhost), a replica seeded unlike its config: --rekey auto fixes it."""
    configured = HashConfig("sha256", block_size=4, seed="0")
    actual = HashConfig("sha256", block_size=4, seed="1")
    tokens = list(range(40, 52))
    theirs = BlockChain(actual, tokens=tokens).event_keys()
    ours = BlockChain(configured, tokens=tokens).event_keys()
    port = publisher.endpoint.rsplit(":", 1)[1]
    config = tmp_path / "gateway.yaml"
    config.write_text(
        f"index: {redis_server.url}\n"
        "replicas:\n"
        f"  - {{dns: 'localhost:8123', models: [{MODEL}], block_size: 4, hash_seed: '0',\n"
        f"     kv_events: 'tcp://localhost:{port}', kv_replay: '{publisher.replay_endpoint}'}}\n")
    index = RedisIndex.from_url(redis_server.url)
    proc = await start_indexer("--config", str(config), "--rekey", "auto")
    try:
        async with asyncio.timeout(30):
            await publisher.wait_subscribed()
        await publisher.publish(stored(theirs[:2], tokens=tokens[:8]))
        await publisher.publish(stored(theirs[2:], parent=theirs[1], tokens=tokens[8:]))

        async def indexed() -> bool:
            return await index.lookup(MODEL, ours, deadline_s=1.0) == {"127.0.0.1:8123": 3}

        await eventually(indexed, deadline_s=15)
        assert await index.lookup(MODEL, theirs, deadline_s=1.0) == {}
        code, log = await stop_indexer(proc)
        assert code == 0, log
        assert "replica 127.0.0.1:8123: rekey auto" in log, log
        assert "key_check=differ" in log, log
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await index.close()
