"""SimFleet: N sims on free loopback ports, healthy on start, faults on demand, always stopped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from replica.fleet import AsyncSimFleet, SimFleet


def _healthy(url: str, timeout: float = 1.0) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def _prompt(url: str, tokens: list[int]) -> dict[str, Any]:
    return httpx.post(f"{url}/v1/completions", json={"prompt": tokens, "max_tokens": 1},
                      timeout=10).json()


def test_fleet_starts_distinct_healthy_replicas_and_stops_them() -> None:
    with SimFleet(2, block_size=32, num_blocks=129, prefill_profile="instant") as fleet:
        a, b = fleet.replicas
        assert len({a.port, b.port}) == 2
        assert a.kv_events_endpoint != b.kv_events_endpoint
        assert all(_healthy(u) for u in fleet.urls)
        # Separate caches: a prompt cached on one is cold on the other.
        tokens = list(range(100, 200))
        _prompt(a.url, tokens)
        assert _prompt(a.url, tokens)["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        assert _prompt(b.url, tokens)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        procs = [r.proc for r in fleet.replicas]
    assert all(p.poll() is not None for p in procs)


def test_kill_pause_resume_restart(wait_until: Callable[..., None],
                                   replay: Callable[..., list[Any]]) -> None:
    with SimFleet(2, prefill_profile="instant") as fleet:
        tokens = list(range(1000, 1040))
        url0 = fleet.replicas[0].url
        _prompt(url0, tokens)
        fleet.kill(0)
        assert fleet.replicas[0].proc.poll() is not None
        assert not _healthy(url0)
        fleet.restart(0)
        assert fleet.replicas[0].url == url0 and _healthy(url0)
        # A restart is a fresh replica: empty cache, event sequence from 0 again.
        assert _prompt(url0, tokens)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert [s for s, _ in replay(fleet.replicas[0].replay_endpoint)] == [0]

        url1 = fleet.replicas[1].url
        fleet.pause(1)
        assert not _healthy(url1, timeout=0.5)  # holds its port but answers nothing
        fleet.resume(1)
        wait_until(lambda: _healthy(url1), timeout=10, what="resumed replica to answer")
        fleet.pause(1)  # stopping must resume a paused replica so it can exit
    assert all(r.proc.poll() is not None for r in fleet.replicas)


async def test_async_fleet() -> None:
    async with AsyncSimFleet(1, prefill_profile="instant") as fleet:
        async with httpx.AsyncClient() as client:
            resp = await client.get(f"{fleet.urls[0]}/health")
            assert resp.status_code == 200
        await fleet.restart(0)
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"{fleet.urls[0]}/health")).status_code == 200
        proc = fleet.replicas[0].proc
    assert proc.poll() is not None


def test_a_poison_prompt_costs_one_replica_and_restart_brings_it_back() -> None:
    with SimFleet(2, block_size=32, num_blocks=129, crash_on_token=7) as fleet:
        a, b = fleet.replicas
        poisoned = httpx.post(f"{a.url}/v1/completions",
                              json={"prompt": [5, 6, 7, 8], "max_tokens": 1}, timeout=10)
        assert poisoned.status_code == 500
        assert poisoned.json()["error"]["message"].startswith("EngineCore encountered an issue")
        assert a.proc.wait(timeout=15) == 1  # the engine's death ends the process
        assert not _healthy(a.url)
        assert _prompt(b.url, [5, 6, 8])["usage"]["prompt_tokens"] == 3  # b is untouched
        fleet.restart(0)
        assert _healthy(fleet.replicas[0].url)
        assert _prompt(fleet.replicas[0].url, [5, 6, 8])["usage"]["prompt_tokens"] == 3
