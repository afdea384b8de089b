"""MemoryIndex bisects replicas whose recorded chains expire, where no expired hole can
exist, and walks them where one may: either way its answers are the walk's."""

from __future__ import annotations

import asyncio
import random

from hypothesis import example, given, settings
from hypothesis import strategies as st

from router.index import MemoryIndex

MODEL = "tiny"
TTL = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def chains_of(rng: random.Random, count: int) -> list[list[int]]:
    """Chained keys (each stands for its whole prefix) over a few tokens, so that chains
    share prefixes and branch."""
    chains = []
    for _ in range(count):
        tokens = tuple(rng.randrange(1, 4) for _ in range(rng.randrange(1, 12)))
        chains.append([hash(tokens[:i + 1]) & (2**63 - 1) for i in range(len(tokens))])
    return chains


async def replay(seed: int, irregular: bool) -> tuple[MemoryIndex, list[tuple[int, str]]]:
    """Random records (whole chains, one TTL) while the clock moves on, then lookups of
    every chain's every prefix by bisection and by the walk, which must agree; with
    `irregular`, now and then a write that may leave an expired hole."""
    rng = random.Random(seed)
    clock = Clock()
    fast = MemoryIndex(clock=clock, capacity_blocks=rng.choice([None, 8, 20]))
    walk = MemoryIndex(clock=clock, capacity_blocks=fast._capacity, lookup_strategy="walk")
    chains = chains_of(rng, 8)
    replicas = ["r1", "r2", "r3"]
    disagreements: list[tuple[int, str]] = []
    for step in range(120):
        replica, chain = rng.choice(replicas), rng.choice(chains)
        odd = irregular and rng.random() < 0.15
        for index in (fast, walk):
            if not odd:
                await index.record(MODEL, replica, chain, ttl_s=TTL)
            else:
                kind = step % 4
                if kind == 0:  # a chain recorded from a later block
                    await index.record(MODEL, replica, chain[len(chain) // 2:], ttl_s=TTL / 3)
                elif kind == 1:  # another TTL
                    await index.record(MODEL, replica, chain, ttl_s=TTL / 4)
                elif kind == 2:  # entries that never expire among ones that do
                    await index.add(MODEL, replica, chain[: 1 + len(chain) // 2])
                else:  # a removal (an eviction event)
                    await index.remove(MODEL, replica, chain[-1:])
        if odd and step % 4 == 1 and rng.random() < 0.5:
            clock.now -= rng.uniform(0, 5)  # the wall clock stepped back
        clock.now += rng.expovariate(1 / 12)
        for probe in chains:
            want = await walk.lookup(MODEL, probe)
            got = await fast.lookup(MODEL, probe)
            if got != want:
                disagreements.append((step, f"{probe}: {got} != {want}"))
    return fast, disagreements


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32))
@example(1)
@example(2)
def test_recorded_chains_bisect_to_the_walks_answer(seed: int) -> None:
    fast, disagreements = asyncio.run(replay(seed, irregular=False))
    assert disagreements == []
    # ...and were bisected, not walked: nothing made them irregular.
    assert all(fast.bisects(MODEL, r) for r in ("r1", "r2", "r3"))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32))
@example(3)
def test_writes_that_may_leave_a_hole_fall_back_to_the_walk(seed: int) -> None:
    _, disagreements = asyncio.run(replay(seed, irregular=True))
    assert disagreements == []


async def test_each_kind_of_irregular_write_is_walked_from_then_on() -> None:
    clock = Clock()
    for write in ("later block", "other ttl", "clock back", "never expires", "seeded"):
        index = MemoryIndex(clock=clock)
        await index.record(MODEL, "r1", [1, 2, 3], ttl_s=TTL)
        assert index.bisects(MODEL, "r1")
        if write == "later block":
            await index.record(MODEL, "r1", [2, 3], ttl_s=TTL)
        elif write == "other ttl":
            await index.record(MODEL, "r1", [1, 2, 3], ttl_s=TTL / 2)
        elif write == "clock back":
            clock.now -= 1.0
            await index.record(MODEL, "r1", [1, 2, 3], ttl_s=TTL)
        elif write == "never expires":
            await index.add(MODEL, "r1", [1, 2, 3, 4])
        else:
            await index.seed(MODEL, "r1", [1, 2, 3, 4], verify=False)
        assert not index.bisects(MODEL, "r1"), write
        assert index.bisects(MODEL, "r2")
        # Emptied, the replica starts over.
        await index.clear_replica("r1")
        assert index.bisects(MODEL, "r1")


async def test_an_expired_hole_is_found_where_a_record_made_one() -> None:
    # What the walk exists for: block 2 re-recorded alone, with a shorter TTL, expires
    # before the blocks around it.
    clock = Clock()
    index = MemoryIndex(clock=clock)
    await index.record(MODEL, "r1", [1, 2, 3, 4], ttl_s=TTL)
    await index.record(MODEL, "r1", [2], ttl_s=1.0)
    clock.now += 2.0
    assert await index.lookup(MODEL, [1, 2, 3, 4]) == {"r1": 1}
