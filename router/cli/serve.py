"""`python -m router serve`: run the cache-aware gateway.

    python -m router serve --config gateway.yaml [--port 8000] [--set proxy.max_retries=3]

Configuration comes from the file, then CACHEROUTE_* environment variables, then flags
(router.config). Logs carry each request's id; API keys never reach a log line (the
gateway never logs headers or bodies). Runs until SIGTERM or SIGINT, then stops
accepting, lets in-flight requests finish within --shutdown-timeout, and closes every
resource.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from aiohttp.http_exceptions import BadHttpMessage

from router.app import REQUEST_ID, build_app, running_gateway
from router.config import ConfigError, add_config_arguments, config_from_args

log = logging.getLogger(__name__)


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


async def _serve(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    app = build_app(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with running_gateway(app, config.listen.host, config.listen.port,
                               shutdown_timeout=args.shutdown_timeout):
        log.info("gateway listening on http://%s:%d (%d replica entries, index %s, policy %s)",
                 config.listen.host, config.listen.port, len(config.replicas),
                 "redis" if config.index.is_redis else "memory", config.policy.name)
        await stop.wait()
        log.info("shutting down")
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the gateway until SIGTERM/SIGINT; 2 on a configuration error."""
    setup_logging(args.log_level)
    try:
        return asyncio.run(_serve(args))
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
