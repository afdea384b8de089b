"""A third-party KV-aware router (vllm-router 0.1.17, policy kv_aware) follows the sims' events.

vllm-router subscribes to each worker's KV-event PUB (and replay ROUTER), tokenizes a
request through the worker's /tokenize, and sends it to the worker whose published
blocks cover most of the prompt. If the sim's events were off in any field the router
reads (frames, msgpack layout, hashes, block size), its index would stay empty and it
would route by load alone. Where each request landed is read from the sims' own
request counters.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from replica.fleet import RunningReplica, SimFleet
from replica.processes import free_port, stop_process, wait_until

ROUTER_BIN = Path(sys.executable).parent / "vllm-router"

Scrape = Callable[[str], dict[str, float]]


@pytest.fixture
def routed_fleet(tiny_model_dir: Path) -> Iterator[tuple[SimFleet, str]]:
    """Two tokenizing sims with KV events, and vllm-router (kv_aware) in front of them."""
    with SimFleet(2, block_size=16, model_dir=tiny_model_dir, served_model_name="tiny") as fleet:
        a, b = fleet.replicas
        port = free_port()
        cmd = [str(ROUTER_BIN), "--host", "127.0.0.1", "--port", str(port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--policy", "kv_aware", "--worker-urls", a.url, b.url,
               "--kv-event-block-size", "16", "--kv-event-model", "tiny",
               "--worker-startup-check-interval", "1"]
        for r in (a, b):
            cmd += ["--kv-event-source", f"{r.url}={r.kv_events_endpoint}",
                    "--kv-event-replay-source", f"{r.url}={r.replay_endpoint}"]
        with tempfile.TemporaryFile() as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            try:
                url = f"http://127.0.0.1:{port}"
                wait_until(lambda: _healthy(url), 60, "vllm-router to answer /health",
                           proc=proc)
                yield fleet, url
            finally:
                stop_process(proc)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _send(url: str, prompt: str) -> dict[str, Any]:
    resp = httpx.post(f"{url}/v1/completions",
                      json={"model": "tiny", "prompt": prompt, "max_tokens": 2}, timeout=30)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def _served(replicas: list[RunningReplica], scrape: Scrape) -> list[float]:
    return [scrape(r.url)["vllm:request_success_total"] for r in replicas]


def _landed_on(fleet: SimFleet, router_url: str, prompt: str, scrape: Scrape) -> int:
    """Send `prompt` through the router; return the index of the replica that served it."""
    before = _served(fleet.replicas, scrape)
    _send(router_url, prompt)
    after = _served(fleet.replicas, scrape)
    (landed,) = [i for i, (x, y) in enumerate(zip(before, after, strict=True)) if y == x + 1]
    return landed


def _long_prompt(tag: str) -> str:
    return f"[{tag}] " + " ".join(f"{tag} clause {i} of a long shared document." for i in range(60))


def test_vllm_router_routes_repeats_to_the_replica_holding_the_prompt(
        routed_fleet: tuple[SimFleet, str], scrape: Scrape) -> None:
    fleet, router_url = routed_fleet
    a, b = fleet.replicas
    # The router's SUB joins asynchronously. Until one warmed probe is routed to its
    # holder, an event may have been published before the subscription existed.
    deadline = time.monotonic() + 30
    probe = 0
    while True:
        probe += 1
        text = _long_prompt(f"probe{probe}")
        _send(b.url, text)  # cached on b only
        if _landed_on(fleet, router_url, text, scrape) == 1:
            break
        assert time.monotonic() < deadline, "vllm-router never routed a warmed prompt to b"

    # Warm one prompt on each replica directly, then send each through the router.
    on_a, on_b = _long_prompt("alpha"), _long_prompt("beta")
    _send(a.url, on_a)
    _send(b.url, on_b)
    deadline = time.monotonic() + 10
    first = (_landed_on(fleet, router_url, on_b, scrape), _landed_on(fleet, router_url, on_a, scrape))
    while first != (1, 0) and time.monotonic() < deadline:
        # Only if the router had not applied the just-published events yet.
        first = (_landed_on(fleet, router_url, on_b, scrape),
                 _landed_on(fleet, router_url, on_a, scrape))
    assert first == (1, 0)
    # Repeats keep landing on the holder, and they hit there.
    for _ in range(4):
        assert _landed_on(fleet, router_url, on_b, scrape) == 1
        assert _landed_on(fleet, router_url, on_a, scrape) == 0
    hits_b = scrape(b.url)["vllm:prefix_cache_hits_total"]
    queries_b = scrape(b.url)["vllm:prefix_cache_queries_total"]
    assert hits_b / queries_b > 0.5
