"""The gateway's one upstream HTTP session is shared by every tenant, so it must not
keep what a replica (or an ingress in front of one) sets as a cookie: it would be sent
back with the next tenant's request to that host."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from replica.fleet import free_port

from .conftest import TENANT_KEYS


@pytest.fixture
async def cookie_setting_replica() -> AsyncIterator[tuple[str, list[str | None]]]:
    """A real HTTP upstream on loopback, named by host name (aiohttp keeps no cookies
    for bare IP addresses): answers completions with a Set-Cookie, and records the
    Cookie header each completion came with."""
    seen: list[str | None] = []

    async def completion(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Cookie"))
        body = await request.json()
        answer = {"id": "cmpl-1", "object": "text_completion", "model": body["model"],
                  "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                  "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1,
                            "total_tokens": len(body["prompt"]) + 1}}
        response = web.Response(text=json.dumps(answer), content_type="application/json")
        response.set_cookie("affinity", f"tenant-secret-{len(seen)}")
        return response

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/v1/completions", completion)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://localhost:{port}", seen
    finally:
        await runner.cleanup()


async def test_a_cookie_a_replica_sets_is_not_sent_with_another_tenants_request(
        start_gateway: Any, cookie_setting_replica: tuple[str, list[str | None]]) -> None:
    url, seen = cookie_setting_replica
    gw = await start_gateway({
        "listen": {"host": "127.0.0.1", "port": free_port()},
        "replicas": [{"url": url, "models": ["m"], "block_size": 16, "hash_seed": "0"}],
        "tenants": {"secret_env": "CACHEROUTE_SALT_SECRET",
                    "keys": [{"key": k, "tenant": t} for k, t in TENANT_KEYS.items()]},
    })
    for key in ("sk-alpha", "sk-beta", "sk-alpha"):
        reply = await gw.post("/v1/completions", {"model": "m", "prompt": [11] * 40,
                                                  "max_tokens": 1}, key=key)
        assert reply.status == 200, reply.body
        assert "set-cookie" not in reply.headers  # nor is it relayed to the client
    assert len(seen) == 3
    assert seen == [None, None, None]
