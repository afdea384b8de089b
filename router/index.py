"""Which replica holds which prefix blocks: the `PrefixIndex` and its two backends.

A lookup answers, for one request's chain of block keys (the 64-bit event form, see
`router.hashing.event_key`), how many *leading* blocks each replica holds. Keys chain,
so a replica missing block i cannot hit block i+1 even if it holds it: a hole ends the
replica's run (vLLM's own lookup stops at the first miss too).

Entries come from two writers:

- `add` / `remove` / `clear_replica`: the KV-event subscriber (router/events.py), which
  mirrors what the replica says it holds. These entries do not expire unless the index
  was built with `event_ttl_s`, because vLLM announces a block once, when it enters the
  cache, and never again while requests keep hitting it.
- `record(model, replica, keys, ttl_s)`: the gateway, for replicas without KV events,
  records the chain it sent. Entries expire `ttl_s` after their last touch, and each
  (model scope, replica) keeps at most `capacity_blocks` entries, the least recently
  touched trimmed first, mimicking the replica's LRU free queue.

Within one write the chain's *tail* counts as touched first and block 0 last, so
trimming drops chains leaf-first, as vLLM evicts them, and held blocks stay a prefix.

"Model" is the index scope: "model", or "model@lora" for a LoRA adapter's blocks.
The capacity bound applies per (scope, replica): a replica serving several LoRA scopes
gets the bound once per scope.

Both backends behave the same (tests/router/test_index.py runs one suite against both).
`MemoryIndex` serves one gateway; `RedisIndex` lets several gateways and indexers share
one index and agree (expiry uses the Redis server's clock, not each gateway's).
`NearCache` wraps either and answers repeats of a recent lookup in-process.

Redis key layout (NS is the namespace, "cr" by default; {M} is the model scope inside a
hash tag; K is the block's 64-bit key as 8 raw big-endian bytes; R the replica id):

    NS:{M}:b:K    HASH  R -> expiry in Unix ms (0 = never). Who holds block K.
                  Key TTL = the latest expiry among its fields (none if any field is 0).
    NS:{M}:r:R    ZSET  K -> touch order. The reverse index of replica R, least recently
                  touched first: clear_replica walks it instead of scanning the
                  keyspace, and trimming pops its head.
    NS:{M}:c:R    STRING  touch counter for the ZSET's scores (exact integers, so
                  positions within one write stay ordered, which ms timestamps would not).
    NS:{M}:t:R    STRING  TTL flag: R may hold entries here that expire (see Lookup).
    NS:{M}:h:R    STRING  hole flag: R's entries here may not be prefix-closed (see Lookup).
                  Both flags live exactly as long as NS:{M}:r:R (same expiry, gone with it).
    NS:rm:R       SET   model scopes replica R has entries under (for clear_replica);
                  its TTL follows the replica's longest-lived entry.
    NS:p:S        STRING  a hash-handshake probe's observation, by its cache salt S
                  (msgpack [replica, block_size, keys, token_ids, rekeyed]); short TTL
                  (`put_probe`'s ttl_s): the gateway that sent the probe reads it once.

`apply(replica, ops)` writes one KV-event batch's operations (`IndexOp`: add / remove,
in order) in one pipelined round trip: each add is its write script, each remove its
remove script, and the writes' SADDs ride along. A batch holding a clear (the replica
reset its cache) runs its operations one by one, since clear_replica takes several
round trips.

Lookup. Each backend takes `lookup_strategy`: "walk" or "bisect" (the default). Both
answer, per replica holding block 0, its leading run; the walk checks every block of the
chain (one EVALSHA of `_LOOKUP_WALK`: a call per block inside Redis, its cost linear in
the chain), the bisection probes O(log n) blocks per replica (one EVALSHA of
`_LOOKUP_BISECT`, the chain sent as one string of 8-byte keys). At 300-900 blocks (5k-14k
token prompts, block size 16) the walk's cost alone approaches or passes the gateway's
few-ms lookup deadline on a busy host; benchmarks/bench_index.py measures both.

The bisection rests on prefix closure: if a replica holds block i of a chain it holds
blocks 0..i-1 too. Keys chain (block i's key stands for its whole prefix), vLLM evicts
leaf-first and a hit touches the whole prefix (../shared/VLLM_FACTS.md), so an index
mirroring a replica's KV events holds prefixes; so does `record`, whose writes are whole
chains from block 0 trimmed tail-first. Where it can fail, the writers leave a flag
(above) and the lookup pays for exactness instead of trusting it:

- TTL flag: a write with a TTL (`record`, or events with `event_ttl_s`). An entry can
  expire mid-run while later ones live, so the replica is walked, one block at a time.
- Hole flag: a `remove` (a block removed while a descendant is held leaves a hole: vLLM
  never does this, but the index cannot tell), or an add whose `IndexOp.parent` the
  replica does not hold (a KV-event batch was lost or came before the subscription). The
  bisection's answer is then checked against the replica's reverse index, one ZMSCORE
  per 1,024 blocks, and cut at the first missing block.
- A broken last link (the run's last block held, the one before it not: keys that are
  not one chain) is checked the same way.

So the bisection gives the walk's answer whenever every add says its parent (the event
subscriber does), with or without removes, records and lost batches
(tests/router/test_index_lookup.py). The one case it does not: blocks added without a
parent (plain `add`) around a hole that no probe lands on; it then claims the run up to
the bisection's boundary, past the hole. The cost: O(R log n) probes for R replicas on
an event-fed, eviction-free index; a remove makes that replica's lookups O(run) (a C-level
ZMSCORE, a few times cheaper than the walk) until its entries are cleared; a TTL makes
them a walk. `NearCache` answers a repeated chain without a round trip at all.

Redis Cluster: the hash tag {M} puts every key of one model scope in one slot, so the
lookup and write scripts touch one slot, as cluster scripts must. The trade-off: one
model's whole index lives on one shard, so a cluster spreads load by model (and LoRA),
not within a model. Tagging by chain root instead would spread a model, but BlockRemoved
events name only the block, not its chain's root. NS:rm:R lives in another slot and is
written by a separate command in the same pipeline, never from a script. The write
scripts reach blocks named by the reverse index (trimming) without declaring them; they
are in the script's slot, which Redis 7 allows. (Only the layout is cluster-ready:
`RedisIndex` is built and tested on a single-node redis.asyncio.Redis client.)

Every Redis call has a deadline (socket timeouts, and asyncio.wait_for around each
operation); a failure raises `IndexUnavailable` so the gateway can route by load alone.
"""

from __future__ import annotations

import asyncio
import math
import struct
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError

from router.handshake import ObservedBlocks

T = TypeVar("T")

# A lookup is on every request's critical path: a slow index is worse than none.
DEFAULT_LOOKUP_TIMEOUT_S = 0.25
DEFAULT_OP_TIMEOUT_S = 2.0
# clear_replica removes this many entries per script run, so clearing a large replica
# does not hold Redis (single-threaded) for long.
_CLEAR_CHUNK = 2000
# Each write also drops up to this many expired entries from the replica's LRU head,
# which keeps the reverse index bounded without a background sweeper.
_EXPIRED_SWEEP = 64
# The bisecting lookup checks a run's blocks against the reverse index this many per
# ZMSCORE (Lua's unpack has a stack limit of a few thousand values).
_VERIFY_CHUNK = 1024

LookupStrategy = Literal["bisect", "walk"]


class IndexUnavailable(RuntimeError):
    """The index could not answer within its deadline; route without it."""


@dataclass(frozen=True)
class IndexOp:
    """One write of a KV-event batch: add or remove `keys` under scope, or clear the replica.

    An add's `parent` is the key of the block its first key follows in the chain (None for
    a chain's root, or unknown): a parent the replica does not hold marks a hole.
    """

    kind: Literal["add", "remove", "clear"]
    scope: str = ""
    keys: tuple[int, ...] = ()
    parent: int | None = None


class PrefixIndex(Protocol):
    """Which replicas hold a chain's leading blocks, per model scope."""

    async def lookup(
        self, model: str, keys: Sequence[int], *, deadline_s: float | None = None
    ) -> dict[str, int]:
        """Replica -> number of leading blocks of `keys` it holds (replicas with 0 omitted)."""
        ...

    async def add(self, model: str, replica: str, keys: Sequence[int]) -> None:
        """The replica now holds these blocks (from its KV events)."""
        ...

    async def remove(self, model: str, replica: str, keys: Sequence[int]) -> None:
        """The replica evicted these blocks."""
        ...

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
        ...

    async def clear_replica(self, replica: str) -> None:
        """Forget everything the replica holds, under every model scope."""
        ...

    async def apply(self, replica: str, ops: Sequence[IndexOp]) -> None:
        """One KV-event batch's writes for the replica, in order (add/remove as above)."""
        ...

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
        ...

    async def get_probe(self, salt: str) -> ObservedBlocks | None:
        """The observation stored for a probe's salt, or None (not seen yet, or expired)."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


class MemoryIndex:
    """The in-process PrefixIndex: dicts, for a single gateway."""

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
        # probe salt -> (expiry, observation)
        self._probes: dict[str, tuple[float, ObservedBlocks]] = {}

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
        # The same steps as the Redis script (_LOOKUP_BISECT), 0-based here.
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
        for key in keys:
            self._drop(holders, key, replica)
            if lru is not None:
                lru.pop(key, None)
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

    async def apply(self, replica: str, ops: Sequence[IndexOp]) -> None:
        """One KV-event batch's writes for the replica, in order."""
        for op in ops:
            if op.kind == "add":
                self._put(op.scope, replica, op.keys, self._event_ttl_s, self._capacity,
                          op.parent)
            elif op.kind == "remove":
                await self.remove(op.scope, replica, op.keys)
            else:
                await self.clear_replica(replica)

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
        now = self._clock()
        # Expired observations go on every put: probes are rare, so this stays small.
        for old in [k for k, (exp, _) in self._probes.items() if exp <= now]:
            del self._probes[old]
        self._probes[salt] = (now + ttl_s, ObservedBlocks(
            block_size, tuple(keys), tuple(token_ids), replica=replica, rekeyed=rekeyed))

    async def get_probe(self, salt: str) -> ObservedBlocks | None:
        """The observation stored for a probe's salt, or None (not seen yet, or expired)."""
        entry = self._probes.get(salt)
        if entry is None or entry[0] <= self._clock():
            return None
        return entry[1]

    async def close(self) -> None:
        """Nothing to release."""

    def _put(
        self, model: str, replica: str, keys: Sequence[int], ttl_s: float | None, cap: int | None,
        parent: int | None = None,
    ) -> None:
        if not keys:
            return
        now = self._clock()
        holders = self._holders.setdefault(model, {})
        if parent is not None and holders.get(parent, {}).get(replica, -math.inf) <= now:
            self._holed.add((model, replica))
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
        for _ in range(_EXPIRED_SWEEP):
            if not lru:
                break
            head = next(iter(lru))
            if holders.get(head, {}).get(replica, -math.inf) > now:
                break
            lru.popitem(last=False)
            self._drop(holders, head, replica)

    @staticmethod
    def _drop(holders: dict[int, dict[str, float]], key: int, replica: str) -> None:
        held = holders.get(key)
        if held is not None:
            held.pop(replica, None)
            if not held:
                del holders[key]


class NearCache:
    """A PrefixIndex in front of another: repeats of a recent lookup answered in-process.

    An answer is kept for `ttl_s` at most. Writes that go through this wrapper (the
    events a co-located EventIndexer applies, the gateway's own records) invalidate the
    cached answers of their model scope at once; writes by other processes become
    visible within ttl_s, the staleness the wrapper trades for skipping a round trip.
    Only an identical chain hits: a conversation's next turn is a new chain.
    """

    def __init__(
        self,
        index: PrefixIndex,
        *,
        ttl_s: float = 0.05,
        max_entries: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._index = index
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._clock = clock
        # (model, chain) -> (stored at, generation of the model scope, answer)
        self._entries: OrderedDict[tuple[str, tuple[int, ...]], tuple[float, int, dict[str, int]]]
        self._entries = OrderedDict()
        # A write bumps its scope's generation (clear_replica bumps all): entries from an
        # older generation are stale without having to find them.
        self._generation: dict[str, int] = {}
        self._epoch = 0
        self.hits = 0
        self.misses = 0

    def _gen(self, model: str) -> int:
        return self._epoch + self._generation.get(model, 0)

    def _invalidate(self, model: str) -> None:
        self._generation[model] = self._generation.get(model, 0) + 1

    async def lookup(
        self, model: str, keys: Sequence[int], *, deadline_s: float | None = None
    ) -> dict[str, int]:
        """Replica -> number of leading blocks held: from the cache if fresh, else the index."""
        cache_key = (model, tuple(keys))
        now = self._clock()
        entry = self._entries.get(cache_key)
        if entry is not None and now - entry[0] < self._ttl_s and entry[1] == self._gen(model):
            self.hits += 1
            return dict(entry[2])
        self.misses += 1
        gen = self._gen(model)
        answer = await self._index.lookup(model, keys, deadline_s=deadline_s)
        # A write that raced this lookup bumped the generation: do not cache its answer.
        if gen == self._gen(model):
            self._entries[cache_key] = (now, gen, dict(answer))
            self._entries.move_to_end(cache_key)
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)
        return answer

    async def add(self, model: str, replica: str, keys: Sequence[int]) -> None:
        """Forward, invalidating the scope's cached answers."""
        self._invalidate(model)
        await self._index.add(model, replica, keys)

    async def remove(self, model: str, replica: str, keys: Sequence[int]) -> None:
        """Forward, invalidating the scope's cached answers."""
        self._invalidate(model)
        await self._index.remove(model, replica, keys)

    async def record(
        self,
        model: str,
        replica: str,
        keys: Sequence[int],
        ttl_s: float,
        *,
        capacity_blocks: int | None = None,
    ) -> None:
        """Forward, invalidating the scope's cached answers."""
        self._invalidate(model)
        await self._index.record(model, replica, keys, ttl_s, capacity_blocks=capacity_blocks)

    async def clear_replica(self, replica: str) -> None:
        """Forward, invalidating every cached answer."""
        self._epoch += 1
        await self._index.clear_replica(replica)

    async def apply(self, replica: str, ops: Sequence[IndexOp]) -> None:
        """Forward, invalidating the cached answers of every scope the ops touch."""
        for op in ops:
            if op.kind == "clear":
                self._epoch += 1
            else:
                self._invalidate(op.scope)
        await self._index.apply(replica, ops)

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
        """Forward (probes are not lookups: nothing to invalidate)."""
        await self._index.put_probe(salt, replica, block_size, keys, token_ids, ttl_s,
                                    rekeyed=rekeyed)

    async def get_probe(self, salt: str) -> ObservedBlocks | None:
        """Forward."""
        return await self._index.get_probe(salt)

    async def close(self) -> None:
        """Close the wrapped index."""
        self._entries.clear()
        await self._index.close()


# Lua 5.1 prints large numbers in %.14g, which would turn a ms timestamp into "1.7e+12";
# every number written to Redis goes through fmt().
_LUA_PRELUDE = """
local function fmt(n) return string.format('%.0f', n) end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- Drop replica's entry from a block's holders. A block key whose never-expiring entry
-- goes takes the TTL of its latest remaining entry, so it cannot outlive them all.
local function drop_holder(bk, replica)
  local e = redis.call('HGET', bk, replica)
  if not e then return end
  redis.call('HDEL', bk, replica)
  if e ~= '0' then return end
  local latest = 0
  for _, v in ipairs(redis.call('HVALS', bk)) do
    if v == '0' then return end
    local n = tonumber(v)
    if n > latest then latest = n end
  end
  if latest > 0 then redis.call('PEXPIREAT', bk, fmt(latest)) end
end
-- A flag fk of a reverse index rk (NS:{M}:t:R, NS:{M}:h:R) lives exactly as long as rk
-- (gone with it, persisted with it): it stays while an entry that raised it may remain.
local function mirror_expiry(fk, rk)
  local at = redis.call('PEXPIRETIME', rk)
  if at == -2 then
    redis.call('DEL', fk)
  elseif at == -1 then
    redis.call('PERSIST', fk)
  else
    redis.call('PEXPIREAT', fk, at)
  end
end
local function raise_flag(fk, rk, raise)
  if raise then redis.call('SET', fk, '1') end
  if raise or redis.call('EXISTS', fk) == 1 then mirror_expiry(fk, rk) end
end
-- Extend a key's TTL to exp (0 = persist). A new key takes exp; an existing one only
-- grows, so one holder's short TTL never cuts another's entry short.
local function set_expiry(key, existed, exp)
  if exp == 0 then
    redis.call('PERSIST', key)
  elseif existed == 0 then
    redis.call('PEXPIREAT', key, fmt(exp))
  else
    redis.call('PEXPIREAT', key, fmt(exp), 'GT')
  end
end
"""

# KEYS: block keys of the chain, in order. Returns {replica, leading count, ...}.
# no-writes: it may run on read replicas and while Redis is out of memory.
_LOOKUP_WALK = """#!lua flags=no-writes
local call = redis.call
local t = call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- alive[1..n]: the replicas holding every block so far; counts: each one's run length.
local alive = {}
local n = 0
local counts = {}
local flat = call('HGETALL', KEYS[1])
for j = 1, #flat, 2 do
  local e = flat[j + 1]
  if e == '0' or tonumber(e) > now then
    n = n + 1
    alive[n] = flat[j]
    counts[flat[j]] = 1
  end
end
-- Past block 0 only the replicas still in the run matter: HGET / HMGET just those,
-- filtering alive in place (the walk costs one call per block, no tables).
local i = 2
local nkeys = #KEYS
while i <= nkeys and n > 0 do
  local m = 0
  if n == 1 then
    local e = call('HGET', KEYS[i], alive[1])
    if e and (e == '0' or tonumber(e) > now) then
      m = 1
      counts[alive[1]] = i
    end
  else
    local vals = call('HMGET', KEYS[i], unpack(alive, 1, n))
    for j = 1, n do
      local e = vals[j]
      if e and (e == '0' or tonumber(e) > now) then
        m = m + 1
        alive[m] = alive[j]
        counts[alive[j]] = i
      end
    end
  end
  n = m
  i = i + 1
end
local out = {}
for r, c in pairs(counts) do
  out[#out + 1] = r
  out[#out + 1] = c
end
return out
"""

# KEYS: [1] block 0's key (it names the scope's slot; the other blocks' keys are built
# from ARGV, in the same slot). ARGV: [1] the chain, 8 big-endian bytes per block,
# [2] block key prefix, [3] reverse index prefix (NS:{M}:r:), [4] TTL flag prefix
# (NS:{M}:t:), [5] hole flag prefix (NS:{M}:h:). Returns {replica, leading count, ...},
# the walk's answer (module docstring).
_LOOKUP_BISECT = """#!lua flags=no-writes
local call = redis.call
local t = call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local chain, bprefix, rprefix, tprefix, hprefix = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local n = string.len(chain) / 8
local function member(i)
  return string.sub(chain, 8 * i - 7, 8 * i)
end
local function alive(e)
  return e and (e == '0' or tonumber(e) > now)
end
local function held(r, i)
  return alive(call('HGET', bprefix .. member(i), r))
end
-- r may hold entries that expire, which can leave an expired hole anywhere: one block
-- at a time, as the walk does.
local function walk(r)
  local i = 1
  while i < n and held(r, i + 1) do i = i + 1 end
  return i
end
-- The last block r holds, were its blocks of the chain a prefix (block 1 is held):
-- block lo held, block hi not (invariant), so O(log n) probes.
local function bisect(r)
  if held(r, n) then return n end
  local lo, hi = 1, n
  while hi - lo > 1 do
    local mid = math.floor((lo + hi) / 2)
    if held(r, mid) then lo = mid else hi = mid end
  end
  return lo
end
-- The run of blocks 1..last that r's reverse index holds: cuts the bisection's answer at
-- the first hole, if the prefix property failed. One ZMSCORE per CHUNK blocks.
local function verified(r, last)
  local rk = rprefix .. r
  local i = 2
  while i <= last do
    local j = math.min(last, i + CHUNK - 1)
    local members = {}
    for k = i, j do members[k - i + 1] = member(k) end
    local scores = call('ZMSCORE', rk, unpack(members))
    for k = 1, #scores do
      if not scores[k] then return i + k - 2 end
    end
    i = j + 1
  end
  return last
end
local out = {}
local flat = call('HGETALL', KEYS[1])
for j = 1, #flat, 2 do
  local r = flat[j]
  if alive(flat[j + 1]) then
    local run = 1
    if n > 1 then
      if call('EXISTS', tprefix .. r) == 1 then
        run = walk(r)
      else
        run = bisect(r)
        -- Verify where a hole may be: the writers saw one coming (hole flag), or the
        -- run's last link is broken (a chain whose blocks are not the index's chains).
        if call('EXISTS', hprefix .. r) == 1 or (run > 2 and not held(r, run - 1)) then
          run = verified(r, run)
        end
      end
    end
    out[#out + 1] = r
    out[#out + 1] = run
  end
end
return out
""".replace("CHUNK", str(_VERIFY_CHUNK))

# KEYS: [1] reverse ZSET, [2] touch counter, [3..] block keys in chain order.
# ARGV: replica, ttl_ms (0 = never), capacity (0 = unbounded), block key prefix, TTL flag,
# hole flag, the key of the first block's parent ('' for a chain root, or unknown).
_WRITE = _LUA_PRELUDE + """
local rk, ck = KEYS[1], KEYS[2]
local replica, ttl, cap, bprefix = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local tk, hk, pk = ARGV[5], ARGV[6], ARGV[7]
-- A block whose parent the replica does not hold (its store event was lost, or came
-- before we subscribed and out of the replay) starts a run behind a hole.
local orphan = false
if pk ~= '' then
  local e = redis.call('HGET', pk, replica)
  orphan = not (e and (e == '0' or tonumber(e) > now_ms()))
end
local plen = string.len(bprefix)
local now = now_ms()
local exp = 0
if ttl > 0 then exp = now + ttl end
local n = #KEYS - 2
local r_existed = redis.call('EXISTS', rk)
local c_existed = redis.call('EXISTS', ck)
local base = redis.call('INCRBY', ck, n)
-- Tail first and block 0 last, with the highest score: trimming takes tails first, and a
-- key repeated within the chain ends up where its first occurrence puts it.
for i = #KEYS, 3, -1 do
  local bk = KEYS[i]
  local existed = redis.call('EXISTS', bk)
  redis.call('HSET', bk, replica, fmt(exp))
  set_expiry(bk, existed, exp)
  redis.call('ZADD', rk, fmt(base - (i - 3)), string.sub(bk, plen + 1))
end
set_expiry(rk, r_existed, exp)
set_expiry(ck, c_existed, exp)
if cap > 0 then
  local over = redis.call('ZCARD', rk) - cap
  if over > 0 then
    local victims = redis.call('ZPOPMIN', rk, over)
    for j = 1, #victims, 2 do
      drop_holder(bprefix .. victims[j], replica)
    end
  end
end
local head = redis.call('ZRANGE', rk, 0, SWEEP_LAST)
for _, m in ipairs(head) do
  local e = redis.call('HGET', bprefix .. m, replica)
  if e and (e == '0' or tonumber(e) > now) then break end
  redis.call('ZREM', rk, m)
  if e then redis.call('HDEL', bprefix .. m, replica) end
end
raise_flag(tk, rk, exp > 0)
raise_flag(hk, rk, orphan)
return n
""".replace("SWEEP_LAST", str(_EXPIRED_SWEEP - 1))

# KEYS: [1] reverse ZSET, [2] touch counter, [3..] block keys.
# ARGV: replica, block key prefix length, TTL flag, hole flag.
_REMOVE = _LUA_PRELUDE + """
local rk, ck, replica, plen = KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2])
for i = 3, #KEYS do
  drop_holder(KEYS[i], replica)
  redis.call('ZREM', rk, string.sub(KEYS[i], plen + 1))
end
-- Whether a removed block had held descendants (a hole) is not known here: verify.
raise_flag(ARGV[4], rk, true)
if redis.call('EXISTS', rk) == 0 then redis.call('DEL', ck, ARGV[3], ARGV[4]) end
return #KEYS - 2
"""

# KEYS: [1] reverse ZSET, [2] touch counter.
# ARGV: replica, block key prefix, chunk, TTL flag, hole flag.
# Returns how many entries are left, so the client calls again until 0.
_CLEAR = _LUA_PRELUDE + """
local rk, ck = KEYS[1], KEYS[2]
local replica, bprefix, chunk = ARGV[1], ARGV[2], tonumber(ARGV[3])
local members = redis.call('ZRANGE', rk, 0, chunk - 1)
for _, m in ipairs(members) do
  drop_holder(bprefix .. m, replica)
end
redis.call('ZREMRANGEBYRANK', rk, 0, chunk - 1)
local left = redis.call('ZCARD', rk)
if left == 0 then redis.call('DEL', ck, ARGV[4], ARGV[5]) end
return left
"""


class _ProbeRecord(msgspec.Struct, array_like=True):
    """A stored probe observation, as msgpack (decoded with every field's type checked)."""

    replica: str
    block_size: int
    keys: list[int]
    token_ids: list[int]
    rekeyed: bool


_probe_encoder = msgspec.msgpack.Encoder()
_probe_decoder = msgspec.msgpack.Decoder(_ProbeRecord)


def _key_bytes(key: int) -> bytes:
    return key.to_bytes(8, "big")


class RedisIndex:
    """The shared PrefixIndex: Redis, one round trip per lookup (see the module docstring)."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        namespace: str = "cr",
        capacity_blocks: int | None = None,
        event_ttl_s: float | None = None,
        lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S,
        op_timeout_s: float = DEFAULT_OP_TIMEOUT_S,
        lookup_strategy: LookupStrategy = "bisect",
    ) -> None:
        self._redis = client
        self._strategy = lookup_strategy
        self._ns = namespace
        self._capacity = capacity_blocks
        self._event_ttl_s = event_ttl_s
        self._lookup_timeout_s = lookup_timeout_s
        self._op_timeout_s = op_timeout_s
        # register_script: loaded once, run by EVALSHA; redis-py reloads a script on
        # NOSCRIPT (a restarted Redis has an empty script cache).
        self._walk_script = client.register_script(_LOOKUP_WALK)
        self._bisect_script = client.register_script(_LOOKUP_BISECT)
        self._write_script = client.register_script(_WRITE)
        self._remove_script = client.register_script(_REMOVE)
        self._clear_script = client.register_script(_CLEAR)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        socket_timeout_s: float = 1.0,
        connect_timeout_s: float = 0.5,
        password: str | None = None,
        **kwargs: Any,
    ) -> RedisIndex:
        """A RedisIndex on its own connection pool, with socket deadlines set."""
        # Only pass a password when given, so one inside the URL still counts.
        auth: dict[str, Any] = {} if password is None else {"password": password}
        client = aioredis.Redis.from_url(
            url,
            **auth,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            # One immediate retry: a pooled connection broken by a Redis restart fails
            # once and the retry reconnects. More retries would only outlast deadlines.
            retry=Retry(NoBackoff(), 1),
            decode_responses=False,
        )
        return cls(client, **kwargs)

    @property
    def client(self) -> aioredis.Redis:
        """The underlying redis client (for benchmarks and tests)."""
        return self._redis

    def block_prefix(self, model: str) -> bytes:
        """The prefix of model scope `model`'s block keys (NS:{M}:b:)."""
        return f"{self._ns}:{{{model}}}:b:".encode()

    def block_key(self, model: str, key: int) -> bytes:
        """The Redis key of one block's holder hash."""
        return self.block_prefix(model) + _key_bytes(key)

    def _replica_keys(self, model: str, replica: str) -> tuple[bytes, bytes]:
        tag = f"{self._ns}:{{{model}}}"
        return f"{tag}:r:{replica}".encode(), f"{tag}:c:{replica}".encode()

    def _flag_keys(self, model: str, replica: str) -> tuple[bytes, bytes]:
        # The TTL flag and the hole flag (module docstring).
        tag = f"{self._ns}:{{{model}}}"
        return f"{tag}:t:{replica}".encode(), f"{tag}:h:{replica}".encode()

    def _models_key(self, replica: str) -> bytes:
        return f"{self._ns}:rm:{replica}".encode()

    async def _call(self, coro: Awaitable[T], limit_s: float, what: str) -> T:
        try:
            return await asyncio.wait_for(coro, limit_s)
        except TimeoutError as exc:
            raise IndexUnavailable(f"redis {what} exceeded its {limit_s:.3f}s deadline") from exc
        except (RedisError, OSError) as exc:
            raise IndexUnavailable(f"redis {what} failed: {exc}") from exc

    async def lookup(
        self, model: str, keys: Sequence[int], *, deadline_s: float | None = None
    ) -> dict[str, int]:
        """Replica -> number of leading blocks of `keys` it holds (replicas with 0 omitted)."""
        if not keys:
            return {}
        prefix = self.block_prefix(model)
        deadline = self._lookup_timeout_s if deadline_s is None else deadline_s
        if self._strategy == "walk":
            block_keys = [prefix + _key_bytes(k) for k in keys]
            flat = await self._call(self._walk_script(keys=block_keys), deadline, "lookup")
        else:
            tag = f"{self._ns}:{{{model}}}"
            chain = struct.pack(f">{len(keys)}Q", *keys)
            script = self._bisect_script(
                keys=[prefix + _key_bytes(keys[0])],
                args=[chain, prefix, f"{tag}:r:".encode(), f"{tag}:t:".encode(),
                      f"{tag}:h:".encode()])
            flat = await self._call(script, deadline, "lookup")
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def add(self, model: str, replica: str, keys: Sequence[int]) -> None:
        """The replica now holds these blocks (from its KV events)."""
        await self._write(model, replica, keys, self._event_ttl_s, self._capacity)

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
        await self._write(model, replica, keys, ttl_s, cap)

    async def _write(
        self,
        model: str,
        replica: str,
        keys: Sequence[int],
        ttl_s: float | None,
        cap: int | None,
        parent: int | None = None,
    ) -> None:
        if not keys:
            return
        await self._call(
            self._pipelined(
                lambda pipe: self._queue_write(pipe, model, replica, keys, ttl_s, cap, parent)),
            self._op_timeout_s,
            "write",
        )

    def _queue_write(
        self,
        pipe: Pipeline,
        model: str,
        replica: str,
        keys: Sequence[int],
        ttl_s: float | None,
        cap: int | None,
        parent: int | None = None,
    ) -> None:
        rk, ck = self._replica_keys(model, replica)
        prefix = self.block_prefix(model)
        # The script reads ttl 0 as "never", so a finite TTL is at least 1 ms.
        ttl_ms = 0 if ttl_s is None else max(1, math.ceil(ttl_s * 1000))
        block_keys = [prefix + _key_bytes(k) for k in keys]
        models_key = self._models_key(replica)
        pipe.sadd(models_key, model)
        # The set outlives its longest-lived entry, as the other keys do.
        if ttl_ms:
            pipe.pexpire(models_key, ttl_ms, nx=True)
            pipe.pexpire(models_key, ttl_ms, gt=True)
        else:
            pipe.persist(models_key)
        pipe.evalsha(self._write_script.sha, len(block_keys) + 2, rk, ck, *block_keys,
                     replica, ttl_ms, cap or 0, prefix, *self._flag_keys(model, replica),
                     b"" if parent is None else prefix + _key_bytes(parent))

    def _queue_remove(self, pipe: Pipeline, model: str, replica: str, keys: Sequence[int]) -> None:
        rk, ck = self._replica_keys(model, replica)
        prefix = self.block_prefix(model)
        block_keys = [prefix + _key_bytes(k) for k in keys]
        pipe.evalsha(self._remove_script.sha, len(block_keys) + 2, rk, ck, *block_keys,
                     replica, len(prefix), *self._flag_keys(model, replica))

    async def _pipelined(self, build: Callable[[Pipeline], None]) -> None:
        # redis-py's pipelines would check SCRIPT EXISTS before every execute, so run
        # EVALSHA by hand and load the scripts on NOSCRIPT (a restarted Redis). Retrying
        # the whole pipeline is safe: adds and removes are idempotent.
        for attempt in range(2):
            pipe = self._redis.pipeline(transaction=False)
            build(pipe)
            try:
                await pipe.execute()
                return
            except NoScriptError:
                if attempt:
                    raise
                await self._redis.script_load(self._write_script.script)
                await self._redis.script_load(self._remove_script.script)

    async def apply(self, replica: str, ops: Sequence[IndexOp]) -> None:
        """One KV-event batch's writes for the replica, in order, in one round trip."""
        if any(op.kind == "clear" for op in ops):
            for op in ops:
                if op.kind == "add":
                    await self._write(op.scope, replica, op.keys, self._event_ttl_s,
                                      self._capacity, op.parent)
                elif op.kind == "remove":
                    await self.remove(op.scope, replica, op.keys)
                else:
                    await self.clear_replica(replica)
            return
        ops = [op for op in ops if op.keys]
        if not ops:
            return

        def build(pipe: Pipeline) -> None:
            for op in ops:
                if op.kind == "add":
                    self._queue_write(pipe, op.scope, replica, op.keys, self._event_ttl_s,
                                      self._capacity, op.parent)
                else:
                    self._queue_remove(pipe, op.scope, replica, op.keys)

        await self._call(self._pipelined(build), self._op_timeout_s, "apply")

    def _probe_key(self, salt: str) -> bytes:
        return f"{self._ns}:p:{salt}".encode()

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
        value = _probe_encoder.encode(
            _ProbeRecord(replica, block_size, list(keys), list(token_ids), rekeyed))
        await self._call(
            self._redis.set(self._probe_key(salt), value, px=max(1, math.ceil(ttl_s * 1000))),
            self._op_timeout_s,
            "put_probe",
        )

    async def get_probe(self, salt: str) -> ObservedBlocks | None:
        """The observation stored for a probe's salt, or None (not seen yet, or expired)."""
        raw = await self._call(self._redis.get(self._probe_key(salt)), self._op_timeout_s,
                               "get_probe")
        if raw is None:
            return None
        r = _probe_decoder.decode(raw if isinstance(raw, bytes) else raw.encode())
        return ObservedBlocks(r.block_size, tuple(r.keys), tuple(r.token_ids),
                              replica=r.replica, rekeyed=r.rekeyed)

    async def remove(self, model: str, replica: str, keys: Sequence[int]) -> None:
        """The replica evicted these blocks."""
        if not keys:
            return
        rk, ck = self._replica_keys(model, replica)
        prefix = self.block_prefix(model)
        await self._call(
            self._remove_script(
                keys=[rk, ck, *(prefix + _key_bytes(k) for k in keys)],
                args=[replica, len(prefix), *self._flag_keys(model, replica)],
            ),
            self._op_timeout_s,
            "remove",
        )

    async def clear_replica(self, replica: str) -> None:
        """Forget everything the replica holds, under every model scope."""
        models_key = self._models_key(replica)
        models = await self._call(
            self._redis.smembers(models_key), self._op_timeout_s, "clear_replica"
        )
        for raw in models:
            model = raw.decode() if isinstance(raw, bytes) else raw
            rk, ck = self._replica_keys(model, replica)
            prefix = self.block_prefix(model)
            left = 1
            while left:
                left = await self._call(
                    self._clear_script(keys=[rk, ck], args=[
                        replica, prefix, _CLEAR_CHUNK, *self._flag_keys(model, replica)]),
                    self._op_timeout_s,
                    "clear_replica",
                )
            await self._call(
                self._redis.srem(models_key, model), self._op_timeout_s, "clear_replica"
            )

    async def close(self) -> None:
        """Close the client and its connection pool."""
        await self._redis.aclose()


def open_index(url: str, **kwargs: Any) -> MemoryIndex | RedisIndex:
    """The index a config value names: "memory" or a redis:// URL."""
    if url == "memory":
        return MemoryIndex(**kwargs)
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisIndex.from_url(url, **kwargs)
    raise ValueError(f"index must be 'memory' or a redis:// URL, got {url!r}")
