"""The in-process PrefixIndex: dicts, for a single gateway (see the package docstring).

It keeps the same contract as RedisIndex, step for step: its bisecting lookup is the
Redis script's (lookup_bisect.lua), 0-based, and tests/router/test_index.py runs one
suite against both.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from router.index.probes import MemoryProbes, ObservedBlocks
from router.index.protocol import (
    DEFAULT_WARM_CONNECTIONS,
    EXPIRED_SWEEP,
    IndexOp,
    LookupStrategy,
    StreamPosition,
)

# Blocks of one KV-event batch applied between two turns of the event loop. A request's
# own batch (a cold 8k-token prompt: 512 stored, as many evicted) arrives with its answer
# and took ~2 ms of the loop in one piece, ahead of relaying that answer; in slices the
# answer goes out after one.
APPLY_SLICE = 64


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
        # (model, replica) -> block keys, least recently touched first
        self._lru: dict[tuple[str, str], OrderedDict[int, None]] = {}
        self._models: dict[str, set[str]] = {}
        # (model, replica) pairs that may hold entries that expire: looked up by the walk;
        # and pairs whose held blocks may have holes: bisected, then verified.
        self._expiring: set[tuple[str, str]] = set()
        self._holed: set[tuple[str, str]] = set()
        self._probes = MemoryProbes(clock)

    @property
    def blocks(self) -> int:
        """(model, replica, key) entries held: what capacity_blocks bounds per replica."""
        return sum(len(lru) for lru in self._lru.values())

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
            elif (model, r) in self._expiring:
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
                if (model, r) in self._holed or (lo >= 2 and not held(r, lo - 1)):
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
        holders = self._holders.get(model, {})
        lru = self._lru.get((model, replica))
        gone: OrderedDict[int, None] = lru if lru is not None else OrderedDict()
        for key in keys:  # _drop inlined: a batch of evictions is hundreds of keys
            held = holders.get(key)
            if held is not None:
                held.pop(replica, None)
                if not held:
                    del holders[key]
            gone.pop(key, None)
        if lru:
            self._holed.add((model, replica))
        else:
            self._expiring.discard((model, replica))
            self._holed.discard((model, replica))

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
            self._expiring.discard((model, replica))
            self._holed.discard((model, replica))
            holders = self._holders.get(model, {})
            for key in self._lru.pop((model, replica), OrderedDict()):
                self._drop(holders, key, replica)

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
        if len(keys) <= APPLY_SLICE:
            self._put(model, replica, keys, self._event_ttl_s, self._capacity, parent)
            return
        self._note_hole(model, replica, parent)
        for end in range(len(keys), 0, -APPLY_SLICE):
            if end != len(keys):
                await asyncio.sleep(0)
            self._put(model, replica, keys[max(0, end - APPLY_SLICE):end], self._event_ttl_s,
                      self._capacity)

    async def stream_position(self, replica: str) -> StreamPosition | None:
        """Always None: nothing here outlives the stream that wrote it."""
        return None

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
        if not keys:
            return
        self._note_hole(model, replica, parent)
        now = self._clock()
        holders = self._holders.setdefault(model, {})
        expiry = math.inf if ttl_s is None else now + ttl_s
        if ttl_s is not None:
            self._expiring.add((model, replica))
        lru = self._lru.setdefault((model, replica), OrderedDict())
        self._models.setdefault(replica, set()).add(model)
        # Tail first, so block 0 is the most recently touched (leaf-first trimming).
        for key in reversed(keys):
            holders.setdefault(key, {})[replica] = expiry
            lru[key] = None
            lru.move_to_end(key)
        if cap is not None and cap > 0:
            while len(lru) > cap:
                victim, _ = lru.popitem(last=False)
                self._drop(holders, victim, replica)
        for _ in range(EXPIRED_SWEEP):
            if not lru:
                break
            head = next(iter(lru))
            if holders.get(head, {}).get(replica, -math.inf) > now:
                break
            lru.popitem(last=False)
            self._drop(holders, head, replica)

    def _note_hole(self, model: str, replica: str, parent: int | None) -> None:
        """Blocks stored after a parent the replica does not hold leave a hole."""
        if parent is not None and self._holders.get(model, {}).get(parent, {}).get(
                replica, -math.inf) <= self._clock():
            self._holed.add((model, replica))

    @staticmethod
    def _drop(holders: dict[int, dict[str, float]], key: int, replica: str) -> None:
        held = holders.get(key)
        if held is not None:
            held.pop(replica, None)
            if not held:
                del holders[key]
