"""The gateway's Prometheus collectors (`cacheroute_*`) and the helpers that record them.

Every gateway app owns one `GatewayMetrics` with its own CollectorRegistry, so several
gateways can run in one process (tests) without sharing counters. Core code (policy,
hashing, index) never touches Prometheus: it returns plain stats and the edge records
them here.

Hit rate is exported as token counters, not as a ratio, so it can be aggregated over
replicas and windows: rate(cacheroute_cached_tokens_total) / rate(cacheroute_prompt_tokens_total).
Predicted (what the gateway expected the replica to hold) and actual (the replica's
usage.prompt_tokens_details.cached_tokens) are recorded side by side so their gap, the
index's error, is one query away.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

_M = TypeVar("_M", bound=MetricWrapperBase)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Routing runs per request, so its buckets start in the tens of microseconds.
_DECISION_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25)
_INDEX_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_GC_BUCKETS = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# Other gateways' work reaches this one in a millisecond when the hosts are quiet, tens
# of milliseconds when their cores are busy (router/shared_work.py).
_FEED_BUCKETS = (5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class _CallbackCollector(Collector):
    """Metrics computed at scrape time from a callback (fleet state, event streams)."""

    def __init__(self, produce: Callable[[], Iterable[Metric]]) -> None:
        self._produce = produce

    def collect(self) -> Iterable[Metric]:
        return list(self._produce())


@dataclass(frozen=True)
class ReplicaGauges:
    """One replica's state as the fleet knows it, for scrape-time gauges."""

    replica: str
    available: bool
    inflight: int
    verified: bool


@dataclass(frozen=True)
class StreamGauges:
    """One replica's KV-event stream counters (router.events.StreamStats), plain."""

    lag_s: float | None
    gaps: int
    restarts: int
    index_errors: int
    decode_errors: int


def fleet_families(replicas: Iterable[ReplicaGauges],
                   streams: Mapping[str, StreamGauges]) -> list[Metric]:
    """Scrape-time metric families for the fleet and its KV-event streams."""
    available = GaugeMetricFamily("cacheroute_replica_available",
                                  "1 when the replica is healthy and not ejected.",
                                  labels=["replica"])
    inflight = GaugeMetricFamily("cacheroute_replica_inflight",
                                 "Requests this gateway has in flight on the replica.",
                                 labels=["replica"])
    verified = GaugeMetricFamily("cacheroute_replica_verified",
                                 "1 while the gateway trusts its block keys for the replica.",
                                 labels=["replica"])
    for r in replicas:
        available.add_metric([r.replica], 1.0 if r.available else 0.0)
        inflight.add_metric([r.replica], r.inflight)
        verified.add_metric([r.replica], 1.0 if r.verified else 0.0)
    families: list[Metric] = [available, inflight, verified]
    if streams:
        lag = GaugeMetricFamily("cacheroute_event_lag_seconds",
                                "Age of the newest KV-event batch applied to the index.",
                                labels=["replica"])
        counters = {name: CounterMetricFamily(f"cacheroute_event_{name}", help_text,
                                              labels=["replica"])
                    for name, help_text in (
                        ("gaps", "Sequence gaps in a replica's KV-event stream."),
                        ("restarts", "Replica restarts seen in its KV-event stream."),
                        ("index_errors", "KV-event batches the index failed to apply."),
                        ("decode_errors", "KV-event payloads that failed to decode."))}
        for rid, s in streams.items():
            if s.lag_s is not None:
                lag.add_metric([rid], s.lag_s)
            counters["gaps"].add_metric([rid], s.gaps)
            counters["restarts"].add_metric([rid], s.restarts)
            counters["index_errors"].add_metric([rid], s.index_errors)
            counters["decode_errors"].add_metric([rid], s.decode_errors)
        families += [lag, *counters.values()]
    return families


@dataclass(frozen=True)
class Bounded:
    """One of the gateway's bounded in-memory structures: how full it is."""

    structure: str
    entries: int
    capacity: int | None  # None: bounded by something else (the replicas' caches, a TTL)


def bounded_families(structures: Iterable[Bounded]) -> list[Metric]:
    """Sizes of what holds the gateway's memory, so 'full' and 'leaking' can be told apart."""
    entries = GaugeMetricFamily(
        "cacheroute_bounded_entries",
        "Entries held by a bounded in-memory structure (chain_cache and pending: blocks; "
        "index: (replica, block) entries of the in-memory index; suspects: fingerprints).",
        labels=["structure"])
    capacity = GaugeMetricFamily("cacheroute_bounded_capacity",
                                 "The entry limit of a bounded in-memory structure.",
                                 labels=["structure"])
    for b in structures:
        entries.add_metric([b.structure], b.entries)
        if b.capacity is not None:
            capacity.add_metric([b.structure], b.capacity)
    return [entries, capacity]


def shared_segment_families(fetched: int, reported: int, failures: int) -> list[Metric]:
    """What sharing segment ids through Redis did (router/shared_segments.py)."""
    family = CounterMetricFamily(
        "cacheroute_shared_segments",
        "Long prompt pieces: fetched (ids read from Redis instead of encoded), reported "
        "(encoded here and counted there), failed (Redis reads or reports that failed).",
        labels=["outcome"])
    for outcome, value in (("fetched", fetched), ("reported", reported), ("failed", failures)):
        family.add_metric([outcome], value)
    return [family]


class GatewayMetrics:
    """One gateway's collectors, in its own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._children: dict[tuple[int, tuple[str, ...]], MetricWrapperBase] = {}
        self.requests = Counter(
            "cacheroute_requests_total", "Requests answered by the gateway, by endpoint and status.",
            ["endpoint", "status"], registry=r)
        self.routed = Counter(
            "cacheroute_routed_requests_total", "Requests forwarded, by the replica chosen and policy.",
            ["replica", "policy"], registry=r)
        self.prompt_tokens = Counter(
            "cacheroute_prompt_tokens_total", "Prompt tokens forwarded (gateway's count).",
            ["replica", "policy"], registry=r)
        self.predicted_cached = Counter(
            "cacheroute_predicted_cached_tokens_total", "Prompt tokens the gateway predicted cached.",
            ["replica", "policy"], registry=r)
        self.actual_prompt_tokens = Counter(
            "cacheroute_reported_prompt_tokens_total", "Prompt tokens as the replica reported them.",
            ["replica", "policy"], registry=r)
        self.actual_cached = Counter(
            "cacheroute_cached_tokens_total",
            "Prompt tokens the replica reported served from its prefix cache.",
            ["replica", "policy"], registry=r)
        self.prediction_mismatches = Counter(
            "cacheroute_prediction_mismatches_total",
            "Responses whose reported cached tokens differed from the prediction.",
            ["replica", "direction"], registry=r)
        self.decision_latency = Histogram(
            "cacheroute_routing_decision_seconds",
            "Time from parsed body to routing decision (tokenize, hash, lookup, policy).",
            ["policy"], buckets=_DECISION_BUCKETS, registry=r)
        self.tokenize_latency = Histogram(
            "cacheroute_tokenize_seconds", "Time to render, tokenize and hash one request.",
            buckets=_DECISION_BUCKETS, registry=r)
        self.index_latency = Histogram(
            "cacheroute_index_lookup_seconds", "Prefix-index lookup round trip.",
            ["backend"], buckets=_INDEX_BUCKETS, registry=r)
        self.index_errors = Counter(
            "cacheroute_index_errors_total", "Index operations that failed, by operation.",
            ["backend", "operation"], registry=r)
        self.index_fallbacks = Counter(
            "cacheroute_index_fallbacks_total",
            "Requests routed on load alone because the index missed its deadline or was down.",
            ["reason"], registry=r)
        self.index_up = Gauge(
            "cacheroute_index_up",
            "1 while the prefix index answers, 0 while it is down.",
            ["backend"], registry=r)
        self.index_transitions = Counter(
            "cacheroute_index_transitions_total",
            "Index state changes: to=down (lost) and to=up (reconnected by itself).",
            ["backend", "to"], registry=r)
        self.event_silences = Counter(
            "cacheroute_event_silences_total",
            "Replicas whose KV events stopped while they served requests; their index "
            "entries were dropped.", ["replica"], registry=r)
        self.retries = Counter(
            "cacheroute_retries_total", "Upstream attempts retried on another replica, by cause.",
            ["replica", "reason"], registry=r)
        self.retry_budget_exhausted = Counter(
            "cacheroute_retry_budget_exhausted_total",
            "Failed attempts not retried because the retry budget was spent.", registry=r)
        self.upstream_failures = Counter(
            "cacheroute_upstream_failures_total", "Upstream attempts that failed, by cause.",
            ["replica", "reason"], registry=r)
        self.ejections = Counter(
            "cacheroute_ejections_total", "Replicas ejected by outlier detection.",
            ["replica"], registry=r)
        self.hygiene = Counter(
            "cacheroute_hygiene_findings_total", "Prompt-hygiene findings, by kind.",
            ["kind"], registry=r)
        self.overloaded = Counter(
            "cacheroute_overloaded_total", "Requests refused with 429 by admission control.",
            ["tenant"], registry=r)
        self.suspects = Counter(
            "cacheroute_suspect_requests_total",
            "Requests that failed as their replica died (router/suspects.py), by replica and "
            "whether their fingerprint is now refused or only has a strike.",
            ["replica", "outcome"], registry=r)
        self.suspect_refusals = Counter(
            "cacheroute_suspect_refusals_total",
            "Requests refused because an identical one coincided with a replica dying.",
            registry=r)
        self.client_disconnects = Counter(
            "cacheroute_client_disconnects_total",
            "Requests whose client went away before the response finished.", registry=r)
        self.upstream_latency = Histogram(
            "cacheroute_time_to_first_byte_seconds",
            "Time from request arrival to the first byte sent to the client.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.gc_pauses = Histogram(
            "cacheroute_gc_pause_seconds",
            "Garbage collections while serving, by generation (2: full), and how long each "
            "held the process: every request in flight waits that long.",
            ["generation"], buckets=_GC_BUCKETS, registry=r)
        self.shared_work_delay = Histogram(
            "cacheroute_shared_work_delay_seconds",
            "From another gateway writing a change of its work on a replica to this gateway "
            "applying it (wall clocks, router/shared_work.py): decisions made within it "
            "cannot see that change; two gateways' requests then queue on one replica "
            "unseen.",
            buckets=_FEED_BUCKETS, registry=r)
        self.shared_work_claims = Counter(
            "cacheroute_shared_work_claims_total",
            "Requests whose replica was claimed in Redis before going upstream "
            "(policy.claim), by outcome: kept (no other gateway's request had gone there "
            "unseen), stayed or moved (one had: decided again, on the same replica or "
            "another), failed (Redis did not answer in time: the decision was kept).",
            ["outcome"], registry=r)

    # -- helpers: the only way the gateway writes metrics -----------------------------

    def _child(self, metric: _M, *values: str) -> _M:
        """metric.labels(*values), remembered: prometheus_client checks the values and
        takes a lock on every labels() call, some 2-3 us, nine times a routed request.
        Nothing here ever removes a child, so a remembered one stays the metric's."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child  # type: ignore[return-value]

    def record_request(self, endpoint: str, status: int) -> None:
        """Count one answered request."""
        self._child(self.requests, endpoint, str(status)).inc()

    def record_routed(self, replica: str, policy: str, prompt_tokens: int | None,
                      predicted_cached_tokens: int, decision_seconds: float) -> None:
        """Count one forwarded request and what the policy expected of it; its prompt
        tokens where known (None: a chat whose newest text is encoded once sent, counted
        then by record_routed_prompt_tokens)."""
        self._child(self.routed, replica, policy).inc()
        if prompt_tokens is not None:
            self.record_routed_prompt_tokens(replica, policy, prompt_tokens)
        self._child(self.predicted_cached, replica, policy).inc(predicted_cached_tokens)
        self._child(self.decision_latency, policy).observe(decision_seconds)

    def record_routed_prompt_tokens(self, replica: str, policy: str, prompt_tokens: int) -> None:
        self._child(self.prompt_tokens, replica, policy).inc(prompt_tokens)

    def record_actual(self, replica: str, policy: str, prompt_tokens: int,
                      cached_tokens: int, predicted_cached_tokens: int) -> None:
        """Record the replica's reported usage against the prediction."""
        self._child(self.actual_prompt_tokens, replica, policy).inc(prompt_tokens)
        self._child(self.actual_cached, replica, policy).inc(cached_tokens)
        if cached_tokens > predicted_cached_tokens:
            self._child(self.prediction_mismatches, replica, "under").inc()
        elif cached_tokens < predicted_cached_tokens:
            self._child(self.prediction_mismatches, replica, "over").inc()

    def record_tokenize(self, seconds: float) -> None:
        """Time spent rendering, tokenizing and hashing one request."""
        self.tokenize_latency.observe(seconds)

    def record_index_lookup(self, backend: str, seconds: float, ok: bool) -> None:
        """One index round trip (failed ones count as errors)."""
        self._child(self.index_latency, backend).observe(seconds)
        if not ok:
            self._child(self.index_errors, backend, "lookup").inc()

    def record_index_error(self, backend: str, operation: str) -> None:
        """An index write or other operation failed."""
        self._child(self.index_errors, backend, operation).inc()

    def record_index_state(self, backend: str, up: bool, changed: bool) -> None:
        """The index's current state, and whether it just changed (lost or regained)."""
        self._child(self.index_up, backend).set(1 if up else 0)
        if changed:
            self._child(self.index_transitions, backend, "up" if up else "down").inc()

    def record_event_silence(self, replica: str) -> None:
        """A replica's event stream went silent when events were due: entries dropped."""
        self._child(self.event_silences, replica).inc()

    def record_fallback(self, reason: str) -> None:
        """A request routed without index data (deadline, index_down)."""
        self._child(self.index_fallbacks, reason).inc()

    def record_upstream_failure(self, replica: str, reason: str) -> None:
        """An attempt failed (before or after the first byte), by cause."""
        self._child(self.upstream_failures, replica, reason).inc()

    def record_retry(self, replica: str, reason: str) -> None:
        """A failed attempt on `replica` is being retried on the next one."""
        self._child(self.retries, replica, reason).inc()

    def record_retry_budget_exhausted(self) -> None:
        """A failed attempt was not retried because the retry budget was spent."""
        self.retry_budget_exhausted.inc()

    def record_ejection(self, replica: str) -> None:
        """Outlier detection ejected a replica."""
        self._child(self.ejections, replica).inc()

    def record_hygiene(self, kinds: Iterable[str]) -> None:
        """Prompt-hygiene findings for one request."""
        for kind in kinds:
            self._child(self.hygiene, kind).inc()

    def record_overloaded(self, tenant: str) -> None:
        """A request refused by admission control."""
        self._child(self.overloaded, tenant).inc()

    def record_suspect(self, replica: str, refused: bool) -> None:
        """A request failed as `replica` died: its fingerprint is refused, or has a strike."""
        self._child(self.suspects, replica, "refused" if refused else "strike").inc()

    def record_suspect_refusal(self) -> None:
        """A request was refused because its fingerprint is a suspect's."""
        self.suspect_refusals.inc()

    def record_client_disconnect(self) -> None:
        """The client went away mid-request."""
        self.client_disconnects.inc()

    def record_gc_pause(self, generation: int, seconds: float) -> None:
        self._child(self.gc_pauses, str(generation)).observe(seconds)

    def record_shared_work_delay(self, seconds: float) -> None:
        self.shared_work_delay.observe(max(seconds, 0.0))  # clocks a hair apart

    def record_claim(self, outcome: str) -> None:
        self._child(self.shared_work_claims, outcome).inc()

    def record_first_byte(self, seconds: float) -> None:
        """Gateway-side time to first byte."""
        self.upstream_latency.observe(seconds)

    def add_scrape_callback(self, produce: Callable[[], Iterable[Metric]]) -> None:
        """Register gauges computed at scrape time (fleet state, KV-event lag per replica)."""
        self.registry.register(_CallbackCollector(produce))

    def render(self) -> bytes:
        """The exposition text for /metrics."""
        return generate_latest(self.registry)
