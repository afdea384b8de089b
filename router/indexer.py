"""`python -m router indexer`: feed the shared prefix index from the replicas' KV events.

One process subscribes to every replica's KV-event stream and keeps the Redis index the
gateways read in step with what the replicas hold. Replicas come from flags

    --replica NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,model=NAME][,topic=T]

or from the gateway's config (`--config gateway.yaml`: every url replica with
kv_events set; its name, first model and kv_replay). NAME must be the replica id the
gateway uses (the config's replica name), or lookups will never match it.

Runs until SIGTERM or SIGINT, logging each stream's counters every --stats-interval.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from dataclasses import dataclass

from router.events import DEFAULT_REPLAY_TIMEOUT_S, EventIndexer, ReplicaFeed, StreamStats
from router.index import MemoryIndex, PrefixIndex, RedisIndex

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaSpec:
    """One --replica flag, before the default model is filled in."""

    name: str
    endpoint: str
    replay: str | None = None
    model: str | None = None
    topic: str = ""


def parse_replica(text: str) -> ReplicaSpec:
    """Parse NAME=tcp://HOST:PORT[,replay=URL][,model=NAME][,topic=T]."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected NAME=tcp://HOST:PORT[,replay=...][,model=...]")
    endpoint, *options = rest.split(",")
    if "://" not in endpoint:
        raise argparse.ArgumentTypeError(f"{text!r}: {endpoint!r} is not a ZMQ endpoint")
    fields: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in ("replay", "model", "topic"):
            raise argparse.ArgumentTypeError(
                f"{text!r}: unknown option {option!r}; use replay=, model= or topic=")
        fields[key] = value
    return ReplicaSpec(name, endpoint, fields.get("replay"), fields.get("model"),
                       fields.get("topic", ""))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The indexer's flags."""
    parser.add_argument("--index", help="redis://HOST:PORT/DB (or 'memory', for a dry run); "
                        "defaults to the config's index")
    parser.add_argument("--replica", action="append", default=[], type=parse_replica,
                        metavar="NAME=tcp://HOST:PORT[,replay=URL][,model=NAME]",
                        help="a replica's KV-event endpoint (repeatable)")
    parser.add_argument("--model", help="model scope for --replica flags without model=")
    parser.add_argument("--config", help="gateway config file: index and replicas from it")
    parser.add_argument("--stats-interval", type=float, default=30.0, metavar="SECONDS",
                        help="how often to log each stream's counters (default 30)")
    parser.add_argument("--replay-timeout", type=float, default=DEFAULT_REPLAY_TIMEOUT_S,
                        metavar="SECONDS", help="deadline for one replay request")
    parser.add_argument("--log-level", default="INFO")


def _feeds_from_config(path: str) -> tuple[list[ReplicaFeed], str | None, str | None]:
    """Feeds, index URL and Redis password from the gateway config."""
    from router.config import load_config  # the config stack is only needed here

    config = load_config(path, os.environ, [])
    served = sorted(config.served_models())
    feeds: list[ReplicaFeed] = []
    for replica in config.replicas:
        if replica.kv_events is None:
            continue
        if replica.url is None:
            log.warning("replica %s: KV events from DNS-discovered replicas are not "
                        "supported by the indexer yet; skipping", replica.name)
            continue
        models = list(replica.models) or served
        if not models:
            raise SystemExit(f"replica {replica.name}: no model to index its blocks under")
        feeds.append(ReplicaFeed(replica.name, replica.kv_events, models[0],
                                 replay_endpoint=replica.kv_replay))
    return feeds, config.index.backend, config.index.password


def _format_stats(replica: str, s: StreamStats) -> str:
    lag = s.lag_s()
    return (f"replica={replica} seq={s.last_seq} batches={s.batches} "
            f"events={s.events_applied} gaps={s.gaps} replays={s.replays} "
            f"replay_failures={s.replay_failures} restarts={s.restarts} "
            f"decode_errors={s.decode_errors} index_errors={s.index_errors} "
            f"lag_s={'-' if lag is None else f'{lag:.3f}'}")


def _log_stats(indexer: EventIndexer) -> None:
    for replica, stats in sorted(indexer.stats().items()):
        log.info("%s", _format_stats(replica, stats))


async def _serve(feeds: list[ReplicaFeed], index: PrefixIndex, args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    indexer = EventIndexer(index, replay_timeout_s=args.replay_timeout)
    try:
        await indexer.sync(feeds)
        log.info("indexing %d replica(s): %s", len(feeds),
                 ", ".join(f"{f.replica_id}={f.endpoint}" for f in feeds))
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), args.stats_interval)
            except TimeoutError:
                _log_stats(indexer)
        log.info("stopping")
        _log_stats(indexer)  # the final counters, whatever the interval
    finally:
        await indexer.stop()
        await index.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the indexer until SIGTERM/SIGINT."""
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    feeds: list[ReplicaFeed] = []
    index_url: str | None = None
    password: str | None = None
    if args.config:
        try:
            feeds, index_url, password = _feeds_from_config(args.config)
        except ValueError as exc:  # router.config.ConfigError names the bad key
            print(f"{args.config}: {exc}", file=sys.stderr)
            return 2
    for spec in args.replica:
        model = spec.model or args.model
        if model is None:
            print(f"--replica {spec.name}: give model= or --model", file=sys.stderr)
            return 2
        feeds.append(ReplicaFeed(spec.name, spec.endpoint, model, replay_endpoint=spec.replay,
                                 topic=spec.topic))
    index_url = args.index or index_url
    if index_url is None:
        print("no index: give --index redis://... or --config", file=sys.stderr)
        return 2
    if not feeds:
        print("no replicas with KV events: give --replica or --config", file=sys.stderr)
        return 2
    index: PrefixIndex
    if index_url == "memory":
        # Nobody else can read this process's memory: useful only to watch the streams.
        log.warning("--index memory: the entries stay in this process (a dry run)")
        index = MemoryIndex()
    elif index_url.startswith(("redis://", "rediss://", "unix://")):
        index = RedisIndex.from_url(index_url, password=password)
    else:
        print(f"--index must be a redis:// URL or 'memory', got {index_url!r}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(feeds, index, args))
