"""The arrival-order lock: turns served by ticket, let go of around I/O, never lost."""

from __future__ import annotations

import asyncio

import pytest

from router.arrival_order import NO_TURN, ArrivalOrder, Turn


async def _step(order: list[str], name: str, turn: Turn, gate: asyncio.Event | None = None
                ) -> None:
    async with turn:
        if gate is not None:
            await gate.wait()
        order.append(name)


async def test_turns_are_served_by_ticket_not_by_who_asked_first() -> None:
    lock = ArrivalOrder()
    first, second, third = lock.turn(), lock.turn(), lock.turn()
    gate = asyncio.Event()
    done: list[str] = []
    holder = asyncio.create_task(_step(done, "first", first, gate))
    await asyncio.sleep(0)
    assert lock.held
    # The third asks before the second: the second still goes first.
    late = asyncio.create_task(_step(done, "third", third))
    await asyncio.sleep(0)
    early = asyncio.create_task(_step(done, "second", second))
    await asyncio.sleep(0)
    assert lock.waiting == 2
    gate.set()
    await asyncio.gather(holder, late, early)
    assert done == ["first", "second", "third"]
    assert not lock.held


async def test_a_request_back_from_io_goes_before_later_arrivals() -> None:
    lock = ArrivalOrder()
    first, second, third = lock.turn(), lock.turn(), lock.turn()
    io_done = asyncio.Event()
    second_in = asyncio.Event()
    release_second = asyncio.Event()
    order: list[str] = []

    async def first_request() -> None:
        async with first:
            async with first.away():  # the index lookup
                await io_done.wait()
            order.append("first continues")

    async def second_request() -> None:
        async with second:
            second_in.set()
            await release_second.wait()
            order.append("second computes")

    tasks = [asyncio.create_task(first_request())]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(second_request()))
    await second_in.wait()  # the second took the turn while the first was away
    tasks.append(asyncio.create_task(_step(order, "third computes", third)))
    io_done.set()  # the first's reply is in while the second holds the turn
    for _ in range(5):
        await asyncio.sleep(0)
    assert order == []  # nobody overtakes the holder
    release_second.set()
    await asyncio.gather(*tasks)
    assert order == ["second computes", "first continues", "third computes"]


@pytest.mark.parametrize("handed", [False, True])
async def test_a_cancelled_waiter_never_loses_the_turn(handed: bool) -> None:
    lock = ArrivalOrder()
    first, second, third = lock.turn(), lock.turn(), lock.turn()
    order: list[str] = []
    gate = asyncio.Event()
    holder = asyncio.create_task(_step(order, "first", first, gate))
    await asyncio.sleep(0)
    doomed = asyncio.create_task(_step(order, "second", second))
    after = asyncio.create_task(_step(order, "third", third))
    await asyncio.sleep(0)
    if handed:
        gate.set()
        await asyncio.sleep(0)  # the first ends and hands the turn to the second...
        doomed.cancel()  # ...which is cancelled (its client went away) before it runs
    else:
        doomed.cancel()  # still queued: it leaves the queue
        await asyncio.sleep(0)
        assert lock.waiting == 1
        gate.set()
    await asyncio.gather(holder, after)
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert order == ["first", "third"]
    assert not lock.held


async def test_while_away_on_io_a_later_request_computes() -> None:
    lock = ArrivalOrder()
    first, second = lock.turn(), lock.turn()
    reply: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    order: list[str] = []

    async def first_request() -> None:
        async with first:
            async with first.away():  # the index lookup
                await reply
            order.append("first continues")

    task = asyncio.create_task(first_request())
    await asyncio.sleep(0)
    assert not lock.held  # let go of while the lookup is out
    await _step(order, "second", second)  # the loop is not left idle meanwhile
    reply.set_result(None)
    await task
    assert order == ["second", "first continues"]
    assert not lock.held


async def test_an_io_wait_that_fails_comes_back_to_its_turn() -> None:
    lock = ArrivalOrder()
    turn = lock.turn()
    async with turn:
        with pytest.raises(ConnectionError):
            async with turn.away():
                raise ConnectionError("index down")
        assert lock.held  # back in its turn; what the failure means is the caller's
    assert not lock.held


async def test_ending_a_turn_twice_and_no_turn_are_harmless() -> None:
    lock = ArrivalOrder()
    turn = lock.turn()
    async with turn:
        turn.end()
        assert not lock.held
        async with turn.away():  # ended: away does not take the turn back
            pass
        assert not lock.held
    async with NO_TURN as none:
        async with none.away():
            pass
        none.end()
