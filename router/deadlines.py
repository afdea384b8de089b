"""`within`: await something for at most so long, without losing a cancellation.

Every bounded wait in the router goes through here rather than asyncio.wait_for. On
Python 3.11 (what we run) wait_for has a flaw: when the awaiting task is cancelled in the
same loop pass as the awaited operation finishes, it returns that result (or raises that
error) and the cancellation is gone. A loop that retries a failing Redis call then
survives its own cancellation and runs on: this is how a deposed indexer kept writing
after stepping down (tests/e2e/test_redis_failover.py), its stop waiting forever on a
stream that never ended. asyncio.timeout counts cancellations (Task.uncancel) and only
turns its own into TimeoutError.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], seconds: float) -> T:
    """`await aw`, raising TimeoutError after `seconds`; a cancellation always propagates."""
    async with asyncio.timeout(seconds):
        return await aw
