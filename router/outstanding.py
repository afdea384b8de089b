"""Outstanding work on one replica, as this gateway sees it: the load cache_aware weighs.

A replica serves prefills roughly first come, first served: vLLM's scheduler gives each
step's token budget to running requests (including partly prefilled ones) before it
admits waiting ones, so a new request's first token waits for the prefill work queued
ahead of it, then its own. Counting requests (the old `load_cost_s x count`) treats a
queued 16k-token cold prefill like a 20-token cached one; the queue is seconds of work.

The model, per replica:

- Each request the gateway sends carries its predicted prefill seconds p (uncached
  tokens through the replica's profile). It is *pending* until its first byte comes back,
  then *decoding* until it ends.
- Pending work drains first come, first served from an anchor: the moment the replica
  last proved progress (a pending request's first byte) or, if later, when the oldest
  pending request was sent. Work still ahead at `now` is

      wait = max(0, anchor + bias * sum(p of pending) - now)

  Each first byte re-anchors the queue at a measured point, so a wrong prediction is
  corrected within one request instead of accumulating.
- `bias` is learned: each streamed request's measured time to first token over its
  prediction before any bias, log(measured / predicted), enters an exponential mean
  (weight a tenth: about the last 20 requests count) over this replica's streamed
  requests (only those: a non-streamed response's first byte comes after its last
  token, not its first). It corrects a profile that is uniformly off (the gateway's
  default profile against a faster or slower GPU) without any per-fleet constant, since
  queue and prefill are in the same unit and scale together. A reading is taken at the
  first byte and learned when the request ends, once the replica's usage says how much
  of the prompt it served from cache: where that is not what the prediction assumed,
  the reading is dropped (it measured the index, not the replica).
- What the policy weighs is that bias drawn toward its fleet's (`toward_fleet`): by how
  far it stands from the fleet's median beyond its own noise. A time to first token
  under load is a noisy reading of a replica's speed (the queue ahead is predicted, not
  known), and a replica whose few readings came out slow looked dearer than its peers,
  got fewer requests, so fewer readings to correct it, and stayed there: on the
  8-replica Mooncake synthetic window two identical sims learned 0.67-0.81 against their
  peers' 0.48-0.56 and served 15-16 requests each against 35-56 (2026-12-05). Its own
  bias counts in full only where it stands well beyond two standard errors of its
  estimate from the fleet's, the errors measured from every replica's readings: an
  untried replica takes the fleet's, and a replica really slower than its peers keeps
  most of the difference once its readings show it.
- Its deviation also ages while it gets no readings: for every reading it would have had
  at a fair share of the fleet's since its last (the fleet's readings since, over the
  number of replicas), it keeps 1 - BIAS_ALPHA of it, as its own exponential mean would
  keep of its history had those readings come out like the fleet's. A replica that is
  dearer for its readings gets fewer requests, so nothing would ever correct an unlucky
  start: on that window, polled each second, one sim's first reading came out 1.45x its
  prediction where the others' were 0.38-0.78x; after two readings it weighed 0.81
  against the fleet's 0.55 and got no request from 3 to 30 s, 5 of 300 in the run
  (2026-12-05). A replica really slower is tried again once its deviation has aged, and
  each new reading restores it.
Pure and synchronous: the proxy calls `begin`, `first_byte` and `end`, the routing
snapshot calls `view`; `now` is always passed in (time.monotonic in the gateway).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

# The weight of one new streamed measurement in the learned bias's exponential mean (in
# log space): about the last 20 requests count, so a replica that slows down is noticed
# within a few seconds of traffic while one odd request (a GC pause, a preemption) moves
# it by a tenth.
BIAS_ALPHA = 0.1
# The learned bias never leaves [1/4, 4] (each measurement is clamped there first):
# beyond that the profile is wrong, not noisy, and the gateway should not trust either
# the profile or a runaway correction.
BIAS_MIN, BIAS_MAX = 0.25, 4.0
# The variance of one measurement's log error before any has been seen twice on one
# replica: a spread of a factor e either way, so that the fleet's first few readings
# (each replica's first request, all at once) count for little against each other.
# Replaced by the measured spread from the second reading of any replica on.
PRIOR_LOG_VAR = 1.0


@dataclass
class _Entry:
    sent_at: float
    prefill_s: float  # predicted, unbiased
    predicted_ttft_s: float  # what the policy predicted at dispatch, before the learned bias
    stream: bool
    predicted_cached: int | None = None  # the cached tokens that prediction assumed
    first_byte_at: float | None = None
    reading: float | None = None  # log(measured / predicted), learned once confirmed


@dataclass(slots=True)  # not frozen, as router.policy.types.ReplicaState says why
class WorkView:
    """A reading of a replica's outstanding work for one routing decision (read-only)."""

    wait_s: float = 0.0  # predicted seconds of prefill queued ahead of a new request
    pending: int = 0  # requests sent that have not produced a first byte
    decoding: int = 0  # requests past their first byte, not finished
    mean_prefill_s: float = 0.0  # recent mean predicted prefill of requests sent here
    bias: float = 1.0  # measured / predicted time to first token (learned)
    samples: int = 0  # streamed first bytes the bias learned from
    # The spread of one measurement around the replica's bias: the mean squared log error
    # of each against the bias before it, and how many such errors there were.
    log_var: float = 0.0
    residuals: int = 0
    # The readings it missed: those its fleet got since this replica's last one, over
    # the replicas the fleet counts them for (its fair share of them).
    missed_readings: float = 0.0
    # What `wait_s` is made of, for joining other gateways' queues into one
    # (router/shared_work.py `joined_wait`): the pending prefills' predicted seconds
    # (bias included, none drained), seconds since this gateway's last first byte there
    # (inf: none yet), and since its oldest pending request was sent (0: none pending).
    queued_s: float = 0.0
    progress_age_s: float = math.inf
    oldest_age_s: float = 0.0


@dataclass
class ReadingCount:
    """Streamed first-byte readings over a fleet's `replicas`, shared by their
    OutstandingWork: how much evidence the fleet gathered while one replica got none."""

    n: int = 0
    replicas: int = 1


@dataclass
class OutstandingWork:
    """One replica's pending prefills and decodes, sent by this gateway."""

    _entries: dict[int, _Entry] = field(default_factory=dict)
    _next: int = 0
    _anchor: float = 0.0  # last measured progress (see module docstring)
    _last_first_byte: float = -math.inf  # the latest first byte itself (for WorkView)
    _log_bias: float = 0.0  # the exponential mean of log(measured / predicted), from 0
    _samples: int = 0
    _log_var: float = 0.0  # the exponential mean of the squared errors, from 0
    _residuals: int = 0
    _mean_prefill_s: float = 0.0
    # The fleet's readings (shared with its other replicas), and their count at this
    # replica's last reading.
    fleet_readings: ReadingCount = field(default_factory=ReadingCount)
    _fleet_at_last: int = 0
    # Told (with `now`) after every change: router/shared_work.py shares the new state
    # with other gateways, router/prefill_hold.py looks again at what it holds.
    listeners: list[Callable[[float], None]] = field(default_factory=list)

    def _changed(self, now: float) -> None:
        for listener in self.listeners:
            listener(now)

    def begin(self, now: float, prefill_s: float, predicted_ttft_s: float, stream: bool,
              predicted_cached: int | None = None) -> int:
        """Count a request just sent; returns the token for `first_byte` and `end`.
        `predicted_cached`: the prompt tokens `predicted_ttft_s` assumed the replica
        holds (None: not known)."""
        if not self._pending(now):
            # The replica had nothing of ours queued: its work on this request starts now.
            self._anchor = now
        token = self._next
        self._next += 1
        self._entries[token] = _Entry(now, max(prefill_s, 0.0), predicted_ttft_s, stream,
                                      predicted_cached)
        if self._mean_prefill_s == 0.0:
            self._mean_prefill_s = prefill_s
        else:
            self._mean_prefill_s += BIAS_ALPHA * (prefill_s - self._mean_prefill_s)
        self._changed(now)
        return token

    def first_byte(self, token: int, now: float) -> None:
        """The request's first byte came back: its prefill is done, it now decodes."""
        entry = self._entries.get(token)
        if entry is None or entry.first_byte_at is not None:
            return
        entry.first_byte_at = now
        # Its prefill finished at `now`: whatever is still pending ahead of newcomers
        # starts from here (first come, first served).
        self._anchor = now
        self._last_first_byte = now
        if entry.stream and entry.predicted_ttft_s > 0:
            measured = now - entry.sent_at
            if measured > 0:
                entry.reading = min(max(math.log(measured / entry.predicted_ttft_s),
                                        math.log(BIAS_MIN)), math.log(BIAS_MAX))
        self._changed(now)

    def end(self, token: int, now: float, cached_tokens: int | None = None) -> None:
        """The request finished, failed or was cancelled: it no longer loads the replica.

        Its first byte's reading teaches the bias now, unless the replica reported
        `cached_tokens` other than the prediction assumed: then the time measured the
        index's error, not the replica's speed. A prefix the index credited to a replica
        that had evicted it (or never announced a reset) makes a prefill 10-50x the
        predicted; taken as speed, a burst of them drove the bias to its bound and priced
        that replica, and through the fleet's bias every other, 4x dearer (a stale start
        in loadgen, 2026-12-05)."""
        entry = self._entries.pop(token, None)
        if entry is None:
            return
        if entry.reading is not None and (
                cached_tokens is None or entry.predicted_cached is None
                or cached_tokens == entry.predicted_cached):
            self._learn(entry.reading)
        self._changed(now)

    def _learn(self, x: float) -> None:
        if self._samples:
            error = x - _debiased(self._log_bias, self._samples)
            self._log_var += BIAS_ALPHA * (error * error - self._log_var)
            self._residuals += 1
        self._log_bias += BIAS_ALPHA * (x - self._log_bias)
        self._samples += 1
        self.fleet_readings.n += 1
        self._fleet_at_last = self.fleet_readings.n

    @property
    def bias(self) -> float:
        """This replica's own learned bias (1.0 before any measurement)."""
        return math.exp(_debiased(self._log_bias, self._samples))

    def _pending(self, now: float | None = None) -> list[_Entry]:
        """Entries whose prefill is still ahead (see _prefilling)."""
        bias = self.bias
        return [e for e in self._entries.values() if _prefilling(e, now, bias)]

    def ahead(self, token: int, now: float) -> int:
        """How many requests counted before `token` (begun earlier) are still prefilling
        (see _prefilling): the queue a request sent now would join the end of."""
        bias = self.bias
        return sum(1 for t, e in self._entries.items() if t < token and _prefilling(e, now, bias))

    def view(self, now: float) -> WorkView:
        """The work ahead of a request sent at `now` (see the module docstring)."""
        # Every replica's view is read for every decision: one pass, no lists (a fleet of
        # 128 replicas spent 0.4 ms a decision here; benchmarks/bench_policy.py).
        since = self.fleet_readings.n - self._fleet_at_last
        bias = self.bias
        wait = 0.0
        pending = 0
        queued = 0.0
        oldest = math.inf
        if self._entries:
            for e in self._entries.values():
                # _prefilling, inlined: a call per entry per replica per decision.
                if e.first_byte_at is None and (e.stream or now - e.sent_at <= bias * e.prefill_s):
                    pending += 1
                    queued += e.prefill_s
                    if e.sent_at < oldest:
                        oldest = e.sent_at
            if pending:
                wait = max(0.0, max(self._anchor, oldest) + bias * queued - now)
        return WorkView(wait_s=wait, pending=pending, decoding=len(self._entries) - pending,
                        mean_prefill_s=self._mean_prefill_s, bias=bias, samples=self._samples,
                        log_var=_debiased(self._log_var, self._residuals),
                        residuals=self._residuals,
                        missed_readings=since / max(1, self.fleet_readings.replicas),
                        queued_s=bias * queued, progress_age_s=now - self._last_first_byte,
                        oldest_age_s=now - oldest if pending else 0.0)

    def __len__(self) -> int:
        return len(self._entries)


def _prefilling(entry: _Entry, now: float | None, bias: float) -> bool:
    """Whether the entry's prefill is still ahead at `now` (None: whenever). A
    non-streamed request shows no first byte until its last token, so it counts as
    prefilling only for its predicted prefill time, then as decoding."""
    return entry.first_byte_at is None and (
        entry.stream or now is None or now - entry.sent_at <= bias * entry.prefill_s)


def _debiased(mean: float, n: int) -> float:
    """An exponential mean started at 0 after `n` updates, less its start's share."""
    if n <= 0:
        return 0.0
    return mean / (1.0 - (1.0 - BIAS_ALPHA) ** n)


def _estimate_variance(n: int) -> float:
    """The variance of a debiased exponential mean of `n` readings, in units of one
    reading's: 1 for one reading, falling to alpha / (2 - alpha) (about 19 readings'
    worth) as they accumulate."""
    if n <= 0:
        return math.inf
    a = BIAS_ALPHA
    return a / (2 - a) * (1 - (1 - a) ** (2 * n)) / (1 - (1 - a) ** n) ** 2


@dataclass(frozen=True)
class FleetBias:
    """What a replica's bias is drawn toward: the fleet's median learned bias, and the
    spread of one measurement around a replica's bias, pooled over the fleet."""

    log_bias: float = 0.0
    log_var: float = PRIOR_LOG_VAR

    @property
    def bias(self) -> float:
        return math.exp(self.log_bias)


def fleet_bias(views: Iterable[WorkView]) -> FleetBias:
    """The median bias of the replicas that have learned one (1.0 if none has), and the
    pooled spread of their measurements (PRIOR_LOG_VAR until some replica has two)."""
    views = list(views)
    learned = sorted(math.log(v.bias) for v in views if v.samples)
    if not learned:
        return FleetBias()
    mid = len(learned) // 2
    median = learned[mid] if len(learned) % 2 else (learned[mid - 1] + learned[mid]) / 2
    residuals = sum(v.residuals for v in views)
    if residuals == 0:
        return FleetBias(median)
    return FleetBias(median, sum(v.log_var * v.residuals for v in views) / residuals)


def toward_fleet(view: WorkView, fleet: FleetBias) -> WorkView:
    """`view` with its bias drawn toward the fleet's, by its own evidence (see the module
    docstring); its queue, already scaled by its own bias, is rescaled to match.

    The share of its own deviation d it keeps is d^2 / (d^2 + (2 se)^2), se the standard
    error of its estimate (the fleet's spread over the readings it rests on): none for
    an untried replica, half at two standard errors, 80% at four, smoothly between.
    Before that, d ages by (1 - BIAS_ALPHA) for each reading it missed at a fair share of
    the fleet's since its last.
    """
    if view.samples == 0:
        log_bias = fleet.log_bias
    else:
        d = (math.log(view.bias) - fleet.log_bias) * (1.0 - BIAS_ALPHA) ** view.missed_readings
        noise = 4.0 * fleet.log_var * _estimate_variance(view.samples)
        keep = d * d / (d * d + noise) if d * d + noise > 0 else 1.0
        log_bias = fleet.log_bias + keep * d
    bias = math.exp(log_bias)
    if bias == view.bias:
        return view
    # Built directly: dataclasses.replace costs several times a constructor, per replica
    # per decision.
    return WorkView(wait_s=view.wait_s * bias / view.bias, pending=view.pending,
                    decoding=view.decoding, mean_prefill_s=view.mean_prefill_s, bias=bias,
                    samples=view.samples, log_var=view.log_var, residuals=view.residuals,
                    missed_readings=view.missed_readings,
                    queued_s=view.queued_s * bias / view.bias,
                    progress_age_s=view.progress_age_s, oldest_age_s=view.oldest_age_s)
