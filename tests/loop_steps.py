"""Waiting in tests for what the event loop will do next, without wall-clock sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(condition: Callable[[], bool], rounds: int = 1000) -> None:
    """Yield to the loop until `condition()` holds; fail after `rounds` yields."""
    for _ in range(rounds):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")
