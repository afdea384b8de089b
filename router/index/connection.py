"""The Redis client an index runs on: one URL, as operators run Redis.

    redis://[[USER]:PASSWORD@]HOST:PORT[/DB]          plain TCP
    rediss://[[USER]:PASSWORD@]HOST:PORT[/DB]         TLS; `ca_file` verifies the server
    unix:///PATH[?db=N]                               a local socket
    redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER[/DB]
                                                      the primary Sentinel names MASTER;
                                                      rediss+sentinel:// for TLS to the
                                                      data nodes (sentinels in plain TCP)

The password (from the config's password_env, never the URL in a config file) goes to
the data nodes; sentinels are asked without one. With Sentinel, redis-py asks a
sentinel for the primary on each new connection and drops its pool when the primary
answers READONLY or goes away, so after a failover the next connection reaches the new
primary; requests in between fail fast (the index's deadlines) and route on load alone.
"""

from __future__ import annotations

import functools
from typing import Any
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")


@functools.cache
def _identity() -> dict[str, Any]:
    """The CLIENT SETINFO identity, resolved once: left to itself redis-py (7 and later)
    reads its own version from the installed package's metadata on disk for every new
    connection, 0.2-0.45 ms of CPU each (measured here), paid inside the requests whose
    lookups open them."""
    try:
        from redis.driver_info import DriverInfo
        from redis.utils import get_lib_version
    except ImportError:  # an older redis-py: nothing to resolve once
        return {}
    return {"driver_info": DriverInfo(lib_version=get_lib_version())}


class BadIndexURL(ValueError):
    """An index URL this module cannot connect with; the message names the bad part."""


def parse_sentinel_url(url: str) -> tuple[list[tuple[str, int]], str, int]:
    """(sentinel addresses, master name, db) of a redis+sentinel:// URL."""
    parts = urlsplit(url)
    hosts, _, _ = parts.netloc.rpartition("@")[2].partition("?")
    addresses: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise BadIndexURL(f"{url!r}: sentinel address {item!r} is not HOST:PORT")
        addresses.append((host.strip("[]"), int(port)))
    path = [unquote(p) for p in parts.path.split("/") if p]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise BadIndexURL(f"{url!r}: expected /MASTER or /MASTER/DB after the sentinels")
    return addresses, path[0], int(path[1]) if len(path) == 2 else 0


def redis_client(url: str, *, password: str | None = None, ca_file: str | None = None,
                 socket_timeout_s: float = 1.0, connect_timeout_s: float = 0.5
                 ) -> aioredis.Redis:
    """A client for `url` (module docstring), with socket deadlines and one quick retry."""
    options: dict[str, Any] = {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": connect_timeout_s,
        # One immediate retry: a pooled connection broken by a Redis restart fails once
        # and the retry reconnects. More retries would only outlast deadlines.
        "retry": Retry(NoBackoff(), 1),
        "decode_responses": False,
        **_identity(),
    }
    # Only pass a password when given, so one inside the URL still counts.
    if password is not None:
        options["password"] = password
    scheme = urlsplit(url).scheme
    tls = scheme in ("rediss", "rediss+sentinel")
    if ca_file is not None:
        if not tls:
            raise BadIndexURL(f"{url!r}: a CA file needs a rediss:// URL")
        options["ssl_ca_certs"] = ca_file
    if scheme not in SENTINEL_SCHEMES:
        return aioredis.Redis.from_url(url, **options)
    addresses, master, db = parse_sentinel_url(url)
    if tls:
        options["ssl"] = True
    sentinel = Sentinel(addresses, sentinel_kwargs={
        "socket_timeout": socket_timeout_s, "socket_connect_timeout": connect_timeout_s})
    return sentinel.master_for(master, db=db, **options)
