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


async def test_a_waiter_cancelled_as_it_is_handed_the_turn_passes_it_on() -> None:
    lock = ArrivalOrder()
    first, second, third = lock.turn(), lock.turn(), lock.turn()
    order: list[str] = []
    gate = asyncio.Event()
    holder = asyncio.create_task(_step(order, "first", first, gate))
    await asyncio.sleep(0)
    doomed = asyncio.create_task(_step(order, "second", second))
    after = asyncio.create_task(_step(order, "third", third))
    await asyncio.sleep(0)
    gate.set()
    await asyncio.sleep(0)  # the first ends and hands the turn to the second...
    doomed.cancel()  # ...which is cancelled (its client went away) before it runs
    await asyncio.gather(holder, after)
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert order == ["first", "third"]
    assert not lock.held


async def test_a_cancelled_waiter_leaves_the_queue() -> None:
    lock = ArrivalOrder()
    first, second, third = lock.turn(), lock.turn(), lock.turn()
    order: list[str] = []
    gate = asyncio.Event()
    holder = asyncio.create_task(_step(order, "first", first, gate))
    await asyncio.sleep(0)
    gone = asyncio.create_task(_step(order, "second", second))
    after = asyncio.create_task(_step(order, "third", third))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    assert lock.waiting == 1
    gate.set()
    await asyncio.gather(holder, after)
    assert order == ["first", "third"]


async def test_wait_keeps_the_turn_for_a_quick_answer_and_lets_go_of_a_slow_one() -> None:
    lock = ArrivalOrder()
    first, second = lock.turn(), lock.turn()
    loop = asyncio.get_running_loop()
    quick: asyncio.Future[None] = loop.create_future()
    loop.call_soon(quick.set_result, None)
    order: list[str] = []
    async with first:
        waiting = asyncio.create_task(_step(order, "second", second))
        await first.wait([quick], timeout_s=5.0, hold_s=5.0)
        assert order == [] and lock.waiting == 1  # kept: the second could not start
        slow: asyncio.Future[None] = loop.create_future()
        # hold_s 0: let go at once; the second computes while the first waits.
        await first.wait([slow], timeout_s=0.5, hold_s=0.0)
        assert order == ["second"]
        assert not slow.done()  # the deadline passed; the caller decides what that means
    await waiting
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
        await none.wait([], 0.1, 0.1)
        none.end()
