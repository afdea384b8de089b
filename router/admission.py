"""Admission: global and per-replica concurrency limits with a bounded FIFO queue.

A request asks for a slot on the first of its candidate replicas (the policy's ranking)
that has room, under the global limit too. With no room it waits in a bounded FIFO queue
for at most queue_timeout_s; a full queue or a timeout raises `Overloaded`, which the app
answers with 429 and Retry-After.

Invariants: a freed slot is offered to queued requests, oldest first, before release()
returns, so a newly arriving request finds free room only when no queued request can use
it (the queue is never overtaken for the same room). A slot is counted from the moment
it is granted, even before its waiter wakes. Pure asyncio: no aiohttp here.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Retry-After bounds: a client told 0 retries at once; told hours, it gives up.
_MIN_RETRY_AFTER_S = 1.0
_MAX_RETRY_AFTER_S = 60.0
# Until a slot has been held and released, assume requests take about this long.
_INITIAL_HOLD_S = 1.0
_HOLD_EWMA_ALPHA = 0.2


class Overloaded(Exception):
    """No slot within the limits: reason is "queue_full" or "queue_timeout"."""

    def __init__(self, reason: str, retry_after: float, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after

    @property
    def retry_after_header(self) -> str:
        """Retry-After as whole seconds, rounded up."""
        return str(max(1, math.ceil(self.retry_after)))


@dataclass
class Slot:
    """One admitted request on one replica; release it exactly once (release is idempotent)."""

    replica_id: str
    _admission: Admission = field(repr=False)
    _granted_at: float = 0.0
    released: bool = False

    def release(self) -> None:
        """Give the slot back and hand it to the oldest queued request that can use it."""
        if not self.released:
            self.released = True
            self._admission._release(self)

    async def __aenter__(self) -> Slot:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


@dataclass
class _Waiter:
    candidates: tuple[str, ...]
    future: asyncio.Future[Slot]


@dataclass(frozen=True)
class AdmissionStats:
    """Counters for metrics: current occupancy and how many requests were turned away."""

    inflight: int
    queued: int
    per_replica: Mapping[str, int]
    rejected_queue_full: int
    rejected_timeout: int


class Admission:
    """Concurrency limits (global and per replica) with a bounded FIFO queue."""

    def __init__(
        self,
        global_concurrency: int,
        per_replica_concurrency: int,
        queue_size: int,
        queue_timeout_s: float,
        *,
        replica_limits: Mapping[str, int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if global_concurrency < 1 or per_replica_concurrency < 1:
            raise ValueError("concurrency limits must be at least 1")
        if queue_size < 0 or queue_timeout_s < 0:
            raise ValueError("queue_size and queue_timeout_s must not be negative")
        self.global_concurrency = global_concurrency
        self.per_replica_concurrency = per_replica_concurrency
        self.queue_size = queue_size
        self.queue_timeout_s = queue_timeout_s
        self._limits = dict(replica_limits or {})
        self._clock = clock
        self._inflight = 0
        self._per_replica: dict[str, int] = {}
        self._queue: deque[_Waiter] = deque()
        self._mean_hold_s = _INITIAL_HOLD_S
        self._rejected_full = 0
        self._rejected_timeout = 0

    @classmethod
    def from_config(cls, limits: Any, replica_limits: Mapping[str, int] | None = None) -> Admission:
        """From the config's LimitsConfig; replica_limits are replicas' own max_concurrency."""
        return cls(
            limits.global_concurrency,
            limits.per_replica_concurrency,
            limits.queue_size,
            limits.queue_timeout_s,
            replica_limits=replica_limits,
        )

    def set_replica_limit(self, replica_id: str, limit: int | None) -> None:
        """Set (or with None, reset to the default) one replica's concurrency limit."""
        if limit is None:
            self._limits.pop(replica_id, None)
        else:
            self._limits[replica_id] = limit
        self._grant_waiters()

    def limit(self, replica_id: str) -> int:
        return self._limits.get(replica_id, self.per_replica_concurrency)

    def inflight(self, replica_id: str | None = None) -> int:
        """Admitted requests, on one replica or (None) in all."""
        return self._inflight if replica_id is None else self._per_replica.get(replica_id, 0)

    @property
    def queued(self) -> int:
        return sum(1 for w in self._queue if not w.future.done())

    def stats(self) -> AdmissionStats:
        return AdmissionStats(
            self._inflight,
            self.queued,
            dict(self._per_replica),
            self._rejected_full,
            self._rejected_timeout,
        )

    def try_acquire(self, candidates: Sequence[str]) -> Slot | None:
        """A slot on the first candidate with room, or None; never waits."""
        replica = self._fit(candidates)
        return None if replica is None else self._take(replica)

    async def acquire(self, candidates: Sequence[str], timeout_s: float | None = None) -> Slot:
        """A slot on the first candidate with room, waiting in the FIFO queue if none has.

        Raises Overloaded when the queue is full or no slot came within timeout_s
        (default queue_timeout_s).
        """
        if not candidates:
            raise ValueError("acquire needs at least one candidate replica")
        slot = self.try_acquire(candidates)
        if slot is not None:
            return slot
        if self.queued >= self.queue_size:
            raise self._queue_full()
        timeout = self.queue_timeout_s if timeout_s is None else timeout_s
        future: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(tuple(candidates), future)
        self._queue.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(future)
        except TimeoutError:
            if future.done() and not future.cancelled():
                return future.result()  # granted in the same instant the timer fired
            self._rejected_timeout += 1
            raise Overloaded(
                "queue_timeout",
                self.retry_after(),
                f"gateway overloaded: no slot within {timeout:g}s",
            ) from None
        except BaseException:
            # Cancelled (the client went away): a slot granted meanwhile goes to the next.
            if future.done() and not future.cancelled():
                future.result().release()
            raise
        finally:
            if not future.done():
                future.cancel()
            self._forget(waiter)

    def refuse_if_full(self, candidates: Sequence[str]) -> None:
        """Raise Overloaded now if `acquire(candidates)` would refuse at once (no room and
        a full queue). The gateway asks before it tokenizes, hashes and looks up a
        request, so an overloaded gateway spends none of that on requests it turns away;
        the ranked candidates the policy picks later are a subset of these."""
        if self._fit(candidates) is None and self.queued >= self.queue_size:
            raise self._queue_full()

    def _queue_full(self) -> Overloaded:
        self._rejected_full += 1
        return Overloaded("queue_full", self.retry_after(),
                          f"gateway overloaded: {self.queued} requests already queued")

    def retry_after(self) -> float:
        """Seconds until a slot is likely: the queue ahead drained at the measured hold time."""
        estimate = (self.queued + 1) * self._mean_hold_s / self.global_concurrency
        return min(max(estimate, _MIN_RETRY_AFTER_S), _MAX_RETRY_AFTER_S)

    # ------------------------------------------------------------------------ internals

    def _fit(self, candidates: Sequence[str]) -> str | None:
        if self._inflight >= self.global_concurrency:
            return None
        for replica in candidates:
            if self._per_replica.get(replica, 0) < self.limit(replica):
                return replica
        return None

    def _take(self, replica: str) -> Slot:
        self._inflight += 1
        self._per_replica[replica] = self._per_replica.get(replica, 0) + 1
        return Slot(replica, self, self._clock())

    def _release(self, slot: Slot) -> None:
        self._inflight -= 1
        remaining = self._per_replica[slot.replica_id] - 1
        if remaining:
            self._per_replica[slot.replica_id] = remaining
        else:
            del self._per_replica[slot.replica_id]
        held = max(self._clock() - slot._granted_at, 0.0)
        self._mean_hold_s += _HOLD_EWMA_ALPHA * (held - self._mean_hold_s)
        self._grant_waiters()

    def _grant_waiters(self) -> None:
        # Oldest first; a waiter whose replicas are all full is skipped, not a barrier,
        # so room on replica B is not held back by a queue of requests for replica A.
        for waiter in list(self._queue):
            if waiter.future.done():
                continue
            replica = self._fit(waiter.candidates)
            if replica is not None:
                waiter.future.set_result(self._take(replica))
                self._forget(waiter)
            elif self._inflight >= self.global_concurrency:
                break

    def _forget(self, waiter: _Waiter) -> None:
        try:
            self._queue.remove(waiter)
        except ValueError:
            pass
