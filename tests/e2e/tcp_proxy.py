"""A small asyncio TCP proxy for fault tests: pass, delay, black-hole or sever connections.

    proxy = TcpProxy("127.0.0.1", target_port); await proxy.start()
    proxy.mode = "blackhole"      # accept and read, forward nothing, answer nothing
    proxy.mode = "delay"; proxy.delay_s = 0.2   # every chunk waits before it is forwarded
    proxy.mode = "pass"
    await proxy.sever()           # reset every open connection (RST, not FIN)
    await proxy.stop()

Black-holing is what a dropped route or a firewall that drops packets looks like from the
client: the connection exists, writes succeed, and nothing ever comes back. Only socket
timeouts end the wait; a refused connection, by contrast, fails at once. The mode applies
to bytes flowing at the moment, so switching it affects open connections too.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Literal

Mode = Literal["pass", "delay", "blackhole"]

_CHUNK = 64 * 1024


class TcpProxy:
    """Listens on a free loopback port and relays each connection to host:port."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.mode: Mode = "pass"
        self.delay_s = 0.0
        self.port = 0
        self.connections = 0  # accepted since start, for assertions
        self.forwarded = 0  # bytes relayed (either way) since start
        self.swallowed = 0  # bytes dropped by the black hole
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url_host(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        await self.sever()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def sever(self) -> None:
        """Reset every open connection (both sides see a connection reset)."""
        for writer in list(self._writers):
            _reset(writer)
        self._writers.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await task

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            _reset(writer)
            return
        self._writers.update((writer, up_writer))
        pumps = [asyncio.ensure_future(self._pump(reader, up_writer)),
                 asyncio.ensure_future(self._pump(up_reader, writer))]
        for pump in pumps:
            self._tasks.add(pump)
            pump.add_done_callback(self._tasks.discard)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            for w in (writer, up_writer):
                self._writers.discard(w)
                with contextlib.suppress(OSError, RuntimeError):
                    w.close()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                data = await src.read(_CHUNK)
                if not data:
                    return
                if self.mode == "blackhole":
                    self.swallowed += len(data)
                    continue  # swallowed: the sender never hears back
                if self.mode == "delay" and self.delay_s > 0:
                    await asyncio.sleep(self.delay_s)  # the simulated latency itself
                dst.write(data)
                self.forwarded += len(data)
                await dst.drain()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), as a crashed peer or a middlebox would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError, RuntimeError):
        writer.close()
