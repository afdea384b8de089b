"""The shared PrefixIndex on Redis: every key it writes and every script it runs.

Several gateways and indexers share one index through it; the contract is the
package's (router/index/__init__.py), kept step for step by MemoryIndex too.

Key layout (NS is the namespace, "cr" by default; {M} is the model scope inside a
hash tag; K is the block's 64-bit key as 8 raw big-endian bytes; R the replica id):

    NS:{M}:b:K    HASH  R -> expiry in Unix ms (0 = never). Who holds block K.
                  Key TTL = the latest expiry among its fields (none if any field is 0).
    NS:{M}:r:R    ZSET  K -> touch order. The reverse index of replica R, least recently
                  touched first: clear_replica walks it instead of scanning the
                  keyspace, and trimming pops its head.
    NS:{M}:c:R    STRING  touch counter for the ZSET's scores (exact integers, so
                  positions within one write stay ordered, which ms timestamps would not).
    NS:{M}:t:R    STRING  TTL flag: R may hold entries here that expire (package docstring,
                  Lookup).
    NS:{M}:h:R    STRING  hole flag: R's entries here may not be prefix-closed (same).
                  Both flags live exactly as long as NS:{M}:r:R (same expiry, gone with it).
    NS:rm:R       SET   model scopes replica R has entries under (for clear_replica);
                  its TTL follows the replica's longest-lived entry.
    NS:s:R        STRING  "seq ts": replica R's stream position, the last KV-event batch
                  whose writes are in the index; kept only by a leased (fenced) indexer,
                  written last in each batch's pipeline, so a successor resumes after it.
    NS:lease      STRING  "token holder", with a PX expiry: the active indexer's lease.
    NS:fence      STRING  the fence counter: the token of the latest lease granted. A
                  fenced write checks it first and refuses if it moved on (lease.py).
    NS:p:S        STRING  a hash-handshake probe's observation, by its cache salt S
                  (msgpack [replica, block_size, keys, token_ids, rekeyed], probes.py);
                  short TTL (`put_probe`'s ttl_s): the gateway that sent the probe reads it.

Scripts (the .lua files in this package, each headed by its KEYS and ARGV): lookups
are lookup_bisect.lua or lookup_walk.lua; writes are write.lua (add, record), remove.lua,
clear.lua (a chunk of clear_replica) and position.lua, each prefixed with prelude.lua's
helpers (and its fence check); lease.lua grants and renews the indexer lease (lease.py). They
are read once, registered with redis-py (register_script: run by EVALSHA, loaded on
NOSCRIPT, as after a Redis restart) and loaded into Redis by `warm`.

`apply(replica, ops)` sends one KV-event batch in one pipelined round trip: each add is
its write script, each remove its remove script, and the writes' SADDs ride along. A
batch holding a clear (the replica reset its cache) runs its operations one by one,
since clear_replica takes several round trips.

Redis Cluster: the hash tag {M} puts every key of one model scope in one slot, so the
lookup and write scripts touch one slot, as cluster scripts must. The trade-off: one
model's whole index lives on one shard, so a cluster spreads load by model (and LoRA),
not within a model. Tagging by chain root instead would spread a model, but BlockRemoved
events name only the block, not its chain's root. NS:rm:R lives in another slot and is
written by a separate command in the same pipeline, never from a script. The write
scripts reach blocks named by the reverse index (trimming) without declaring them; they
are in the script's slot, which Redis 7 allows. (Only the layout is cluster-ready:
`RedisIndex` is built and tested on a single-node redis.asyncio.Redis client.) Fencing
is not cluster-ready: NS:fence lives in its own slot, which the write scripts read.

Fencing. An index built with `fence_token` (a leased indexer's, lease.py) runs every
write with the fence key and its token: once another indexer took the lease, each
write script refuses before writing (`IndexFenced`). It also keeps stream positions
(NS:s:R) with each batch and clears them with the replica.

Every Redis call has a deadline (socket timeouts, and router.deadlines.within around each
operation); a failure raises `IndexUnavailable` so the gateway can route by load alone.
"""

from __future__ import annotations

import asyncio
import math
import struct
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError, ResponseError

from router.deadlines import within
from router.index.connection import redis_client
from router.index.lease import lease_keys
from router.index.probes import ObservedBlocks, decode_observation, encode_observation
from router.index.protocol import (
    DEFAULT_WARM_CONNECTIONS,
    EXPIRED_SWEEP,
    IndexFenced,
    IndexOp,
    IndexUnavailable,
    LookupStrategy,
    StreamPosition,
)

T = TypeVar("T")

# A lookup is on every request's critical path: a slow index is worse than none.
DEFAULT_LOOKUP_TIMEOUT_S = 0.25
DEFAULT_OP_TIMEOUT_S = 2.0
# clear_replica removes this many entries per script run, so clearing a large replica
# does not hold Redis (single-threaded) for long.
_CLEAR_CHUNK = 2000


def _lua(name: str, *, prelude: bool = False) -> str:
    """A script's source from this package's .lua files (write scripts get the prelude)."""
    files = resources.files(__package__)
    body = files.joinpath(name).read_text(encoding="utf-8")
    return files.joinpath("prelude.lua").read_text(encoding="utf-8") + body if prelude else body


# Read once, when the module is imported: every RedisIndex registers the same texts.
_LOOKUP_WALK = _lua("lookup_walk.lua")
_LOOKUP_BISECT = _lua("lookup_bisect.lua")
_WRITE = _lua("write.lua", prelude=True)
_REMOVE = _lua("remove.lua", prelude=True)
_CLEAR = _lua("clear.lua", prelude=True)
_POSITION = _lua("position.lua", prelude=True)


@dataclass(frozen=True)
class ReplicaSnapshot:
    """One replica's entries as the index holds them (`RedisIndex.snapshot`)."""

    position: StreamPosition  # the last KV-event batch whose writes they include
    held: Mapping[str, tuple[int, ...]]  # model scope -> keys, least recently touched first
    holed: frozenset[str]  # scopes whose entries may not be prefix-closed (hole flag)


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
        fence_token: int | None = None,
    ) -> None:
        self._redis = client
        self._fence_token = fence_token
        # The fence key and token every write script ends its ARGV with ('' when unfenced).
        self._fence: tuple[bytes, bytes] = (
            (b"", b"") if fence_token is None
            else (lease_keys(namespace)[1], str(fence_token).encode()))
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
        self._position_script = client.register_script(_POSITION)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        socket_timeout_s: float = 1.0,
        connect_timeout_s: float = 0.5,
        password: str | None = None,
        ca_file: str | None = None,
        **kwargs: Any,
    ) -> RedisIndex:
        """A RedisIndex on its own client for `url` (redis, rediss, unix, redis+sentinel)."""
        client = redis_client(url, password=password, ca_file=ca_file,
                              socket_timeout_s=socket_timeout_s,
                              connect_timeout_s=connect_timeout_s)
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
            return await within(coro, limit_s)
        except TimeoutError as exc:
            raise IndexUnavailable(f"redis {what} exceeded its {limit_s:.3f}s deadline") from exc
        except ResponseError as exc:
            if "FENCED" in str(exc):
                raise IndexFenced(f"redis {what} refused: {exc}") from exc
            raise IndexUnavailable(f"redis {what} failed: {exc}") from exc
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
                     b"" if parent is None else prefix + _key_bytes(parent), EXPIRED_SWEEP,
                     *self._fence)

    def _queue_remove(self, pipe: Pipeline, model: str, replica: str, keys: Sequence[int]) -> None:
        rk, ck = self._replica_keys(model, replica)
        prefix = self.block_prefix(model)
        block_keys = [prefix + _key_bytes(k) for k in keys]
        pipe.evalsha(self._remove_script.sha, len(block_keys) + 2, rk, ck, *block_keys,
                     replica, len(prefix), *self._flag_keys(model, replica), *self._fence)

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
                await self._redis.script_load(self._position_script.script)

    def _position_key(self, replica: str) -> bytes:
        return f"{self._ns}:s:{replica}".encode()

    def _queue_position(self, pipe: Pipeline, replica: str, position: StreamPosition | None
                        ) -> None:
        value = b"" if position is None else f"{position.seq} {position.ts!r}".encode()
        pipe.evalsha(self._position_script.sha, 1, self._position_key(replica), value,
                     *self._fence)

    async def stream_position(self, replica: str) -> StreamPosition | None:
        """The position stored with the replica's last applied batch (None: start over).

        Only a fenced index keeps positions; any other answers None.
        """
        if self._fence_token is None:
            return None
        raw = await self._call(self._redis.get(self._position_key(replica)),
                               self._op_timeout_s, "stream_position")
        if raw is None:
            return None
        seq, ts = (raw if isinstance(raw, bytes) else raw.encode()).decode().split(" ")
        return StreamPosition(int(seq), None if ts == "None" else float(ts))

    async def snapshot(self, replica: str) -> ReplicaSnapshot | None:
        """What the index holds for an event-fed replica and the stream position that
        covers it, for a mirror starting up (router/index/mirror.py); None where no
        position is stored (an indexer without a lease keeps none) or entries expire.

        The position is read first: the indexer stores it after its batch's writes, so
        the entries read after it hold at least that batch's state, perhaps some of
        later batches, which the reader then applies again from the stream (adds and
        removes are idempotent).
        """
        raw = await self._call(self._redis.get(self._position_key(replica)),
                               self._op_timeout_s, "snapshot")
        if raw is None:
            return None
        seq, ts = (raw if isinstance(raw, bytes) else raw.encode()).decode().split(" ")
        position = StreamPosition(int(seq), None if ts == "None" else float(ts))
        scopes = sorted(m.decode() if isinstance(m, bytes) else m for m in await self._call(
            self._redis.smembers(self._models_key(replica)), self._op_timeout_s, "snapshot"))
        pipe = self._redis.pipeline(transaction=False)
        for model in scopes:
            ttl_flag, hole_flag = self._flag_keys(model, replica)
            pipe.zrange(self._replica_keys(model, replica)[0], 0, -1)
            pipe.exists(ttl_flag, hole_flag)
            pipe.exists(hole_flag)
        replies = await self._call(pipe.execute(), self._op_timeout_s, "snapshot")
        held: dict[str, tuple[int, ...]] = {}
        holed: set[str] = set()
        for i, model in enumerate(scopes):
            members, flags, hole = replies[3 * i:3 * i + 3]
            if flags > hole:
                return None  # entries that expire: a mirror would keep them for good
            held[model] = tuple(int.from_bytes(m, "big") for m in members)
            if hole:
                holed.add(model)
        return ReplicaSnapshot(position, held, frozenset(holed))

    async def apply(self, replica: str, ops: Sequence[IndexOp], *,
                    position: StreamPosition | None = None) -> None:
        """One KV-event batch's writes for the replica, in order, in one round trip.

        A fenced index stores `position` last in the same pipeline: Redis runs one
        connection's commands in order, so a stored position implies the batch's writes.
        """
        keep = self._fence_token is not None and position is not None
        if any(op.kind == "clear" for op in ops):
            for op in ops:
                if op.kind == "add":
                    await self._write(op.scope, replica, op.keys, self._event_ttl_s,
                                      self._capacity, op.parent)
                elif op.kind == "remove":
                    await self.remove(op.scope, replica, op.keys)
                else:
                    await self.clear_replica(replica)
            if keep:
                await self._call(self._pipelined(
                    lambda pipe: self._queue_position(pipe, replica, position)),
                    self._op_timeout_s, "apply")
            return
        ops = [op for op in ops if op.keys]
        if not ops and not keep:
            return

        def build(pipe: Pipeline) -> None:
            for op in ops:
                if op.kind == "add":
                    self._queue_write(pipe, op.scope, replica, op.keys, self._event_ttl_s,
                                      self._capacity, op.parent)
                else:
                    self._queue_remove(pipe, op.scope, replica, op.keys)
            if keep:
                self._queue_position(pipe, replica, position)

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
        value = encode_observation(ObservedBlocks(block_size, tuple(keys), tuple(token_ids),
                                                  replica=replica, rekeyed=rekeyed))
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
        return decode_observation(raw if isinstance(raw, bytes) else raw.encode())

    async def remove(self, model: str, replica: str, keys: Sequence[int]) -> None:
        """The replica evicted these blocks."""
        if not keys:
            return
        rk, ck = self._replica_keys(model, replica)
        prefix = self.block_prefix(model)
        await self._call(
            self._remove_script(
                keys=[rk, ck, *(prefix + _key_bytes(k) for k in keys)],
                args=[replica, len(prefix), *self._flag_keys(model, replica), *self._fence],
            ),
            self._op_timeout_s,
            "remove",
        )

    async def clear_replica(self, replica: str) -> None:
        """Forget everything the replica holds, under every model scope."""
        if self._fence_token is not None:
            # Position first: a successor finding none starts over rather than resuming
            # after batches this clear removed.
            await self._call(self._pipelined(
                lambda pipe: self._queue_position(pipe, replica, None)),
                self._op_timeout_s, "clear_replica")
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
                        replica, prefix, _CLEAR_CHUNK, *self._flag_keys(model, replica),
                        *self._fence]),
                    self._op_timeout_s,
                    "clear_replica",
                )
            await self._call(
                self._redis.srem(models_key, model), self._op_timeout_s, "clear_replica"
            )

    @property
    def script_shas(self) -> tuple[str, ...]:
        """The SHA1 of every script this index runs (what `warm` loads into Redis)."""
        return tuple(s.sha for s in self._scripts())

    def _scripts(self) -> tuple[AsyncScript, ...]:
        # Only a fenced index keeps stream positions, so only it runs position.lua.
        fenced = () if self._fence_token is None else (self._position_script,)
        return (self._walk_script, self._bisect_script, self._write_script,
                self._remove_script, self._clear_script, *fenced)

    async def warm(self, connections: int = DEFAULT_WARM_CONNECTIONS) -> None:
        """Open `connections` pooled connections and load every script, before serving.

        A cold pool connects inside a request's lookup (TCP handshake, the client's
        HELLO / SELECT), and a cold script cache costs a NOSCRIPT round trip and a
        SCRIPT LOAD: enough for the first concurrent lookups to miss a few-ms deadline.
        Concurrent PINGs each take a connection of their own, so the pool ends up holding
        `connections` idle ones. Raises IndexUnavailable if Redis does not answer.
        """

        async def load_all() -> None:
            await asyncio.gather(*(self._redis.ping() for _ in range(max(1, connections))))
            pipe = self._redis.pipeline(transaction=False)
            for script in self._scripts():
                pipe.script_load(script.script)
            await pipe.execute()

        await self._call(load_all(), self._op_timeout_s, "warm")

    async def close(self) -> None:
        """Close the client and its connection pool."""
        await self._redis.aclose()
