"""The serving gateway's garbage collector: start-up's heap frozen and young collections
rarer while it serves (router/app.py), both undone when it stops."""

from __future__ import annotations

import gc

import aiohttp
from aiohttp import web
from servers import free_port, serving

from router.app import YOUNG_COLLECTION_THRESHOLD, build_app, running_gateway
from router.config import build_config


async def test_the_collector_is_tuned_while_serving_and_restored_after() -> None:
    async def health(_request: web.Request) -> web.Response:
        return web.json_response({})

    replica = web.Application()
    replica.router.add_get("/health", health)
    port = free_port()
    before = gc.get_threshold()
    assert before[0] != YOUNG_COLLECTION_THRESHOLD
    async with serving(replica) as url:
        config = build_config({
            "listen": {"host": "127.0.0.1", "port": port},
            "replicas": [{"url": url, "models": ["m"]}],
            "tenants": {"allow_anonymous": True},
            "health": {"interval_s": 60}},
            {"CACHEROUTE_SALT_SECRET": "collector-test-secret-0123456789"})
        async with running_gateway(build_app(config), "127.0.0.1", port), \
                aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/v1/models") as resp:
                assert resp.status == 200, await resp.text()
            assert gc.get_threshold() == (YOUNG_COLLECTION_THRESHOLD, *before[1:])
            assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
