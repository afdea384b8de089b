"""The indexer lease: one active indexer per index namespace, any others on standby.

An indexer asks for the lease with lease.lua: granted only when nobody holds it (SET NX
PX), and granting moves the fence counter up (to one past it, or to the server's clock in
microseconds if that is later), and its new value is the lease's token.
The holder renews it well inside its TTL and builds its RedisIndex with that token
(`fence_token`), so each of its writes is checked against the counter inside Redis, in
the same script that writes. A holder that stalls past its TTL (a long pause, a
partition) and is replaced cannot write after its successor's grant: its scripts find
the counter moved on and refuse (IndexFenced). Key names: redis.py's docstring.

Redis failover: with asynchronous replication a promoted replica may miss the latest
grant, or the counter altogether (a replica promoted before its first sync). Counting up
from the clock keeps tokens rising anyway, so no later grant repeats a token a deposed
holder may still write with, unless the servers' clocks differ by more than the time
between the two grants. The lease expires within its TTL either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from router.deadlines import within
from router.index.protocol import IndexUnavailable

LEASE_SCRIPT = resources.files(__package__).joinpath("lease.lua").read_text(encoding="utf-8")
# A standby takes over at most ttl_s (plus one poll) after the active stopped renewing.
DEFAULT_LEASE_TTL_S = 2.0


def lease_keys(namespace: str) -> tuple[bytes, bytes]:
    """The lease key and the fence counter of an index namespace (redis.py's docstring)."""
    return f"{namespace}:lease".encode(), f"{namespace}:fence".encode()


@dataclass(frozen=True)
class LeaseSettings:
    """Who asks for the lease and how long a grant lasts without renewal."""

    holder: str
    ttl_s: float = DEFAULT_LEASE_TTL_S

    @property
    def renew_s(self) -> float:
        """How often the holder renews and a standby asks: four tries per TTL."""
        return self.ttl_s / 4


class IndexerLease:
    """Acquire, renew and release the indexer lease of one namespace."""

    def __init__(self, client: aioredis.Redis, settings: LeaseSettings, *,
                 namespace: str = "cr", op_timeout_s: float = 0.5) -> None:
        self.settings = settings
        self._keys = lease_keys(namespace)
        self._script = client.register_script(LEASE_SCRIPT)
        self._op_timeout_s = op_timeout_s

    async def _run(self, action: str, token: int | None) -> object:
        ttl_ms = max(1, math.ceil(self.settings.ttl_s * 1000))
        try:
            return await within(self._script(keys=list(self._keys), args=[
                action, self.settings.holder, "" if token is None else str(token), ttl_ms]),
                self._op_timeout_s)
        except (TimeoutError, RedisError, OSError) as exc:
            raise IndexUnavailable(f"redis lease {action} failed: {exc!r}") from exc

    async def acquire(self) -> int | None:
        """The new fence token if the lease was free and is now ours, else None."""
        token = await self._run("acquire", None)
        return None if token is None else int(token)  # type: ignore[call-overload]

    async def renew(self, token: int) -> bool:
        """Extend our lease by its TTL; False if it is no longer ours."""
        return bool(await self._run("renew", token))

    async def release(self, token: int) -> None:
        """Give the lease up now (a clean stop), so a standby need not wait out the TTL."""
        await self._run("release", token)
