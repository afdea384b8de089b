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
- `bias` is learned: each streamed request moves it by a tenth of its remaining error,
  log(measured / predicted time to first token), over this replica's streamed requests (only those: a non-streamed
  response's first byte comes after its last token, not its first). It corrects a
  profile that is uniformly off (the gateway's default profile against a faster or
  slower GPU) without any per-fleet constant, since queue and prefill are in the same
  unit and scale together.

Pure and synchronous: the proxy calls `begin`, `first_byte` and `end`, the routing
snapshot calls `view`; `now` is always passed in (time.monotonic in the gateway).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

# How much one new streamed measurement moves the learned bias (in log space): about the
# last 10 requests count, so a replica that slows down is noticed within a few seconds of
# traffic while one odd request (a GC pause, a preemption) moves it by a tenth.
BIAS_ALPHA = 0.1
# The learned bias never leaves [1/4, 4]: beyond that the profile is wrong, not noisy,
# and the gateway should not trust either the profile or a runaway correction.
BIAS_MIN, BIAS_MAX = 0.25, 4.0
# A replica with fewer measurements than this borrows the rest of its bias from its
# fleet (see `with_prior`): a replica that has served nothing yet (new, or back from an
# ejection) would otherwise keep the 1.0 it started with while its peers learned that the
# profile is, say, 4x slow, and look 4x dearer than them for ever, never sent the
# traffic that would teach it otherwise.
BIAS_PRIOR_SAMPLES = 5


@dataclass
class _Entry:
    sent_at: float
    prefill_s: float  # predicted, unbiased
    predicted_ttft_s: float  # what the policy predicted at dispatch (bias included)
    stream: bool
    first_byte_at: float | None = None


@dataclass(frozen=True)
class WorkView:
    """A frozen reading of a replica's outstanding work for one routing decision."""

    wait_s: float = 0.0  # predicted seconds of prefill queued ahead of a new request
    pending: int = 0  # requests sent that have not produced a first byte
    decoding: int = 0  # requests past their first byte, not finished
    mean_prefill_s: float = 0.0  # recent mean predicted prefill of requests sent here
    bias: float = 1.0  # measured / predicted time to first token (learned)
    samples: int = 0  # streamed first bytes the bias learned from


@dataclass
class OutstandingWork:
    """One replica's pending prefills and decodes, sent by this gateway."""

    _entries: dict[int, _Entry] = field(default_factory=dict)
    _next: int = 0
    _anchor: float = 0.0  # last measured progress (see module docstring)
    _log_bias: float = 0.0
    _samples: int = 0
    _mean_prefill_s: float = 0.0
    # Told (with `now`) after every change: router/shared_work.py shares the new state
    # with other gateways.
    listener: Callable[[float], None] | None = None

    def _changed(self, now: float) -> None:
        if self.listener is not None:
            self.listener(now)

    def begin(self, now: float, prefill_s: float, predicted_ttft_s: float, stream: bool) -> int:
        """Count a request just sent; returns the token for `first_byte` and `end`."""
        if not self._pending(now):
            # The replica had nothing of ours queued: its work on this request starts now.
            self._anchor = now
        token = self._next
        self._next += 1
        self._entries[token] = _Entry(now, max(prefill_s, 0.0), predicted_ttft_s, stream)
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
        if entry.stream and entry.predicted_ttft_s > 0:
            measured = now - entry.sent_at
            if measured > 0:
                # The prediction already carries the current bias: move it by a share of
                # the remaining error (in log space, so 2x slow and 2x fast weigh alike).
                self._log_bias += BIAS_ALPHA * math.log(measured / entry.predicted_ttft_s)
                self._log_bias = min(max(self._log_bias, math.log(BIAS_MIN)), math.log(BIAS_MAX))
                self._samples += 1
        self._changed(now)

    def end(self, token: int, now: float) -> None:
        """The request finished, failed or was cancelled: it no longer loads the replica."""
        if self._entries.pop(token, None) is not None:
            self._changed(now)

    @property
    def bias(self) -> float:
        return math.exp(self._log_bias)

    def _pending(self, now: float | None = None) -> list[_Entry]:
        """Entries whose prefill is still ahead. A non-streamed request shows no first
        byte until its last token, so it counts as pending only for its predicted
        prefill time, then as decoding."""
        bias = self.bias
        return [e for e in self._entries.values()
                if e.first_byte_at is None
                and (e.stream or now is None or now - e.sent_at <= bias * e.prefill_s)]

    def view(self, now: float) -> WorkView:
        """The work ahead of a request sent at `now` (see the module docstring)."""
        pending = self._pending(now)
        bias = self.bias
        wait = 0.0
        if pending:
            oldest = min(e.sent_at for e in pending)
            anchor = max(self._anchor, oldest)
            wait = max(0.0, anchor + bias * sum(e.prefill_s for e in pending) - now)
        return WorkView(wait_s=wait, pending=len(pending),
                        decoding=len(self._entries) - len(pending),
                        mean_prefill_s=self._mean_prefill_s, bias=bias, samples=self._samples)

    def __len__(self) -> int:
        return len(self._entries)


def fleet_bias(views: Iterable[WorkView]) -> float:
    """The median bias of the replicas that have learned one (1.0 if none has)."""
    learned = sorted(v.bias for v in views if v.samples >= BIAS_PRIOR_SAMPLES)
    if not learned:
        return 1.0
    mid = len(learned) // 2
    return learned[mid] if len(learned) % 2 else math.sqrt(learned[mid - 1] * learned[mid])


def with_prior(view: WorkView, prior: float) -> WorkView:
    """`view` with its bias blended toward the fleet's while it has few measurements.

    Blended in log space by sample count, so the replica's own measurements take over
    as they arrive; its queue, already scaled by its own bias, is rescaled to match.
    """
    if view.samples >= BIAS_PRIOR_SAMPLES:
        return view
    own = view.samples / BIAS_PRIOR_SAMPLES
    bias = math.exp(own * math.log(view.bias) + (1 - own) * math.log(prior))
    return replace(view, bias=bias, wait_s=view.wait_s * bias / view.bias)
