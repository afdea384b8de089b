"""The in-process PrefixIndex: dicts, for a single gateway (see the package docstring).

It keeps the same contract as RedisIndex, step for step: its bisecting lookup is the
Redis script's (lookup_bisect.lua), 0-based, and tests/router/test_index.py runs one
suite against both. One step differs: a replica holding entries that expire (chains the
gateway recorded, for a replica without KV events) is bisected here too where its
entries cannot have left an expired hole (see MemoryIndex._put), where the script walks
every such replica block by block: one process with one clock and one TTL can tell,
while the script's writers are several gateways, with their own clocks and settings.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType

from router.index.probes import MemoryProbes, ObservedBlocks
from router.index.protocol import (
    DEFAULT_WARM_CONNECTIONS,
    EXPIRED_SWEEP,
    IndexOp,
    LookupStrategy,
    StreamPosition,
)

_upkeep: ModuleType | None
try:  # the per-block loops of _put and _forget in C (router/index/_upkeep.c), optional
    from router.index import _upkeep  # type: ignore[attr-defined, no-redef]
except ImportError:
    _upkeep = None
if os.environ.get("CACHEROUTE_NATIVE", "1") == "0":
    _upkeep = None

# Blocks of one KV-event batch applied between two turns of the event loop. A request's
# own batch (a cold 8k-token prompt: 512 stored, as many evicted) arrives with its answer
# and took ~2 ms of the loop in one piece, ahead of relaying that answer; in slices the
# answer goes out after one. A slice is about 0.1 ms of the loop in the serving gateway:
# 64 blocks in Python, 256 in C (~0.6 us a block there against ~0.16 in a benchmark:
# the index's dicts are out of the CPU's caches between requests). Each slice costs a
# turn of the loop (~10 us with its poll), 16 a cold 8k prompt at 64.
APPLY_SLICE = 64 if _upkeep is None else 256


class MemoryIndex:
    """The in-process PrefixIndex: dicts, for a single gateway."""

    # Its lookups never wait on I/O: callers await them directly, without the task and
    # deadline a round trip to Redis needs (router/routing.py lookup_matches).
    in_process = True

    def __init__(
        self,
        *,
        capacity_blocks: int | None = None,
        event_ttl_s: float | None = None,
        clock: Callable[[], float] = time.time,
        lookup_strategy: LookupStrategy = "bisect",
    ) -> None:
        self._strategy = lookup_strategy
        self._capacity = capacity_blocks
        self._event_ttl_s = event_ttl_s
        self._clock = clock
        # model -> block key -> replica -> expiry (math.inf = never)
        self._holders: dict[str, dict[int, dict[str, float]]] = {}
        # (model, replica) -> block key -> its parent's key (None for a chain's first
        # block), least recently touched first
        self._lru: dict[tuple[str, str], OrderedDict[int, int | None]] = {}
        self._models: dict[str, set[str]] = {}
        # (model, replica) pairs that hold entries that expire, and those of them whose
        # expired entries may have left a hole (looked up by the walk; see _put).
        self._expiring: set[tuple[str, str]] = set()
        self._irregular: set[tuple[str, str]] = set()
        # pair -> (the TTL of its expiring writes, the clock at the last one)
        self._ttls: dict[tuple[str, str], tuple[float, float]] = {}
        # Holes, counted exactly so that the bisection verifies only where one exists:
        # per (model, replica), how many held blocks name each key as parent, and how
        # many held blocks have a parent the replica does not hold ("orphans"). With no
        # orphan every held block's whole prefix is held. vLLM evicts leaf first, so its
        # evictions leave none; flagging every replica that ever evicted (as the Redis
        # script must, having no parents) walked a long prompt's every block per lookup,
        # 0.05 ms per lookup of a 1,024-block chain against 0.001. The price: 394 bytes
        # per held block instead of 342 (tracemalloc, one replica, 1,000-block chains).
        self._kids: dict[tuple[str, str], dict[int, int]] = {}
        self._orphans: dict[tuple[str, str], int] = {}
        self._probes = MemoryProbes(clock)

    @property
    def blocks(self) -> int:
        """(model, replica, key) entries held: what capacity_blocks bounds per replica."""
        return sum(len(lru) for lru in self._lru.values())

    def bisects(self, model: str, replica: str) -> bool:
        """Whether lookups bisect the replica's run (False: walked block by block, for
        entries that expire and may have left a hole; see _put)."""
        return (model, replica) not in self._irregular

    def holes(self, model: str, replica: str) -> int:
        """Blocks the replica holds after a parent it does not (0: every run is whole)."""
        return self._orphans.get((model, replica), 0)

    async def lookup(
        self, model: str, keys: Sequence[int], *, deadline_s: float | None = None
    ) -> dict[str, int]:
        """Replica -> number of leading blocks of `keys` it holds (replicas with 0 omitted)."""
        holders = self._holders.get(model)
        if not holders or not keys:
            return {}
        if self._strategy == "walk":
            return self._walk(holders, keys)
        return self._bisect(model, holders, keys)

    def _walk(self, holders: dict[int, dict[str, float]], keys: Sequence[int]) -> dict[str, int]:
        counts: dict[str, int] = {}
        now = self._clock()
        alive: set[str] | None = None
        for i, key in enumerate(keys, start=1):
            held = holders.get(key)
            if not held:
                break
            nxt = {r for r, exp in held.items() if exp > now and (alive is None or r in alive)}
            if not nxt:
                break
            for r in nxt:
                counts[r] = i
            alive = nxt
        return counts

    def _bisect(self, model: str, holders: dict[int, dict[str, float]], keys: Sequence[int]
                ) -> dict[str, int]:
        # The same steps as the Redis script (lookup_bisect.lua), 0-based here.
        now = self._clock()
        n = len(keys)

        def held(r: str, i: int) -> bool:
            return holders.get(keys[i], {}).get(r, -math.inf) > now

        counts: dict[str, int] = {}
        for r, expiry in holders.get(keys[0], {}).items():
            if expiry <= now:
                continue
            if n == 1:
                counts[r] = 1
            elif (model, r) in self._irregular:
                run = 1
                while run < n and held(r, run):
                    run += 1
                counts[r] = run
            else:
                lo, hi = 0, n - 1  # block lo held, block hi not (unless hi is the last)
                if held(r, hi):
                    lo = hi
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if held(r, mid):
                        lo = mid
                    else:
                        hi = mid
                run = lo + 1
                if self._orphans.get((model, r)) or (lo >= 2 and not held(r, lo - 1)):
                    # Cut at the first hole, should the prefix property have failed.
                    for i in range(1, lo):
                        if r not in holders.get(keys[i], ()):
                            run = i
                            break
                counts[r] = run
        return counts

    async def add(self, model: str, replica: str, keys: Sequence[int]) -> None:
        """The replica now holds these blocks (from its KV events)."""
        self._put(model, replica, keys, self._event_ttl_s, self._capacity)

    async def remove(self, model: str, replica: str, keys: Sequence[int]) -> None:
        """The replica evicted these blocks."""
        pair = (model, replica)
        lru = self._lru.get(pair)
        if not lru:
            return
        self._forget(pair, lru, self._holders.get(model, {}), keys)
        if not lru:
            self._forget_pair(pair)

    async def record(
        self,
        model: str,
        replica: str,
        keys: Sequence[int],
        ttl_s: float,
        *,
        capacity_blocks: int | None = None,
    ) -> None:
        """The gateway sent this chain to the replica: assume it holds it for ttl_s."""
        cap = self._capacity if capacity_blocks is None else capacity_blocks
        self._put(model, replica, keys, ttl_s, cap)

    async def clear_replica(self, replica: str) -> None:
        """Forget everything the replica holds, under every model scope."""
        for model in self._models.pop(replica, set()):
            self._forget_pair((model, replica))
            holders = self._holders.get(model, {})
            for key in self._lru.pop((model, replica), OrderedDict()):
                self._drop(holders, key, replica)

    def _forget_pair(self, pair: tuple[str, str]) -> None:
        """Drop a pair's bookkeeping beside its entries (it holds none now)."""
        self._expiring.discard(pair)
        self._irregular.discard(pair)
        self._ttls.pop(pair, None)
        self._kids.pop(pair, None)
        self._orphans.pop(pair, None)

    async def apply(self, replica: str, ops: Sequence[IndexOp], *,
                    position: StreamPosition | None = None) -> None:
        """One KV-event batch's writes for the replica, in order.

        `position` is not kept: this index dies with its process, so no successor resumes.
        """
        for op in ops:
            if op.kind == "add":
                await self._put_in_slices(op.scope, replica, op.keys, op.parent)
            elif op.kind == "remove":
                for start in range(0, len(op.keys), APPLY_SLICE):
                    if start:
                        await asyncio.sleep(0)
                    await self.remove(op.scope, replica, op.keys[start:start + APPLY_SLICE])
            else:
                await self.clear_replica(replica)

    async def _put_in_slices(self, model: str, replica: str, keys: Sequence[int],
                             parent: int | None) -> None:
        """An event's stored blocks, APPLY_SLICE at a time, letting the loop run between.

        Slices go tail first, which leaves the LRU order exactly as one _put would
        (block 0 most recent). Between slices a lookup may find the tail before the head:
        both are held by the replica already (its event says so), so the answer is only
        as late as the index ever is, never ahead of the replica."""
        for end in range(len(keys), 0, -APPLY_SLICE):
            if end != len(keys):
                await asyncio.sleep(0)
            start = max(0, end - APPLY_SLICE)
            self._put(model, replica, keys[start:end], self._event_ttl_s, self._capacity,
                      keys[start - 1] if start else parent)

    async def stream_position(self, replica: str) -> StreamPosition | None:
        """Always None: nothing here outlives the stream that wrote it."""
        return None

    async def seed(self, model: str, replica: str, keys: Sequence[int], *,
                   verify: bool) -> None:
        """Hold `keys` (least recently touched first) as another index says the replica
        does, their parents unknown (router/index/mirror.py seeds a mirror so). They
        count as roots: a later event's block whose parent is one of them is no orphan.
        `verify`: that index could not vouch for prefix closure (its hole flag), so
        every lookup of the replica here checks its run block by block until a clear."""
        pair = (model, replica)
        if pair in self._expiring:
            self._irregular.add(pair)  # entries that never expire among ones that do
        holders = self._holders.setdefault(model, {})
        lru = self._lru.setdefault(pair, OrderedDict())
        self._kids.setdefault(pair, {})
        self._models.setdefault(replica, set()).add(model)
        for start in range(0, len(keys), APPLY_SLICE * 16):
            if start:
                await asyncio.sleep(0)  # a replica's snapshot is tens of thousands
            for key in keys[start:start + APPLY_SLICE * 16]:
                held = holders.get(key)
                if held is None:
                    holders[key] = {replica: math.inf}
                else:
                    held[replica] = math.inf
                if key in lru:
                    lru.move_to_end(key)
                else:
                    lru[key] = None
        # One standing orphan keeps the bisection verifying (see _bisect).
        self._orphans[pair] = self._orphans.get(pair, 0) + (1 if verify else 0)

    async def put_probe(
        self,
        salt: str,
        replica: str,
        block_size: int,
        keys: Sequence[int],
        token_ids: Sequence[int],
        ttl_s: float,
        *,
        rekeyed: bool = False,
    ) -> None:
        """Keep what the replica's events said about a handshake probe, for ttl_s."""
        self._probes.put(salt, ObservedBlocks(block_size, tuple(keys), tuple(token_ids),
                                              replica=replica, rekeyed=rekeyed), ttl_s)

    async def get_probe(self, salt: str) -> ObservedBlocks | None:
        """The observation stored for a probe's salt, or None (not seen yet, or expired)."""
        return self._probes.get(salt)

    async def warm(self, connections: int = DEFAULT_WARM_CONNECTIONS) -> None:
        """Nothing to open: dicts are always warm."""

    async def close(self) -> None:
        """Nothing to release."""

    def _put(
        self, model: str, replica: str, keys: Sequence[int], ttl_s: float | None, cap: int | None,
        parent: int | None = None,
    ) -> None:
        """Hold `keys`, a chain whose first block follows `parent` (None: a chain's root)."""
        if not keys:
            return
        pair = (model, replica)
        now = self._clock()
        holders = self._holders.setdefault(model, {})
        expiry = math.inf if ttl_s is None else now + ttl_s
        lru = self._lru.setdefault(pair, OrderedDict())
        # Whether the pair's live entries still form runs from block 0, expiry aside. A
        # write sets one expiry on all its blocks. Where every write with one is a whole
        # chain from its first block (as the gateway records what it sent), with one TTL
        # and a clock that does not go back, a block is written whenever any block after
        # it in its chain is, at the same time or later: it expires no sooner than they
        # do, the live blocks of a chain are a run from block 0, and the lookup may
        # bisect. Anything else (a chain recorded from a later block, a run stored under
        # a parent, another TTL, the clock going back, entries that never expire among
        # ones that do) may leave an expired block before a live one: walked from then on.
        if ttl_s is not None:
            last = self._ttls.get(pair)
            if parent is not None or lru.get(keys[0]) is not None or (
                    (ttl_s != last[0] or now < last[1]) if last is not None else bool(lru)):
                self._irregular.add(pair)
            self._expiring.add(pair)
            self._ttls[pair] = (ttl_s, now)
        elif pair in self._expiring:
            self._irregular.add(pair)
        kids = self._kids.setdefault(pair, {})
        self._models.setdefault(replica, set()).add(model)
        put = _put_blocks if _upkeep is None else _upkeep.put
        self._orphans[pair] = self._orphans.get(pair, 0) + put(
            holders, lru, kids, keys, replica, expiry, parent)
        if cap is not None and cap > 0 and len(lru) > cap:
            self._forget(pair, lru, holders, list(itertools.islice(lru, len(lru) - cap)))
        for _ in range(EXPIRED_SWEEP):
            if not lru:
                break
            head = next(iter(lru))
            if holders.get(head, {}).get(replica, -math.inf) > now:
                break
            self._forget(pair, lru, holders, (head,))

    def _forget(self, pair: tuple[str, str], lru: OrderedDict[int, int | None],
                holders: dict[int, dict[str, float]], keys: Iterable[int]) -> None:
        """The replica no longer holds `keys` (those it held): keep the hole count exact."""
        forget = _forget_blocks if _upkeep is None else _upkeep.forget
        self._orphans[pair] += forget(holders, lru, self._kids[pair], keys, pair[1])

    @staticmethod
    def _drop(holders: dict[int, dict[str, float]], key: int, replica: str) -> None:
        held = holders.get(key)
        if held is not None:
            held.pop(replica, None)
            if not held:
                del holders[key]


def _put_blocks(holders: dict[int, dict[str, float]], lru: OrderedDict[int, int | None],
                kids: dict[int, int], keys: Sequence[int], replica: str, expiry: float,
                parent: int | None) -> int:
    """Hold `keys` (a chain whose first block follows `parent`) for `replica`; returns
    the change in its orphan count. router/index/_upkeep.c's put runs the same loop."""
    orphans = 0
    # Tail first, so block 0 is the most recently touched (leaf-first trimming). A
    # block's parent comes after it, so it counts as an orphan for one step.
    # (Locals and no calls per block: an event batch is hundreds of them.)
    count = kids.get
    for i in range(len(keys) - 1, -1, -1):
        key = keys[i]
        held = holders.get(key)
        if held is None:
            holders[key] = {replica: expiry}
        else:
            held[replica] = expiry
        if key in lru:
            lru.move_to_end(key)
            continue
        up = keys[i - 1] if i else parent
        lru[key] = up
        orphans -= count(key, 0)  # its held children have their parent again
        if up is not None:
            kids[up] = count(up, 0) + 1
            if up not in lru:
                orphans += 1
    return orphans


def _forget_blocks(holders: dict[int, dict[str, float]], lru: OrderedDict[int, int | None],
                   kids: dict[int, int], keys: Iterable[int], replica: str) -> int:
    """`replica` no longer holds `keys` (those it held); returns the change in its
    orphan count. router/index/_upkeep.c's forget runs the same loop."""
    orphans = 0
    count = kids.get
    pop = lru.pop
    for key in keys:
        if key not in lru:
            continue
        up = pop(key)
        held = holders.get(key)
        if held is not None:
            held.pop(replica, None)
            if not held:
                del holders[key]
        orphans += count(key, 0)  # its held children lose their parent
        if up is not None:
            left = count(up, 0) - 1
            if left > 0:
                kids[up] = left
            else:
                kids.pop(up, None)
            if up not in lru:
                orphans -= 1  # it was one itself
    return orphans
