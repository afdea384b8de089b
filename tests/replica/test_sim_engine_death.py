"""`--crash-on-token`: a poison prompt kills the sim's engine as one kills vLLM's EngineCore.

Real sim processes over real HTTP: requests in flight get vLLM's 500 (a stream gets it
as its last event), /health never answers 200 again, and the process exits, after which
connections are refused.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from replica.fleet import SimFleet, is_healthy

Fleet = Callable[..., SimFleet]
Fn = Callable[..., Any]

POISON = 7
ENGINE_DEAD = {"error": {
    "message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
    "type": "InternalServerError", "param": None, "code": 500}}


def _ids(seed: int, n: int) -> list[int]:
    # Ids from 100 up: never the poison token.
    return [(seed * 104729 + i * 17) % 30000 + 100 for i in range(n)]


def test_poison_prompt_kills_the_engine_and_every_request_in_flight(
        make_fleet: Fleet, scrape: Fn, wait_until: Fn) -> None:
    # unit profile at real time: 4,000 decode steps of 2 ms keep the requests in flight.
    fleet = make_fleet(1, prefill_profile="unit",
                       extra_args=["--crash-on-token", str(POISON)])
    (sim,) = fleet.replicas
    ok = httpx.post(f"{sim.url}/v1/completions",
                    json={"prompt": _ids(1, 20), "max_tokens": 2}, timeout=10)
    assert ok.status_code == 200  # ordinary prompts are served

    with ThreadPoolExecutor(1) as pool, httpx.Client(timeout=30) as client:
        in_flight = pool.submit(client.post, f"{sim.url}/v1/completions",
                                json={"prompt": _ids(2, 20), "max_tokens": 4000})
        body = {"prompt": _ids(3, 20), "max_tokens": 4000, "stream": True}
        with client.stream("POST", f"{sim.url}/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")  # the stream is under way
            wait_until(lambda: scrape(sim.url)["vllm:num_requests_running"] == 2, timeout=10,
                       what="both requests to be running")
            poison = client.post(f"{sim.url}/v1/completions",
                                 json={"prompt": [1, POISON, 3] * 10, "max_tokens": 2})
            assert poison.status_code == 500
            assert poison.json() == ENGINE_DEAD
            rest = [ln for ln in lines if ln]
        assert in_flight.result().status_code == 500
        assert in_flight.result().json() == ENGINE_DEAD
    # The stream (already 200) ends with vLLM's error event, then [DONE].
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: ")) == ENGINE_DEAD
    assert not is_healthy(sim.url)  # 503 while shutting down, or refused once gone
    assert sim.proc.wait(timeout=15) == 1
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{sim.url}/health", timeout=2)


def test_a_poison_token_elsewhere_costs_nothing(make_fleet: Fleet) -> None:
    # Only prompts hold the poison: the same id as a max_tokens value or in another sim
    # without the flag changes nothing.
    (plain,) = make_fleet(1).replicas
    resp = httpx.post(f"{plain.url}/v1/completions",
                      json={"prompt": [1, POISON, 3], "max_tokens": POISON}, timeout=10)
    assert resp.status_code == 200
    assert resp.json()["usage"]["completion_tokens"] == POISON
    assert is_healthy(plain.url)


def test_crash_on_token_must_be_a_token_id() -> None:
    proc = subprocess.run([sys.executable, "-m", "replica", "sim", "--port", "1",
                           "--crash-on-token", "-3"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 2
    assert "--crash-on-token must be a token id >= 0, got -3" in proc.stderr
