"""The gateway's front door for the two completion endpoints: an asyncio protocol that
reads a plain HTTP/1.1 POST itself and hands any other request, with the rest of its
connection, to aiohttp's server.

Why: every routed request crossed aiohttp's server (its parser callbacks, a request
object with multidicts, URL dispatch, the middleware chain, a response object, its
writer): 8-12% of the serving gateway's busy CPU in a py-spy profile of sequential
64-token and chat requests, on cores where each Python call costs about four times what
it does in a warm loop. benchmarks/bench_gateway.py compares the two in one run
(`--gateway-set listen.fast_front=false`); on 2026-12-06 (2 cores, interleaved, two
runs): added latency lower on most of its requests (by 0.05-0.5 ms), 1,074 / 959 against
987 / 901 routed requests a second, 1.31 / 1.56 against 1.38 / 1.69 ms of CPU per
streamed request (vllm-router cache_aware 1.31 / 1.44).

The fast path takes only the common, unambiguous shape: `POST /v1/chat/completions` or
`POST /v1/completions`, HTTP/1.1, one Content-Length within proxy.max_body_bytes, no
Transfer-Encoding, Expect or Upgrade, every line within aiohttp's limits. Anything else
(another path or method, chunked bodies, a malformed or oversized head, HTTP/1.0) goes
to aiohttp with every byte of that request: the connection becomes an ordinary aiohttp
connection (router/read_deadline.py's wrapper included) for the rest of its life, so
errors, limits and every other endpoint keep aiohttp's exact behaviour. A pipelined
request waits until the answer before it is out.

What aiohttp's server gave the completion handler and keeps giving it here: the
middleware's request id, error bodies and request counting (router.handlers.run_handler),
handler cancellation when the client goes away (the proxy then drops the upstream
request, and vLLM aborts it), a deadline on receiving each request
(listen.request_read_timeout_s), a keep-alive timeout, back-pressure on streamed
answers, and a graceful drain at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Coroutine, Mapping
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, cast

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

log = logging.getLogger(__name__)

FAST_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
# aiohttp's default keep-alive timeout: an idle connection is closed after this.
KEEPALIVE_S = 75.0
# Bytes a pipelining client may send ahead of its answer before reading pauses.
_AHEAD_BYTES = 1 << 20
# Header names that make a request aiohttp's (see the module docstring).
_NOT_FAST = frozenset({b"transfer-encoding", b"expect", b"upgrade"})
# Bytes no header line may hold (tab is allowed in values).
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_TOKEN = frozenset(b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz"
                   b"ABCDEFGHIJKLMNOPQRSTUVWXYZ")


class FrontRequest:
    """A completion request read by the fast front: what the completion handler reads
    of aiohttp's web.Request (app, method, path, headers), with its whole body."""

    __slots__ = ("answered", "app", "body", "conn", "headers", "method", "path")

    def __init__(self, app: web.Application, path: str, headers: CIMultiDictProxy[str],
                 body: bytes, conn: FrontConnection) -> None:
        self.app = app
        self.method = "POST"
        self.path = path
        self.headers = headers
        self.body = body
        self.conn = conn
        self.answered = False  # a whole answer, or a stream's head, has been written

    @property
    def content_length(self) -> int:
        return len(self.body)


class FrontStreamResponse:
    """A streamed answer on a fast connection: the calls the proxy makes on aiohttp's
    web.StreamResponse (prepare, write, write_eof), framed as aiohttp frames them
    (chunked, the head sent with the first chunk: one write, one packet). A write to a
    client that went away raises ConnectionResetError."""

    def __init__(self, status: int, headers: Mapping[str, str]) -> None:
        self.status = status
        self.headers: CIMultiDict[str] = CIMultiDict(headers)
        self.prepared = False
        self._conn: FrontConnection | None = None
        self._head = b""  # not yet written

    async def prepare(self, request: FrontRequest) -> None:
        if self.prepared:
            return
        self.prepared = True
        self._conn = request.conn
        request.answered = True
        self.headers["Transfer-Encoding"] = "chunked"
        self._head = _head(self.status, self.headers, request.conn.extra_headers,
                           request.conn.close_after)

    def send_head(self) -> None:
        """Write the head now rather than with the first chunk (proxy.early_head)."""
        assert self._conn is not None, "send_head before prepare"
        if self._head:
            self._conn.write(self._head)
            self._head = b""

    async def write(self, data: bytes) -> None:
        assert self._conn is not None, "write before prepare"
        if data:
            self._conn.write(b"%b%x\r\n%b\r\n" % (self._head, len(data), data))
            self._head = b""
            await self._conn.drain()

    async def write_eof(self) -> None:
        assert self._conn is not None, "write_eof before prepare"
        self._conn.write(self._head + b"0\r\n\r\n")
        self._head = b""
        await self._conn.drain()


# A request and a response on either server: what the completion path is written against.
AnyRequest = web.Request | FrontRequest
AnyResponse = web.StreamResponse | FrontStreamResponse


def stream_response(request: web.Request | FrontRequest, status: int,
                    headers: Mapping[str, str]) -> web.StreamResponse | FrontStreamResponse:
    """A streamed answer for `request`, on whichever server read it."""
    if isinstance(request, FrontRequest):
        return FrontStreamResponse(status, headers)
    return web.StreamResponse(status=status, headers=headers)


async def prepare(response: AnyResponse, request: AnyRequest) -> None:
    """`response.prepare(request)` for a response made by stream_response(request)."""
    if isinstance(response, FrontStreamResponse):
        assert isinstance(request, FrontRequest)
        await response.prepare(request)
    else:
        assert isinstance(request, web.Request)
        await response.prepare(request)


async def send_head(response: AnyResponse, request: AnyRequest) -> None:
    """Prepare `response` (made by stream_response(request)) and send its head now."""
    await prepare(response, request)
    if isinstance(response, FrontStreamResponse):
        response.send_head()
    # aiohttp's StreamResponse sends its head in prepare().


def send_whole(request: FrontRequest, response: web.StreamResponse) -> None:
    """Write a whole (unprepared) web.Response on a fast connection, once."""
    if request.answered:
        return
    assert isinstance(response, web.Response), "a fast answer is whole or streamed"
    body = response.body
    payload = body if isinstance(body, bytes) else b""
    headers = response.headers
    headers["Content-Length"] = str(len(payload))
    conn = request.conn
    data = _head(response.status, headers, conn.extra_headers, conn.close_after) + payload
    request.answered = True  # only once it can be written: else the error answer goes
    conn.write(data)


_date_cache: tuple[int, bytes] = (0, b"")


def _date() -> bytes:
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, formatdate(now, usegmt=True).encode())
    return _date_cache[1]


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


def _head(status: int, headers: Mapping[str, str], extra: Mapping[str, str],
          close: bool) -> bytes:
    lines = [f"HTTP/1.1 {status} {_reason(status)}"]
    lines.extend(f"{name}: {value}" for name, value in headers.items())
    lines.extend(f"{name}: {value}" for name, value in extra.items() if name not in headers)
    if close:
        lines.append("Connection: close")
    # A value read from the request (an x-request-id) goes back as the bytes it came as.
    head = "\r\n".join(lines) + "\r\nDate: "
    return head.encode("utf-8", "surrogateescape") + _date() + b"\r\n\r\n"


Handler = Callable[[FrontRequest], Coroutine[Any, Any, None]]


class FrontConnection(asyncio.Protocol):
    """One client connection: completion requests served here until a request needs
    aiohttp, then handed over to `make_inner()` (aiohttp's handler, wrapped)."""

    def __init__(self, app: web.Application, serve: Handler,
                 make_inner: Callable[[], asyncio.Protocol], *, max_body_bytes: int,
                 read_timeout_s: float, max_line_bytes: int, max_headers: int,
                 registry: set[FrontConnection], extra_headers: Mapping[str, str]) -> None:
        self._app = app
        self._serve = serve
        self._make_inner = make_inner
        self._max_body = max_body_bytes
        self._read_timeout_s = read_timeout_s
        self._max_line = max_line_bytes
        self._max_headers = max_headers
        self._registry = registry
        self.extra_headers = extra_headers
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        # The request being received: (path, headers, where its body starts and ends).
        self._head: tuple[str, CIMultiDictProxy[str], int, int] | None = None
        self._task: asyncio.Task[None] | None = None
        # One timer a connection for both the read deadline and the keep-alive timeout,
        # moved only when it fires (every read_timeout_s at most): a request answered in
        # time arms and cancels nothing. `_since`: when the request being received began
        # (its first byte, or the connection), None while answering or idle; `_idle_since`:
        # when the connection last went idle.
        self._timer: asyncio.TimerHandle | None = None
        self._since: float | None = None
        self._idle_since = 0.0
        self._paused_reading = False
        self._drain: asyncio.Future[None] | None = None
        self._writable = True
        self.close_after = False  # this answer ends the connection
        self.draining = False  # shutdown: no new request is taken

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self._transport = cast(asyncio.Transport, transport)
        self._registry.add(self)
        self._since = self._loop.time()  # the clock starts at connect
        self._timer = self._loop.call_at(self._since + self._read_timeout_s, self._tick)

    def data_received(self, data: bytes) -> None:
        if self._since is None and self._task is None:
            self._since = self._loop.time()  # the first bytes of a new request
        self._buffer += data
        if self._task is not None:
            if len(self._buffer) > _AHEAD_BYTES and not self._paused_reading:
                assert self._transport is not None
                self._transport.pause_reading()
                self._paused_reading = True
            return
        self._next()

    def eof_received(self) -> bool | None:
        return None  # close, as aiohttp's handler does (which cancels an answer in progress)

    def connection_lost(self, exc: Exception | None) -> None:
        self._registry.discard(self)
        self._cancel_timers()
        if self._task is not None:
            self._task.cancel()  # the client went away: stop the upstream request too
        self._wake_writer()

    def pause_writing(self) -> None:
        self._writable = False

    def resume_writing(self) -> None:
        self._writable = True
        self._wake_writer()

    # -- writing

    def write(self, data: bytes) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        transport.write(data)

    async def drain(self) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        if self._writable:
            return
        if self._drain is None:
            self._drain = self._loop.create_future()
        await asyncio.shield(self._drain)
        if transport.is_closing():
            raise ConnectionResetError("Connection lost")

    def _wake_writer(self) -> None:
        if self._drain is not None:
            if not self._drain.done():
                self._drain.set_result(None)
            self._drain = None

    # -- reading

    def _next(self) -> None:
        """Take the next request in the buffer, if all of it is here."""
        if self.draining:
            return
        if self._head is None:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > self._max_line * 2 or b"\n\n" in self._buffer:
                    self._hand_off()  # a long head, or bare LFs: aiohttp's parser answers
                return
            head = self._parse_head(end)
            if head is None:
                self._hand_off()
                return
            self._head = head
        path, headers, start, stop = self._head
        if len(self._buffer) < stop:
            return
        body = bytes(self._buffer[start:stop])
        del self._buffer[:stop]
        self._head = None
        self._since = None  # received in time: answering takes as long as it takes
        self.close_after = _wants_close(headers)
        request = FrontRequest(self._app, path, headers, body, self)
        self._task = self._loop.create_task(self._serve(request))
        self._task.add_done_callback(self._answered)

    def _parse_head(self, end: int) -> tuple[str, CIMultiDictProxy[str], int, int] | None:
        """The head of a request the fast path takes, else None (aiohttp's)."""
        head = bytes(self._buffer[:end])
        lines = head.split(b"\r\n")
        if len(lines) - 1 > self._max_headers or any(len(x) > self._max_line for x in lines):
            return None
        if _CONTROL.search(head.replace(b"\r\n", b"")):
            return None  # a bare CR or LF, or another control byte: aiohttp refuses it
        parts = lines[0].split(b" ")
        if len(parts) != 3 or parts[0] != b"POST" or parts[2] != b"HTTP/1.1":
            return None
        path = parts[1].decode("latin-1")
        if path not in FAST_PATHS:
            return None
        headers: CIMultiDict[str] = CIMultiDict()
        length: int | None = None
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not name or not _TOKEN.issuperset(name):
                return None  # obs-fold, whitespace before the colon, no name: aiohttp's
            lower = name.lower()
            if lower in _NOT_FAST:
                return None
            value = value.strip(b" \t")
            if lower == b"content-length":
                if length is not None or not value.isdigit():
                    return None
                length = int(value)
            # Decoded as aiohttp decodes them, so an API key reads the same on both.
            headers.add(name.decode("latin-1"), value.decode("utf-8", "surrogateescape"))
        if length is None or length > self._max_body:
            return None  # no body, or too big: aiohttp's handler answers (413 included)
        start = end + 4
        return path, CIMultiDictProxy(headers), start, start + length

    def _hand_off(self) -> None:
        """From now on aiohttp serves this connection, from this request's first byte."""
        transport = self._transport
        assert transport is not None and self._task is None
        self._registry.discard(self)
        self._cancel_timers()
        inner = self._make_inner()
        transport.set_protocol(inner)
        inner.connection_made(transport)
        if self._paused_reading:
            transport.resume_reading()
            self._paused_reading = False
        data = bytes(self._buffer)
        self._buffer.clear()
        self._head = None
        if data:
            inner.data_received(data)

    def _answered(self, task: asyncio.Task[None]) -> None:
        self._task = None
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if not task.cancelled() and task.exception() is not None:
            log.error("fast front: answering failed", exc_info=task.exception())
            transport.close()
            return
        if self.close_after or self.draining:
            transport.close()
            return
        if self._paused_reading:
            transport.resume_reading()
            self._paused_reading = False
        if self._buffer:
            self._since = self._loop.time()  # the next request (pipelined) starts now
            self._next()
        else:
            self._idle_since = self._loop.time()

    # -- timers

    def _tick(self) -> None:
        """The timer: close a connection whose request is late, or idle too long; else
        sleep until the state it finds is due, a read_timeout_s at most (so a request
        begun meanwhile is never checked later than its own deadline)."""
        self._timer = None
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        now = self._loop.time()
        if self._task is not None:
            due = now + self._read_timeout_s  # answering: no bound
        elif self._since is not None:
            due = self._since + self._read_timeout_s
            if now >= due:
                log.info("closing a connection that sent no complete request within %.1fs",
                         self._read_timeout_s)
                transport.close()
                return
        else:
            due = self._idle_since + KEEPALIVE_S
            if now >= due:
                transport.close()
                return
        self._timer = self._loop.call_at(min(due, now + self._read_timeout_s), self._tick)

    def _cancel_timers(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- shutdown

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The answer in progress, if any."""
        return self._task

    def close_when_idle(self) -> None:
        """Shutdown: take no new request; close now if nothing is being answered."""
        self.draining = True
        if self._task is None and self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()


def _wants_close(headers: CIMultiDictProxy[str]) -> bool:
    value = headers.get("Connection")
    return value is not None and "close" in value.lower()


async def drain(connections: set[FrontConnection], timeout_s: float) -> None:
    """Let the answers in progress finish (within `timeout_s`), closing every
    connection as it goes idle; then cut the rest."""
    for conn in list(connections):
        conn.close_when_idle()
    answering = [conn.task for conn in connections if conn.task is not None]
    if answering:
        await asyncio.wait(answering, timeout=timeout_s)
    for conn in list(connections):
        conn.abort()
