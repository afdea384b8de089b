"""The gateway's small endpoints and the middleware every request passes through
(request id, OpenAI-style errors, request counting). The completion endpoints are in
router.completions."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web

from router.deadlines import within
from router.endpoints import models_cards
from router.front_http import AnyRequest, AnyResponse
from router.gateway import (
    GATEWAY,
    INDEX_OP_TIMEOUT_S,
    REQUEST_ID,
    note_index_state,
    tenant_of,
)
from router.index import IndexUnavailable
from router.metrics import CONTENT_TYPE
from router.openapi import openapi_spec
from router.proxy import json_error
from router.request import ENDPOINTS, ClientError

log = logging.getLogger(__name__)

R = TypeVar("R", bound=AnyRequest)

@web.middleware
async def request_context(request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                          ) -> web.StreamResponse:
    """Request id (forwarded or generated), OpenAI-style errors, request counting."""
    response = await run_handler(request, handler)
    assert isinstance(response, web.StreamResponse)
    return response


async def run_handler(request: R, handler: Callable[[R], Awaitable[AnyResponse]]
                      ) -> AnyResponse:
    """`handler(request)` with the request id set (forwarded or generated), errors
    answered OpenAI-style, and the request counted: the middleware of aiohttp's server
    and of the fast front (router/front_http.py) alike."""
    gw = request.app[GATEWAY]
    request_id = request.headers.get("x-request-id") or gw.request_ids.next()
    token = REQUEST_ID.set(request_id)
    status = 500
    try:
        response: AnyResponse
        try:
            response = await handler(request)
        except ClientError as exc:
            response = web.json_response(exc.payload(), status=exc.status, headers=exc.headers)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            response = json_error(exc.status, exc.reason, "invalid_request_error")
        except Exception:
            log.exception("unhandled error serving %s %s", request.method, request.path)
            response = json_error(500, "internal gateway error", "internal_error")
        if not response.prepared:
            response.headers.setdefault("x-request-id", request_id)
        status = response.status
        return response
    finally:
        gw.metrics.record_request(request.path if request.path in _COUNTED_PATHS else "other",
                                  status)
        REQUEST_ID.reset(token)


_COUNTED_PATHS = frozenset({*ENDPOINTS, "/v1/models", "/health", "/ready", "/metrics",
                            "/openapi.json", "/v1/responses", "/v1/messages", "/tokenize",
                            "/detokenize", "/version", "/v1/embeddings"})


async def handle_models(request: web.Request) -> web.Response:
    """GET /v1/models: the union of the models the fleet serves, each entry as vLLM's
    (max_model_len, root, parent) from a replica serving it."""
    gw = request.app[GATEWAY]
    tenant_of(gw, request)
    return web.json_response({"object": "list", "data": await models_cards(gw)})


async def handle_health(request: web.Request) -> web.Response:
    """GET /health: the process is alive."""
    return web.json_response({"status": "ok"})


async def handle_ready(request: web.Request) -> web.Response:
    """GET /ready: 200 while some replica is available; index and replica states."""
    gw = request.app[GATEWAY]
    assert gw.fleet is not None and gw.index is not None
    try:
        # Redis where there is one: a mirrored index answers lookups without it.
        await within((gw.redis or gw.index).lookup("cacheroute-ready-probe", [0]),
                     INDEX_OP_TIMEOUT_S)
        index_state = "ok"
    except (TimeoutError, IndexUnavailable, OSError) as exc:
        index_state = f"down: {type(exc).__name__}"
    # A probe answers for the index too: with no traffic, /ready is what notices.
    note_index_state(gw, "ok" if index_state == "ok" else "down")
    ready = gw.fleet.any_available()
    body: dict[str, Any] = {
        "ready": ready,
        "index": {"backend": gw.index_backend, "status": index_state,
                  "last_lookup": gw.index_status},
        "replicas": gw.fleet.describe(),
    }
    if gw.indexer is not None:
        body["events"] = {rid: {"last_seq": s.last_seq, "batches": s.batches, "gaps": s.gaps,
                                "restarts": s.restarts, "lag_s": s.lag_s()}
                          for rid, s in gw.indexer.stats().items()}
    return web.json_response(body, status=200 if ready else 503)


async def handle_metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus exposition of the cacheroute_* collectors."""
    gw = request.app[GATEWAY]
    return web.Response(body=gw.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def handle_openapi(request: web.Request) -> web.Response:
    """GET /openapi.json: the gateway's HTTP surface."""
    return web.json_response(openapi_spec())
