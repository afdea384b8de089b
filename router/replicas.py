"""The fleet: which replicas exist, whether they are fit to serve, and how loaded they are.

Discovery (router.discovery): a replica entry is a static URL or a DNS name (host:port)
that stands for every address behind it; names are re-resolved periodically and
replicas appear and disappear with their addresses. A failed resolution keeps the last
known set: a DNS hiccup must not empty the fleet.

Fitness has three inputs:
- active health checks (GET /health with a deadline),
- passive outlier detection: consecutive failed attempts (connect error, 5xx, reset,
  first-token timeout) eject a replica for an exponentially growing time. A replica
  that stalls counts as failing even while its /health answers 200, because the proxy
  reports the stall. Ejection never takes the last available replica of a model: a
  fleet that is all "ejected" would fail every request instead of most.
- load, scraped from the replica's /metrics (vllm:num_requests_running / waiting /
  kv_cache_usage_perc) plus the gateway's own count of requests it has in flight there,
  which is fresh when the scrape is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field

import aiohttp

from router.config import HealthConfig
from router.discovery import (
    Discovery,
    ReplicaSource,
    ReplicaTarget,
    Resolver,
    resolve_addresses,
)
from router.handshake import run_handshake
from router.index import PrefixIndex
from router.outstanding import (
    FleetBias,
    OutstandingWork,
    ReadingCount,
    fleet_bias,
    toward_fleet,
)

# Probe token ids stay below this so any vocabulary, however small, accepts them.
_PROBE_VOCAB = 1000

log = logging.getLogger(__name__)

_MISMATCHES_TO_DOUBT = 3

_VLLM_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
}


# The Fleet's health parameters are the config's health section itself: one definition
# and one set of defaults (router/config/sections.py).
HealthSettings = HealthConfig


@dataclass
class Replica:
    """A replica's live state; mutated only by the Fleet and the proxy's reports."""

    target: ReplicaTarget
    healthy: bool = False  # until the first health check answers
    last_error: str = ""
    consecutive_failures: int = 0
    ejections: int = 0
    ejected_until: float = 0.0
    inflight: int = 0
    # Requests of ours sent there, ever: a scrape counts those begun while it was in
    # flight as ours (see Fleet._scrape_one).
    begun: int = 0
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    scraped_at: float = 0.0
    inflight_at_scrape: int = 0  # our own count when the scraped gauges were read
    # Whether the gateway may trust its index matches for this replica: it computes the
    # replica's keys from the configured settings (assumed), confirmed once the replica
    # reports exactly the predicted cached tokens; see Fleet.record_prediction.
    verified: bool = True
    verification: str = "assumed"  # assumed | handshake | rekeyed | confirmed | mismatch
    verification_detail: str = ""
    zero_hits: int = 0  # consecutive responses with nothing cached though the index said so
    mode: str = "record"  # "events" when its KV events feed the index
    removed: bool = False
    served_models: tuple[str, ...] = ()  # from its /v1/models, when not configured
    # This gateway's pending prefills and decodes there (the proxy counts them): the
    # queue cache_aware weighs, in seconds of work (router/outstanding.py).
    work: OutstandingWork = field(default_factory=OutstandingWork)

    def serves(self, model: str) -> bool:
        if self.target.models:
            return model in self.target.models
        return not self.served_models or model in self.served_models

    @property
    def replica_id(self) -> str:
        return self.target.replica_id

    @property
    def base_url(self) -> str:
        return self.target.base_url

    def outstanding(self) -> tuple[int, int]:
        """(running, waiting) now: our exact in-flight count plus other clients' share of
        the last scrape.

        The scrape counts every gateway's requests but is up to a scrape interval old; a
        burst of decisions between two scrapes would all see the same stale number (and
        avoid a replica that has since drained). What the scrape saw beyond our own
        in-flight requests at that moment is other clients' load; ours is known exactly.
        """
        scraped = int(self.running + self.waiting)
        external = max(0, scraped - self.inflight_at_scrape)
        total = self.inflight + external
        waiting = min(int(self.waiting), total)
        return total - waiting, waiting

    def start_request(self) -> None:
        """One of our requests goes to the replica now (until end_request)."""
        self.inflight += 1
        self.begun += 1

    def end_request(self) -> None:
        self.inflight -= 1

    @contextlib.contextmanager
    def in_flight(self) -> Iterator[None]:
        """start_request ... end_request around a block."""
        self.start_request()
        try:
            yield
        finally:
            self.end_request()

    def external(self) -> tuple[int, int]:
        """(running, waiting) of other clients' requests there, at the last scrape: what
        the scrape saw beyond our own in-flight requests at that moment."""
        scraped = int(self.running + self.waiting)
        external = max(0, scraped - self.inflight_at_scrape)
        waiting = min(int(self.waiting), external)
        return external - waiting, waiting

    def ejected(self, now: float) -> bool:
        return now < self.ejected_until

    def available(self, now: float) -> bool:
        """Healthy and not ejected: eligible for new requests."""
        return self.healthy and not self.ejected(now) and not self.removed

    def describe(self, now: float, fleet: FleetBias | None = None) -> dict[str, object]:
        """The replica's state as /ready reports it, with what cache_aware weighs there:
        our queued prefill, the TTFT bias learned from its answers (its own, and drawn
        toward `fleet`'s as the policy weighs it), and the load the last scrape saw beyond
        our own requests (a replica the policy avoids says why here)."""
        own = self.work.view(now)
        work = toward_fleet(own, fleet) if fleet is not None else own
        external_running, external_waiting = self.external()
        if self.ejected(now):
            state = "ejected"
        elif self.healthy:
            state = "healthy"
        else:
            state = "unhealthy"
        return {
            "id": self.replica_id, "state": state, "verified": self.verified,
            "verification": self.verification,
            "verification_detail": self.verification_detail, "mode": self.mode,
            "models": list(self.target.models), "inflight": self.inflight,
            "running": self.running, "waiting": self.waiting, "kv_usage": self.kv_usage,
            "queued_prefill_s": round(work.wait_s, 4), "pending": work.pending,
            "decoding": work.decoding, "ttft_bias": round(own.bias, 3),
            "ttft_bias_weighed": round(work.bias, 3), "bias_samples": work.samples, "external_running": external_running,
            "external_waiting": external_waiting,
            "consecutive_failures": self.consecutive_failures, "last_error": self.last_error,
            "ejected_for_s": round(max(0.0, self.ejected_until - now), 3),
        }


def parse_prometheus_gauges(text: str, names: Iterable[str]) -> dict[str, float]:
    """Sum the samples of the named metrics in Prometheus text (labels ignored)."""
    wanted = set(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = len(line)
        for sep in ("{", " "):
            pos = line.find(sep)
            if pos != -1:
                name_end = min(name_end, pos)
        name = line[:name_end]
        if name not in wanted:
            continue
        try:
            value = float(line.rsplit(" ", 1)[-1]) if "}" not in line else float(
                line[line.rindex("}") + 1 :].split()[0])
        except (ValueError, IndexError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


@dataclass
class _Listeners:
    added: list[Callable[[Replica], None]] = field(default_factory=list)
    removed: list[Callable[[Replica], None]] = field(default_factory=list)
    ejected: list[Callable[[Replica], None]] = field(default_factory=list)
    unhealthy: list[Callable[[Replica], None]] = field(default_factory=list)
    healthy: list[Callable[[Replica], None]] = field(default_factory=list)


class Fleet:
    """The set of replicas, kept current by discovery, health checks and scrapes.

    Owns its background tasks (start/close); borrows the ClientSession it is given.
    """

    def __init__(
        self,
        sources: Iterable[ReplicaSource],
        health: HealthSettings,
        session: aiohttp.ClientSession,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        resolver: Resolver = resolve_addresses,
    ) -> None:
        self.discovery = Discovery(sources, resolver=resolver, timeout_s=health.timeout_s)
        self.health = health
        self._session = session
        self._clock = clock
        self._readings = ReadingCount()
        self._rng = rng or random.Random()
        self._replicas: dict[str, Replica] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.listeners = _Listeners()

    # -- queries -------------------------------------------------------------------

    def all(self) -> list[Replica]:
        return list(self._replicas.values())

    def get(self, replica_id: str) -> Replica | None:
        return self._replicas.get(replica_id)

    def for_model(self, model: str) -> list[Replica]:
        """Every known replica serving `model` (available or not)."""
        return [r for r in self._replicas.values() if r.serves(model)]

    def models(self) -> list[str]:
        """The union of models the fleet serves, sorted."""
        return sorted({m for r in self._replicas.values()
                       for m in (r.target.models or r.served_models)})

    def available(self, model: str | None = None) -> list[Replica]:
        now = self._clock()
        pool = self.for_model(model) if model is not None else self.all()
        return [r for r in pool if r.available(now)]

    def any_available(self) -> bool:
        return bool(self.available())

    def now(self) -> float:
        return self._clock()

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Discover, check health once (so /ready is true as soon as it can be), then poll."""
        await self.refresh_discovery()
        await self.check_health()
        await self.scrape()
        self._tasks = [
            asyncio.create_task(self._every(self.health.interval_s, self.check_health), name="health"),
            asyncio.create_task(self._every(self.health.scrape_interval_s, self.scrape), name="scrape"),
        ]
        if self.discovery.has_dns:
            self._tasks.append(asyncio.create_task(
                self._every(self.health.dns_interval_s, self.refresh_discovery), name="dns"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def _every(self, interval: float, job: Callable[[], Awaitable[None]]) -> None:
        while True:
            # Jitter so many gateways do not probe the fleet in lock-step.
            await asyncio.sleep(interval * (0.9 + 0.2 * self._rng.random()))
            try:
                await job()
            except Exception:
                log.exception("fleet background job %s failed", getattr(job, "__name__", job))

    # -- discovery -----------------------------------------------------------------

    async def refresh_discovery(self) -> None:
        """Resolve DNS sources and add/remove replicas to match."""
        wanted = {t.replica_id: t for t in await self.discovery.targets()}
        for rid, target in wanted.items():
            if rid not in self._replicas:
                replica = Replica(target=target)
                # Every replica counts its readings in the fleet's total: a replica's
                # learned bias ages by the readings it missed (router/outstanding.py).
                replica.work.fleet_readings = self._readings
                self._replicas[rid] = replica
                self._readings.replicas = len(self._replicas)
                log.info("replica %s added (from %s)", rid, target.source)
                for cb in self.listeners.added:
                    cb(replica)
        for rid in [rid for rid in self._replicas if rid not in wanted]:
            replica = self._replicas.pop(rid)
            self._readings.replicas = max(1, len(self._replicas))
            replica.removed = True
            log.info("replica %s removed (no longer resolved)", rid)
            for cb in self.listeners.removed:
                cb(replica)

    # -- active checks -------------------------------------------------------------

    async def check_health(self) -> None:
        """Probe every replica's /health concurrently, each with the health deadline."""
        replicas = self.all()
        results = await asyncio.gather(*(self._probe(r) for r in replicas))
        for replica, (ok, error) in zip(replicas, results, strict=True):
            if ok and not replica.healthy:
                log.info("replica %s healthy", replica.replica_id)
                if not replica.target.models and not replica.served_models:
                    await self._learn_models(replica)
                replica.healthy = True
                for cb in self.listeners.healthy:
                    cb(replica)
            elif not ok and replica.healthy:
                log.warning("replica %s failed its health check: %s", replica.replica_id, error)
                for cb in self.listeners.unhealthy:
                    cb(replica)
            replica.healthy = ok
            if error:
                replica.last_error = error

    async def _probe(self, replica: Replica) -> tuple[bool, str]:
        timeout = aiohttp.ClientTimeout(total=self.health.timeout_s)
        try:
            async with self._session.get(f"{replica.base_url}/health", timeout=timeout) as resp:
                await resp.read()
                if resp.status == 200:
                    return True, ""
                return False, f"/health answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return False, f"/health: {type(exc).__name__}: {exc}"

    async def _learn_models(self, replica: Replica) -> None:
        timeout = aiohttp.ClientTimeout(total=self.health.timeout_s)
        try:
            async with self._session.get(f"{replica.base_url}/v1/models", timeout=timeout) as resp:
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            log.debug("reading %s/v1/models failed: %s", replica.replica_id, exc)
            return
        if isinstance(data, dict):
            replica.served_models = tuple(
                str(m["id"]) for m in data.get("data") or () if isinstance(m, dict) and "id" in m)

    async def scrape(self) -> None:
        """Read each healthy replica's load gauges from its /metrics."""
        await asyncio.gather(*(self._scrape_one(r) for r in self.all() if r.healthy))

    async def _scrape_one(self, replica: Replica) -> None:
        timeout = aiohttp.ClientTimeout(total=self.health.timeout_s)
        # Which of our requests the gauges may include: those in flight when the scrape
        # was sent and those begun before its answer came. Our count when the answer is
        # read instead misses any that ended in between, and each would show as another
        # client's request there until the next scrape: a replica looking busy to the
        # burst that decides where sessions go.
        ours_before, begun_before = replica.inflight, replica.begun
        try:
            async with self._session.get(f"{replica.base_url}/metrics", timeout=timeout) as resp:
                if resp.status != 200:
                    self._forget_scrape(replica)
                    return
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.debug("scraping %s failed: %s", replica.replica_id, exc)
            self._forget_scrape(replica)
            return
        values = parse_prometheus_gauges(text, _VLLM_GAUGES)
        for metric, attr in _VLLM_GAUGES.items():
            if metric in values:
                setattr(replica, attr, values[metric])
        replica.scraped_at = self._clock()
        replica.inflight_at_scrape = ours_before + (replica.begun - begun_before)

    @staticmethod
    def _forget_scrape(replica: Replica) -> None:
        """A replica that stopped answering scrapes keeps no scraped load: the last
        numbers would otherwise stand for ever (a replica paused while busy would look
        busy, and be avoided, long after it is resumed and idle). Our own in-flight count
        is still exact."""
        replica.running = replica.waiting = 0.0
        replica.inflight_at_scrape = replica.inflight

    # -- passive outlier detection -------------------------------------------------

    def report_success(self, replica: Replica) -> None:
        """An attempt got its first token: the failure streak ends."""
        replica.consecutive_failures = 0

    def report_failure(self, replica: Replica, reason: str) -> bool:
        """An attempt failed before its first token; returns True when this ejects it."""
        replica.consecutive_failures += 1
        replica.last_error = reason
        now = self._clock()
        if replica.consecutive_failures < self.health.eject_after_failures or replica.ejected(now):
            return False
        models = replica.target.models or replica.served_models
        pool = [r for m in models for r in self.available(m)] if models else self.available()
        others = [r for r in pool if r is not replica]
        if not others:
            # Never eject the last available replica of a model: failing some requests
            # beats failing all of them.
            log.warning("replica %s is failing (%s) but is the last available one; not ejecting",
                        replica.replica_id, reason)
            return False
        backoff = min(self.health.eject_max_s,
                      self.health.eject_base_s * (2 ** replica.ejections))
        replica.ejections += 1
        replica.ejected_until = now + backoff
        replica.consecutive_failures = 0
        log.warning("replica %s ejected for %.1fs after repeated failures (last: %s)",
                    replica.replica_id, backoff, reason)
        for cb in self.listeners.ejected:
            cb(replica)
        return True

    def record_prediction(self, replica: Replica, predicted: int, actual: int) -> None:
        """Confirm or doubt that the gateway computes this replica's block keys.

        An exact non-zero match confirms it. Repeated responses with nothing cached where
        the index predicted a hit mean the keys never meet (other block size, algorithm
        or seed): matches for the replica stop being trusted until one is confirmed.
        """
        if predicted > 0 and actual == predicted:
            replica.verification = "confirmed"
            replica.verified = True
            replica.zero_hits = 0
        elif predicted > 0 and actual == 0:
            replica.zero_hits += 1
            if replica.zero_hits >= _MISMATCHES_TO_DOUBT and replica.verification != "confirmed":
                if replica.verified:
                    log.warning("replica %s reported no cached tokens for %d predicted hits: "
                                "its block keys differ from the gateway's (block_size, "
                                "hash_algo or hash_seed?)", replica.replica_id, replica.zero_hits)
                replica.verification = "mismatch"
                replica.verified = False

    def describe(self) -> list[dict[str, object]]:
        now = self._clock()
        replicas = sorted(self.all(), key=lambda r: r.replica_id)
        # The fleet the bias is drawn toward: every replica here (routing draws it toward
        # the replicas serving the request's model, the same set in a one-model fleet).
        fleet = fleet_bias(r.work.view(now) for r in replicas)
        return [r.describe(now, fleet) for r in replicas]


async def verify_keys(session: aiohttp.ClientSession, index: PrefixIndex, replica: Replica,
                      model: str, within_s: float, probe_every_s: float = 1.0) -> bool:
    """Run the hash handshake (router.handshake.run_handshake) and record its verdict.

    A replica whose keys match, or whose blocks the indexer re-keys with ours, is routed
    by prefix; any other verdict (a differing setting, no events, a failed probe) leaves
    its matches untrusted (Replica.verified False) and says why in /ready and the log.
    """
    verdict = await run_handshake(
        session, replica.base_url, model, replica.target.hash_config, index,
        timeout_s=within_s, vocab_size=_PROBE_VOCAB, probe_every_s=probe_every_s,
        sending=replica.in_flight)
    # The seed is a secret for the xxhash algorithms (knowing it lets a client craft
    # colliding block keys): this text reaches /ready and the log, so any value is cut.
    detail = redact_seed(verdict.detail, replica.target.hash_config.seed)
    replica.verified = verdict.routable_by_prefix
    replica.verification = (
        "handshake" if verdict.verified else "rekeyed" if verdict.rekeyed else "mismatch")
    replica.verification_detail = detail
    if replica.verified:
        log.info("hash handshake with %s: %s", replica.replica_id, detail)
    else:
        log.warning("hash handshake with %s failed (%s): %s; its cache matches are ignored "
                    "until it is fixed", replica.replica_id, verdict.mismatch, detail)
    return replica.verified


def redact_seed(text: str, seed: str | None) -> str:
    """`text` with the hash seed's value replaced, for anything shown or logged."""
    if not seed:
        return text
    text = text.replace(repr(seed), "<redacted>")
    # Bare occurrences as whole words only: a short seed ("0") must not eat digits of
    # other numbers in the text.
    return re.sub(rf"(?<!\w){re.escape(seed)}(?!\w)", "<redacted>", text)


