"""router.deadlines.within: a bounded wait that never loses a cancellation."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest

from router.deadlines import within


async def _cancel_as_it_finishes(bounded: Callable[[Awaitable[int]], Coroutine[Any, Any, int]],
                                 finish: Callable[[asyncio.Future[int]], None]) -> None:
    """Cancel the waiting task in the very loop pass its operation finishes."""
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    started = asyncio.Event()

    async def operation() -> int:
        started.set()
        return await fut

    task = asyncio.create_task(bounded(operation()))
    await started.wait()
    finish(fut)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("finish", [
    lambda fut: fut.set_result(1),
    lambda fut: fut.set_exception(ConnectionRefusedError("the index is away")),
], ids=["result", "error"])
async def test_a_cancellation_survives_an_operation_finishing_with_it(
        finish: Callable[[asyncio.Future[int]], None]) -> None:
    await _cancel_as_it_finishes(lambda aw: within(aw, 5.0), finish)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12 rebuilt wait_for on timeout")
async def test_asyncio_wait_for_is_the_flaw_within_avoids() -> None:
    # The race above is real: Python 3.11's wait_for hands back the result and drops the
    # cancellation (so the tests above can fail, and did with wait_for in router/).
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        await _cancel_as_it_finishes(lambda aw: asyncio.wait_for(aw, 5.0),
                                     lambda fut: fut.set_result(1))


async def test_it_times_out_and_cancels_the_operation() -> None:
    cancelled = asyncio.Event()

    async def forever() -> int:
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()
        return 0

    with pytest.raises(TimeoutError):
        await within(forever(), 0.01)
    assert cancelled.is_set()
