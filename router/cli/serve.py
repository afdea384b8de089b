"""`python -m router serve`: run the cache-aware gateway.

    python -m router serve --config gateway.yaml [--port 8000] [--set proxy.max_retries=3]
    python -m router serve --config gateway.yaml --workers 4      # listen.workers

Configuration comes from the file, then CACHEROUTE_* environment variables, then flags
(router.config). Logs carry each request's id; API keys never reach a log line (the
gateway never logs headers or bodies). Runs until SIGTERM or SIGINT, then stops
accepting, lets in-flight requests finish within --shutdown-timeout, and closes every
resource.

Workers: one process routes on one core. With listen.workers N > 1 this process
supervises N worker processes (each `serve` again, with --worker) that listen on the
same port with SO_REUSEPORT, so the kernel spreads connections over them and routed
requests/s grow with cores. Each worker keeps its own fleet view (health checks, scrapes,
in-flight counts) and tokenizer caches, so they must share the prefix index: N > 1 is
refused with `index: memory`, where each worker would hold an index of its own (and
record-mode replicas' entries would be split among them). SIGTERM or SIGINT to the
supervisor stops every worker; a worker that exits on its own stops the others and the
supervisor exits 1 (the process manager restarts the whole gateway); a worker whose
supervisor is gone (even SIGKILLed) stops too. With proxy.expose_routing_headers each worker's responses
carry `x-cacheroute-worker: PID`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from router import event_loop
from router.app import REQUEST_ID, build_app, running_gateway
from router.config import ConfigError, GatewayConfig, add_config_arguments, config_from_args

log = logging.getLogger(__name__)

WORKER_HEADER = "x-cacheroute-worker"
# Beyond --shutdown-timeout, how long the supervisor waits for workers before SIGKILL.
WORKER_STOP_MARGIN_S = 5.0


class _RequestIdFilter(logging.Filter):
    """Stamps each record with the id of the request the logging task is serving."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


class _MalformedRequestFilter(logging.Filter):
    """aiohttp logs every unparsable request (bad framing, oversized headers) at ERROR
    with a traceback; a client can cause that at will, so it becomes one INFO line: a
    flood of junk must not flood the log or look like a gateway fault."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BadHttpMessage):
            record.msg, record.args = "refused a malformed HTTP request: %r", (exc.message,)
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
            return logging.getLogger(record.name).isEnabledFor(logging.INFO)
        return True


def setup_logging(level: str) -> None:
    """Log to stderr with the request id on every line."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RequestIdFilter())
    handler.addFilter(_MalformedRequestFilter())
    handler.setFormatter(logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The serve command's flags: config sources plus logging and shutdown."""
    add_config_arguments(parser)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="seconds in-flight requests get to finish on SIGTERM")
    # Set by the supervisor on the processes it starts (see the module docstring).
    parser.add_argument("--worker-of", type=int, default=None, metavar="PID",
                        help=argparse.SUPPRESS)


def check_workers(config: GatewayConfig) -> None:
    """ConfigError when listen.workers cannot work with the rest of the config."""
    if config.listen.workers > 1 and not config.index.is_redis:
        raise ConfigError(
            "listen.workers",
            f"is {config.listen.workers} but index is memory: each worker would keep an "
            "index of its own; give a shared index (index: redis://...) or 1 worker")


def _stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


def _stop_when_orphaned(supervisor: int, stop: asyncio.Event) -> None:
    """Stop when the supervisor is gone (SIGKILLed, say) instead of keeping the port.

    The supervisor holds the write end of this worker's stdin and never writes to it:
    the kernel closes it when the supervisor exits, however it exits, and stdin reads EOF.
    """
    loop = asyncio.get_running_loop()
    fd = sys.stdin.fileno()

    def readable() -> None:
        if not os.read(fd, 4096):
            loop.remove_reader(fd)
            log.warning("supervisor %d is gone; stopping", supervisor)
            stop.set()

    loop.add_reader(fd, readable)


async def _serve(config: GatewayConfig, args: argparse.Namespace) -> int:
    app = build_app(config)
    worker = args.worker_of is not None
    named: dict[str, str] = {}  # on every answer of the fast front (router/front_http.py)
    if worker and config.proxy.expose_routing_headers:
        pid = str(os.getpid())
        named[WORKER_HEADER] = pid

        async def name_worker(_: web.Request, response: web.StreamResponse) -> None:
            response.headers[WORKER_HEADER] = pid

        app.on_response_prepare.append(name_worker)
    stop = asyncio.Event()
    _stop_on_signals(stop)
    if worker:
        _stop_when_orphaned(args.worker_of, stop)
    async with running_gateway(app, config.listen.host, config.listen.port,
                               shutdown_timeout=args.shutdown_timeout, reuse_port=worker,
                               response_headers=named):
        log.info("gateway %slistening on http://%s:%d (%d replica entries, index %s, "
                 "policy %s, event loop %s)", f"worker {os.getpid()} " if worker else "",
                 config.listen.host, config.listen.port, len(config.replicas),
                 "redis" if config.index.is_redis else "memory", config.policy.name,
                 type(asyncio.get_running_loop()).__module__.split(".")[0])
        await stop.wait()
        log.info("shutting down")
    return 0


async def _supervise(config: GatewayConfig, args: argparse.Namespace) -> int:
    """Run listen.workers worker processes until SIGTERM/SIGINT or one of them exits."""
    stop = asyncio.Event()
    _stop_on_signals(stop)
    # Each worker reads the same config sources: this command line, the inherited env.
    cmd = [sys.executable, "-m", "router", *sys.argv[1:], "--worker-of", str(os.getpid())]
    # stdin: a pipe this process never writes to, closed when it exits (see
    # _stop_when_orphaned).
    workers = [await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.PIPE)
               for _ in range(config.listen.workers)]
    log.info("gateway on http://%s:%d: %d workers, pids %s", config.listen.host,
             config.listen.port, len(workers), ", ".join(str(w.pid) for w in workers))
    exits = {asyncio.create_task(w.wait()): w for w in workers}
    stopped = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([stopped, *exits], return_when=asyncio.FIRST_COMPLETED)
    code = 0
    for task in done:
        if task in exits:
            log.error("worker %d exited with %s; stopping the others", exits[task].pid,
                      exits[task].returncode)
            code = 1
    stopped.cancel()
    for w in workers:
        if w.returncode is None:
            w.send_signal(signal.SIGTERM)
    try:
        async with asyncio.timeout(args.shutdown_timeout + WORKER_STOP_MARGIN_S):
            await asyncio.gather(*exits)
    except TimeoutError:
        for w in workers:
            if w.returncode is None:
                log.error("worker %d did not stop in time; killing it", w.pid)
                w.kill()
        await asyncio.gather(*exits)
    log.info("all workers stopped")
    return code


def run(args: argparse.Namespace) -> int:
    """Run the gateway until SIGTERM/SIGINT; 2 on a configuration error."""
    setup_logging(args.log_level)
    try:
        config = config_from_args(args)
        check_workers(config)
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    if config.listen.workers > 1 and args.worker_of is None:
        return event_loop.run(_supervise(config, args), config.listen.event_loop)
    return event_loop.run(_serve(config, args), config.listen.event_loop)
