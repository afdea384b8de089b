"""Which event loop a gateway process runs on (listen.event_loop).

asyncio's own loop is the default, by measurement rather than habit. uvloop (libuv, which
vLLM's API server runs on) was expected to cut the gateway's CPU per request; measured
side by side (benchmarks/bench_gateway.py --gateway-set listen.event_loop=asyncio, two
runs of 3 and 5 interleaved rounds on 2 cores) it did not: 2.62 / 2.12 ms of CPU per
streamed request on uvloop against 2.31 / 2.06 ms on asyncio, a cold 8k-token request
1.1-1.4 ms slower through it, a growing conversation and a chat turn equal within the
spread. It did route 11% more short requests a second under 64 concurrent clients
(942 / 984 against 867 / 885 req/s), so a gateway bound by request rate rather than
time to first token may choose it (`pip install uvloop`, the package's `uvloop` extra).
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

EVENT_LOOPS = ("asyncio", "uvloop")
DEFAULT_EVENT_LOOP = "asyncio"


def missing(name: str) -> str | None:
    """Why the loop `name` cannot run here, or None when it can."""
    if name == "uvloop" and importlib.util.find_spec("uvloop") is None:
        return "uvloop is not installed (pip install uvloop, or cacheroute[uvloop])"
    return None


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """The constructor of the loop `name` (one of EVENT_LOOPS)."""
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    if name == "asyncio":
        return asyncio.new_event_loop
    raise ValueError(f"event loop must be one of {', '.join(EVENT_LOOPS)}, got {name!r}")


def run(main: Coroutine[Any, Any, T], name: str = DEFAULT_EVENT_LOOP) -> T:
    """asyncio.run(main) on the loop `name`."""
    with asyncio.Runner(loop_factory=loop_factory(name)) as runner:
        return runner.run(main)
