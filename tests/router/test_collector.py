"""The serving gateway's garbage collector (router/collector.py): start-up's heap frozen,
young collections at listen.gc_young_threshold and every pause counted while it serves,
all undone when it stops."""

from __future__ import annotations

import gc

import aiohttp
import pytest
from aiohttp import web
from servers import free_port, serving

from router.app import build_app, running_gateway
from router.config import ConfigError, build_config
from router.config.sections import ListenConfig


def _config(port: int, url: str, **listen: object) -> object:
    return build_config({
        "listen": {"host": "127.0.0.1", "port": port, **listen},
        "replicas": [{"url": url, "models": ["m"]}],
        "tenants": {"allow_anonymous": True},
        "health": {"interval_s": 60}},
        {"CACHEROUTE_SALT_SECRET": "collector-test-secret-0123456789"})


def _pauses(metrics: str, generation: int) -> float:
    prefix = f'cacheroute_gc_pause_seconds_count{{generation="{generation}"}} '
    return sum(float(line[len(prefix):]) for line in metrics.splitlines()
               if line.startswith(prefix))


@pytest.mark.parametrize("threshold", [None, 1234])
async def test_the_collector_is_tuned_and_watched_while_serving_and_restored_after(
        threshold: int | None) -> None:
    async def health(_request: web.Request) -> web.Response:
        return web.json_response({})

    replica = web.Application()
    replica.router.add_get("/health", health)
    port = free_port()
    before = gc.get_threshold()
    expected = threshold or ListenConfig().gc_young_threshold
    assert before[0] != expected
    listen = {} if threshold is None else {"gc_young_threshold": threshold}
    async with serving(replica) as url:
        config = _config(port, url, **listen)
        async with running_gateway(build_app(config), "127.0.0.1", port), \
                aiohttp.ClientSession() as session:
            assert gc.get_threshold() == (expected, *before[1:])
            assert gc.get_freeze_count() > 0
            gc.collect()  # a full collection, as the gateway would meet one
            async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                assert resp.status == 200
                metrics = await resp.text()
    assert _pauses(metrics, 2) >= 1
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("value", [0, -5, "lots", 1.5])
def test_a_bad_threshold_is_refused_naming_it(value: object) -> None:
    with pytest.raises(ConfigError, match="gc_young_threshold"):
        _config(8000, "http://127.0.0.1:9", gc_young_threshold=value)
