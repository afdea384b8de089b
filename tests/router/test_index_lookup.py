"""The bisecting lookup against the walk, on both backends (router/index/__init__.py's docstring).

Keys here are chained as vLLM's are: a key stands for its whole prefix, so chains that
share a key share everything before it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import pytest
from servers import RedisServer

from router.index import IndexOp, MemoryIndex, PrefixIndex, RedisIndex

MODEL = "tiny"


async def eventually(check: Callable[[], Awaitable[bool]], deadline_s: float = 10.0) -> None:
    """Poll an async condition until it holds, failing after the deadline."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if await check():
            return
        await asyncio.sleep(0.01)  # polling interval, not synchronisation
    raise AssertionError(f"condition not met within {deadline_s}s")


@dataclass
class Twins:
    """One index's data read by the bisecting lookup and by the walk."""

    writers: list[PrefixIndex]
    bisect: PrefixIndex
    walk: PrefixIndex

    async def apply(self, replica: str, ops: Sequence[IndexOp]) -> None:
        for w in self.writers:
            await w.apply(replica, ops)

    async def record(self, replica: str, keys: Sequence[int], ttl_s: float) -> None:
        for w in self.writers:
            await w.record(MODEL, replica, keys, ttl_s)

    async def add(self, replica: str, keys: Sequence[int]) -> None:
        for w in self.writers:
            await w.add(MODEL, replica, keys)

    async def both(self, keys: Sequence[int]) -> tuple[dict[str, int], dict[str, int]]:
        return (await self.bisect.lookup(MODEL, keys), await self.walk.lookup(MODEL, keys))


@pytest.fixture(params=["memory", "redis"])
async def twins(request: pytest.FixtureRequest) -> AsyncIterator[Twins]:
    if request.param == "memory":
        bisect: PrefixIndex = MemoryIndex()
        walk: PrefixIndex = MemoryIndex(lookup_strategy="walk")
        yield Twins([bisect, walk], bisect, walk)
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    bisect = RedisIndex.from_url(server.url)
    walk = RedisIndex.from_url(server.url, lookup_strategy="walk")
    try:
        yield Twins([bisect], bisect, walk)
    finally:
        await bisect.close()
        await walk.close()


def chained(prefix: tuple[int, ...], token: int) -> int:
    """A 63-bit key standing for the prefix it ends (as vLLM's chained block hashes do)."""
    return hash((*prefix, token)) & (2**63 - 1)


def make_chains(rng: random.Random, count: int, shared: int, own: int) -> list[list[int]]:
    """`count` chains: a common root of `shared` blocks, then up to `own` blocks each."""
    tokens = [rng.randrange(1000) for _ in range(shared)]
    chains = []
    for _ in range(count):
        seq = tokens + [rng.randrange(1000) for _ in range(rng.randrange(1, own + 1))]
        chains.append([chained(tuple(seq[:i]), seq[i]) for i in range(len(seq))])
    return chains


def store(chain: Sequence[int], start: int, stop: int) -> IndexOp:
    """The add a KV-event batch storing chain[start:stop] becomes (with its parent)."""
    return IndexOp("add", MODEL, tuple(chain[start:stop]), chain[start - 1] if start else None)


async def test_bisect_answers_as_the_walk_on_prefix_closed_chains(twins: Twins) -> None:
    rng = random.Random(3)
    chains = make_chains(rng, 12, shared=300, own=200)
    for replica in ("r0", "r1", "r2", "r3"):
        # Requests store a chain's blocks in segments, each batch continuing a held prefix.
        for chain in rng.sample(chains, 5):
            held = rng.randrange(1, len(chain) + 1)
            for start in range(0, held, 64):
                await twins.apply(replica, [store(chain, start, min(held, start + 64))])
    probes = chains + [c[: rng.randrange(1, len(c))] for c in chains]
    for keys in probes:
        bisect, walk = await twins.both(keys)
        assert bisect == walk
    answers = [await twins.walk.lookup(MODEL, c) for c in chains]
    assert sum(len(a) for a in answers) >= 12  # the chains were held, by several replicas


async def test_leaf_first_evictions_keep_the_answers_exact(twins: Twins) -> None:
    rng = random.Random(4)
    chains = make_chains(rng, 6, shared=40, own=60)
    for chain in chains:
        await twins.apply("r1", [store(chain, 0, len(chain))])
    # Evict tails, leaf-first, as vLLM does: each chain shrinks to a random length.
    for chain in chains:
        keep = rng.randrange(41, len(chain) + 1)
        if keep < len(chain):
            await twins.apply("r1", [IndexOp("remove", MODEL, tuple(reversed(chain[keep:])))])
    for chain in chains:
        bisect, walk = await twins.both(chain)
        assert bisect == walk
        assert walk["r1"] >= 40


async def test_a_hole_from_an_interior_eviction_is_found(twins: Twins) -> None:
    chain = make_chains(random.Random(5), 1, shared=300, own=1)[0]
    await twins.apply("r1", [store(chain, 0, len(chain))])
    await twins.apply("r1", [IndexOp("remove", MODEL, (chain[100],))])
    assert await twins.both(chain) == ({"r1": 100}, {"r1": 100})


async def test_a_lost_store_is_seen_through_its_successors_parent(twins: Twins) -> None:
    chain = make_chains(random.Random(6), 1, shared=200, own=1)[0]
    await twins.apply("r1", [store(chain, 0, 50)])
    # The batch storing blocks 50..99 was lost; the next one names block 99 as parent.
    await twins.apply("r1", [store(chain, 100, 201)])
    assert await twins.both(chain) == ({"r1": 50}, {"r1": 50})
    # Once the missing blocks arrive the run is whole again.
    await twins.apply("r1", [store(chain, 50, 100)])
    assert await twins.both(chain) == ({"r1": 201}, {"r1": 201})


async def test_expiring_entries_are_walked(twins: Twins) -> None:
    chain = make_chains(random.Random(7), 1, shared=100, own=1)[0]
    await twins.record("r1", chain, ttl_s=60)
    await twins.record("r1", chain[:80], ttl_s=60)
    # An entry mid-chain that has already expired (a tiny TTL, refreshed by nothing).
    for w in twins.writers:
        await w.remove(MODEL, "r1", [chain[30]])
        await w.record(MODEL, "r1", [chain[30]], ttl_s=0.001)

    async def expired() -> bool:
        return (await twins.walk.lookup(MODEL, chain)) == {"r1": 30}

    await eventually(expired)
    assert await twins.bisect.lookup(MODEL, chain) == {"r1": 30}


async def test_an_unseen_hole_gives_the_bisections_boundary(twins: Twins) -> None:
    """Defined behaviour where prefix closure fails and no writer could tell: adds that
    name no parent (`add`), leaving a hole the bisection's probes do not land on."""
    chain = make_chains(random.Random(8), 1, shared=40, own=1)[0]
    await twins.add("r1", chain[:10])
    await twins.add("r1", chain[20:])
    bisect, walk = await twins.both(chain)
    assert walk == {"r1": 10}
    # The last block is held and so is the one before it: the whole chain is claimed.
    assert bisect == {"r1": len(chain)}


async def test_a_broken_last_link_is_verified(twins: Twins) -> None:
    await twins.add("r1", [1, 2, 3, 4])
    # Not one chain (3 follows 2, not 9): the link into the last held block is missing.
    assert await twins.both([1, 9, 3]) == ({"r1": 1}, {"r1": 1})
    assert await twins.both([1, 2, 9, 4]) == ({"r1": 2}, {"r1": 2})


@pytest.mark.parametrize("seed", [11, 12, 13])
async def test_bisect_and_walk_agree_on_random_operations(twins: Twins, seed: int) -> None:
    """Adds that name their parent, any removes, records and clears: always the walk's answer."""
    rng = random.Random(seed)
    chains = make_chains(rng, 5, shared=rng.randrange(1, 30), own=40)
    replicas = ["r1", "r2", "r3"]
    for step in range(120):
        op = rng.choice(["store", "store", "remove", "record", "clear"])
        replica, chain = rng.choice(replicas), rng.choice(chains)
        start = rng.randrange(len(chain))
        stop = rng.randrange(start + 1, len(chain) + 1)
        if op == "store":
            await twins.apply(replica, [store(chain, start, stop)])
        elif op == "remove":
            await twins.apply(replica, [IndexOp("remove", MODEL, tuple(chain[start:stop]))])
        elif op == "record":
            await twins.record(replica, chain[:stop], ttl_s=600)
        else:
            for w in twins.writers:
                await w.clear_replica(replica)
        for keys in chains:
            bisect, walk = await twins.both(keys)
            assert bisect == walk, (step, op)


@pytest.mark.parametrize("seed", [21, 22, 23])
async def test_the_memory_index_counts_its_holes_exactly(seed: int) -> None:
    """Stores, leaf-first and interior evictions, capacity trimming and clears: the count
    the bisection trusts is always the held blocks whose parent is not held, and
    leaf-first evictions (vLLM's) leave none."""
    rng = random.Random(seed)
    chains = make_chains(rng, 5, shared=rng.randrange(1, 30), own=40)
    parent = {c[i]: c[i - 1] if i else None for c in chains for i in range(len(c))}
    index = MemoryIndex(capacity_blocks=rng.choice([None, 50]))
    replicas = ["r1", "r2"]

    def held(replica: str) -> set[int]:
        return set(index._lru.get((MODEL, replica), ()))

    for step in range(150):
        op = rng.choice(["store", "store", "store", "leaf_first", "remove", "clear"])
        replica, chain = rng.choice(replicas), rng.choice(chains)
        start = rng.randrange(len(chain))
        stop = rng.randrange(start + 1, len(chain) + 1)
        if op == "store":
            await index.apply(replica, [store(chain, start, stop)])
        elif op == "leaf_first":
            await index.apply(replica, [IndexOp("remove", MODEL, tuple(reversed(chain[start:])))])
        elif op == "remove":
            await index.apply(replica, [IndexOp("remove", MODEL, tuple(chain[start:stop]))])
        else:
            await index.clear_replica(replica)
        for r in replicas:
            mine = held(r)
            orphans = sum(1 for k in mine if parent[k] is not None and parent[k] not in mine)
            assert index.holes(MODEL, r) == orphans, (step, op, r)


async def test_leaf_first_evictions_leave_no_hole_to_verify() -> None:
    chains = make_chains(random.Random(24), 4, shared=64, own=200)
    index = MemoryIndex()
    for chain in chains:
        await index.apply("r1", [store(chain, 0, len(chain))])
    for chain in chains:
        await index.apply("r1", [IndexOp("remove", MODEL, tuple(reversed(chain[100:])))])
    assert index.holes(MODEL, "r1") == 0
    await index.apply("r1", [IndexOp("remove", MODEL, (chains[0][80],))])
    assert index.holes(MODEL, "r1") == 1  # block 81, whose parent was evicted
    assert await index.lookup(MODEL, chains[0]) == {"r1": 80}
