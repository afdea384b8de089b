"""The handshake names the setting that differs between a replica and the gateway.

The pure comparison on made-up observations first, then `run_handshake` end to end
against a simulated replica whose KV events reach an in-process indexer.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest
from servers import REPO, free_port

from replica.fleet import RunningReplica, SimFleet
from router.events import EventIndexer, ReplicaFeed
from router.handshake import compare, is_probe_salt, make_probe, run_handshake
from router.hashing import HashConfig, chain_hashes, event_key
from router.index import MemoryIndex, ObservedBlocks, PrefixIndex, RedisIndex


def observe(config: HashConfig, tokens: tuple[int, ...], salt: str) -> ObservedBlocks:
    """What a replica with `config` would publish for the probe."""
    keys = tuple(event_key(k) for k in chain_hashes(config, tokens, cache_salt=salt))
    n = len(keys) * config.block_size
    return ObservedBlocks(config.block_size, keys, tokens[:n])


GATEWAY = HashConfig(algo="sha256", block_size=32, seed="7")


def test_same_settings_verify() -> None:
    probe = make_probe(32)
    result = compare(probe, GATEWAY, observe(GATEWAY, probe.token_ids, probe.cache_salt))
    assert result.verified and result.mismatch is None


@pytest.mark.parametrize(
    ("replica", "mismatch"),
    [
        (HashConfig(algo="sha256", block_size=64, seed="7"), "block_size"),
        (HashConfig(algo="sha256_cbor", block_size=32, seed="7"), "hash_algo"),
        (HashConfig(algo="xxhash", block_size=32, seed="7"), "hash_algo"),
        (HashConfig(algo="sha256", block_size=32, seed="8"), "hash_seed"),
        (HashConfig(algo="sha256", block_size=32, seed=None), "hash_seed"),
    ],
)
def test_mismatch_names_the_setting(replica: HashConfig, mismatch: str) -> None:
    probe = make_probe(32, blocks=3)
    result = compare(probe, GATEWAY, observe(replica, probe.token_ids, probe.cache_salt))
    assert not result.verified
    assert result.mismatch == mismatch
    assert result.detail


def test_probes_are_unique_and_recognisable() -> None:
    a, b = make_probe(32), make_probe(32)
    assert a.cache_salt != b.cache_salt
    assert is_probe_salt(a.cache_salt) and not is_probe_salt("tenant-salt")
    assert len(a.token_ids) == 2 * 32 + 1


# --- run_handshake against simulated replicas (real HTTP, real ZMQ, real indexer) ---------

SIM_MODEL = "sim"


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningReplica]:
    """One sim replica keying like vLLM with block size 32, sha256, PYTHONHASHSEED "0"."""
    with SimFleet(1, block_size=32, num_blocks=256, seed="0", kv_events=True) as fleet:
        yield fleet.replicas[0]


@contextlib.asynccontextmanager
async def indexed(replica: RunningReplica, index: PrefixIndex) -> AsyncIterator[EventIndexer]:
    """The replica's KV events flowing into `index`, as the gateway's indexer does it."""
    assert replica.kv_events_endpoint is not None
    indexer = EventIndexer(index)
    await indexer.add_replica(ReplicaFeed("sim-0", replica.kv_events_endpoint, SIM_MODEL,
                                          replay_endpoint=replica.replay_endpoint))
    try:
        yield indexer
    finally:
        await indexer.stop()


@pytest.mark.parametrize(
    ("ours", "mismatch"),
    [
        (HashConfig("sha256", 32, "0"), None),
        (HashConfig("sha256", 32, "1"), "hash_seed"),
        (HashConfig("sha256", 64, "0"), "block_size"),
        (HashConfig("sha256_cbor", 32, "0"), "hash_algo"),
    ],
)
async def test_run_handshake_against_a_sim_names_the_differing_setting(
    sim: RunningReplica, index: PrefixIndex, ours: HashConfig, mismatch: str | None
) -> None:
    async with indexed(sim, index) as indexer, aiohttp.ClientSession() as session:
        result = await run_handshake(session, sim.url, SIM_MODEL, ours, index,
                                     timeout_s=10, vocab_size=1000)
        stats = indexer.stats()["sim-0"]
    assert result.verified == (mismatch is None), result
    assert result.mismatch == mismatch, result
    assert not result.rekeyed  # this indexer does not re-key
    # The probe went to put_probe, not into the index as blocks.
    assert stats.probes >= 1 and stats.events_applied >= 1


async def test_run_handshake_says_when_no_events_reach_the_index(sim: RunningReplica) -> None:
    index = MemoryIndex()  # nothing feeds it
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        result = await run_handshake(session, sim.url, SIM_MODEL, HashConfig("sha256", 32, "0"),
                                     index, timeout_s=1.5, vocab_size=1000, probe_every_s=0.5)
        elapsed = time.monotonic() - started
    assert (result.verified, result.mismatch) == (False, "no_events")
    assert "kv_events" in result.detail
    assert 1.5 <= elapsed < 5.0


async def test_a_probe_counts_as_a_request_in_flight_while_it_is_sent(
        sim: RunningReplica) -> None:
    """A scrape that catches the probe at the replica must not take it for another
    client's request (which would price that replica's first cold prefills as if a
    request waited there)."""
    counts: list[int] = []

    @contextlib.contextmanager
    def sending() -> Iterator[None]:
        counts.append(1)
        try:
            yield
        finally:
            counts.append(-1)

    async with aiohttp.ClientSession() as session:
        result = await run_handshake(session, sim.url, SIM_MODEL, HashConfig("sha256", 32, "0"),
                                     MemoryIndex(), timeout_s=0.6, vocab_size=1000,
                                     probe_every_s=0.25, sending=sending)
    assert result.mismatch == "no_events"  # nothing feeds this index
    assert len(counts) >= 2 and counts[::2] == [1] * (len(counts) // 2)
    assert sum(counts) == 0  # each probe's count ended with it


async def test_run_handshake_says_when_the_probe_cannot_be_sent() -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    async with aiohttp.ClientSession() as session:
        result = await run_handshake(session, closed, SIM_MODEL, HashConfig("sha256", 32, "0"),
                                     MemoryIndex(), timeout_s=0.5, vocab_size=1000)
    assert (result.verified, result.mismatch) == (False, "probe_failed")
    assert closed in result.detail


def test_the_pure_part_imports_without_aiohttp() -> None:
    code = ("import sys; sys.modules['aiohttp'] = None; import router.handshake as h; "
            "print(h.make_probe(4).cache_salt)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("cacheroute-probe-")


async def test_run_handshake_says_when_the_index_cannot_be_read(sim: RunningReplica) -> None:
    index = RedisIndex.from_url(f"redis://127.0.0.1:{free_port()}/0", op_timeout_s=0.2,
                                connect_timeout_s=0.1)  # nothing listens there
    try:
        async with aiohttp.ClientSession() as session:
            result = await run_handshake(session, sim.url, SIM_MODEL,
                                         HashConfig("sha256", 32, "0"), index, timeout_s=1.0,
                                         vocab_size=1000)
    finally:
        await index.close()
    assert (result.verified, result.mismatch) == (False, "index_unavailable")
    assert "redis" in result.detail


def test_seed_never_appears_in_diagnosis_or_repr() -> None:
    secret = "s3cret-seed-4242"
    ours = HashConfig(algo="xxhash", block_size=32, seed=secret)
    replica = HashConfig(algo="xxhash", block_size=32, seed="other")
    probe = make_probe(32)
    result = compare(probe, ours, observe(replica, probe.token_ids, probe.cache_salt))
    assert result.mismatch == "hash_seed"
    assert secret not in result.detail and secret not in repr(ours)
