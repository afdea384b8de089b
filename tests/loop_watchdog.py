"""A pytest plugin that fails any async test whose event loop blocks.

Async code must never block its loop (docs: STYLE.md); a sync call hidden in an async
path (time.sleep, a blocking socket, a long CPU-bound step) stalls every other request
the gateway serves. This plugin catches it where it happens, as aiohttp's own suite
does, but without asyncio's debug mode (which records a stack for every callback and
slows the whole suite): a watchdog thread pings the loop and, when a ping waits longer
than the threshold while the loop is running and not idle in its selector, samples the
loop thread's stack. The test then fails with how long the loop was blocked and where.

Stalls are measured net of garbage collection. A full collection holds the GIL for as
long as it walks the heap: the test process's heap (920k objects at the end of the
suite) took up to 554 ms a collection on a quiet day. CI (stop 29) failed on a 3.6 s
stall with the loop thread waiting for the GIL inside a zmq recv (DONTWAIT, so not
blocked there); encoding releases the GIL (measured), which leaves a collection in
another thread. No async code blocked the loop then, and the gateway freezes its own
start-up heap (router/app.py) so it does not pay this. A stall that is over the
threshold only because a collection ran in it (in any thread) is not a failure.

Stalls are also measured net of the time the kernel kept the loop thread waiting for a
CPU. CI (stop 30) failed on a 438 ms stall with the loop thread in a non-blocking
`socket.send` and no collection in it: on two cores shared with a vLLM server that
computes a prefill, a runnable thread can wait that long for its turn. The kernel counts
that wait per thread (/proc/self/task/<tid>/schedstat, field 2), so the watchdog reads
it when a ping goes out and when the loop answers: what is left is the time the loop
thread ran or slept, which is what the same code costs on a core of its own. A CPU-bound
step or a sleep on the loop is still caught, loaded machine or not
(tests/test_loop_watchdog.py starves a loop thread on purpose to show both).

Every coroutine test gets the `loop_watchdog` fixture, set up first so it also covers
the async fixtures' set-up and tear-down. The threshold is BLOCK_THRESHOLD_S unless
CACHEROUTE_LOOP_BLOCK_MS is set; a test that must block on purpose can say so with
`@pytest.mark.allow_loop_blocking` (none does).
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import os
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

# Measured on the shared 2-core test machine (tests/test_loop_watchdog.py's docstring):
# above the suite's worst stall under heavy load, below a time.sleep(0.5).
BLOCK_THRESHOLD_S = 0.4
FIXTURE = "loop_watchdog"
# The stalls garbage collection explained in this session's tests (their fixtures'
# watchdogs, not those a test makes itself): the terminal summary counts them.
EXCUSED: list[Block] = []


@dataclass
class Block:
    """One stall: how long the loop did not answer, and the loop thread's stack then.

    Recorded as soon as the stall passes the threshold; `seconds` grows until the loop
    answers.
    """

    seconds: float
    stack: str
    gc_seconds: float = 0.0  # how much of `seconds` the garbage collector was running
    cpu_wait_seconds: float = 0.0  # how much the loop thread waited for a CPU (runnable)
    on_cpu_seconds: float = 0.0  # how much the loop thread ran

    @property
    def net_seconds(self) -> float:
        """The stall less collection and waiting for a CPU: what the code itself cost.

        A collection on the loop thread while it also waited for a CPU is subtracted
        twice; both are the machine's doing, not the async code's, so this errs by at
        most the smaller of the two, towards passing.
        """
        return self.seconds - self.gc_seconds - self.cpu_wait_seconds


@dataclass(frozen=True)
class ThreadClock:
    """A thread's time on a CPU and waiting for one, from the kernel's scheduler stats."""

    on_cpu: float
    cpu_wait: float

    @staticmethod
    def read(native_id: int) -> ThreadClock | None:
        """Now, for a thread of this process; None where the kernel does not say."""
        try:
            with open(f"/proc/self/task/{native_id}/schedstat", "rb") as f:
                on_cpu_ns, wait_ns, _ = f.read().split()
        except (OSError, ValueError):
            return None
        return ThreadClock(int(on_cpu_ns) / 1e9, int(wait_ns) / 1e9)


@dataclass
class CollectorTime:
    """When the garbage collector ran, in any thread: a gc.callbacks callback.

    Only collections of at least MIN_SPAN_S are kept (the young generations take
    microseconds, thousands of times a second). The callback only appends, and readers
    index up to a length they read first, so neither locks: a lock here could deadlock,
    since any allocation under it may start a collection that calls back in.
    """

    MIN_SPAN_S = 0.005
    spans: list[tuple[float, float]] = field(default_factory=list)
    _started: float | None = None

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        now = time.monotonic()
        if phase == "start":
            self._started = now
        elif self._started is not None:
            if now - self._started >= self.MIN_SPAN_S:
                self.spans.append((self._started, now))
            self._started = None

    def within(self, start: float, end: float) -> float:
        """Seconds of collection between start and end (monotonic)."""
        spans = self.spans
        total = 0.0
        for i in range(len(spans)):
            s, e = spans[i]
            total += max(0.0, min(e, end) - max(s, start))
        running = self._started
        if running is not None:
            total += max(0.0, end - max(running, start))
        return total


@dataclass
class LoopWatchdog:
    """Pings a running loop from a thread and records every stall over `threshold_s`."""

    loop: asyncio.AbstractEventLoop
    threshold_s: float
    blocks: list[Block] = field(default_factory=list)
    _loop_thread: int = field(default_factory=threading.get_ident)
    _loop_native_id: int = field(default_factory=threading.get_native_id)
    _stop: threading.Event = field(default_factory=threading.Event)
    _settled: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _pending: threading.Event | None = None  # the ping in flight
    collector: CollectorTime = field(default_factory=CollectorTime)
    # Stalls that collection or waiting for a CPU explain.
    excused: list[Block] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._settled.set()

    def start(self) -> LoopWatchdog:
        """Start watching; call from the loop's own thread."""
        gc.callbacks.append(self.collector)
        self._thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[Block]:
        """Stop watching; returns the stalls seen."""
        self._stop.set()
        pending = self._pending
        if pending is not None:
            # Called on the loop thread, which cannot answer a ping while it waits here:
            # wake the watcher instead of letting it time out and report this very wait.
            pending.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.collector in gc.callbacks:
            gc.callbacks.remove(self.collector)
        return self.blocks

    def settle(self, timeout: float = 5.0) -> list[Block]:
        """The stalls seen so far, once a stall in progress has been measured to its end."""
        self._settled.wait(timeout)
        return self.blocks

    def _watch(self) -> None:
        interval = self.threshold_s / 4
        while not self._stop.wait(interval):
            if self.loop.is_closed() or not self.loop.is_running():
                continue  # between fixtures' steps: a stopped loop is not a blocked one
            answered = threading.Event()
            self._pending = answered
            if self._stop.is_set():
                return  # stop() may have missed this ping: do not wait for it
            clock_at_send = ThreadClock.read(self._loop_native_id)
            sent = time.monotonic()
            try:
                self.loop.call_soon_threadsafe(answered.set)
            except RuntimeError:  # closed meanwhile
                continue
            answered.wait(self.threshold_s)
            if self._stop.is_set():
                return
            if answered.is_set():
                continue
            stack = self._loop_stack()
            if stack is None:
                continue
            block = Block(time.monotonic() - sent, stack)
            self._settled.clear()
            self.blocks.append(block)  # now: the test may end before the stall does
            while not answered.wait(interval) and not self._stop.is_set():
                if not self.loop.is_running():
                    break
            end = time.monotonic()
            clock_at_end = ThreadClock.read(self._loop_native_id)
            block.seconds = end - sent
            block.gc_seconds = self.collector.within(sent, end)
            if clock_at_send is not None and clock_at_end is not None:
                block.cpu_wait_seconds = clock_at_end.cpu_wait - clock_at_send.cpu_wait
                block.on_cpu_seconds = clock_at_end.on_cpu - clock_at_send.on_cpu
            # (Unless a test that ended meanwhile took the block to fail with: settle()
            # waits only so long.)
            if block.net_seconds < self.threshold_s and block in self.blocks:
                self.blocks.remove(block)
                self.excused.append(block)
            self._settled.set()

    def _loop_stack(self) -> str | None:
        """The loop thread's stack if it is running a callback, None if idle or stopped."""
        frame = sys._current_frames().get(self._loop_thread)
        if frame is None or not self.loop.is_running():
            return None
        frames = traceback.extract_stack(frame)
        if not any(f.name == "_run_once" for f in frames):
            return None  # not inside the loop: it stopped between run_until_complete calls
        innermost = frames[-1]
        if innermost.filename.endswith("selectors.py") or innermost.name == "select":
            return None  # idle, waiting for I/O: our ping is about to run
        start = max(i for i, f in enumerate(frames) if f.name == "_run_once")
        return "".join(traceback.format_list(frames[start + 1:]))


def threshold_s() -> float:
    """The stall that fails a test, in seconds."""
    override = os.environ.get("CACHEROUTE_LOOP_BLOCK_MS")
    return float(override) / 1000 if override else BLOCK_THRESHOLD_S


def describe(blocks: list[Block], threshold: float) -> str:
    """A failure message: each stall's length and where the loop thread was."""
    parts = [f"the event loop was blocked {len(blocks)} time(s) for more than "
             f"{threshold * 1000:.0f} ms (async code must not block; run it in a thread):"]
    for b in blocks:
        parts.append(f"--- blocked {b.seconds * 1000:.0f} ms ({explain(b)}), loop thread at:\n"
                     f"{b.stack}")
    return "\n".join(parts)


def explain(block: Block) -> str:
    """Where a stall's time went, as far as the process can tell."""
    text = (f"the loop thread ran {block.on_cpu_seconds * 1000:.0f} ms and waited "
            f"{block.cpu_wait_seconds * 1000:.0f} ms for a CPU")
    if block.gc_seconds:
        text += f"; {block.gc_seconds * 1000:.0f} ms of it garbage collection"
    return text


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "allow_loop_blocking: this async test may block its event loop")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # First in the closure: set up before every other fixture of the test, torn down
    # after them, so their async set-up and tear-down are watched too.
    for item in items:
        function = getattr(item, "obj", None)
        if (isinstance(item, pytest.Function) and inspect.iscoroutinefunction(function)
                and item.get_closest_marker("allow_loop_blocking") is None
                and FIXTURE not in item.fixturenames):
            item.fixturenames.insert(0, FIXTURE)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    # Visible, not silent: how often the machine, not the code, stalled a loop.
    if EXCUSED:
        longest = max(EXCUSED, key=lambda b: b.seconds)
        terminalreporter.write_line(
            f"loop watchdog: {len(EXCUSED)} stall(s) over the threshold were garbage "
            f"collection or waiting for a CPU; the longest {longest.seconds * 1000:.0f} ms "
            f"({explain(longest)})")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> object:
    # Fail the test itself (not its tear-down) when its body blocked the loop.
    result = yield
    watchdog = getattr(item, "funcargs", {}).get(FIXTURE)
    if isinstance(watchdog, LoopWatchdog) and watchdog.settle():
        blocks, watchdog.blocks = watchdog.blocks, []
        pytest.fail(describe(blocks, watchdog.threshold_s), pytrace=False)
    return result


@pytest.fixture(name=FIXTURE)
async def loop_watchdog_fixture() -> AsyncIterator[LoopWatchdog]:
    """Fail the test if its event loop stops answering for longer than the threshold."""
    threshold = threshold_s()
    watchdog = LoopWatchdog(asyncio.get_running_loop(), threshold).start()
    try:
        yield watchdog
    finally:
        blocks = watchdog.stop()
        EXCUSED.extend(watchdog.excused)
    if blocks:
        pytest.fail(describe(blocks, threshold), pytrace=False)
