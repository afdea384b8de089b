"""The garbage collector while the gateway serves: start-up's heap frozen, young
collections rarer than Python's default, and every collection's pause measured.

Start-up leaves ~400k long-lived objects (modules, tokenizers, chat templates); a full
collection walking them all pauses the loop ~200 ms, which some request pays every few
hundred requests. Frozen (gc.freeze), they are never walked; unfrozen at shutdown.

The young generation's threshold (listen.gc_young_threshold) counts net new container
objects between collections; Python's default is 700. Requests in flight hold a few
hundred each, so at 700 a gateway under 64 clients collected ~45 times a second, and the
promotions set off a full collection every few seconds that walked whatever was built
since start-up (the chain cache, the index): 19-44 ms each, paid by every request in
flight. Measured with 256-token prompts from 64 clients on 2 sims (two gateways of the
same code, 8 interleaved rounds of 3 s, 2026-12-07): at 700, 916 young, 83 middle and 6
full collections took 863 ms of the 24 s; at 10,000, 7 young ones (4 ms at the median,
9 ms the longest) took 25 ms, and CPU per request was 0.85 against 0.93 ms (lower in 6
rounds of 8). Refcounting frees everything that is not a cycle either way; what the
threshold delays is only the freeing of cycles (asyncio's exceptions and tasks), a few
thousand objects at most.

What a full collection walks is every tracked container outside the frozen heap, element
by element; the chain cache keeps its keys and digests where it does not look
(router/routing.py _Chain). In a gateway on the in-memory index, that index's dicts are
most of what is left (10-13 ms a full collection at saturation, 2026-12-07).

Each collection's pause is recorded (cacheroute_gc_pause_seconds, by generation), so an
operator can see how much of a tail the collector makes, and the benchmark compares
thresholds (benchmarks/bench_gateway.py --gateway-set listen.gc_young_threshold=700).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def serving_collector(young_threshold: int,
                      record: Callable[[int, float], None]) -> Iterator[None]:
    """Freeze what exists now, collect the young generation every `young_threshold` net
    new objects, and call `record(generation, seconds)` after each collection; all undone
    on exit (tests run several gateways, one after another, in one process)."""
    started = [0.0]

    def watch(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            record(info["generation"], time.perf_counter() - started[0])

    gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(young_threshold, *thresholds[1:])
    gc.callbacks.append(watch)
    try:
        yield
    finally:
        gc.callbacks.remove(watch)
        gc.set_threshold(*thresholds)
        gc.unfreeze()
