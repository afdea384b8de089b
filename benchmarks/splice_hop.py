"""The leanest hop a Python proxy can be: bytes spliced between a client and one upstream.

    .venv/bin/python benchmarks/splice_hop.py PORT UPSTREAM_HOST UPSTREAM_PORT

benchmarks/bench_gateway.py runs it (`--splice`) beside the routers as a floor. It is an
asyncio server whose connections each open one connection to the upstream and copy bytes
both ways, with no HTTP parsing, no routing and no second request built. What a gateway
adds beyond this is its own work; what this adds over the direct request is the hop
itself: a second loopback connection, an event loop and two copies. Not a gateway: no
limits, no errors answered, nothing logged.
"""

from __future__ import annotations

import asyncio
import sys


class _Upstream(asyncio.Protocol):
    def __init__(self, client: asyncio.Transport) -> None:
        self.client = client

    def data_received(self, data: bytes) -> None:
        self.client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.close()


class _Client(asyncio.Protocol):
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.transport: asyncio.Transport | None = None
        self.upstream: asyncio.Transport | None = None
        self.early: list[bytes] = []  # what the client sent before the upstream connected
        self.connecting: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.connecting = asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        client = self.transport
        assert client is not None
        try:
            upstream, _ = await asyncio.get_running_loop().create_connection(
                lambda: _Upstream(client), self.host, self.port)
        except OSError:
            client.close()
            return
        self.upstream = upstream
        for data in self.early:
            upstream.write(data)
        self.early.clear()

    def data_received(self, data: bytes) -> None:
        if self.upstream is None:
            self.early.append(data)
        else:
            self.upstream.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.upstream is not None:
            self.upstream.close()


async def serve(port: int, host: str, upstream_port: int) -> None:
    """Splice every connection to 127.0.0.1:`port` to `host`:`upstream_port`, forever."""
    server = await asyncio.get_running_loop().create_server(
        lambda: _Client(host, upstream_port), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    try:
        port, host, upstream_port = int(argv[0]), argv[1], int(argv[2])
    except ValueError:
        print(f"splice_hop: PORT and UPSTREAM_PORT must be integers, got {argv[0]!r} and "
              f"{argv[2]!r}", file=sys.stderr)
        return 2
    asyncio.run(serve(port, host, upstream_port))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
