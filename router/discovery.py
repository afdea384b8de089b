"""Replica discovery: which replicas a config entry stands for, their ids and endpoints.

A replica entry is a static URL or a DNS name "host:port" that stands for every address
it resolves to (a Kubernetes headless Service answers with one A or AAAA record per
ready pod). The gateway (router.replicas.Fleet) and the indexer (router.indexer) both
ask this module, so they name every replica alike and subscribe to the same endpoints:
the index holds a replica's blocks under the id the gateway looks up.

- A static replica's id is its configured name; "{host}" in its endpoints is its URL's
  host, and any other endpoint is used as written.
- A DNS replica's id is "ADDRESS:PORT" (an IPv6 address in brackets, as in a URL), and
  its kv_events / kv_replay endpoints point at that address: "{host}" in the template is
  replaced by it, or else the template's host (the service name) is. Replacing only
  "{host}" would leave "tcp://svc:5557" as it is, and every address would subscribe to
  whichever pod the name reaches, indexing one pod's blocks under every replica's id.

Names are re-resolved periodically; a failed resolution keeps the last known set, so a
DNS hiccup does not empty the fleet (or drop the indexer's streams and their entries).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from router.deadlines import within
from router.hashing import HashConfig
from router.policy.types import PrefillProfile

if TYPE_CHECKING:
    from router.config import ReplicaConfig

log = logging.getLogger(__name__)

DNS_TIMEOUT_S = 2.0

# (host, port) -> the addresses it resolves to; tests pass their own.
Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every distinct address `host` resolves to, sorted (stable replica ids)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def url_host(address: str) -> str:
    """An address as the host part of a URL or ZMQ endpoint: IPv6 in brackets."""
    return f"[{address}]" if ":" in address else address


def dns_replica_id(address: str, port: int) -> str:
    """A DNS-discovered replica's id: "ADDRESS:PORT"."""
    return f"{url_host(address)}:{port}"


def endpoint_at(template: str, address: str) -> str:
    """A ZMQ endpoint of the replica at `address`: "{host}" filled, or the host replaced.

    ValueError when the template has neither "{host}" nor a tcp://HOST:PORT form.
    """
    host = url_host(address)
    if "{host}" in template:
        return template.replace("{host}", host)
    scheme, sep, rest = template.partition("://")
    _, colon, port = rest.rpartition(":")
    if not sep or not colon or not port.isdigit():
        raise ValueError(f"{template!r}: expected tcp://HOST:PORT or {{host}} to take the "
                         "replica's address")
    return f"{scheme}://{host}:{port}"


def split_dns(dns: str) -> tuple[str, int]:
    """A DNS entry "host:port" (IPv6 literals in brackets) as (host, port)."""
    host, _, port = dns.rpartition(":")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class ReplicaTarget:
    """One replica address and what it serves; `replica_id` names it everywhere."""

    replica_id: str
    base_url: str
    models: tuple[str, ...]
    hash_config: HashConfig
    kv_events: str | None
    kv_replay: str | None
    max_concurrency: int | None
    source: str
    prefill: PrefillProfile | None = None


@dataclass(frozen=True)
class ReplicaSource:
    """One configured replica entry: a static URL or a DNS name standing for many."""

    name: str
    models: tuple[str, ...]  # empty: every model the replica reports
    hash_config: HashConfig
    url: str | None = None
    dns: str | None = None  # "host:port"; every address it resolves to is a replica
    scheme: str = "http"
    kv_events: str | None = None  # for DNS: "{host}" or the host becomes each address
    kv_replay: str | None = None
    max_concurrency: int | None = None
    prefill: PrefillProfile | None = None

    def target(self, address: str | None = None) -> ReplicaTarget:
        """The replica at one resolved address of this source (None: the static URL).

        The one place replica ids and endpoints are derived (see the module docstring).
        """
        if address is None:
            assert self.url is not None, f"replica {self.name} is a DNS entry: give an address"
            host = url_host(urlsplit(self.url).hostname or "")

            def fill(template: str | None) -> str | None:
                return template.replace("{host}", host) if template else None

            return self._target(self.name, self.url.rstrip("/"), fill(self.kv_events),
                                fill(self.kv_replay))
        assert self.dns is not None, f"replica {self.name} has a static URL"
        _, port = split_dns(self.dns)
        replica_id = dns_replica_id(address, port)
        return self._target(
            replica_id, f"{self.scheme}://{replica_id}",
            endpoint_at(self.kv_events, address) if self.kv_events else None,
            endpoint_at(self.kv_replay, address) if self.kv_replay else None)

    def _target(self, replica_id: str, base_url: str, kv_events: str | None,
                kv_replay: str | None) -> ReplicaTarget:
        return ReplicaTarget(
            replica_id=replica_id, base_url=base_url, models=self.models,
            hash_config=self.hash_config, kv_events=kv_events, kv_replay=kv_replay,
            max_concurrency=self.max_concurrency, source=self.name, prefill=self.prefill)

    def check(self) -> None:
        """Fail now (ValueError naming the entry) on what would fail at every resolution."""
        if self.dns is not None:
            for template in (self.kv_events, self.kv_replay):
                if template:
                    try:
                        endpoint_at(template, "0.0.0.0")
                    except ValueError as exc:
                        raise ValueError(f"replica {self.name}: {exc}") from None


def source_from_config(replica: ReplicaConfig) -> ReplicaSource:
    """The discovery entry for one config replica."""
    return ReplicaSource(
        name=replica.name, models=replica.models, hash_config=replica.hash,
        url=replica.url, dns=replica.dns, kv_events=replica.kv_events,
        kv_replay=replica.kv_replay, max_concurrency=replica.max_concurrency,
        prefill=replica.prefill)


class Discovery:
    """Resolves replica sources into targets, keeping the last known set on failure."""

    def __init__(self, sources: Iterable[ReplicaSource], *, resolver: Resolver = resolve_addresses,
                 timeout_s: float = DNS_TIMEOUT_S) -> None:
        self.sources: list[ReplicaSource] = list(sources)
        self._resolver = resolver
        self._timeout_s = timeout_s
        self._known: dict[str, list[str]] = {}

    @property
    def has_dns(self) -> bool:
        return any(s.dns for s in self.sources)

    async def addresses(self, source: ReplicaSource) -> list[str]:
        """What a DNS source resolves to now, or its last known set when resolution fails."""
        assert source.dns is not None
        host, port = split_dns(source.dns)
        try:
            found = await within(self._resolver(host, port), self._timeout_s)
        except (OSError, TimeoutError) as exc:
            found = self._known.get(source.name, [])
            log.warning("resolving %s failed (%s); keeping %d known addresses",
                        source.dns, exc, len(found))
        if found != self._known.get(source.name):
            log.info("replica %s: %s resolves to %s", source.name, host,
                     ", ".join(found) or "nothing")
        self._known[source.name] = found
        return found

    async def targets(self) -> list[ReplicaTarget]:
        """Every replica now: static ones, then each DNS source's addresses."""
        out: list[ReplicaTarget] = []
        for source in self.sources:
            if source.url is not None:
                out.append(source.target())
            else:
                out.extend(source.target(a) for a in await self.addresses(source))
        return out
