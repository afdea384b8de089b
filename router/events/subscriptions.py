"""The indexer's subscriptions: one ReplicaEventStream per replica, following discovery."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import zmq.asyncio

from router.events.planning import DEFAULT_MEDIA, RekeyMode
from router.events.stats import StreamStats
from router.events.stream import DEFAULT_REPLAY_TIMEOUT_S, ReplicaEventStream
from router.hashing import HashConfig
from router.index import IndexUnavailable, PrefixIndex

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaFeed:
    """Where one replica publishes its KV events, and how to index them."""

    replica_id: str
    endpoint: str
    model: str
    replay_endpoint: str | None = None
    topic: str = ""
    rekey: HashConfig | None = None
    rekey_mode: RekeyMode = "always"
    lora_paths: tuple[tuple[str, str], ...] = ()


class EventIndexer:
    """One ReplicaEventStream per replica, following discovery as replicas come and go."""

    def __init__(
        self,
        index: PrefixIndex,
        *,
        replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
        media: frozenset[str | None] = DEFAULT_MEDIA,
    ) -> None:
        self._index = index
        self._replay_timeout_s = replay_timeout_s
        self._media = media
        self._ctx = zmq.asyncio.Context()
        self._streams: dict[str, tuple[ReplicaFeed, ReplicaEventStream]] = {}

    @property
    def streams(self) -> dict[str, ReplicaEventStream]:
        """The running streams by replica id."""
        return {rid: stream for rid, (_, stream) in self._streams.items()}

    def stats(self) -> dict[str, StreamStats]:
        """Each replica's stream counters."""
        return {rid: stream.stats for rid, (_, stream) in self._streams.items()}

    def stopped_streams(self) -> list[str]:
        """Replicas whose stream task has ended (on an error): it applies no more events."""
        return [rid for rid, (_, stream) in self._streams.items() if not stream.running]

    async def add_replica(self, feed: ReplicaFeed) -> ReplicaEventStream:
        """Subscribe to a replica (replacing its stream if its feed changed)."""
        current = self._streams.get(feed.replica_id)
        if current is not None:
            if current[0] == feed:
                return current[1]
            await self.remove_replica(feed.replica_id)
        stream = ReplicaEventStream(
            feed.replica_id,
            feed.endpoint,
            feed.replay_endpoint,
            self._index,
            feed.model,
            topic=feed.topic,
            rekey=feed.rekey,
            rekey_mode=feed.rekey_mode,
            lora_paths=dict(feed.lora_paths),
            media=self._media,
            replay_timeout_s=self._replay_timeout_s,
            context=self._ctx,
        )
        stream.start()
        self._streams[feed.replica_id] = (feed, stream)
        return stream

    async def remove_replica(self, replica_id: str, *, clear: bool = True) -> None:
        """Unsubscribe from a replica and, by default, drop its entries from the index."""
        entry = self._streams.pop(replica_id, None)
        if entry is None:
            return
        await entry[1].stop()
        if clear:
            await self._index.clear_replica(replica_id)

    async def sync(self, feeds: Iterable[ReplicaFeed]) -> None:
        """Make the subscriptions match a discovery result: add new, drop gone replicas."""
        wanted = {feed.replica_id: feed for feed in feeds}
        for replica_id in [r for r in self._streams if r not in wanted]:
            try:
                await self.remove_replica(replica_id)
            except IndexUnavailable as exc:
                # The stream is gone either way; its entries stay until the index is
                # back and something clears them (a gateway's mark_stale, a restart).
                log.warning("replica %s left, but its entries could not be cleared: %s",
                            replica_id, exc)
        for feed in wanted.values():
            await self.add_replica(feed)

    async def stop(self) -> None:
        """Stop every stream (keeping the index's entries) and close the ZMQ context."""
        for replica_id in list(self._streams):
            await self.remove_replica(replica_id, clear=False)
        self._ctx.term()


async def wait_caught_up(streams: Mapping[str, ReplicaEventStream], timeout_s: float,
                         ) -> list[str]:
    """Wait until every stream has applied the replay of what its replica published
    before it subscribed (ReplicaEventStream.caught_up), at most `timeout_s`; returns the
    replicas still catching up.

    Until then the index passes through the replica's history batch by batch: a replay
    from the start of a replica's buffer (up to vLLM's 10,000 batches) shows prefixes the
    replica evicted or cleared long ago, the newest batches last. A request routed
    meanwhile follows them to a replica that holds nothing.
    """
    waits = {rid: asyncio.ensure_future(s.caught_up.wait()) for rid, s in streams.items()}
    if not waits:
        return []
    _, late = await asyncio.wait(waits.values(), timeout=timeout_s)
    for wait in late:
        wait.cancel()
    return sorted(rid for rid, wait in waits.items() if wait in late)
