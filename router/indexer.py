"""The indexer process's work: which KV-event feeds to follow, and following them.

`python -m router indexer` (router/cli/indexer.py) is its command line. The feeds come
from flags or from the gateway's config (`feeds_from_config`: every replica with
kv_events set; its name, first model and kv_replay). Of that config the indexer reads
only the replicas and index sections (CONFIG_SECTIONS). A feed's replica id must be the id
the gateway uses for that replica, or lookups will never match it.

A config replica given by `dns: HOST:PORT` stands for every address HOST resolves to:
one stream per address, its id and endpoints derived by router.discovery exactly as the
gateway derives them ("ADDRESS:PORT"; the kv_events host replaced by the address). The
name is re-resolved every dns_refresh_s; streams follow the set (a failed resolution
keeps the last known set, as the gateway does).

Rekey (router/events.py): a config replica is indexed in one of three modes, from its
`rekey` setting when the config has one, else from the command's --rekey (default never):
  never   its keys are indexed as they are (they must be the gateway's);
  always  every block is re-keyed from its token ids with the replica's configured
          block_size / hash_algo / hash_seed, the keys the gateway computes for it;
  auto    its first root block is compared with the gateway's key; re-keyed only if
          they differ (a replica started with another PYTHONHASHSEED or algorithm).
Re-keying needs the same block size; the log line for each stream says its mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.deadlines import within
from router.discovery import (
    DNS_TIMEOUT_S,
    Discovery,
    ReplicaSource,
    ReplicaTarget,
    Resolver,
    resolve_addresses,
    source_from_config,
)
from router.events import EventIndexer, RekeyMode, ReplicaFeed, StreamStats, wait_caught_up
from router.hashing import HashConfig
from router.index import PrefixIndex
from router.indexer_health import IndexerHealth

if TYPE_CHECKING:
    from router.config import ReplicaConfig

log = logging.getLogger(__name__)

REKEY_SETTINGS = ("never", "always", "auto")
# How long start-up waits before saying which replicas' replays have not been applied
# (at least twice the replay timeout: a silent replica's catch-up ends by that).
CATCH_UP_LOG_TIMEOUT_S = 10.0
# The only parts of the gateway's config the indexer reads. Everything else (tenants
# and their API keys, the salt secret, the tokenizers) is the gateway's: the indexer is
# trusted with hash seeds and the Redis password only (docs/SECURITY.md), so it must
# start without the others' secrets in its environment.
CONFIG_SECTIONS = ("replicas", "index")


@dataclass(frozen=True)
class DnsReplicas:
    """A config replica given by DNS name: one feed per address it resolves to.

    Ids and endpoints come from router.discovery, as the gateway's do.
    """

    source: ReplicaSource
    model: str
    rekey: HashConfig | None
    rekey_mode: RekeyMode
    refresh_s: float

    def feed_at(self, address: str) -> ReplicaFeed:
        """The feed of the replica at `address`."""
        return feed_for(self.source.target(address), self.model, self.rekey, self.rekey_mode)


def feed_for(target: ReplicaTarget, model: str, rekey: HashConfig | None,
             rekey_mode: RekeyMode) -> ReplicaFeed:
    """The KV-event feed of one discovered replica."""
    assert target.kv_events is not None, f"replica {target.replica_id} publishes no events"
    return ReplicaFeed(target.replica_id, target.kv_events, model,
                       replay_endpoint=target.kv_replay, rekey=rekey, rekey_mode=rekey_mode)


class DnsFollower:
    """Keeps the indexer's streams matched to fixed feeds plus what DNS names resolve to."""

    def __init__(self, indexer: EventIndexer, static: Sequence[ReplicaFeed],
                 sources: Sequence[DnsReplicas], *, resolver: Resolver = resolve_addresses,
                 timeout_s: float = DNS_TIMEOUT_S) -> None:
        self._indexer = indexer
        self._static = list(static)
        self._sources = list(sources)
        self._discovery = Discovery([s.source for s in sources], resolver=resolver,
                                    timeout_s=timeout_s)

    @property
    def interval_s(self) -> float | None:
        """How often to re-resolve (the shortest dns_refresh_s), None without DNS replicas."""
        return min((s.refresh_s for s in self._sources), default=None)

    async def feeds(self) -> list[ReplicaFeed]:
        """The fixed feeds and one per address each DNS replica resolves to now."""
        feeds = list(self._static)
        for source in self._sources:
            addresses = await self._discovery.addresses(source.source)
            feeds.extend(source.feed_at(a) for a in addresses)
        return feeds

    async def refresh(self) -> list[ReplicaFeed]:
        """Resolve every DNS replica and sync the indexer's streams; returns the feeds."""
        feeds = await self.feeds()
        await self._indexer.sync(feeds)
        return feeds

    async def run(self) -> None:
        """Re-resolve every interval_s until cancelled (returns at once without DNS)."""
        interval = self.interval_s
        if interval is None:
            return
        while True:
            await asyncio.sleep(interval)  # a refresh period, not synchronisation
            try:
                await self.refresh()
            except Exception:
                log.exception("refreshing DNS replicas failed; will retry")


def rekey_setting(replica: ReplicaConfig, default: str) -> tuple[HashConfig | None, RekeyMode]:
    """The (rekey config, mode) a config replica's stream runs with.

    Reads the replica's `rekey` setting once router.config has one, else `default`.
    """
    setting = getattr(replica, "rekey", None) or default
    if setting not in REKEY_SETTINGS:
        raise ValueError(f"replica {replica.name}: rekey must be one of "
                         f"{', '.join(REKEY_SETTINGS)}, got {setting!r}")
    if setting == "never":
        return None, "always"
    return replica.hash, "auto" if setting == "auto" else "always"


def describe_mode(feed: ReplicaFeed) -> str:
    """How a feed's blocks are keyed, for the log."""
    if feed.rekey is None:
        return "rekey never (its keys are indexed as they are)"
    c = feed.rekey
    settings = f"block_size={c.block_size} hash_algo={c.algo} hash_seed={c.seed!r}"
    if feed.rekey_mode == "auto":
        return f"rekey auto (re-keyed with {settings} if its keys differ)"
    return f"rekey always (every block re-keyed with {settings})"


@dataclass(frozen=True)
class ConfigFeeds:
    """What the indexer reads from the gateway config."""

    static: list[ReplicaFeed]
    dns: list[DnsReplicas]
    index_url: str | None
    password: str | None


def feeds_from_config(path: str, rekey_default: str = "never",
                      env: Mapping[str, str] | None = None) -> ConfigFeeds:
    """Feeds (fixed and DNS), index URL and Redis password from the gateway config.

    Reads and validates only the sections in CONFIG_SECTIONS, with `env` (default: this
    process's environment) for CACHEROUTE_* overrides and the Redis password.
    """
    from router.config import load_config  # the config stack is only needed here

    config = load_config(path, os.environ if env is None else env, [],
                         sections=CONFIG_SECTIONS)
    served = sorted(config.served_models())
    static: list[ReplicaFeed] = []
    dns: list[DnsReplicas] = []
    for replica in config.replicas:
        if replica.kv_events is None:
            continue
        models = list(replica.models) or served
        if not models:
            raise SystemExit(f"replica {replica.name}: no model to index its blocks under "
                             "(list its models: the indexer does not read the models section)")
        rekey, mode = rekey_setting(replica, rekey_default)
        source = source_from_config(replica)
        source.check()  # fail now, not at the first resolution
        if source.url is not None:
            static.append(feed_for(source.target(), models[0], rekey, mode))
        else:
            dns.append(DnsReplicas(source, models[0], rekey, mode, replica.dns_refresh_s))
    return ConfigFeeds(static, dns, config.index.backend, config.index.password)


def _format_stats(replica: str, s: StreamStats) -> str:
    lag = s.lag_s()
    return (f"replica={replica} seq={s.last_seq} batches={s.batches} "
            f"events={s.events_applied} gaps={s.gaps} replays={s.replays} "
            f"replay_failures={s.replay_failures} restarts={s.restarts} "
            f"decode_errors={s.decode_errors} index_errors={s.index_errors} "
            f"probes={s.probes} key_check={s.key_check or '-'} "
            f"rekey_misses={s.rekey_misses} rekey_unsupported={s.rekey_unsupported} "
            f"lag_s={'-' if lag is None else f'{lag:.3f}'}")


def _log_stats(indexer: EventIndexer) -> None:
    for replica, stats in sorted(indexer.stats().items()):
        log.info("%s", _format_stats(replica, stats))


async def run_indexer(feeds: list[ReplicaFeed], dns: list[DnsReplicas], index: PrefixIndex,
                      *, replay_timeout_s: float, stats_interval_s: float,
                      health: IndexerHealth | None = None) -> int:
    """Follow every feed into `index` until SIGTERM/SIGINT, logging counters as it goes;
    `health` (router/indexer_health.py) watches the streams while they run."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    indexer = EventIndexer(index, replay_timeout_s=replay_timeout_s)
    if health is not None:
        health.indexer = indexer
    follower = DnsFollower(indexer, feeds, dns)
    dns_task: asyncio.Task[None] | None = None
    try:
        current = await follower.refresh()
        log.info("indexing %d replica(s): %s", len(current),
                 ", ".join(f"{f.replica_id}={f.endpoint}" for f in current))
        for feed in current:
            log.info("replica %s: %s", feed.replica_id, describe_mode(feed))
        # Said once the index holds what the replicas published before this indexer
        # subscribed: until then it shows their histories, oldest batches first (a load
        # test starts its clients on this line; an operator reads why hits were low).
        bound = max(CATCH_UP_LOG_TIMEOUT_S, 2 * replay_timeout_s)
        late = await wait_caught_up(indexer.streams, bound)
        if late:
            log.warning("still catching up after %.0f s: %s", bound, ", ".join(late))
        else:
            log.info("caught up with %d replica(s)", len(indexer.streams))
        dns_task = asyncio.create_task(follower.run(), name="dns")
        while not stop.is_set():
            try:
                await within(stop.wait(), stats_interval_s)
            except TimeoutError:
                _log_stats(indexer)
        log.info("stopping")
        _log_stats(indexer)  # the final counters, whatever the interval
    finally:
        if dns_task is not None:
            dns_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await dns_task
        if health is not None:
            health.indexer = None
        await indexer.stop()
        await index.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return 0


