"""The PrefixIndex contract both backends keep (see the package docstring for its rules)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from router.index.probes import ObservedBlocks

LookupStrategy = Literal["bisect", "walk"]

# Each write also drops up to this many expired entries from the replica's LRU head,
# which keeps the reverse index bounded without a background sweeper (both backends).
EXPIRED_SWEEP = 64
# Connections `warm` opens by default: twice the requests a gateway starts with at once
# (a load test's 16 concurrent conversations), since each request holds two at a time:
# its lookup and, beside it, the read of other gateways' work (router/shared_work.py).
# With 16 a first burst of 16 opened 16 more inside its requests (a TCP connect, HELLO
# and CLIENT SETINFO each), on the event loop every one of them waits on.
DEFAULT_WARM_CONNECTIONS = 32


class IndexUnavailable(RuntimeError):
    """The index could not answer within its deadline; route without it."""


class IndexFenced(IndexUnavailable):
    """Another indexer holds the lease now: this one's writes are refused (lease.py)."""


@dataclass(frozen=True)
class IndexOp:
    """One write of a KV-event batch: add or remove `keys` under scope, or clear the replica.

    An add's `parent` is the key of the block its first key follows in the chain (None for
    a chain's root, or unknown): a parent the replica does not hold marks a hole.
    """

    kind: Literal["add", "remove", "clear"]
    scope: str = ""
    keys: tuple[int, ...] = ()
    parent: int | None = None


@dataclass(frozen=True)
class StreamPosition:
    """Where one replica's KV-event stream stands in the index: its last applied batch.

    `ts` is that batch's timestamp, so a successor can tell the same batch from a
    restarted replica's batch under the same seq.
    """

    seq: int
    ts: float | None = None


class PrefixIndex(Protocol):
    """Which replicas hold a chain's leading blocks, per model scope."""

    async def lookup(
        self, model: str, keys: Sequence[int], *, deadline_s: float | None = None
    ) -> dict[str, int]:
        """Replica -> number of leading blocks of `keys` it holds (replicas with 0 omitted)."""
        ...

    async def add(self, model: str, replica: str, keys: Sequence[int]) -> None:
        """The replica now holds these blocks (from its KV events)."""
        ...

    async def remove(self, model: str, replica: str, keys: Sequence[int]) -> None:
        """The replica evicted these blocks."""
        ...

    async def record(
        self,
        model: str,
        replica: str,
        keys: Sequence[int],
        ttl_s: float,
        *,
        capacity_blocks: int | None = None,
    ) -> None:
        """The gateway sent this chain to the replica: assume it holds it for ttl_s."""
        ...

    async def clear_replica(self, replica: str) -> None:
        """Forget everything the replica holds, under every model scope."""
        ...

    async def apply(self, replica: str, ops: Sequence[IndexOp], *,
                    position: StreamPosition | None = None) -> None:
        """One KV-event batch's writes for the replica, in order (add/remove as above).

        `position`: the batch's place in the replica's stream, kept with its writes where
        the index keeps positions (a leased indexer's RedisIndex), so a successor resumes
        after it.
        """
        ...

    async def stream_position(self, replica: str) -> StreamPosition | None:
        """The position stored with the replica's last applied batch (None: start over)."""
        ...

    async def put_probe(
        self,
        salt: str,
        replica: str,
        block_size: int,
        keys: Sequence[int],
        token_ids: Sequence[int],
        ttl_s: float,
        *,
        rekeyed: bool = False,
    ) -> None:
        """Keep what the replica's events said about a handshake probe, for ttl_s."""
        ...

    async def get_probe(self, salt: str) -> ObservedBlocks | None:
        """The observation stored for a probe's salt, or None (not seen yet, or expired)."""
        ...

    async def warm(self, connections: int = DEFAULT_WARM_CONNECTIONS) -> None:
        """Get ready to serve: open `connections` connections and load scripts, if any.

        Called once before serving, so the first concurrent lookups meet their deadline
        instead of paying for connects. Raises IndexUnavailable if the index is down.
        """
        ...

    async def close(self) -> None:
        """Release connections."""
        ...
