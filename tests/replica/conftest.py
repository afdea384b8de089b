"""Fixtures for the simulated replica's tests: sim fleets, ZMQ subscribers, metric scrapes."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import zmq

from replica.fleet import SimFleet
from replica.processes import wait_until
from router.kv_events import END_SEQ, EventBatch, decode_batch, parse_seq, seq_bytes


@pytest.fixture
def make_fleet() -> Iterator[Callable[..., SimFleet]]:
    """Start SimFleets on demand; every one is stopped after the test."""
    fleets: list[SimFleet] = []

    def make(n: int = 1, **kwargs: Any) -> SimFleet:
        kwargs.setdefault("prefill_profile", "instant")
        fleet = SimFleet(n, **kwargs).start()
        fleets.append(fleet)
        return fleet

    yield make
    for fleet in fleets:
        fleet.stop()


def scrape(url: str) -> dict[str, float]:
    """A replica's /metrics as {'name{labels}': value} and {'name': value} (first series)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        out[key] = float(value)
        out.setdefault(re.sub(r"\{.*\}", "", key), float(value))
    return out


class Subscriber:
    """A ZMQ SUB on a replica's KV-event endpoint, decoding every batch."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def recv(self, timeout: float = 5.0) -> tuple[int, EventBatch] | None:
        if not self.sock.poll(int(timeout * 1000)):
            return None
        _topic, seq, payload = self.sock.recv_multipart()
        return parse_seq(seq), decode_batch(payload)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def replay(endpoint: str, start: int = 0, timeout: float = 5.0) -> list[tuple[int, EventBatch]]:
    """Ask a replay ROUTER for every kept batch from `start`, as vLLM's protocol does."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", seq_bytes(start)])
        out: list[tuple[int, EventBatch]] = []
        while True:
            if not sock.poll(int(timeout * 1000)):
                raise AssertionError("replay did not end with the end marker")
            frames = sock.recv_multipart()
            assert frames[0] == b"" and len(frames) == 4
            _, _topic, seq, payload = frames
            if seq == END_SEQ:
                return out
            out.append((parse_seq(seq), decode_batch(payload)))
    finally:
        sock.close(0)
        ctx.term()


# Test modules cannot import this conftest by name (every test directory has one), so the
# helpers are handed out as fixtures.


@pytest.fixture(name="scrape")
def scrape_fixture() -> Callable[[str], dict[str, float]]:
    return scrape


@pytest.fixture(name="wait_until")
def wait_until_fixture() -> Callable[..., None]:
    return wait_until


@pytest.fixture(name="replay")
def replay_fixture() -> Callable[..., list[tuple[int, EventBatch]]]:
    return replay


@pytest.fixture
def subscribe() -> Iterator[Callable[[str], Subscriber]]:
    """Open KV-event subscribers; all are closed after the test."""
    subs: list[Subscriber] = []

    def make(endpoint: str) -> Subscriber:
        sub = Subscriber(endpoint)
        subs.append(sub)
        return sub

    yield make
    for sub in subs:
        sub.close()
