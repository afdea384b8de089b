"""The proxy's HTTP/1.1 client: its response parser on every framing and split, and its
pool against real servers on loopback (aiohttp's, and raw sockets for what aiohttp's
server never does: closing mid-body, answering garbage)."""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from servers import free_port, serving

from router.upstream_http import (
    MAX_HEAD_BYTES,
    ResponseParser,
    UpstreamConnectError,
    UpstreamPool,
    UpstreamProtocolError,
    _Connection,
)


def _chunked(body: bytes, sizes: list[int], trailers: bool) -> bytes:
    out, pos, i = [], 0, 0
    while pos < len(body):
        size = max(1, sizes[i % len(sizes)])
        piece = body[pos:pos + size]
        ext = b";name=value" if i % 3 == 1 else b""
        out.append(b"%x%s\r\n%s\r\n" % (len(piece), ext, piece))
        pos += size
        i += 1
    out.append(b"0\r\nx-trailer: 1\r\n\r\n" if trailers else b"0\r\n\r\n")
    return b"".join(out)


def _feed_split(parser: ResponseParser, wire: bytes, cuts: list[int]) -> bytes:
    body = b""
    last = 0
    for cut in [*sorted({c % (len(wire) + 1) for c in cuts}), len(wire)]:
        parser.feed(wire[last:cut])
        body += parser.take()
        last = cut
    return body


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-Dup: a\r\nx-dup: b\r\n"


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=600), sizes=st.lists(st.integers(1, 70), min_size=1, max_size=6),
       cuts=st.lists(st.integers(0, 2000), max_size=12), trailers=st.booleans())
def test_a_chunked_body_parses_the_same_in_any_split(body: bytes, sizes: list[int],
                                                      cuts: list[int], trailers: bool) -> None:
    wire = HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + _chunked(body, sizes, trailers)
    parser = ResponseParser()
    assert _feed_split(parser, wire, cuts) == body
    assert parser.done and parser.keep_alive
    assert parser.status == 200
    assert parser.headers["content-type"] == "text/event-stream"
    assert parser.headers["x-dup"] == "a, b"


@settings(max_examples=100, deadline=None)
@given(body=st.binary(max_size=600), cuts=st.lists(st.integers(0, 2000), max_size=12))
def test_a_content_length_body_parses_the_same_in_any_split(body: bytes,
                                                            cuts: list[int]) -> None:
    wire = HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body
    parser = ResponseParser()
    assert _feed_split(parser, wire, cuts) == body
    assert parser.done and parser.keep_alive


def test_a_body_without_length_runs_to_the_close_and_ends_the_connection() -> None:
    parser = ResponseParser()
    parser.feed(b"HTTP/1.1 200 OK\r\n\r\nsome")
    parser.feed(b" bytes")
    assert not parser.done
    parser.feed_eof()
    assert parser.done and not parser.keep_alive
    assert parser.take() == b"some bytes"


def test_an_interim_response_is_skipped_and_connection_close_is_honoured() -> None:
    parser = ResponseParser()
    parser.feed(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 503 Service Unavailable\r\n"
                b"Connection: close\r\nContent-Length: 2\r\n\r\nno")
    assert parser.status == 503 and parser.done and not parser.keep_alive
    assert parser.take() == b"no"


@pytest.mark.parametrize("wire, problem", [
    (b"SSH-2.0-OpenSSH\r\n\r\n", "status line"),
    (b"HTTP/1.1 2x0 OK\r\n\r\n", "status line"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "header line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -3\r\n\r\n", "Content-Length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY", "CRLF"),
])
def test_what_is_not_an_http_response_is_refused(wire: bytes, problem: str) -> None:
    with pytest.raises(UpstreamProtocolError, match=problem):
        ResponseParser().feed(wire)


def test_a_head_that_never_ends_is_refused_past_the_bound() -> None:
    parser = ResponseParser()
    parser.feed(b"HTTP/1.1 200 OK\r\n")
    with pytest.raises(UpstreamProtocolError, match="exceeds"):
        parser.feed(b"x-filler: " + b"a" * MAX_HEAD_BYTES)


def test_a_close_mid_response_is_an_error_not_an_end() -> None:
    parser = ResponseParser()
    parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
    with pytest.raises(UpstreamProtocolError, match="mid-response"):
        parser.feed_eof()


class _Transport:
    """Records flow control: what the connection asked of its socket."""

    def __init__(self) -> None:
        self.paused = False
        self.closed = False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def close(self) -> None:
        self.closed = True


async def test_a_reader_that_falls_behind_pauses_the_socket_until_it_catches_up() -> None:
    conn = _Connection(asyncio.get_running_loop())
    transport = _Transport()
    conn.transport = transport  # type: ignore[assignment]
    conn.parser = ResponseParser()
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n")
    for _ in range(40):
        conn.data_received(b"x" * 8192)  # 320 KiB waiting for the client
    assert transport.paused
    assert len(conn.parser.take()) == 40 * 8192
    conn.readable()
    assert not transport.paused


# --- the pool against real servers on loopback -----------------------------------------

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
async def raw_server() -> AsyncIterator[Callable[[Serve], Awaitable[str]]]:
    """A raw asyncio TCP server on loopback running `serve` per connection."""
    servers: list[asyncio.Server] = []

    async def start(serve: Serve) -> str:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        servers.append(server)
        port = server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head, await reader.readexactly(length)


@pytest.fixture
async def echo_app() -> AsyncIterator[str]:
    """aiohttp's server: /echo answers what it got; /stream streams SSE events."""
    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response({"method": request.method, "path": request.path,
                                  "body": body.decode(),
                                  "headers": {k.lower(): v for k, v in request.headers.items()}})

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(20):
            await resp.write(b"data: %d\n\n" % i)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/base/echo", echo)
    app.router.add_get("/base/echo", echo)
    app.router.add_post("/stream", stream)
    async with serving(app) as url:
        yield url


async def test_requests_reach_the_server_whole_and_reuse_one_connection(echo_app: str) -> None:
    pool = UpstreamPool()
    sent: list[int] = []
    try:
        for i in range(3):
            resp = await pool.send("POST", echo_app + "/base", "/echo", b'{"n": %d}' % i,
                                   {"Content-Type": "application/json", "x-request-id": "r1"},
                                   on_sent=lambda i=i: sent.append(i))
            assert resp.status == 200
            assert resp.headers["content-type"].startswith("application/json")
            got = json.loads(await resp.read())
            resp.release()
            assert got["path"] == "/base/echo"
            assert got["body"] == f'{{"n": {i}}}'
            assert got["headers"]["x-request-id"] == "r1"
            assert got["headers"]["host"] == echo_app.removeprefix("http://")
        assert sent == [0, 1, 2]
        assert pool.connections_made == 1
    finally:
        pool.close()


async def test_a_request_without_a_body_says_no_length(echo_app: str) -> None:
    """GET /version, relayed as the client sent it."""
    pool = UpstreamPool()
    try:
        resp = await pool.send("GET", echo_app + "/base", "/echo", None, {"x-request-id": "g"})
        got = json.loads(await resp.read())
        resp.release()
        assert (got["method"], got["body"]) == ("GET", "")
        assert "content-length" not in got["headers"]
        resp = await pool.send("POST", echo_app + "/base", "/echo", b"after", {})
        assert json.loads(await resp.read())["body"] == "after"  # the same connection
        resp.release()
        assert pool.connections_made == 1
    finally:
        pool.close()


async def test_a_stream_arrives_whole_and_its_connection_is_kept(echo_app: str) -> None:
    pool = UpstreamPool()
    try:
        for _ in range(2):
            resp = await pool.send("POST", echo_app, "/stream", b"{}", {})
            assert resp.headers["transfer-encoding"] == "chunked"
            body = b""
            while piece := await resp.readany():
                body += piece
            resp.release()
            assert body == b"".join(b"data: %d\n\n" % i for i in range(20))
        assert pool.connections_made == 1
    finally:
        pool.close()


async def test_nothing_listening_is_a_connect_error() -> None:
    pool = UpstreamPool()
    with pytest.raises(UpstreamConnectError, match="cannot connect"):
        await pool.send("POST", f"http://127.0.0.1:{free_port()}", "/x", b"", {}, connect_timeout_s=2)


async def test_a_replica_that_dies_mid_body_is_a_connection_error(
        raw_server: Callable[[Serve], Awaitable[str]]) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"9\r\ndata: 1\n\n\r\n")
        await writer.drain()
        writer.transport.abort()

    url = await raw_server(serve)
    pool = UpstreamPool()
    resp = await pool.send("POST", url, "/x", b"{}", {})
    with pytest.raises(ConnectionError):
        while await resp.readany():
            pass
    resp.close()


async def test_garbage_for_an_answer_is_a_connection_error(
        raw_server: Callable[[Serve], Awaitable[str]]) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"220 smtp.example ESMTP\r\n\r\n")
        await writer.drain()

    url = await raw_server(serve)
    with pytest.raises(UpstreamProtocolError, match="status line"):
        await UpstreamPool().send("POST", url, "/x", b"{}", {})


async def test_a_connection_the_replica_closed_while_idle_is_not_reused(
        raw_server: Callable[[Serve], Awaitable[str]]) -> None:
    """vLLM's uvicorn closes an idle keep-alive connection after 5 s: the pool must see
    the close and connect again rather than send into a dead socket."""
    closed = asyncio.Event()
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # as a keep-alive timeout would, without saying so
        await writer.wait_closed()
        closed.set()

    url = await raw_server(serve)
    pool = UpstreamPool()
    try:
        resp = await pool.send("POST", url, "/x", b"{}", {})
        assert await resp.read() == b"ok"
        resp.release()
        await closed.wait()
        idle = pool._idle[pool._origin(url)]
        for _ in range(1000):  # the FIN reaches the client within a few loop turns
            if not idle or idle[0].lost:
                break
            await asyncio.sleep(0)
        resp = await pool.send("POST", url, "/x", b"{}", {})
        assert await resp.read() == b"ok"
        resp.release()
        assert connections == 2 and pool.connections_made == 2
    finally:
        pool.close()


async def test_closing_an_unfinished_answer_drops_the_connection(
        raw_server: Callable[[Serve], Awaitable[str]]) -> None:
    """How vLLM learns that a client went away: its connection closes."""
    gone = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"9\r\ndata: 1\n\n\r\n")
        await writer.drain()
        if await reader.read(1) == b"":
            gone.set()

    url = await raw_server(serve)
    pool = UpstreamPool()
    resp = await pool.send("POST", url, "/x", b"{}", {})
    assert await resp.readany() == b"data: 1\n\n"
    resp.release()  # not read to its end: closed, not kept
    await asyncio.wait_for(gone.wait(), 5)
    assert not pool._idle.get(pool._origin(url))


async def test_a_header_that_would_split_the_request_is_refused(echo_app: str) -> None:
    with pytest.raises(ValueError, match="line break"):
        await UpstreamPool().send("POST", echo_app, "/base/echo", b"",
                                  {"traceparent": "00-1\r\nX-Injected: 1"})


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


async def test_an_https_replica_is_reached_over_tls_and_its_certificate_checked(
        tls_files: tuple[Path, Path]) -> None:
    cert, key = tls_files
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)

    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    app = web.Application()
    app.router.add_post("/echo", echo)
    async with serving(app, server_tls) as url:
        trusting = UpstreamPool(ssl_context=ssl.create_default_context(cafile=str(cert)))
        resp = await trusting.send("POST", url, "/echo", b"over tls", {})
        assert (resp.status, await resp.read()) == (200, b"over tls")
        resp.release()
        trusting.close()
        # The system's trust store does not know this certificate: no connection.
        with pytest.raises(UpstreamConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await UpstreamPool().send("POST", url, "/echo", b"", {}, connect_timeout_s=5)
