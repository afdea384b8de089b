"""Requests suspected of killing a replica, refused for a while so a retry cannot kill the next.

Some inputs kill a replica's engine (vLLM's EngineCore dies on them; every request in
flight then gets HTTP 500, /health answers 503 and the server shuts down). Carried to the
next replica, such a request kills that one too, and a client's own retry the one after.
So a failure that coincides with its replica dying is not carried over, and the request's
fingerprint is refused until `ttl_s` has passed.

The gateway cannot tell the poison from the innocent requests that were in flight beside
it: all of them become suspects. That costs those few requests a refusal for a while; the
other choice costs the fleet.

Two kinds of evidence:
- conclusive: the replica answered 5xx and then failed its health check (its engine died
  while the API server still answered, as vLLM's does). Refused at once.
- circumstantial: the connection was lost and the replica then failed its health check.
  That is also what a replica killed from outside looks like (a rolling restart, an OOM
  kill, a lost node), whose requests must move on; so it is a strike, and a request whose
  fingerprint has a strike already is refused on its second.

Bounded: at most `capacity` fingerprints, the oldest dropped first, each kept `ttl_s`.
The fingerprint is the request's last block key (salted per tenant where the tenant's cache
is, so one tenant cannot learn another's prompts from refusals), or a hash of the body
when the gateway could not key the prompt.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Fingerprint = bytes


def request_fingerprint(keys: Mapping[Any, Sequence[int]], num_tokens: int, body: bytes,
                        cache_salt: str | None) -> Fingerprint:
    """What identifies a request as the same one again: its prompt's last block key (a
    chained hash: it covers every block before it) and length, so a re-encoded retry
    matches; else, with no keys, its raw body. Scoped by cache salt."""
    h = hashlib.blake2b(digest_size=16)
    h.update((cache_salt or "").encode() + b"\0")
    chain = next((k for k in keys.values() if k), None)
    if chain:
        h.update(f"keys\0{num_tokens}\0{chain[-1]}".encode())
    else:
        h.update(b"body\0" + body)
    return h.digest()


@dataclass(frozen=True)
class Suspicion:
    """Why a fingerprint is held back, and until when (monotonic seconds)."""

    replica_id: str
    cause: str  # e.g. "HTTP 500, then /health 503"
    since: float
    until: float
    strikes: int
    refused: bool

    def message(self, now: float) -> str:
        """The client-facing explanation, naming the replica death it coincided with."""
        return (f"this request is refused for another {max(0.0, self.until - now):.0f}s: an "
                f"identical request was in flight when replica {self.replica_id} died "
                f"({self.cause}), so it may be what killed it; the gateway will not send it to "
                "another replica until then (proxy.suspect_ttl_s)")


class SuspectList:
    """Fingerprints of requests that coincided with a replica dying; bounded, expiring."""

    def __init__(self, ttl_s: float, capacity: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._clock = clock
        self._entries: OrderedDict[Fingerprint, Suspicion] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def now(self) -> float:
        return self._clock()

    def strike(self, fingerprint: Fingerprint, replica_id: str, cause: str, *,
               conclusive: bool) -> Suspicion:
        """Record that the request coincided with `replica_id` dying; returns its state
        (refused when the evidence is conclusive or this is its second strike)."""
        self.expire()
        now = self._clock()
        previous = self.check_entry(fingerprint, now)
        strikes = 1 + (previous.strikes if previous is not None else 0)
        entry = Suspicion(replica_id=replica_id, cause=cause, since=now, until=now + self.ttl_s,
                          strikes=strikes, refused=conclusive or strikes >= 2)
        self._entries.pop(fingerprint, None)
        self._entries[fingerprint] = entry
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return entry

    def refused(self, fingerprint: Fingerprint) -> Suspicion | None:
        """The suspicion that refuses this fingerprint now, if any."""
        entry = self.check_entry(fingerprint, self._clock())
        return entry if entry is not None and entry.refused else None

    def check_entry(self, fingerprint: Fingerprint, now: float) -> Suspicion | None:
        """The live entry for `fingerprint` (strike or refusal); expired ones are dropped."""
        entry = self._entries.get(fingerprint)
        if entry is not None and entry.until <= now:
            del self._entries[fingerprint]
            return None
        return entry

    def expire(self) -> int:
        """Drop expired entries (oldest first, so the scan stops at the first live one)."""
        now = self._clock()
        dropped = 0
        while self._entries:
            fingerprint, entry = next(iter(self._entries.items()))
            if entry.until > now:
                break
            del self._entries[fingerprint]
            dropped += 1
        return dropped
