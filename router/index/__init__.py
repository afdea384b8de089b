"""Which replica holds which prefix blocks: the `PrefixIndex` and its two backends.

A lookup answers, for one request's chain of block keys (the 64-bit event form, see
`router.hashing.event_key`), how many *leading* blocks each replica holds. Keys chain,
so a replica missing block i cannot hit block i+1 even if it holds it: a hole ends the
replica's run (vLLM's own lookup stops at the first miss too).

Entries come from two writers:

- `add` / `remove` / `clear_replica` / `apply`: the KV-event subscriber (router/events/),
  which mirrors what the replica says it holds. These entries do not expire unless the
  index was built with `event_ttl_s`, because vLLM announces a block once, when it
  enters the cache, and never again while requests keep hitting it. `apply(replica,
  ops)` writes one KV-event batch's operations (`IndexOp`: add / remove / clear, in
  order) as one call: RedisIndex sends it in one round trip.
- `record(model, replica, keys, ttl_s)`: the gateway, for replicas without KV events,
  records the chain it sent. Entries expire `ttl_s` after their last touch, and each
  (model scope, replica) keeps at most `capacity_blocks` entries, the least recently
  touched trimmed first, mimicking the replica's LRU free queue.

Within one write the chain's *tail* counts as touched first and block 0 last, so
trimming drops chains leaf-first, as vLLM evicts them, and held blocks stay a prefix.

"Model" is the index scope: "model", or "model@lora" for a LoRA adapter's blocks.
The capacity bound applies per (scope, replica): a replica serving several LoRA scopes
gets the bound once per scope.

Both backends behave the same (tests/router/test_index.py runs one suite against both):
`MemoryIndex` (memory.py) serves one gateway; `RedisIndex` (redis.py, which owns and
documents every Redis key, with its Lua scripts in the *.lua files beside it) lets
several gateways and indexers share one index and agree (expiry uses the Redis server's
clock, not each gateway's). Each also keeps hash-handshake probe observations
(probes.py), which no lookup sees.

Lookup. Each backend takes `lookup_strategy`: "walk" or "bisect" (the default). Both
answer, per replica holding block 0, its leading run; the walk checks every block of the
chain (in Redis: one EVALSHA of lookup_walk.lua, a call per block inside Redis, its cost
linear in the chain), the bisection probes O(log n) blocks per replica (one EVALSHA of
lookup_bisect.lua, the chain sent as one string of 8-byte keys). At 300-900 blocks
(5k-14k token prompts, block size 16) the walk's cost alone approaches or passes the
gateway's few-ms lookup deadline on a busy host; benchmarks/bench_index.py measures both.

The bisection rests on prefix closure: if a replica holds block i of a chain it holds
blocks 0..i-1 too. Keys chain (block i's key stands for its whole prefix), vLLM evicts
leaf-first and a hit touches the whole prefix (vLLM 0.32's v1/core/block_pool.py), so an index
mirroring a replica's KV events holds prefixes; so does `record`, whose writes are whole
chains from block 0 trimmed tail-first. Where it can fail, the writers leave a flag per
(scope, replica) and the lookup pays for exactness instead of trusting it:

- TTL flag: a write with a TTL (`record`, or events with `event_ttl_s`). An entry can
  expire mid-run while later ones live, so the replica is walked, one block at a time.
  MemoryIndex walks only where that can happen: with one clock and one TTL, whole
  chains recorded from block 0 expire tail first, so such a replica is bisected until
  some other write with a TTL arrives (MemoryIndex._put says which).
- Hole flag: a `remove` (a block removed while a descendant is held leaves a hole: vLLM
  never does this, but the index cannot tell), or an add whose `IndexOp.parent` the
  replica does not hold (a KV-event batch was lost or came before the subscription). The
  bisection's answer is then checked against the replica's reverse index (in Redis, one
  ZMSCORE per 1,024 blocks) and cut at the first missing block.
  MemoryIndex keeps each held block's parent instead and counts the exact holes (held
  blocks whose parent the replica does not hold): it verifies only while there is one,
  so vLLM's leaf-first evictions cost its lookups nothing. Redis keeps no parents (they
  would add to every entry's memory), so there any remove raises the flag.
- A broken last link (the run's last block held, the one before it not: keys that are
  not one chain) is checked the same way.

So the bisection gives the walk's answer whenever every add says its parent (the event
subscriber does), with or without removes, records and lost batches
(tests/router/test_index_lookup.py). The one case it does not: blocks added without a
parent (plain `add`) around a hole that no probe lands on; it then claims the run up to
the bisection's boundary, past the hole. The cost: O(R log n) probes for R replicas on
an event-fed, eviction-free index; in Redis a remove makes that replica's lookups O(run)
(a C-level ZMSCORE, a few times cheaper than the walk) until its entries are cleared, in
memory only a real hole does (benchmarks/bench_index.py (e2), (e3)); a TTL makes them a
walk.

Before serving, the gateway calls `warm(connections)`: RedisIndex opens that many
pooled connections and loads its scripts, so the first concurrent lookups do not pay
for connects and script loads inside their few-ms deadline.
"""

from router.index.lease import DEFAULT_LEASE_TTL_S, IndexerLease, LeaseSettings
from router.index.memory import MemoryIndex
from router.index.mirror import MirroredIndex, MirrorFeed
from router.index.probes import ObservedBlocks
from router.index.protocol import (
    DEFAULT_WARM_CONNECTIONS,
    EXPIRED_SWEEP,
    IndexFenced,
    IndexOp,
    IndexUnavailable,
    LookupStrategy,
    PrefixIndex,
    StreamPosition,
)
from router.index.redis import (
    DEFAULT_LOOKUP_TIMEOUT_S,
    DEFAULT_OP_TIMEOUT_S,
    RedisIndex,
    ReplicaSnapshot,
)

__all__ = [
    "DEFAULT_LEASE_TTL_S",
    "DEFAULT_LOOKUP_TIMEOUT_S",
    "DEFAULT_OP_TIMEOUT_S",
    "DEFAULT_WARM_CONNECTIONS",
    "EXPIRED_SWEEP",
    "IndexFenced",
    "IndexOp",
    "IndexUnavailable",
    "IndexerLease",
    "LeaseSettings",
    "LookupStrategy",
    "MemoryIndex",
    "MirrorFeed",
    "MirroredIndex",
    "ObservedBlocks",
    "PrefixIndex",
    "RedisIndex",
    "ReplicaSnapshot",
    "StreamPosition",
]
