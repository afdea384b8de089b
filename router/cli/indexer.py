"""`python -m router indexer`: feed the shared prefix index from the replicas' KV events.

One process subscribes to every replica's KV-event stream and keeps the Redis index the
gateways read in step with what the replicas hold. Replicas come from flags

    --replica NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,model=NAME][,topic=T]

or from the gateway's config (`--config gateway.yaml`: every replica with kv_events
set; its name, first model and kv_replay). Only the replicas and index sections are read
and validated: the indexer needs the hash seeds and the Redis password, never the
tenants' API keys or the salt secret. NAME must be the replica id the gateway uses
(the config's replica name), or lookups will never match it.

DNS replicas and the rekey modes (--rekey is the default for config replicas without a
`rekey` setting) are described in router/indexer.py.

Runs until SIGTERM or SIGINT, logging each stream's counters every --stats-interval.
With --health-port, GET /healthz answers 200 while the event streams run and the index
answers, 503 otherwise (router/indexer_health.py): the chart's liveness and readiness.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from router.cli.arg_types import tcp_port
from router.events import DEFAULT_REPLAY_TIMEOUT_S, ReplicaFeed, lead_while_holding
from router.index import (
    DEFAULT_LEASE_TTL_S,
    IndexerLease,
    LeaseSettings,
    MemoryIndex,
    PrefixIndex,
    RedisIndex,
)
from router.index.connection import BadIndexURL
from router.indexer import REKEY_SETTINGS, DnsReplicas, feeds_from_config, run_indexer
from router.indexer_health import IndexerHealth, serving_health

log = logging.getLogger(__name__)

REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+sentinel://", "rediss+sentinel://")


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
    parser.add_argument("--index", help="redis://HOST:PORT/DB, rediss://, unix://, "
                        "redis+sentinel://HOST:PORT,.../MASTER (or 'memory', for a dry run); "
                        "defaults to the config's index")
    parser.add_argument("--replica", action="append", default=[], type=parse_replica,
                        metavar="NAME=tcp://HOST:PORT[,replay=URL][,model=NAME]",
                        help="a replica's KV-event endpoint (repeatable)")
    parser.add_argument("--model", help="model scope for --replica flags without model=")
    parser.add_argument("--config", help="gateway config file: index and replicas from it")
    parser.add_argument("--rekey", choices=REKEY_SETTINGS, default="never",
                        help="rekey mode for config replicas without their own rekey setting "
                        "(default never; see the module docstring)")
    parser.add_argument("--stats-interval", type=float, default=30.0, metavar="SECONDS",
                        help="how often to log each stream's counters (default 30)")
    parser.add_argument("--replay-timeout", type=float, default=DEFAULT_REPLAY_TIMEOUT_S,
                        metavar="SECONDS", help="deadline for one replay request")
    parser.add_argument("--tls-ca-file", metavar="PATH",
                        help="CA bundle that verifies a rediss:// index's certificate")
    parser.add_argument("--lease", action="store_true",
                        help="active/standby: index only while holding the Redis lease "
                        "(run two or more; see router/events/leadership.py)")
    parser.add_argument("--lease-ttl", type=float, default=DEFAULT_LEASE_TTL_S,
                        metavar="SECONDS", help="how long a lease lasts unrenewed: a standby "
                        f"takes over within about this long (default {DEFAULT_LEASE_TTL_S})")
    parser.add_argument("--health-port", type=tcp_port, metavar="PORT",
                        help="serve GET /healthz on this port (200 healthy, 503 wedged)")
    parser.add_argument("--health-host", default="127.0.0.1", metavar="HOST",
                        help="address the health endpoint binds (default 127.0.0.1)")
    parser.add_argument("--log-level", default="INFO")


async def _with_health(args: argparse.Namespace, health: IndexerHealth,
                       main: Callable[[], Awaitable[object]]) -> object:
    """Run `main`, serving /healthz alongside when --health-port is given."""
    if args.health_port is None:
        return await main()
    async with serving_health(health, args.health_host, args.health_port):
        return await main()


def run(args: argparse.Namespace) -> int:
    """Run the indexer until SIGTERM/SIGINT."""
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    feeds: list[ReplicaFeed] = []
    dns: list[DnsReplicas] = []
    index_url: str | None = None
    password: str | None = None
    if args.config:
        try:
            loaded = feeds_from_config(args.config, args.rekey, os.environ)
        except ValueError as exc:  # router.config.ConfigError names the bad key
            print(f"{args.config}: {exc}", file=sys.stderr)
            return 2
        feeds, dns = loaded.static, loaded.dns
        index_url, password = loaded.index_url, loaded.password
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
    if not feeds and not dns:
        print("no replicas with KV events: give --replica or --config", file=sys.stderr)
        return 2
    index: PrefixIndex
    if index_url == "memory":
        # Nobody else can read this process's memory: useful only to watch the streams.
        log.warning("--index memory: the entries stay in this process (a dry run)")
        index = MemoryIndex()
    elif index_url.startswith(REDIS_SCHEMES):
        try:
            index = RedisIndex.from_url(index_url, password=password, ca_file=args.tls_ca_file)
        except BadIndexURL as exc:
            print(f"--index: {exc}", file=sys.stderr)
            return 2
        if args.lease:
            return asyncio.run(_run_leased(args, feeds, dns, index_url, password))
    elif args.lease:
        print("--lease needs a redis:// index", file=sys.stderr)
        return 2
    else:
        print(f"--index must be a redis:// URL or 'memory', got {index_url!r}", file=sys.stderr)
        return 2
    health = IndexerHealth(index)
    asyncio.run(_with_health(args, health, lambda: run_indexer(
        feeds, dns, index, replay_timeout_s=args.replay_timeout,
        stats_interval_s=args.stats_interval, health=health)))
    return 0


async def _run_leased(args: argparse.Namespace, feeds: list[ReplicaFeed], dns: list[DnsReplicas],
                      index_url: str, password: str | None) -> int:
    """Index while holding the lease, stand by otherwise, until SIGTERM/SIGINT."""
    settings = LeaseSettings(f"{socket.gethostname()}:{os.getpid()}", args.lease_ttl)
    lease_index = RedisIndex.from_url(index_url, password=password, ca_file=args.tls_ca_file)
    lease = IndexerLease(lease_index.client, settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signals() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

    async def lead(token: int) -> None:
        # run_indexer installs its own signal handlers while it leads, returns on them and
        # removes them: ours are back once it ends, however it ends.
        index = RedisIndex.from_url(index_url, password=password, ca_file=args.tls_ca_file,
                                    fence_token=token)
        try:
            await run_indexer(feeds, dns, index, replay_timeout_s=args.replay_timeout,
                              stats_interval_s=args.stats_interval, health=health)
            stop.set()
        finally:
            on_signals()

    on_signals()
    log.info("standing by for the indexer lease as %s (ttl %.1fs)", settings.holder,
             settings.ttl_s)
    health = IndexerHealth(lease_index)  # standing by: healthy while Redis answers
    try:
        await _with_health(args, health, lambda: lead_while_holding(lease, lead, stop))
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await lease_index.close()
    return 0
