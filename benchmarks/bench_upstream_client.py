"""What the proxy's upstream HTTP client costs: aiohttp's client against
router/upstream_http.py's UpstreamPool, side by side in one run.

    .venv/bin/python benchmarks/bench_upstream_client.py [--rounds 5] [--requests 200]

Two measurements, each over interleaved rounds (the order alternates every round; this
2-core machine is noisy, so read the medians and the spread, not one round):

1. The clients alone against an upstream (a raw asyncio server in a child process that
   answers every POST with a chunked SSE stream of --events events, as vLLM's uvicorn
   does, 0.3 ms apart): time to the first body byte, CPU (process time) per request
   with the whole stream read, and requests per second at 32 concurrent.
2. A bare pass-through proxy (aiohttp's server in front, as the gateway has) with each
   client behind it, in child processes: the first byte's added latency over going
   direct, for an 8k-token-id body.

Everything runs on loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from replica.fleet import free_port  # noqa: E402
from replica.processes import stop_process, wait_until  # noqa: E402
from router.upstream_http import UpstreamPool  # noqa: E402

BODY = json.dumps({"model": "m", "prompt": list(range(8192)), "stream": True,
                   "max_tokens": 16}).encode()
HEADERS = {"Content-Type": "application/json", "x-request-id": "bench"}


# ------------------------------------------------------------------ child processes


def serve_upstream(port: int, events: int) -> None:
    """A raw HTTP/1.1 server: every POST gets a chunked SSE stream, events 0.3 ms apart."""
    chunks = [b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,'
              b'"text":" tok%d","logprobs":null,"finish_reason":null}]}\n\n' % i
              for i in range(events)] + [b"data: [DONE]\n\n"]
    framed = [b"%x\r\n%s\r\n" % (len(c), c) for c in chunks] + [b"0\r\n\r\n"]
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"transfer-encoding: chunked\r\n\r\n")

    class Upstream(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            self.transport = transport
            self.buf = b""

        def data_received(self, data: bytes) -> None:
            self.buf += data
            while (end := self.buf.find(b"\r\n\r\n")) != -1:
                length = 0
                for line in self.buf[:end].lower().split(b"\r\n"):
                    if line.startswith(b"content-length:"):
                        length = int(line[15:])
                if len(self.buf) < end + 4 + length:
                    return
                self.buf = self.buf[end + 4 + length:]
                loop = asyncio.get_running_loop()
                self.transport.write(head + framed[0])
                for k, piece in enumerate(framed[1:], start=1):
                    loop.call_later(0.0003 * k, self.transport.write, piece)

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Upstream, "127.0.0.1", port)
        await server.serve_forever()

    asyncio.run(main())


def serve_proxy(port: int, upstream: str, client: str) -> None:
    """aiohttp's server relaying /v1/completions to `upstream` with `client`."""
    from aiohttp import web

    async def main() -> None:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                        cookie_jar=aiohttp.DummyCookieJar())
        pool = UpstreamPool()

        async def handle(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            if client == "aiohttp":
                async with session.post(upstream + request.path, data=body,
                                        headers=HEADERS) as up:
                    await resp.prepare(request)
                    async for piece in up.content.iter_any():
                        await resp.write(piece)
            else:
                answer = await pool.send("POST", upstream, request.path, body, HEADERS)
                await resp.prepare(request)
                while piece := await answer.readany():
                    await resp.write(piece)
                answer.release()
            await resp.write_eof()
            return resp

        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    asyncio.run(main())


# ------------------------------------------------------------------------ clients


async def via_aiohttp(session: aiohttp.ClientSession, url: str) -> float:
    """Seconds to the first body byte; the stream read to its end."""
    started = time.perf_counter()
    first = 0.0
    async with session.post(url + "/v1/completions", data=BODY, headers=HEADERS) as resp:
        async for _ in resp.content.iter_any():
            first = first or time.perf_counter() - started
    return first


async def via_pool(pool: UpstreamPool, url: str) -> float:
    started = time.perf_counter()
    first = 0.0
    resp = await pool.send("POST", url, "/v1/completions", BODY, HEADERS)
    while await resp.readany():
        first = first or time.perf_counter() - started
    resp.release()
    return first


def _spread(values: list[float], scale: float = 1.0, fmt: str = ".3f") -> str:
    return (f"{statistics.median(values) * scale:{fmt}} "
            f"[{min(values) * scale:{fmt}}..{max(values) * scale:{fmt}}]")


async def clients_alone(url: str, rounds: int, requests: int) -> None:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                    cookie_jar=aiohttp.DummyCookieJar())
    pool = UpstreamPool()
    calls: dict[str, Callable[[], Awaitable[float]]] = {
        "aiohttp ClientSession": lambda: via_aiohttp(session, url),
        "UpstreamPool": lambda: via_pool(pool, url)}
    first: dict[str, list[float]] = {name: [] for name in calls}
    cpu: dict[str, list[float]] = {name: [] for name in calls}
    rate: dict[str, list[float]] = {name: [] for name in calls}
    try:
        for call in calls.values():  # warm: connections made, code paths loaded
            await call()
        for round_ in range(rounds):
            order = list(calls) if round_ % 2 == 0 else list(reversed(calls))
            for name in order:
                call = calls[name]
                cpu_start = time.process_time()
                firsts = [await call() for _ in range(requests)]
                cpu[name].append((time.process_time() - cpu_start) / requests)
                first[name].append(statistics.median(firsts))
                started = time.perf_counter()
                for _ in range(max(1, requests // 32)):
                    await asyncio.gather(*(call() for _ in range(32)))
                rate[name].append(max(1, requests // 32) * 32 / (time.perf_counter() - started))
    finally:
        await session.close()
        pool.close()
    print(f"1) the clients alone, {rounds} rounds x {requests} requests; median [min..max] "
          "over rounds")
    print(f"{'client':<22} | {'first byte ms':>22} | {'CPU ms/request':>22} | "
          f"{'req/s at 32':>20}")
    for name in calls:
        print(f"{name:<22} | {_spread(first[name], 1000):>22} | {_spread(cpu[name], 1000):>22} | "
              f"{_spread(rate[name], 1, '.0f'):>20}")
    ratio = [p / a for p, a in zip(cpu["UpstreamPool"], cpu["aiohttp ClientSession"],
                                   strict=True)]
    print(f"   CPU per request, UpstreamPool / aiohttp: {_spread(ratio, 1, '.2f')}")


async def through_proxies(targets: dict[str, str], rounds: int, requests: int) -> None:
    added: dict[str, list[float]] = {name: [] for name in targets if name != "direct"}
    async with aiohttp.ClientSession() as session:
        for url in targets.values():
            await via_aiohttp(session, url)
        for _ in range(rounds):
            lat: dict[str, list[float]] = {name: [] for name in targets}
            for _ in range(requests // 4):
                for name, url in targets.items():  # interleaved request by request
                    lat[name].append(await via_aiohttp(session, url))
            direct = statistics.median(lat["direct"])
            for name in added:
                added[name].append(statistics.median(lat[name]) - direct)
    print(f"\n2) a bare pass-through proxy (aiohttp's server) with each client: first-byte "
          f"added over direct, ms; {rounds} rounds x {requests // 4} requests each, "
          "median [min..max] over rounds")
    for name, values in added.items():
        print(f"{name:<30} {_spread(values, 1000, '+.3f')}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200, help="per client and round")
    parser.add_argument("--events", type=int, default=16, help="SSE events per answer")
    parser.add_argument("--serve-upstream", nargs=2, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-proxy", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_upstream:
        serve_upstream(*args.serve_upstream)
        return 0
    if args.serve_proxy:
        serve_proxy(int(args.serve_proxy[0]), args.serve_proxy[1], args.serve_proxy[2])
        return 0
    for name, value in (("--rounds", args.rounds), ("--requests", args.requests),
                        ("--events", args.events)):
        if value < 1:
            parser.error(f"{name} must be at least 1, got {value}")
    me = [sys.executable, str(Path(__file__).resolve())]
    port = free_port()
    upstream = f"http://127.0.0.1:{port}"
    procs = [subprocess.Popen([*me, "--serve-upstream", str(port), str(args.events)])]
    targets = {"direct": upstream}
    try:
        for client in ("aiohttp", "pool"):
            proxy_port = free_port()
            procs.append(subprocess.Popen([*me, "--serve-proxy", str(proxy_port), upstream,
                                           client]))
            targets[f"proxy with {'aiohttp ClientSession' if client == 'aiohttp' else 'UpstreamPool'}"] = \
                f"http://127.0.0.1:{proxy_port}"
        for url in targets.values():
            wait_until(functools.partial(_answers, url), 30, f"{url} to answer")
        asyncio.run(clients_alone(upstream, args.rounds, args.requests))
        asyncio.run(through_proxies(targets, args.rounds, args.requests))
    finally:
        for proc in procs:
            stop_process(proc)
    return 0


def _answers(url: str) -> bool:
    async def once() -> bool:
        try:
            async with aiohttp.ClientSession() as session:
                await via_aiohttp(session, url)
            return True
        except aiohttp.ClientError:
            return False
    return asyncio.run(once())


if __name__ == "__main__":
    raise SystemExit(main())
