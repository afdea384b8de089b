"""The fast front (router/front_http.py) with a real gateway on loopback, spoken to over
raw sockets: what it serves itself, what it hands to aiohttp on the same connection,
pipelining, streaming, limits, and a drain at shutdown that lets an answer finish."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from servers import free_port, serving

from router import front_http
from router.app import build_app, running_gateway
from router.config import build_config

SECRET = {"CACHEROUTE_SALT_SECRET": "front-http-test-secret-0123456"}
AUTH = b"Authorization: Bearer sk-t\r\n"


async def _completions(request: web.Request) -> web.StreamResponse:
    """A replica that answers with its prompt; streamed, in three events, slowly when
    the prompt says so (released by the test through `release`)."""
    body = await request.json()
    prompt = body.get("prompt", "")
    if not body.get("stream"):
        return web.json_response({
            "id": "c", "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": f"echo {prompt}", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(3):
        if (prompt == "slow" and i == 1) or (prompt == "held" and i == 0):
            await request.app[RELEASE].wait()
        chunk = {"id": "c", "object": "text_completion",
                 "choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({})


RELEASE = web.AppKey("release", asyncio.Event)


def _replica_app() -> web.Application:
    app = web.Application()
    app[RELEASE] = asyncio.Event()
    app.router.add_get("/health", _ok)
    app.router.add_post("/v1/completions", _completions)
    return app


@pytest.fixture
async def replica() -> AsyncIterator[tuple[str, asyncio.Event]]:
    app = _replica_app()
    async with serving(app) as url:
        yield url, app[RELEASE]


def _config(replica_url: str, port: int, **proxy: Any) -> Any:
    return build_config({
        "listen": {"host": "127.0.0.1", "port": port},
        "replicas": [{"url": replica_url, "models": ["m"]}],
        "tenants": {"keys": [{"key": "sk-t", "tenant": "t"}]},
        "health": {"interval_s": 60},
        "proxy": {"max_body_bytes": 4096, **proxy}}, SECRET)


def _post(body: dict[str, Any], extra: bytes = b"", path: bytes = b"/v1/completions") -> bytes:
    raw = json.dumps(body).encode()
    return (b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + AUTH + extra + b"Content-Length: %d\r\n\r\n" % len(raw) + raw)


async def _response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response: status, headers (lower-case names), the body de-chunked."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            piece = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += piece[:-2]
        return status, headers, body
    return status, headers, await reader.readexactly(int(headers.get("content-length", "0")))


def _aiohttps(headers: dict[str, str]) -> bool:
    """Whether aiohttp's server wrote the answer (it names itself; the front does not)."""
    return "aiohttp" in headers.get("server", "")


async def test_completions_are_read_by_the_front_the_rest_by_aiohttp_on_one_connection(
        replica: tuple[str, asyncio.Event]) -> None:
    port = free_port()
    async with running_gateway(build_app(_config(replica[0], port)), "127.0.0.1", port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post({"model": "m", "prompt": "one", "max_tokens": 1}))
        status, headers, body = await _response(reader)
        assert status == 200 and json.loads(body)["choices"][0]["text"] == "echo one"
        assert not _aiohttps(headers) and headers["x-request-id"] and headers["date"]
        # A request the front does not take: the connection is aiohttp's from here on,
        # and answers every later request in order.
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = await _response(reader)
        assert status == 200 and json.loads(body) == {"status": "ok"} and _aiohttps(headers)
        writer.write(_post({"model": "m", "prompt": "two", "max_tokens": 1}))
        status, headers, body = await _response(reader)
        assert status == 200 and json.loads(body)["choices"][0]["text"] == "echo two"
        assert _aiohttps(headers)
        writer.close()


async def test_pipelined_requests_are_answered_in_order_and_close_is_honoured(
        replica: tuple[str, asyncio.Event]) -> None:
    port = free_port()
    async with running_gateway(build_app(_config(replica[0], port)), "127.0.0.1", port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"".join(_post({"model": "m", "prompt": f"p{i}", "max_tokens": 1},
                                    b"Connection: close\r\n" if i == 3 else b"")
                              for i in range(4)))
        for i in range(4):
            status, headers, body = await _response(reader)
            assert status == 200 and json.loads(body)["choices"][0]["text"] == f"echo p{i}"
            assert not _aiohttps(headers)
        assert headers["connection"] == "close"
        assert await reader.read() == b""  # closed after the answer it asked to end with
        writer.close()


async def test_a_streamed_answer_goes_out_chunked_event_by_event(
        replica: tuple[str, asyncio.Event]) -> None:
    port = free_port()
    url, release = replica
    async with running_gateway(build_app(_config(url, port)), "127.0.0.1", port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post({"model": "m", "prompt": "slow", "max_tokens": 3, "stream": True}))
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        assert head.startswith("HTTP/1.1 200") and "Transfer-Encoding: chunked" in head
        # The first event is out while the replica holds the rest.
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        first = await reader.readexactly(size + 2)
        assert b'"t0"' in first and b"[DONE]" not in first
        release.set()
        rest = b""
        while not rest.endswith(b"0\r\n\r\n"):
            rest += await reader.read(4096)
        assert b'"t1"' in rest and b'"t2"' in rest and b"data: [DONE]" in rest
        writer.close()


async def test_a_streams_head_goes_out_before_its_first_token(
        replica: tuple[str, asyncio.Event]) -> None:
    """proxy.early_head: the client has its 200 while the replica is still on the
    prompt; the first token follows as a chunk of its own."""
    port = free_port()
    url, release = replica
    async with running_gateway(build_app(_config(url, port, early_head=True)), "127.0.0.1",
                               port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post({"model": "m", "prompt": "held", "max_tokens": 3, "stream": True}))
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).decode()
        assert head.startswith("HTTP/1.1 200") and "Transfer-Encoding: chunked" in head
        assert not release.is_set()  # the replica has sent no token yet
        release.set()
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        first = await reader.readexactly(size + 2)
        assert b'"t0"' in first
        rest = b""
        while not rest.endswith(b"0\r\n\r\n"):
            rest += await reader.read(4096)
        assert b'"t2"' in rest and b"data: [DONE]" in rest
        writer.close()


async def test_requests_the_front_does_not_take_get_aiohttps_answers(
        replica: tuple[str, asyncio.Event]) -> None:
    port = free_port()
    async with running_gateway(build_app(_config(replica[0], port)), "127.0.0.1", port):
        body = json.dumps({"model": "m", "prompt": "chunked", "max_tokens": 1}).encode()
        cases: list[tuple[bytes, int]] = [
            # A chunked body, and one announced with Expect: served, by aiohttp.
            (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + AUTH +
             b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n" % (len(body), body), 200),
            (_post({"model": "m", "prompt": "e", "max_tokens": 1},
                   b"Expect: 100-continue\r\n"), 200),
            # Over proxy.max_body_bytes: the JSON 413 the handler gives on aiohttp.
            (_post({"model": "m", "prompt": "x" * 5000, "max_tokens": 1}), 413),
            # Whitespace before a header's colon (a smuggling shape): refused.
            (b"POST /v1/completions HTTP/1.1\r\nHost : x\r\nContent-Length: 2\r\n\r\n{}", 400),
            # A line over the 8 KiB limit: refused.
            (b"POST /v1/completions HTTP/1.1\r\nX-Long: " + b"a" * 9000 +
             b"\r\nContent-Length: 2\r\n\r\n{}", 400),
        ]
        for raw, expected in cases:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(raw)
            status, headers, answer = await _response(reader)
            if status == 100:
                status, headers, answer = await _response(reader)
            assert status == expected, (raw[:60], status, answer[:200])
            assert _aiohttps(headers), raw[:60]
            if expected == 413:
                assert json.loads(answer)["error"]["code"] == 413
            writer.close()


async def test_bad_requests_on_the_front_get_openai_errors_with_request_ids(
        replica: tuple[str, asyncio.Event]) -> None:
    port = free_port()
    async with running_gateway(build_app(_config(replica[0], port)), "127.0.0.1", port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        raw = b"{not json"
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + AUTH +
                     b"x-request-id: mine-1\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw)
        status, headers, body = await _response(reader)
        assert status == 400 and not _aiohttps(headers)
        assert headers["x-request-id"] == "mine-1"
        assert json.loads(body)["error"]["type"] == "invalid_request_error"
        # A request id in UTF-8 comes back as the bytes it was sent as.
        writer.write(_post({"model": "m", "prompt": "id", "max_tokens": 1},
                           "x-request-id: réq-→\r\n".encode()))
        status, headers, body = await _response(reader)
        assert status == 200 and not _aiohttps(headers)
        assert headers["x-request-id"].encode("latin-1").decode() == "réq-→"
        # Without a key: 401, and the connection still serves the next request.
        writer.write(_post({"model": "m", "prompt": "k", "max_tokens": 1}).replace(AUTH, b""))
        status, headers, body = await _response(reader)
        assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
        writer.write(_post({"model": "m", "prompt": "after", "max_tokens": 1}))
        status, _, body = await _response(reader)
        assert status == 200 and json.loads(body)["choices"][0]["text"] == "echo after"
        writer.close()


async def test_shutdown_lets_a_stream_in_progress_finish(
        replica: tuple[str, asyncio.Event]) -> None:
    port = free_port()
    url, release = replica
    reader, writer = None, None
    async with running_gateway(build_app(_config(url, port)), "127.0.0.1", port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post({"model": "m", "prompt": "slow", "max_tokens": 3, "stream": True}))
        await reader.readuntil(b'"t0"')  # in progress: the replica holds the rest
        asyncio.get_running_loop().call_soon(release.set)  # once shutdown has begun
    # The gateway has shut down; the answer in progress was let finish first, and the
    # connection closed after it (not left to the keep-alive timeout).
    rest = await asyncio.wait_for(reader.read(), 5.0)
    assert b'"t2"' in rest and rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    writer.close()


async def test_idle_and_late_connections_are_closed_on_time(
        replica: tuple[str, asyncio.Event], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(front_http, "KEEPALIVE_S", 0.6)
    port = free_port()
    config = _config(replica[0], port)
    config = dataclasses.replace(config, listen=dataclasses.replace(
        config.listen, request_read_timeout_s=1.0))
    async with running_gateway(build_app(config), "127.0.0.1", port):
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
        late_reader, late_writer = await asyncio.open_connection("127.0.0.1", port)
        for reader, writer in ((idle_reader, idle_writer), (late_reader, late_writer)):
            writer.write(_post({"model": "m", "prompt": "x", "max_tokens": 1}))
            assert (await _response(reader))[0] == 200
        answered = time.perf_counter()
        await asyncio.sleep(0.3)  # the late one's next request begins later than its answer
        late_writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # then silence
        begun = time.perf_counter()
        assert await asyncio.wait_for(idle_reader.read(), 5.0) == b""
        idle_for = time.perf_counter() - answered
        assert await asyncio.wait_for(late_reader.read(), 5.0) == b""
        late_by = time.perf_counter() - begun
        # Idle: the keep-alive timeout; a request begun: its own read bound, counted from
        # its first byte (not from the connection or the answer before it).
        assert 0.6 <= idle_for < 1.5, idle_for
        assert 1.0 <= late_by < 2.0, late_by
        idle_writer.close()
        late_writer.close()


def test_requests_are_routed_on_uvloop() -> None:
    """listen.event_loop uvloop: its transports are not asyncio.Transport subclasses, and
    both the front and the upstream client must take them (an isinstance check in the
    upstream client once failed every routed request there with a 500)."""
    import uvloop  # a test dependency (pyproject.toml)

    async def scenario() -> None:
        app = _replica_app()
        app[RELEASE].set()
        port = free_port()
        async with serving(app) as url, \
                running_gateway(build_app(_config(url, port)), "127.0.0.1", port):
            assert "uvloop" in type(asyncio.get_running_loop()).__module__
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(_post({"model": "m", "prompt": "uv", "max_tokens": 1}))
            status, headers, body = await _response(reader)
            assert status == 200 and not _aiohttps(headers)
            assert json.loads(body)["choices"][0]["text"] == "echo uv"
            writer.write(_post({"model": "m", "prompt": "s", "max_tokens": 3, "stream": True}))
            status, _, body = await _response(reader)
            assert status == 200 and b'"t2"' in body and body.endswith(b"data: [DONE]\n\n")
            writer.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())
