"""A Redis index read through this gateway's own mirror of the replicas' KV events.

With a Redis index a lookup is a round trip: the request's task hands its chain to
redis-py, the loop waits for the reply and resumes the task. Redis itself answers in
well under a millisecond, but on a busy gateway host each of those hand-offs waits for
the loop, and for a CPU: on 8 simulated replicas sharing two cores with the gateway the
lookup step took ~11 ms a request (median) where the in-process index took 0.44 ms
(results/mooncake-conversation-300-from6000-8sims-routercpu-seed167/README.md), and a
network hop adds its own round trip in a cluster.

So each gateway keeps what the replicas' KV events say in a MemoryIndex of its own,
fed by its own subscription to every event-publishing replica (the in-gateway indexer,
router/events/), and answers lookups from it without leaving the process. This is how
Dynamo's KV router and llm-d's indexer serve lookups too: each router instance consumes
the events and holds the tree in memory. Every gateway hears the same events, so they
agree as closely as each agrees with the separate indexer that writes Redis (both lag
the replica by one event hop).

Redis stays the index for what only gateways know: the chains they `record` for
replicas without KV events (shared, so every gateway routes a conversation's next turn
where another sent its last one). A lookup asks Redis only while such a replica serves
some model (`from_shared`); with every replica publishing events the lookup is
in-process (`in_process`), with no task, timer or deadline. Writes go to Redis as
before; handshake probes are read here first (this gateway's own streams put them in
the mirror), then from Redis.

A gateway that starts after the replicas (a rolling update, a new pod) would know only
what their replay buffers still hold (vLLM keeps the last 10,000 batches), and vLLM
announces a block once, when it is stored: a system prompt cached an hour ago would stay
unknown. So each of its streams starts from a snapshot of that replica in Redis, taken
with the position the leased indexer stored beside it (`RedisIndex.snapshot`), and
resumes the stream after that position, as a standby indexer taking over does
(`MirrorFeed`). Without a stored position (no leased indexer), or with Redis down, the
stream starts over from the replay buffer, as with `backend: memory`. A replica without
a replay endpoint cannot confirm the first batch after a resumed position (that it did
not restart meanwhile, router/events/sequence.py), so that batch clears the seed.

The price: each gateway decodes every replica's events and holds every held block
(~400 bytes a block in the MemoryIndex, per gateway worker): 1M blocks ~0.4 GB.
`index.mirror_events: false` turns the mirror off (lookups then go to Redis, fed by the
separate indexer).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from router.index.memory import MemoryIndex
from router.index.probes import ObservedBlocks
from router.index.protocol import (
    DEFAULT_WARM_CONNECTIONS,
    IndexOp,
    PrefixIndex,
    StreamPosition,
)
from router.index.redis import RedisIndex

log = logging.getLogger(__name__)


class _Delegating:
    """A PrefixIndex that passes every call to `target`; the two classes below override
    what they answer otherwise."""

    def __init__(self, target: PrefixIndex) -> None:
        self._target = target

    async def lookup(
        self, model: str, keys: Sequence[int], *, deadline_s: float | None = None
    ) -> dict[str, int]:
        """Replica -> number of leading blocks of `keys` it holds (replicas with 0 omitted)."""
        return await self._target.lookup(model, keys, deadline_s=deadline_s)

    async def add(self, model: str, replica: str, keys: Sequence[int]) -> None:
        """The replica now holds these blocks."""
        await self._target.add(model, replica, keys)

    async def remove(self, model: str, replica: str, keys: Sequence[int]) -> None:
        """The replica evicted these blocks."""
        await self._target.remove(model, replica, keys)

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
        await self._target.record(model, replica, keys, ttl_s, capacity_blocks=capacity_blocks)

    async def clear_replica(self, replica: str) -> None:
        """Forget everything the replica holds."""
        await self._target.clear_replica(replica)

    async def apply(self, replica: str, ops: Sequence[IndexOp], *,
                    position: StreamPosition | None = None) -> None:
        """One KV-event batch's writes for the replica, in order."""
        await self._target.apply(replica, ops, position=position)

    async def stream_position(self, replica: str) -> StreamPosition | None:
        """The position stored with the replica's last applied batch."""
        return await self._target.stream_position(replica)

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
        await self._target.put_probe(salt, replica, block_size, keys, token_ids, ttl_s,
                                     rekeyed=rekeyed)

    async def get_probe(self, salt: str) -> ObservedBlocks | None:
        """The observation stored for a probe's salt, or None."""
        return await self._target.get_probe(salt)

    async def warm(self, connections: int = DEFAULT_WARM_CONNECTIONS) -> None:
        """Get ready to serve."""
        await self._target.warm(connections)

    async def close(self) -> None:
        """Release connections."""
        await self._target.close()


class MirroredIndex(_Delegating):
    """The PrefixIndex of a gateway on Redis with `index.mirror_events` (see module doc):
    lookups and probes read the mirror first; every write goes to Redis."""

    def __init__(self, shared: RedisIndex, local: MemoryIndex) -> None:
        super().__init__(shared)
        self.shared = shared
        self.local = local
        # Replicas whose holdings only Redis knows (no KV events: recorded decisions).
        self._from_shared: set[str] = set()

    @property
    def in_process(self) -> bool:
        """Whether lookups need no round trip (router/routing.py lookup_matches)."""
        return not self._from_shared

    def answer_from_shared(self, replica: str, shared: bool) -> None:
        """Answer `replica` from Redis (True: it publishes no events) or from the mirror."""
        if shared:
            self._from_shared.add(replica)
        else:
            self._from_shared.discard(replica)

    async def lookup(
        self, model: str, keys: Sequence[int], *, deadline_s: float | None = None
    ) -> dict[str, int]:
        """Replica -> number of leading blocks of `keys` it holds (replicas with 0 omitted)."""
        from_shared = self._from_shared
        local = await self.local.lookup(model, keys)
        if not from_shared:
            return local
        answer = {r: n for r, n in local.items() if r not in from_shared}
        shared = await self.shared.lookup(model, keys, deadline_s=deadline_s)
        answer.update((r, n) for r, n in shared.items() if r in from_shared)
        return answer

    async def get_probe(self, salt: str) -> ObservedBlocks | None:
        """This gateway's own streams' observation of a probe, else the indexer's."""
        return await self.local.get_probe(salt) or await self.shared.get_probe(salt)

    async def close(self) -> None:
        """Release Redis connections and the mirror."""
        await self.local.close()
        await self.shared.close()


class MirrorFeed(_Delegating):
    """The index this gateway's own event streams write: the mirror (a MemoryIndex),
    which a stream starting up seeds from the replica's snapshot in Redis (module doc).

    `stream_position` is the one call a starting stream makes before applying anything
    (router/events/stream.py `_resume`); every other call goes to the mirror.
    """

    def __init__(self, local: MemoryIndex, shared: RedisIndex) -> None:
        super().__init__(local)
        self.local = local
        self.shared = shared

    async def stream_position(self, replica: str) -> StreamPosition | None:
        """Load the replica's snapshot from Redis into the mirror; the position it covers
        (None: no snapshot, the stream starts over). Raises IndexUnavailable with Redis
        down, which the stream takes as "start over" too."""
        snapshot = await self.shared.snapshot(replica)
        if snapshot is None:
            return None
        await self.local.clear_replica(replica)
        for model, keys in snapshot.held.items():
            await self.local.seed(model, replica, keys, verify=model in snapshot.holed)
        log.info("replica %s: mirror seeded from the index with %d blocks (seq %d)", replica,
                 sum(map(len, snapshot.held.values())), snapshot.position.seq)
        return snapshot.position

    async def close(self) -> None:
        """Nothing to close: MirroredIndex closes both indexes."""
