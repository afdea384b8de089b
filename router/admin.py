"""The admin listener: /health, /ready and /metrics on a port of their own.

/ready names every replica, its state and last error, and the index's state; /metrics
counts requests per tenant and replica. Neither asks for an API key (probes and
Prometheus carry none), so with `listen.admin_port` set they leave the API port and
answer only here, where a NetworkPolicy or a loopback bind can keep them to the
kubelet and the scraper (docs/SECURITY.md). /health stays on both: it says nothing.
"""

from __future__ import annotations

from aiohttp import web

from router.gateway import GATEWAY, Gateway
from router.handlers import handle_health, handle_metrics, handle_ready, request_context

ADMIN_PATHS = ("/ready", "/metrics")  # served only by the admin listener when it is on


def build_admin_app(gw: Gateway) -> web.Application:
    """The admin listener's app, sharing the API app's gateway state."""
    app = web.Application(middlewares=[request_context])
    app[GATEWAY] = gw
    app.router.add_get("/health", handle_health)
    app.router.add_get("/ready", handle_ready)
    app.router.add_get("/metrics", handle_metrics)
    return app
