"""Chains routed but not yet announced: the index's blind spot, closed per gateway.

Between sending a new prefix to a replica and that replica's BlockStored events (which
come only once its prefill is done: seconds for a long prompt under load), the index
knows nothing of it. Requests sharing the prefix that arrive in that window would see no
match anywhere and scatter (each paying a cold prefill) or herd by load. So the gateway
remembers each chain it routes as *pending* on the chosen replica for a short time:
lookups take the longer of the index's match and the pending one, and the events, once
they arrive, carry on. Dynamo's predicted-TTL indexer and vllm-router's speculative
entries do the same.

Only what the index did not already hold is remembered: a route's keys past the leading
run the lookup found on that replica. A conversation's turn resends its whole history,
but only its last few blocks are new; storing the history again would hold ~10 s of
every routed prompt (100k+ keys at a few hundred requests a second) to say what the
index says already. A pending match therefore continues the index's: from the replica's
indexed run, as far as pending keys go on.

A pending entry is a prediction, not a fact, so it is bounded three ways: it expires
`ttl_s` after the request was routed; it is dropped when that replica does not serve the
request (refused after routing, failed, or served by another: Route.drop_pending); and
the whole store holds at most `capacity_blocks` keys (oldest routes first out). Pure and
synchronous; `now` is passed in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice, takewhile


@dataclass
class _Route:
    model: str
    replica_id: str
    keys: tuple[int, ...]
    expires_at: float
    # Its last key, while the chain past it is still to be keyed (`add`'s `unfinished`).
    unfinished_at: int | None = None


class PendingChains:
    """Recently routed chains per (model, replica), each with an expiry."""

    def __init__(self, ttl_s: float = 10.0, capacity_blocks: int = 200_000) -> None:
        self.ttl_s = ttl_s
        self.capacity_blocks = capacity_blocks
        self._routes: OrderedDict[int, _Route] = OrderedDict()
        # (model, replica) -> key -> number of live routes holding it
        self._held: dict[tuple[str, str], dict[int, int]] = {}
        self._blocks = 0
        self._next = 0
        # last keyed block -> the callback that keys the rest of that route's chain
        self._unfinished: dict[int, Callable[[], None]] = {}

    def add(self, model: str, replica_id: str, keys: Sequence[int], now: float,
            unfinished: Callable[[], None] | None = None) -> int:
        """Remember `keys` as pending on the replica; returns a handle for `drop`.

        `keys` are the chain's blocks past what the replica was already known to hold
        (see the module docstring). `unfinished`: the chain goes on past `keys` but is not
        keyed yet (router/routing.py `defer_keys`); the callback keys the rest and
        `extend`s this route, and `finish_overlapping` calls it for a request that shares
        the chain through its last keyed block."""
        self._expire(now)
        handle = self._next
        self._next += 1
        if self.ttl_s <= 0 or not (keys or unfinished):
            return handle
        # Unfinished with no keys yet (a chat whose every keyed block its replica holds,
        # its newest text encoded after sending): a route all the same, for `extend`.
        route = _Route(model, replica_id, (), now + self.ttl_s)
        if unfinished is not None and keys:
            route.unfinished_at = keys[-1]
            self._unfinished[route.unfinished_at] = unfinished
        self._routes[handle] = route
        if keys:
            self._hold(route, keys)
        return handle

    def extend(self, handle: int, keys: Sequence[int]) -> None:
        """Continue a live route's chain with `keys` (its blocks keyed after routing:
        router/routing.py Route.finish_keys); nothing if the route is gone."""
        route = self._routes.get(handle)
        if route is None:
            return
        if route.unfinished_at is not None:
            self._unfinished.pop(route.unfinished_at, None)
            route.unfinished_at = None
        if keys:
            self._hold(route, keys)

    def _hold(self, route: _Route, keys: Sequence[int]) -> None:
        """Add `keys` to a live route's chain, then keep within capacity_blocks (oldest
        routes first out, this one included if it alone is over)."""
        route.keys += tuple(keys)
        held = self._held.setdefault((route.model, route.replica_id), {})
        for k in keys:
            held[k] = held.get(k, 0) + 1
        self._blocks += len(keys)
        while self._blocks > self.capacity_blocks and self._routes:
            self._remove(next(iter(self._routes)))

    def drop(self, handle: int) -> None:
        """Forget a route whose request failed: the replica never cached it."""
        if handle in self._routes:
            self._remove(handle)

    def matches(self, model: str, keys: Sequence[int], replica_ids: Iterable[str],
                now: float, known: Mapping[str, int] | None = None) -> dict[str, int]:
        """Leading blocks of `keys` on each replica counting pending ones: from the
        replica's `known` (indexed) run, as far as pending keys continue it. Replicas
        where pending keys add nothing are omitted."""
        self._expire(now)
        out: dict[str, int] = {}
        for rid in replica_ids:
            held = self._held.get((model, rid))
            if not held:
                continue
            start = (known or {}).get(rid, 0)
            # The run of pending keys from `start`, counted in C: in a burst sharing a
            # long prefix every replica's walk covers the whole prefix (390 keys: 46 us
            # as a Python loop, 17 us so).
            run = len(list(takewhile(held.__contains__, islice(keys, start, None))))
            if run:
                out[rid] = start + run
        return out

    def finish_overlapping(self, chain: Sequence[int]) -> bool:
        """Key the rest of every unfinished route whose last keyed block is in `chain`:
        a request sharing that much of a prefix routed moments ago likely shares more,
        and must see all of it pending. In a burst of one new long prefix, the first
        request is decided on a probe of it, and its rest is keyed only once its body
        is sent: after the burst's other decisions. True if any was finished."""
        if not self._unfinished or self._unfinished.keys().isdisjoint(chain):
            return False
        for key in [k for k in chain if k in self._unfinished]:
            finish = self._unfinished.pop(key, None)
            if finish is not None:
                finish()
        return True

    @property
    def blocks(self) -> int:
        """Pending block keys held (what capacity_blocks bounds)."""
        return self._blocks

    def __len__(self) -> int:
        return len(self._routes)

    def _expire(self, now: float) -> None:
        # Routes are added in time order with one ttl, so the oldest expires first.
        while self._routes:
            handle, route = next(iter(self._routes.items()))
            if route.expires_at > now:
                break
            self._remove(handle)

    def _remove(self, handle: int) -> None:
        route = self._routes.pop(handle)
        if route.unfinished_at is not None:
            self._unfinished.pop(route.unfinished_at, None)
        if not route.keys:
            return
        scope = (route.model, route.replica_id)
        held = self._held[scope]
        for k in route.keys:
            left = held[k] - 1
            if left:
                held[k] = left
            else:
                del held[k]
        if not held:
            del self._held[scope]
        self._blocks -= len(route.keys)


def merge_matches(indexed: Mapping[str, int], pending: Mapping[str, int]) -> dict[str, int]:
    """Per replica, the longer of the index's and the pending leading match."""
    out = dict(indexed)
    for rid, n in pending.items():
        if n > out.get(rid, 0):
            out[rid] = n
    return out
