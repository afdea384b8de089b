"""The rest of vLLM 0.32's OpenAI server surface, served through the gateway.

- /v1/responses and /v1/messages (Anthropic) carry a conversation: it is turned into the
  chat messages vLLM renders for it (`chat_view`), routed cache-aware like a chat
  request (the tenant's cache_salt added, as vLLM accepts it on both), and the client's
  own body is forwarded to the chosen replica. A conversation the gateway cannot read
  as text (images, tool items) routes on load alone.
- /tokenize, /v1/embeddings: to the least loaded available replica serving the body's
  model (neither reads the prefix cache, so there is nothing to route by); 404 naming
  the served models when none serves it. An embeddings request a replica cannot serve
  (a generative model) gets that replica's own answer, as from vLLM.
- /detokenize, /version: any available replica (a model-less /detokenize too).

Answers are relayed as the replica sent them, streams chunk by chunk.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web

from router import lax_fields
from router.admission import Overloaded
from router.gateway import GATEWAY, REQUEST_ID, Gateway, served_models, tenant_of
from router.policy.pipeline import NoReplicasError
from router.proxy import json_error
from router.replicas import Replica
from router.request import ClientError, ParsedRequest, decode_body, requested_model
from router.routing import KnownTokens
from router.tenants import ClientSaltError
from router.upstream_http import UpstreamResponse

log = logging.getLogger(__name__)

_LOAD_ONLY = KnownTokens(())  # a prompt the gateway cannot read: routed on load alone

async def _body(request: web.Request, gw: Gateway) -> tuple[bytes, dict[str, Any]]:
    limit = gw.config.proxy.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise ClientError(f"request body exceeds {limit} bytes", status=413)
    raw = await request.content.read(limit + 1)
    if len(raw) > limit:
        raise ClientError(f"request body exceeds {limit} bytes", status=413)
    return raw, decode_body(raw)


def _serving(gw: Gateway, model: object) -> list[Replica]:
    """Available replicas serving `model` (any available one when no model is named)."""
    assert gw.fleet is not None
    if model is None:
        pool = gw.fleet.available()
    else:
        if not isinstance(model, str) or not model:
            raise ClientError("'model' must be a string", "model")
        if model not in served_models(gw):
            raise ClientError(f"The model '{model}' does not exist; this gateway serves "
                              f"{', '.join(sorted(served_models(gw)))}", "model", status=404)
        pool = gw.fleet.available(model)
    if not pool:
        raise ClientError("no healthy replica is available", status=503,
                          type="service_unavailable")
    return pool


def _least_loaded(replicas: list[Replica]) -> Replica:
    return min(replicas, key=lambda r: (sum(r.outstanding()), r.inflight))


def _headers(gw: Gateway, replica: Replica) -> dict[str, str]:
    out = {"x-request-id": REQUEST_ID.get()}
    if gw.config.proxy.expose_routing_headers:
        out["x-cacheroute-replica"] = replica.replica_id
    return out


async def _relay(gw: Gateway, request: web.Request, replica: Replica, path: str,
                 payload: bytes | None, extra_headers: Mapping[str, str] | None = None,
                 ) -> web.StreamResponse:
    """Send the request to `replica` and hand its answer to the client as it comes."""
    assert gw.upstream is not None
    headers = {"x-request-id": REQUEST_ID.get()}
    if payload is not None:
        headers["Content-Type"] = "application/json"
    replica.start_request()
    resp: UpstreamResponse | None = None
    try:
        resp = await gw.upstream.send(request.method, replica.base_url, path, payload, headers,
                                      connect_timeout_s=gw.config.proxy.connect_timeout_s)
        out_headers = {**_headers(gw, replica), **(extra_headers or {})}
        content_type = resp.headers.get("content-type", "application/json")
        if not content_type.startswith("text/event-stream"):
            body = await resp.read()
            return web.Response(status=resp.status, body=body,
                                headers={"Content-Type": content_type, **out_headers})
        response = web.StreamResponse(status=resp.status, headers={
            "Content-Type": content_type, "Cache-Control": "no-cache", **out_headers})
        await response.prepare(request)
        try:
            while chunk := await resp.readany():
                await response.write(chunk)
            await response.write_eof()
        except OSError as exc:
            # The client left, or the replica broke off mid-stream: the answer has
            # begun, so there is nothing to retry; leaving closes the upstream
            # connection, which is how vLLM learns to abort.
            log.info("%s stream from %s ended early: %s", path, replica.replica_id, exc)
        return response
    except (TimeoutError, OSError) as exc:
        log.warning("%s on %s failed: %s", path, replica.replica_id, exc)
        return json_error(502, f"replica {replica.replica_id} failed: {type(exc).__name__}",
                          "upstream_error")
    finally:
        if resp is not None:
            resp.release()  # kept when read to its end, else dropped
        replica.end_request()


async def handle_version(request: web.Request) -> web.StreamResponse:
    """GET /version: the replicas' vLLM version (any available replica answers)."""
    gw = request.app[GATEWAY]
    tenant_of(gw, request)
    return await _relay(gw, request, _least_loaded(_serving(gw, None)), "/version", None)


async def handle_by_model(request: web.Request) -> web.StreamResponse:
    """POST /tokenize, /detokenize, /v1/embeddings: the least loaded replica serving the
    body's model (any replica when a /detokenize names none)."""
    gw = request.app[GATEWAY]
    tenant_of(gw, request)
    raw, body = await _body(request, gw)
    model = body.get("model")
    if model is not None or request.path != "/detokenize":
        # vLLM's tokenize and embedding requests take model: str | None, as completions do.
        model = requested_model(body, served_models(gw))
    return await _relay(gw, request, _least_loaded(_serving(gw, model)), request.path, raw)


def _text(content: object) -> str | None:
    """A message's content as text: a string, or text parts joined; None if any part is
    not text (an image, a tool block): such a prompt is not known to the gateway."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("text", "input_text",
                                                                    "output_text"):
            return None
        text = part.get("text")
        if not isinstance(text, str):
            return None
        texts.append(text)
    return "".join(texts)


def anthropic_chat(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The chat messages vLLM renders for an Anthropic /v1/messages body
    (AnthropicServingMessages.to_chat_completion_request: the system blocks joined into
    one leading system message, then each message), or None where it is not all text."""
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        text = _text(system)
        if text is None:
            return None
        messages.append({"role": "system", "content": text})
    for msg in body.get("messages") or ():
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            return None
        text = _text(msg.get("content"))
        if text is None:
            return None
        messages.append({"role": msg["role"], "content": text})
    return messages or None


def responses_chat(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The chat messages vLLM renders for a /v1/responses body: `instructions` as the
    system message, then `input` (a string is one user message), or None where an input
    item is not a text message (or the request continues a stored response)."""
    if body.get("previous_response_id") is not None:
        return None  # the earlier turns live in the replica that stored them
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list):
        return None
    for item in items:
        if not isinstance(item, dict) or item.get("type", "message") != "message" or \
                not isinstance(item.get("role"), str):
            return None
        text = _text(item.get("content"))
        if text is None:
            return None
        messages.append({"role": item["role"], "content": text})
    return messages or None


def chat_view(path: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
    """A chat-completions body standing for `body`'s prompt, for routing; None if unknown."""
    messages = anthropic_chat(body) if path == "/v1/messages" else responses_chat(body)
    if messages is None:
        return None
    view: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    tools = body.get("tools")
    if path == "/v1/messages" and isinstance(tools, list) and tools:
        # vLLM hands Anthropic tools to the chat template as OpenAI function tools.
        view["tools"] = [{"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description"),
            "parameters": t.get("input_schema")}} for t in tools if isinstance(t, dict)]
    return view


def _with_salt(raw: bytes, body: dict[str, Any], salt: str | None) -> bytes:
    if salt is None:
        return raw
    return json.dumps({**body, "cache_salt": salt}, separators=(",", ":")).encode()


async def handle_conversation(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses and /v1/messages: routed by the conversation's prefix."""
    gw = request.app[GATEWAY]
    assert gw.fleet is not None and gw.pipeline is not None and gw.admission is not None
    tenant = tenant_of(gw, request)
    raw, body = await _body(request, gw)
    model = body.get("model")
    if model is not None or request.path == "/v1/responses":
        # vLLM's ResponsesRequest takes model: str | None (its own model when absent);
        # its Anthropic MessagesRequest requires one.
        model = requested_model(body, served_models(gw))
    if model is None:
        raise ClientError("'model' is required", "model")
    served = _serving(gw, model)
    try:
        salt = gw.tenants.effective_salt(tenant, body.get("cache_salt"))
    except ClientSaltError as exc:
        raise ClientError(str(exc), "cache_salt") from None
    view = chat_view(request.path, body)
    parsed = ParsedRequest(endpoint="chat", body=view or {"model": model, "messages": []},
                           model=str(model),
                           # bool | None in vLLM's ResponsesRequest and MessagesRequest alike
                           stream=bool(lax_fields.field(body, "stream", "chat")),
                           client_wants_usage=True, max_tokens=None, cache_salt=salt, raw=raw)
    known = None if view is not None else _LOAD_ONLY
    session_key = request.headers.get("x-session-id")
    try:
        route = await gw.pipeline.route(parsed, served, gw.fleet.now(), tenant.tenant_id,
                                        salt, session_key, offload=True, tokenizer=known)
    except NoReplicasError:
        return json_error(503, "no replica serves this model", "service_unavailable")
    except ClientError:
        # vLLM's renderer may accept what the gateway's cannot: route on load instead.
        route = await gw.pipeline.route(parsed, served, gw.fleet.now(), tenant.tenant_id,
                                        salt, session_key, offload=False,
                                        tokenizer=_LOAD_ONLY)
    if not route.candidates:
        return json_error(503, "no replica serves this model", "service_unavailable")
    try:
        slot = await gw.admission.acquire([r.replica_id for r in route.candidates])
    except Overloaded as exc:
        route.drop_pending(gw.pipeline.pending)  # refused: no replica will cache it
        gw.metrics.record_overloaded(tenant.tenant_id)
        return json_error(429, str(exc), "rate_limit_error",
                          headers={"Retry-After": exc.retry_after_header})
    async with slot:
        by_id = {r.replica_id: r for r in route.candidates}
        replica = by_id[slot.replica_id]
        extra = {}
        if gw.config.proxy.expose_routing_headers:
            extra["x-cacheroute-predicted-cached-tokens"] = str(
                route.predicted_for(replica.replica_id))
        response: web.StreamResponse | None = None
        try:
            response = await _relay(gw, request, replica, request.path,
                                    _with_salt(raw, body, salt), extra)
            return response
        finally:
            route.settle_pending(gw.pipeline.pending, replica.replica_id,
                                 response.status if response is not None else 0)


async def models_cards(gw: Gateway) -> list[dict[str, Any]]:
    """vLLM's /v1/models entries (root, parent, max_model_len...) for each served model,
    as one available replica serving it reports them; a bare entry where none answers."""
    assert gw.fleet is not None and gw.session is not None
    names = sorted(served_models(gw))
    timeout = aiohttp.ClientTimeout(total=gw.config.health.timeout_s)

    async def ask(replica: Replica) -> list[dict[str, Any]]:
        assert gw.session is not None
        try:
            async with gw.session.get(f"{replica.base_url}/v1/models", timeout=timeout) as r:
                data = await r.json(content_type=None) if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return []
        cards = data.get("data") if isinstance(data, dict) else None
        return [c for c in cards or () if isinstance(c, dict)]

    askers = {(r := _least_loaded(pool)).replica_id: r for name in names
              if (pool := gw.fleet.available(name))}
    replies = await asyncio.gather(*(ask(r) for r in askers.values()))
    cards: dict[str, dict[str, Any]] = {}
    for reply in replies:
        for card in reply:
            cards.setdefault(str(card.get("id")), card)
    out = []
    for name in names:
        if name not in cards:
            tokenizer = gw.tokenizers.get(name)
            cards[name] = {"id": name, "object": "model", "created": 0, "owned_by": "vllm",
                    "root": name, "parent": None,
                    "max_model_len": (tokenizer.max_model_len or None) if tokenizer else None}
        out.append(cards[name])
    return out
