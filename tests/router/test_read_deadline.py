"""The listener's limits with a real gateway on loopback: a request must be sent within
listen.request_read_timeout_s (half-open and slow clients are cut off, answers are not),
and with listen.admin_port set /ready and /metrics answer only on the admin listener."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web
from servers import free_port, serving

from router.app import build_app, running_gateway
from router.config import ConfigError, build_config

BOUND_S = 1.0
SECRET = {"CACHEROUTE_SALT_SECRET": "read-deadline-test-secret-0123"}


async def _slow_stream(request: web.Request) -> web.StreamResponse:
    """A replica whose answer takes longer than the read bound: it must not be cut."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(6):
        chunk = {"id": "c", "object": "text_completion",
                 "choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await asyncio.sleep(0.3)
    last = {"id": "c", "object": "text_completion",
            "choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
    await resp.write(b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({})


@dataclass
class Gateway:
    host: str
    port: int
    admin_port: int | None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@pytest.fixture
async def replica_url() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/health", _ok)
    app.router.add_post("/v1/completions", _slow_stream)
    async with serving(app) as url:
        yield url


def _config(replica_url: str, port: int, **listen: object) -> dict[str, object]:
    return {"listen": {"host": "127.0.0.1", "port": port,
                       "request_read_timeout_s": BOUND_S, **listen},
            "replicas": [{"url": replica_url, "models": ["m"]}],
            "tenants": {"keys": [{"key": "sk-t", "tenant": "t"}]},
            "health": {"interval_s": 60}}


async def _closed_at(reader: asyncio.StreamReader) -> float:
    """When the server closes the connection (reading what it sends meanwhile)."""
    while await reader.read(4096):
        pass
    return time.perf_counter()


async def test_half_open_and_slow_clients_are_closed_within_the_bound(replica_url: str) -> None:
    port = free_port()
    config = build_config(_config(replica_url, port), SECRET)
    async with running_gateway(build_app(config), "127.0.0.1", port):
        conns, opened = [], []
        for _ in range(300):
            conns.append(await asyncio.open_connection("127.0.0.1", port))
            opened.append(time.perf_counter())  # the server's clock starts at connect
        started = opened[0]
        for i, (_, writer) in enumerate(conns):
            if i % 3 == 0:
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # then silence
            elif i % 3 == 1:  # headers complete, a body that never arrives in full
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
            # and every third sends nothing at all
        closed_at = await asyncio.wait_for(
            asyncio.gather(*(_closed_at(reader) for reader, _ in conns)), BOUND_S + 5.0)
        closed = [at - since for at, since in zip(closed_at, opened, strict=True)]
        elapsed = max(closed_at) - started
        for _, writer in conns:
            writer.close()
        print(f"\n300 half-open connections: all closed by the gateway after "
              f"{elapsed:.2f}s (bound {BOUND_S:.1f}s; slowest {max(closed):.2f}s)")
        assert max(closed) <= BOUND_S + 1.5
        assert min(closed) >= BOUND_S * 0.8  # the bound, not an eager close

        # The listener still serves, and an answer longer than the bound is not cut.
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{port}/v1/completions",
                                    json={"model": "m", "prompt": "hi", "stream": True},
                                    headers={"Authorization": "Bearer sk-t"}) as resp:
                text = await resp.text()
                assert resp.status == 200, text
            assert text.endswith("data: [DONE]\n\n") and '"finish_reason": "length"' in text
            # A request sent within the bound, slowly, is served too.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            for part in (b"GET /health HTTP/1.1\r\n", b"Host: x\r\n", b"Connection: close\r\n\r\n"):
                writer.write(part)
                await asyncio.sleep(BOUND_S / 4)
            assert (await reader.read()).startswith(b"HTTP/1.1 200")
            writer.close()


async def test_admin_listener_takes_ready_and_metrics_off_the_api_port(replica_url: str) -> None:
    port, admin = free_port(), free_port()
    config = build_config(_config(replica_url, port, admin_port=admin), SECRET)
    async with running_gateway(build_app(config), "127.0.0.1", port), \
            aiohttp.ClientSession() as session:
        for path in ("/ready", "/metrics"):
            async with session.get(f"http://127.0.0.1:{port}{path}") as resp:
                assert resp.status == 404, path
                assert (await resp.json())["error"]["type"] == "invalid_request_error"
        async with session.get(f"http://127.0.0.1:{admin}/ready") as resp:
            assert resp.status == 200 and (await resp.json())["ready"] is True
        async with session.get(f"http://127.0.0.1:{admin}/metrics") as resp:
            assert resp.status == 200 and "cacheroute_requests_total" in await resp.text()
        for url in (f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{admin}/health"):
            async with session.get(url) as resp:
                assert resp.status == 200
        async with session.post(f"http://127.0.0.1:{admin}/v1/completions", json={}) as resp:
            assert resp.status in (404, 405)  # the API is not on the admin port


def test_admin_port_must_differ_from_the_api_port() -> None:
    with pytest.raises(ConfigError, match=r"listen\.admin_port"):
        build_config(_config("http://127.0.0.1:9", 8000, admin_port=8000), SECRET)
