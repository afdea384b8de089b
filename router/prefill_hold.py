"""Holding requests at the gateway while every replica's prefill queue is full
(policy.hold_cap).

A replica serves prefills first come, first served: once it has a full step of prefill
queued, a request sent there joins the back of that queue, and a 40-token question
waits behind the 30k-token cold prompt that arrived a moment before it. Placement alone
cannot help once every replica is that busy (defer_cap's bet on where the next short
prompt goes is all it can do). Held at the gateway instead, the question can go first.

While every replica has at least a full prefill step queued (policy.hold_step_tokens
through its profile and learned bias: router/policy/cost.py step_s), new requests wait
here and are let go in order of a deadline: their arrival plus hold_cap times their
least prefill (what their best cache match leaves to compute). Each goes as soon as some
replica's queue falls under a step, and at its deadline at the latest. So no request is
held longer than hold_cap of its own prefill (at 0.5: a 3 s cold prompt up to 1.5 s, a
40 ms one up to 20 ms), and a short prompt overtakes a long one that arrived up to
hold_cap of the difference between their prefills before it: earliest deadline first
with deadlines proportional to size, which bounds each request's slowdown where
shortest-first would starve the long ones. Nothing is held while any replica has room,
so a fleet below its capacity never sees this, and the fleet is never left idle for
the order's sake. The decision is made when a request is let go, on the queues and the
cache as they are then (late binding).

One request per model is let go at a time, the next once the one before is counted on
its replica (its decision made and its work reserved, `Turn.done`): an opening is
filled by one request, not by the whole queue. A look again comes with every change of
a replica's outstanding work (a first byte re-anchors its queue), and a timer for the
moment the predicted queues or the next deadline say.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

_MIN_WAKE_S = 0.001

# Seconds until some replica has room for a request (<= 0: now), as of the time given.
Room = Callable[[float], float]


@dataclass(order=True)
class _Held:
    deadline: float
    seq: int
    future: asyncio.Future[None] = field(compare=False)
    room: Room = field(compare=False)


class PrefillHold:
    """The gateway's held requests, per model, for one event loop."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._held: dict[str, list[_Held]] = {}
        self._releasing: dict[str, int] = {}
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._look_scheduled = False
        self.held_total = 0  # requests ever held (for metrics and tests)

    def holding(self, model: str | None = None) -> int:
        """Requests held now (for `model`, or for all)."""
        queues = self._held.values() if model is None else [self._held.get(model, [])]
        return sum(1 for q in queues for h in q if not h.future.done())

    def quiet(self, model: str) -> bool:
        """Whether nothing of `model`'s is held or on its way (a newcomer with room may
        then go at once: there is no one it would overtake)."""
        return not self._releasing.get(model, 0) and not any(
            not h.future.done() for h in self._held.get(model, ()))

    def turn(self, model: str, deadline: float, room: Room, room_now: float) -> Turn:
        """A request's turn to be decided, by `deadline` at the latest (`room`: when some
        replica serving `model` has less than a step of prefill queued; `room_now`: its
        value now, from the states the caller read already)."""
        return Turn(self, model, deadline, room, room_now)

    def changed(self, now: float = 0.0) -> None:
        """A replica's outstanding work changed: look again (soon, not from inside the
        change: the caller may be in the middle of reserving)."""
        if self._held and not self._look_scheduled:
            self._look_scheduled = True
            asyncio.get_running_loop().call_soon(self._look)

    def _enter(self, model: str, deadline: float, room: Room,
               room_now: float) -> asyncio.Future[None] | None:
        """None: go now. Else the future that is set when it is let go."""
        releasing = self._releasing.get(model, 0)
        if room_now <= 0 and not releasing and not any(
                not h.future.done() for h in self._held.get(model, ())):
            self._releasing[model] = releasing + 1
            return None
        entry = _Held(deadline, next(self._seq), asyncio.get_running_loop().create_future(),
                      room)
        heapq.heappush(self._held.setdefault(model, []), entry)
        self.held_total += 1
        self._look_scheduled = False
        self._look()
        return entry.future

    def _leave(self, model: str) -> None:
        """A request let go (or let through) is counted on its replica, or gave up."""
        self._releasing[model] = max(0, self._releasing.get(model, 0) - 1)
        self.changed()

    def _look(self) -> None:
        self._look_scheduled = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        now = self._clock()
        wake = math.inf
        for model, queue in list(self._held.items()):
            while queue and queue[0].future.done():  # cancelled while held
                heapq.heappop(queue)
            if not queue:
                del self._held[model]
                continue
            if self._releasing.get(model, 0):
                continue  # the one let go is not counted on its replica yet
            top = queue[0]
            left = top.room(now)
            if left <= 0 or top.deadline <= now:
                heapq.heappop(queue)
                self._releasing[model] = self._releasing.get(model, 0) + 1
                top.future.set_result(None)
            else:
                wake = min(wake, left, top.deadline - now)
        if wake < math.inf:
            # At least a millisecond: a prediction that does not drain (another gateway's
            # queue as last shared) must not make this spin.
            self._timer = asyncio.get_running_loop().call_later(max(wake, _MIN_WAKE_S),
                                                                self._look)


class Turn:
    """One request's place in a PrefillHold (see PrefillHold.turn): `await wait()`, then
    `done()` in a finally once its work is counted or it gave up (idempotent)."""

    def __init__(self, hold: PrefillHold, model: str, deadline: float, room: Room,
                 room_now: float) -> None:
        self._hold = hold
        self._model = model
        self._deadline = deadline
        self._room = room
        self._room_now = room_now
        self._counted = False  # let go (or through): its model's next waits for done()
        self._future: asyncio.Future[None] | None = None
        self.held = False  # whether it waited

    def go_now(self) -> bool:
        """Whether it may be decided at once (no await: the common case costs no loop
        iteration); if not, it is held, and `wait` returns when it is let go."""
        self._future = self._hold._enter(self._model, self._deadline, self._room,
                                         self._room_now)
        if self._future is None:
            self._counted = True
            return True
        self.held = True
        return False

    async def wait(self) -> None:
        """Return when this request may be decided (after go_now, or in its stead)."""
        if self._future is None and not self._counted and self.go_now():
            return
        future = self._future
        if future is None:
            return
        try:
            await future
        finally:
            # Let go, even where cancelled before it ran: done() must hand the turn on.
            self._counted = future.done() and not future.cancelled()

    def done(self) -> None:
        if self._counted:
            self._counted = False
            self._hold._leave(self._model)
