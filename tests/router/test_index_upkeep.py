"""router/index/_upkeep.c (MemoryIndex's per-block loops in C) against the Python loops it
replaces: the same random histories of KV events and records leave the same holders,
the same LRU order with the same parents, the same kid and orphan counts, and give the
same lookups. The fallback is the index every other test runs where the extension is
not built; here both run side by side."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from router.index import MemoryIndex
from router.index import memory as memory_module
from router.index.protocol import IndexOp

MODELS = ["m1", "m2"]
REPLICAS = ["r1", "r2", "r3"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_extension_is_built_here() -> None:
    # The project's setup builds it; without this a broken build would leave the
    # comparison below running the Python loops against themselves.
    assert memory_module._upkeep is not None


def state(index: MemoryIndex) -> tuple[object, ...]:
    """Everything the loops write, the LRU's order included."""
    return (index._holders,
            {pair: list(lru.items()) for pair, lru in index._lru.items()},
            index._kids, index._orphans, index._models, index._expiring, index._irregular)


def chains_of(rng: random.Random, count: int) -> list[list[int]]:
    """Chained keys over a few tokens, so that chains share prefixes and branch."""
    out = []
    for _ in range(count):
        tokens = tuple(rng.randrange(1, 4) for _ in range(rng.randrange(1, 40)))
        out.append([hash(tokens[:i + 1]) & (2**64 - 1) for i in range(len(tokens))])
    return out


async def history(seed: int, native: bool, monkeypatch: pytest.MonkeyPatch
                  ) -> tuple[tuple[object, ...], list[dict[str, int]]]:
    rng = random.Random(seed)
    clock = Clock()
    upkeep = memory_module._upkeep
    with monkeypatch.context() as patch:
        if not native:
            patch.setattr(memory_module, "_upkeep", None)
        index = MemoryIndex(clock=clock, capacity_blocks=rng.choice([None, 6, 30, 200]))
        chains = chains_of(rng, 10)
        answers = []
        for _ in range(150):
            model, replica, chain = rng.choice(MODELS), rng.choice(REPLICAS), rng.choice(chains)
            cut = rng.randrange(len(chain))
            kind = rng.random()
            if kind < 0.35:  # a stored batch, whole or from a later block under its parent
                parent = chain[cut - 1] if cut else None
                await index.apply(replica, [IndexOp("add", model, tuple(chain[cut:]), parent)])
            elif kind < 0.55:  # an eviction, leaf first or anywhere (a hole)
                keys = chain[cut:][::-1] if rng.random() < 0.7 else rng.sample(chain, cut + 1)
                await index.apply(replica, [IndexOp("remove", model, tuple(keys))])
            elif kind < 0.75:  # the gateway's own record of what it sent
                await index.record(model, replica, chain, ttl_s=rng.choice([30.0, 60.0]))
            elif kind < 0.8:
                await index.apply(replica, [IndexOp("clear", model, ())])
            elif kind < 0.85:
                await index.seed(model, replica, chain, verify=rng.random() < 0.5)
            else:
                await index.add(model, replica, chain[: cut + 1])
            clock.now += rng.expovariate(1 / 20)
            answers.append(await index.lookup(model, rng.choice(chains)))
        assert memory_module._upkeep is (upkeep if native else None)
        return state(index), answers


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32))
@example(1)
def test_the_c_loops_leave_what_the_python_loops_leave(seed: int) -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        native = asyncio.run(history(seed, True, monkeypatch))
        python = asyncio.run(history(seed, False, monkeypatch))
    assert native == python


def test_the_c_loops_refuse_what_is_not_theirs_without_writing() -> None:
    upkeep = memory_module._upkeep
    assert upkeep is not None
    holders: dict[int, dict[str, float]] = {}
    lru: OrderedDict[int, int | None] = OrderedDict()
    with pytest.raises(TypeError):
        upkeep.put(holders, lru, {}, 5, "r1", 1.0, None)  # keys not a sequence
    with pytest.raises(TypeError):
        upkeep.put([], lru, {}, [1], "r1", 1.0, None)  # holders not a dict
    holders[7] = "not a dict"  # type: ignore[assignment]
    with pytest.raises(TypeError, match="dicts"):
        upkeep.put(holders, lru, {}, [7], "r1", 1.0, None)
    assert not lru


def test_the_benchmark_runs_and_names_a_bad_value() -> None:
    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_index_upkeep.py"
    done = subprocess.run([sys.executable, str(bench), "--blocks", "8", "--held", "32",
                           "--rounds", "2", "--per-round", "3"],
                          capture_output=True, text=True, timeout=120, check=True)
    assert "C / Python:" in done.stdout and "8 blocks stored + 8 evicted" in done.stdout
    bad = subprocess.run([sys.executable, str(bench), "--held", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--held must be at least 1" in bad.stderr
