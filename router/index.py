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

A lookup is one EVALSHA of `_LOOKUP` with the chain's block keys as KEYS: the script
walks the chain, intersecting holders until none is left, so its cost is one round trip
however long the chain (a pipeline of one HGETALL per block ships every block's holders
back to the client instead; benchmarks/bench_index.py measures both).

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


class IndexUnavailable(RuntimeError):
    """The index could not answer within its deadline; route without it."""


@dataclass(frozen=True)
class IndexOp:
    """One write of a KV-event batch: add or remove `keys` under scope, or clear the replica."""

    kind: Literal["add", "remove", "clear"]
    scope: str = ""
    keys: tuple[int, ...] = ()


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
    ) -> None:
        self._capacity = capacity_blocks
        self._event_ttl_s = event_ttl_s
        self._clock = clock
        # model -> block key -> replica -> expiry (math.inf = never)
        self._holders: dict[str, dict[int, dict[str, float]]] = {}
        # (model, replica) -> block keys, least recently touched first
        self._lru: dict[tuple[str, str], OrderedDict[int, None]] = {}
        self._models: dict[str, set[str]] = {}
        # probe salt -> (expiry, observation)
        self._probes: dict[str, tuple[float, ObservedBlocks]] = {}

    async def lookup(
        self, model: str, keys: Sequence[int], *, deadline_s: float | None = None
    ) -> dict[str, int]:
        """Replica -> number of leading blocks of `keys` it holds (replicas with 0 omitted)."""
        holders = self._holders.get(model)
        counts: dict[str, int] = {}
        if not holders:
            return counts
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
            holders = self._holders.get(model, {})
            for key in self._lru.pop((model, replica), OrderedDict()):
                self._drop(holders, key, replica)

    async def apply(self, replica: str, ops: Sequence[IndexOp]) -> None:
        """One KV-event batch's writes for the replica, in order."""
        for op in ops:
            if op.kind == "add":
                await self.add(op.scope, replica, op.keys)
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
        self, model: str, replica: str, keys: Sequence[int], ttl_s: float | None, cap: int | None
    ) -> None:
        if not keys:
            return
        now = self._clock()
        expiry = math.inf if ttl_s is None else now + ttl_s
        holders = self._holders.setdefault(model, {})
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
_LOOKUP = """#!lua flags=no-writes
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

# KEYS: [1] reverse ZSET, [2] touch counter, [3..] block keys in chain order.
# ARGV: replica, ttl_ms (0 = never), capacity (0 = unbounded), block key prefix.
_WRITE = _LUA_PRELUDE + """
local rk, ck = KEYS[1], KEYS[2]
local replica, ttl, cap, bprefix = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
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
return n
""".replace("SWEEP_LAST", str(_EXPIRED_SWEEP - 1))

# KEYS: [1] reverse ZSET, [2] touch counter, [3..] block keys.
# ARGV: replica, block key prefix length.
_REMOVE = _LUA_PRELUDE + """
local rk, ck, replica, plen = KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2])
for i = 3, #KEYS do
  drop_holder(KEYS[i], replica)
  redis.call('ZREM', rk, string.sub(KEYS[i], plen + 1))
end
if redis.call('EXISTS', rk) == 0 then redis.call('DEL', ck) end
return #KEYS - 2
"""

# KEYS: [1] reverse ZSET, [2] touch counter. ARGV: replica, block key prefix, chunk.
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
if left == 0 then redis.call('DEL', ck) end
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
    ) -> None:
        self._redis = client
        self._ns = namespace
        self._capacity = capacity_blocks
        self._event_ttl_s = event_ttl_s
        self._lookup_timeout_s = lookup_timeout_s
        self._op_timeout_s = op_timeout_s
        # register_script: loaded once, run by EVALSHA; redis-py reloads a script on
        # NOSCRIPT (a restarted Redis has an empty script cache).
        self._lookup_script = client.register_script(_LOOKUP)
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
        block_keys = [prefix + _key_bytes(k) for k in keys]
        deadline = self._lookup_timeout_s if deadline_s is None else deadline_s
        flat = await self._call(self._lookup_script(keys=block_keys), deadline, "lookup")
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
    ) -> None:
        if not keys:
            return
        await self._call(
            self._pipelined(lambda pipe: self._queue_write(pipe, model, replica, keys, ttl_s, cap)),
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
                     replica, ttl_ms, cap or 0, prefix)

    def _queue_remove(self, pipe: Pipeline, model: str, replica: str, keys: Sequence[int]) -> None:
        rk, ck = self._replica_keys(model, replica)
        prefix = self.block_prefix(model)
        block_keys = [prefix + _key_bytes(k) for k in keys]
        pipe.evalsha(self._remove_script.sha, len(block_keys) + 2, rk, ck, *block_keys,
                     replica, len(prefix))

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
                    await self.add(op.scope, replica, op.keys)
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
                                      self._capacity)
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
                args=[replica, len(prefix)],
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
                    self._clear_script(keys=[rk, ck], args=[replica, prefix, _CLEAR_CHUNK]),
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
