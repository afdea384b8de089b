"""A deadline on how long a client may take to send a request's headers and body.

aiohttp's server has no such bound: a connection that sends a request line and one
header, then nothing (a half-open or slowloris client), is held until its keep-alive
timeout, and each such connection holds a socket and a handler task. Here every
connection must deliver a complete request (headers and body) within `timeout_s` of
connecting, or of the first byte of that request; otherwise it is closed. Once a
request is fully received the clock stops: answering it (a long stream) takes as long
as it takes, and an idle keep-alive connection is aiohttp's keep-alive timeout's.

The check rides on the parser's own output: once a request's headers are complete,
aiohttp queues (message, payload), and the payload reports end of body; a request is
complete when its payload is at its end.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger(__name__)


class ReadDeadline(asyncio.Protocol):
    """Wraps one connection's aiohttp RequestHandler; closes it when a request is slow."""

    def __init__(self, inner: RequestHandler, timeout_s: float,
                 on_timeout: Callable[[], None] | None = None) -> None:
        self._inner = inner
        self._timeout_s = timeout_s
        self._on_timeout = on_timeout
        self._transport: asyncio.BaseTransport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._payload: Any = None  # the latest request's body stream, once its headers are in

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._payload = None
        self._timer = asyncio.get_running_loop().call_later(self._timeout_s, self._expire)

    def _complete(self) -> bool:
        return self._payload is not None and self._payload.is_eof()

    def _expire(self) -> None:
        self._timer = None
        if self._complete():
            return  # received in time; the next request's first byte starts a new clock
        if self._transport is not None and not self._transport.is_closing():
            log.info("closing a connection that sent no complete request within %.1fs",
                     self._timeout_s)
            if self._on_timeout is not None:
                self._on_timeout()
            self._transport.close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._arm()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._timer is None or self._complete():
            self._arm()  # the first bytes of a new request
        queued = self._inner._messages  # aiohttp queues each parsed request here
        before = len(queued)
        self._inner.data_received(data)
        if len(queued) > before:
            self._payload = queued[-1][1]

    def eof_received(self) -> bool | None:
        self._inner.eof_received()
        return None  # close the transport, as aiohttp's handler does

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


# Given how to make a connection's aiohttp protocol (wrapped in ReadDeadline), the
# protocol that serves the connection first (router/front_http.py's fast front).
FrontFactory = Callable[[Callable[[], asyncio.Protocol]], asyncio.Protocol]


class ReadDeadlineSite(web.TCPSite):
    """A TCPSite whose connections must send each request within `read_timeout_s`;
    with `front`, each connection is served by the protocol it makes, which hands the
    connection to aiohttp when it needs to."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *,
                 read_timeout_s: float, reuse_port: bool = False,
                 on_timeout: Callable[[], None] | None = None,
                 front: FrontFactory | None = None) -> None:
        super().__init__(runner, host, port, reuse_port=reuse_port)
        self._read_timeout_s = read_timeout_s
        self._on_timeout = on_timeout
        self._front = front

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert server is not None
        timeout_s, on_timeout, front = self._read_timeout_s, self._on_timeout, self._front

        def aiohttp_side() -> asyncio.Protocol:
            return ReadDeadline(server(), timeout_s, on_timeout)

        self._server = await asyncio.get_running_loop().create_server(
            aiohttp_side if front is None else lambda: front(aiohttp_side),
            self._host, self._port, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port)
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port
