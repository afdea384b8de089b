"""The HTTP/1.1 client that carries client requests to replicas (routed completions,
and the endpoints relayed as they are): a keep-alive pool of asyncio connections, each
parsing its response as bytes arrive.

Why not aiohttp's client, which the gateway keeps for its own calls (health checks,
scrapes, discovery, the hash handshake): on the forwarding path it costs more than it
must, on every request.
benchmarks/bench_upstream_client.py (2 cores, 5 interleaved rounds, medians [min..max]):
against an upstream streaming 16 SSE events, the first byte after 0.16 [0.12..0.16] ms
against aiohttp's 0.33 [0.30..0.34], 0.62x [0.38..0.80] of its CPU per request, 3.9k
against 3.1k requests a second at 32 concurrent; behind aiohttp's server as a bare
pass-through proxy of an 8k-token-id body, +0.59 [+0.56..+0.61] ms to the first byte
against +0.88 [+0.79..+0.89]. aiohttp builds a request and a response object with
multidicts, timers and tracing hooks, and on Python 3.11 writes the body from a task of
its own one loop iteration later; a replica needs none of that, only the bytes.
The proxy needs few features: a request with a known body (or none), a response read as it
comes (Content-Length, chunked or until close), keep-alive, a connect timeout and
back-pressure. Every other deadline is the caller's (router/proxy.py).

Errors are typed for the proxy's failover rules: UpstreamConnectError (no connection
was made: the replica saw nothing), UpstreamConnectTimeout, and ConnectionError
subclasses once a request may have reached the replica.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

# A response head larger than this is not a replica's: refuse it rather than buffer it.
MAX_HEAD_BYTES = 64 * 1024
_MAX_CHUNK_LINE = 4 * 1024
# Back-pressure: stop reading a replica's socket while this much of its answer waits
# for the client, and go on below the low mark (a slow client must not make the gateway
# buffer a whole answer; vLLM then sees the stall as TCP flow control).
_HIGH_WATER = 256 * 1024
_LOW_WATER = 64 * 1024

_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILERS, _UNTIL_CLOSE, _DONE = range(8)


class UpstreamConnectError(ConnectionError):
    """No connection could be made: the replica received nothing."""


class UpstreamConnectTimeout(TimeoutError):
    """No connection within the connect timeout: the replica received nothing."""


class UpstreamProtocolError(ConnectionError):
    """The replica's bytes are not an HTTP/1.1 response (or it closed mid-response)."""


class ResponseParser:
    """An HTTP/1.1 response parsed incrementally: `feed` bytes in any split, then read
    `status`, `headers` (lower-case names) once `head_done`, and take the body's pieces
    from `pieces` (`buffered` bytes in all) until `done`.

    Pure: no I/O, so every framing and every split of it is tested without a socket.
    """

    def __init__(self) -> None:
        self.state = _HEAD
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = True
        self.pieces: deque[bytes] = deque()
        self.buffered = 0
        self._left = 0  # bytes left of the body (Content-Length) or of the current chunk
        self._rest = b""  # an incomplete head, chunk-size line or chunk terminator

    @property
    def head_done(self) -> bool:
        return self.state != _HEAD

    @property
    def done(self) -> bool:
        return self.state == _DONE

    def feed(self, data: bytes) -> None:
        """Parse `data`; UpstreamProtocolError when it is not a valid response."""
        if self._rest:
            data, self._rest = self._rest + data, b""
        pos, end = 0, len(data)
        while pos < end:
            state = self.state
            if state == _LENGTH or state == _CHUNK_DATA:
                take = min(self._left, end - pos)
                self._body(data[pos:pos + take] if pos or take < end else data)
                pos += take
                self._left -= take
                if not self._left:
                    self.state = _DONE if state == _LENGTH else _CHUNK_END
            elif state == _UNTIL_CLOSE:
                self._body(data[pos:] if pos else data)
                return
            elif state == _HEAD:
                at = data.find(b"\r\n\r\n", pos)
                if at == -1:
                    if end - pos > MAX_HEAD_BYTES:
                        raise UpstreamProtocolError(
                            f"response head exceeds {MAX_HEAD_BYTES} bytes")
                    self._rest = data[pos:]
                    return
                self._head(data[pos:at])
                pos = at + 4
            elif state == _CHUNK_SIZE or state == _TRAILERS:
                at = data.find(b"\r\n", pos)
                if at == -1:
                    if end - pos > _MAX_CHUNK_LINE:
                        raise UpstreamProtocolError("chunk size line too long")
                    self._rest = data[pos:]
                    return
                line = data[pos:at]
                pos = at + 2
                if state == _TRAILERS:
                    if not line:  # the blank line after the (ignored) trailers
                        self.state = _DONE
                    continue
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise UpstreamProtocolError(f"bad chunk size {line[:40]!r}") from None
                if size < 0:
                    raise UpstreamProtocolError(f"bad chunk size {line[:40]!r}")
                self._left = size
                self.state = _CHUNK_DATA if size else _TRAILERS
            elif state == _CHUNK_END:
                if end - pos < 2:
                    self._rest = data[pos:]
                    return
                if data[pos:pos + 2] != b"\r\n":
                    raise UpstreamProtocolError("chunk not followed by CRLF")
                pos += 2
                self.state = _CHUNK_SIZE
            else:  # _DONE: bytes past the response (none are asked for): not reusable
                self.keep_alive = False
                return

    def feed_eof(self) -> None:
        """The replica closed the connection: the end of a body read until close, else
        UpstreamProtocolError (it ended mid-response)."""
        if self.state == _UNTIL_CLOSE:
            self.state = _DONE
        elif self.state != _DONE:
            raise UpstreamProtocolError(
                "connection closed before the response head" if self.state == _HEAD
                else "connection closed mid-response")
        self.keep_alive = False

    def take(self) -> bytes:
        """Every body byte parsed so far (b"" when none is)."""
        pieces = self.pieces
        out = pieces.popleft() if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        self.buffered = 0
        return out

    def _body(self, piece: bytes) -> None:
        if piece:
            self.pieces.append(piece)
            self.buffered += len(piece)

    def _head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
            raise UpstreamProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(code)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon or not name or name != name.strip():
                raise UpstreamProtocolError(f"bad header line {line[:80]!r}")
            name = name.lower()
            value = value.strip()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        if 100 <= status < 200:
            return  # an interim response (100 Continue): the real one follows
        self.status = status
        self.headers = headers
        connection = headers.get("connection", "").lower()
        self.keep_alive = ("close" not in connection if version == "HTTP/1.1"
                           else "keep-alive" in connection)
        if status in (204, 304):
            self.state = _DONE
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self.state = _CHUNK_SIZE
        elif "content-length" in headers:
            length = headers["content-length"]
            if not length.isdigit():
                raise UpstreamProtocolError(f"bad Content-Length {length[:40]!r}")
            self._left = int(length)
            self.state = _LENGTH if self._left else _DONE
        else:
            self.state = _UNTIL_CLOSE
            self.keep_alive = False


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a replica, one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser: ResponseParser | None = None
        self.error: BaseException | None = None
        self.lost = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods
        # (an isinstance check here failed every routed request on listen.event_loop uvloop).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        parser = self.parser
        if parser is None:  # bytes nobody asked for on an idle connection
            self.close()
            return
        try:
            parser.feed(data)
        except UpstreamProtocolError as exc:
            self.error = exc
            self.close()
        else:
            if parser.buffered > _HIGH_WATER and not self._paused and self.transport:
                self._paused = True
                self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        return False  # close: HTTP/1.1 answers are never half-closed here

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        parser = self.parser
        if parser is not None and self.error is None:
            try:
                parser.feed_eof()
            except UpstreamProtocolError as eof_error:
                self.error = ConnectionResetError(
                    f"{eof_error}{f' ({exc})' if exc else ''}")
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Until more of the response arrived, or the connection ended."""
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def readable(self) -> None:
        """Reading may go on (a reader took what was buffered, below the low mark)."""
        if self._paused and self.transport is not None and \
                self.parser is not None and self.parser.buffered < _LOW_WATER:
            self._paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()


class UpstreamResponse:
    """A replica's answer: `status` and `headers` (lower-case names) at once, the body
    as it arrives. `release` keeps the connection for the next request when the body
    was read to its end, and drops it otherwise; `close` always drops it. A dropped
    connection is how vLLM learns to abort a request."""

    def __init__(self, pool: UpstreamPool, key: _Origin, conn: _Connection,
                 parser: ResponseParser) -> None:
        self._pool = pool
        self._key = key
        self._conn: _Connection | None = conn
        self._parser = parser
        self.status = parser.status
        self.headers = parser.headers

    async def readany(self) -> bytes:
        """The body bytes that have arrived (waiting for some), b"" at its end;
        ConnectionError when the connection broke first."""
        parser, conn = self._parser, self._conn
        while not parser.pieces:
            if parser.done:
                return b""
            if conn is None:
                raise ConnectionResetError("response already closed")
            if conn.error is not None:
                raise conn.error
            if conn.lost:
                raise ConnectionResetError("connection lost mid-response")
            await conn.wait()
        out = parser.take()
        if conn is not None:
            conn.readable()
        return out

    async def read(self, limit: int = -1) -> bytes:
        """The body to its end, or its first `limit` bytes when limit >= 0."""
        parts: list[bytes] = []
        size = 0
        while limit < 0 or size < limit:
            piece = await self.readany()
            if not piece:
                break
            parts.append(piece)
            size += len(piece)
        body = b"".join(parts)
        return body if limit < 0 else body[:limit]

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        parser = self._parser
        if parser.done and parser.keep_alive and not conn.lost and conn.error is None:
            self._pool._keep(self._key, conn)
        else:
            conn.close()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


@dataclass(frozen=True)
class _Origin:
    scheme: str
    host: str
    port: int
    prefix: str  # the base URL's own path, before every request's
    host_header: str


class UpstreamPool:
    """Keep-alive connections to replicas, by origin, most recently used first.

    No bound on connections: admission control bounds concurrency (router/admission.py),
    and a pool limit would queue requests invisibly, outside every deadline.
    `keepalive_s`: an idle connection older than this is closed rather than reused (the
    replica's server closes its end after a while too; vLLM's uvicorn after 5 s, which
    a closed connection's FIN tells the pool about at once)."""

    def __init__(self, keepalive_s: float = 30.0, max_idle_per_origin: int = 256,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.keepalive_s = keepalive_s
        self.max_idle_per_origin = max_idle_per_origin
        self._ssl = ssl_context
        self._idle: dict[_Origin, list[_Connection]] = {}
        self._origins: dict[str, _Origin] = {}
        self.connections_made = 0

    async def send(self, method: str, base_url: str, path: str, body: bytes | None,
                   headers: Mapping[str, str], *, connect_timeout_s: float | None = None,
                   on_sent: Callable[[], None] | None = None) -> UpstreamResponse:
        """Send `method` base_url + path with `body` (None: none) and return the answer
        once its head arrived. `on_sent` is called (on the loop, once it is free) after
        the request was handed to the connection."""
        origin = self._origin(base_url)
        head = _request_head(method, origin, path, body, headers)
        loop = asyncio.get_running_loop()
        conn = self._reusable(origin, loop.time())
        if conn is None:
            conn = await self._connect(origin, loop, connect_timeout_s)
        parser = conn.parser = ResponseParser()
        assert conn.transport is not None
        try:
            conn.transport.write(head + body if body else head)
            if on_sent is not None:
                loop.call_soon(on_sent)
            while not parser.head_done:
                if conn.error is not None:
                    raise conn.error
                if conn.lost:
                    raise ConnectionResetError("connection lost before the response head")
                await conn.wait()
        except BaseException:
            conn.close()
            raise
        return UpstreamResponse(self, origin, conn, parser)

    def close(self) -> None:
        """Close every idle connection (those in use close with their responses)."""
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    def _origin(self, base_url: str) -> _Origin:
        origin = self._origins.get(base_url)
        if origin is None:
            parts = urlsplit(base_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"not an http(s) URL: {base_url!r}")
            port = parts.port or (443 if parts.scheme == "https" else 80)
            default = (parts.scheme, port) in (("http", 80), ("https", 443))
            host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
            origin = _Origin(parts.scheme, parts.hostname, port, parts.path.rstrip("/"),
                             host if default else f"{host}:{port}")
            self._origins[base_url] = origin
        return origin

    def _reusable(self, origin: _Origin, now: float) -> _Connection | None:
        conns = self._idle.get(origin)
        while conns:
            conn = conns.pop()
            if not conn.lost and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.close()
        return None

    async def _connect(self, origin: _Origin, loop: asyncio.AbstractEventLoop,
                       timeout_s: float | None) -> _Connection:
        tls: ssl.SSLContext | None = None
        if origin.scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            tls = self._ssl
        try:
            async with asyncio.timeout(timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop), origin.host, origin.port, ssl=tls)
        except TimeoutError:
            raise UpstreamConnectTimeout(
                f"no connection to {origin.host}:{origin.port} within {timeout_s}s") from None
        except OSError as exc:
            raise UpstreamConnectError(
                f"cannot connect to {origin.host}:{origin.port}: {exc}") from exc
        self.connections_made += 1
        return conn

    def _keep(self, origin: _Origin, conn: _Connection) -> None:
        conn.parser = None
        conns = self._idle.setdefault(origin, [])
        if len(conns) >= self.max_idle_per_origin:
            conn.close()
            return
        conn.idle_since = asyncio.get_running_loop().time()
        conns.append(conn)


def _request_head(method: str, origin: _Origin, path: str, body: bytes | None,
                  headers: Mapping[str, str]) -> bytes:
    lines = [f"{method} {origin.prefix}{path} HTTP/1.1\r\nHost: {origin.host_header}\r\n"]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}\r\n")
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
            # A header carried from a client must not start a header (or request) of its own.
            raise ValueError(f"header {name!r} holds a line break or a colon in its name")
        if name.lower() not in ("host", "content-length", "transfer-encoding", "connection"):
            lines.append(f"{name}: {value}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("utf-8")

