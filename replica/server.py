"""The simulated replica's OpenAI-compatible HTTP surface, driven in real time.

`SimReplica` owns the engine, the optional tokenizer and the KV-event publisher. One
task drives the engine: it runs a step, sleeps the step's virtual cost divided by the
time scale, then publishes the step's KV events and hands sampled tokens to the waiting
handlers. Handlers only parse (off the loop), validate and wait on their request's queue,
so a client disconnect (aiohttp cancels the handler: the runner is built with
handler_cancellation) aborts the request and frees its blocks.

Endpoints mirror vLLM 0.32's where a gateway touches them: /v1/completions (batched
prompts too) and /v1/chat/completions (streaming or not, usage with
prompt_tokens_details.cached_tokens, top-level cache_salt), /v1/models, /health,
/tokenize, /detokenize, /version, /metrics (vLLM's metric names and labels) and POST
/reset_prefix_cache. Errors are vLLM's OpenAI-style bodies.

When the engine dies (--crash-on-token), the replica does what vLLM's API server does on
EngineDeadError: every request in flight gets 500 with vLLM's EngineCore message (a
stream gets it as an error chunk), new requests get the same 500 and /health 503, and
the server shuts down (terminate_if_errored), so connections are then refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from replica.engine import Engine, EngineConfig, EngineDead, RequestRejected, RequestResult
from replica.kv_publisher import KVEventPublisher
from replica.openai_api import (
    ApiError,
    ModelSurface,
    ParsedRequest,
    check_model,
    full_body,
    model_card,
    parse_request,
    prompt_token_lists,
    usage,
)
from replica.sim_metrics import TTFT_BUCKETS, EngineCollector

log = logging.getLogger(__name__)

# What /version answers: the vLLM release whose behaviour the sim follows.
VLLM_VERSION = "0.32.0"


@dataclass
class SimSettings:
    """Everything `python -m replica sim` was started with."""

    engine: EngineConfig
    served_model_name: str = "sim"
    model_dir: Path | None = None
    time_scale: float = 1.0
    kv_events: str | None = None
    kv_replay: str | None = None
    engine_label: str = "0"
    max_chars_per_token: int | None = None


# What a request's queue carries: (prompt index, sampled tokens | its result | engine death).
_Item = tuple[int, "list[int] | RequestResult | EngineDead"]


@dataclass
class _Pending:
    """One HTTP request's engine requests, all feeding one queue (a batch merges)."""

    queue: asyncio.Queue[_Item] = field(default_factory=asyncio.Queue)
    arrival_wall: float = field(default_factory=time.monotonic)
    first_token_wall: float | None = None
    results: dict[int, RequestResult] = field(default_factory=dict)


class SimReplica:
    """The engine, its real-time driver, tokenizer and event publisher."""

    def __init__(self, settings: SimSettings, tokenizer: Any | None = None) -> None:
        self.settings = settings
        self.engine = Engine(settings.engine)
        self.tokenizer = tokenizer
        self.model = ModelSurface(settings.served_model_name, settings.engine.max_model_len,
                                  settings.engine.vocab_size, tokenizer,
                                  settings.max_chars_per_token)
        self.publisher: KVEventPublisher | None = None
        # engine request id -> (its HTTP request's pending state, its prompt index)
        self._pending: dict[str, tuple[_Pending, int]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Set when the engine dies: the server then shuts down, as vLLM's does.
        self.died = asyncio.Event()
        self.registry = CollectorRegistry()
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.",
                              ["model_name", "engine"], buckets=TTFT_BUCKETS,
                              registry=self.registry)
        self.registry.register(EngineCollector(self.engine, settings.served_model_name,
                                               settings.engine_label))

    @property
    def labels(self) -> dict[str, str]:
        return {"model_name": self.settings.served_model_name,
                "engine": self.settings.engine_label}

    async def start(self) -> None:
        if self.settings.kv_events:
            self.publisher = KVEventPublisher(self.settings.kv_events, self.settings.kv_replay)
            self.publisher.start()
        self._task = asyncio.get_running_loop().create_task(self._drive())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.publisher is not None:
            await self.publisher.close()

    def submit(self, parsed: ParsedRequest) -> _Pending:
        """Queue every prompt of a request; raises RequestRejected or EngineDead."""
        pending = _Pending()
        added: list[str] = []
        try:
            for i, req in enumerate(parsed.requests):
                req.arrival = self.engine.now
                self.engine.add_request(req)
                self._pending[req.request_id] = (pending, i)
                added.append(req.request_id)
        except (RequestRejected, EngineDead):
            for rid in added:
                self.abort(rid)
            raise
        self._wake.set()
        return pending

    def abort(self, request_id: str) -> None:
        if self._pending.pop(request_id, None) is not None and self.engine.dead is None:
            self.engine.abort(request_id)

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    async def _drive(self) -> None:
        try:
            await self._run_engine()
        except EngineDead as exc:
            self._fail_all(exc)

    def _fail_all(self, exc: EngineDead) -> None:
        log.error("EngineCore died: %s; failing %d in-flight requests and shutting down",
                  exc.cause, len(self._pending))
        for pending, index in self._pending.values():
            pending.queue.put_nowait((index, exc))
        self._pending.clear()
        self.died.set()

    async def _run_engine(self) -> None:
        scale = self.settings.time_scale
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.engine.has_work():
                out = self.engine.run_step()
                # The step's tokens exist only once its (scaled) cost has elapsed.
                await asyncio.sleep(out.duration / scale if out.duration > 0 else 0)
                if out.events and self.publisher is not None:
                    self.publisher.publish(out.events)
                now = time.monotonic()
                for rid, tokens in out.new_tokens.items():
                    entry = self._pending.get(rid)
                    if entry is None:
                        continue
                    pending, index = entry
                    if pending.first_token_wall is None:
                        pending.first_token_wall = now
                        self.ttft.labels(**self.labels).observe(now - pending.arrival_wall)
                    pending.queue.put_nowait((index, tokens))
                for result in out.finished:
                    done = self._pending.pop(result.request_id, None)
                    if done is not None:
                        done[0].queue.put_nowait((done[1], result))
                if out.num_scheduled_tokens == 0 and not out.finished:
                    break  # nothing schedulable: wait for the next request


REPLICA_KEY = web.AppKey("replica", SimReplica)


def error_response(exc: ApiError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


async def _json_body(request: web.Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ApiError(f"request body is not valid JSON: {exc}") from exc


async def _items(pending: _Pending, count: int) -> AsyncIterator[tuple[int, list[int]]]:
    """Sampled tokens as they come, until all `count` prompts finish; raises EngineDead."""
    left = count
    while left:
        index, item = await pending.queue.get()
        if isinstance(item, EngineDead):
            raise item
        if isinstance(item, RequestResult):
            left -= 1
            pending.results[index] = item
            continue
        yield index, item


def _text(replica: SimReplica, ids: list[int]) -> str:
    tok = replica.tokenizer
    return str(tok.decode(ids)) if tok is not None and ids else ""


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    replica = request.app[REPLICA_KEY]
    try:
        if replica.engine.dead is not None:
            raise ApiError.engine_dead()  # vLLM's _preflight: errored engine, 500 at once
        body = await _json_body(request)
        parsed = await asyncio.to_thread(parse_request, replica.model, body, chat)
        pending = replica.submit(parsed)
    except ApiError as exc:
        return error_response(exc)
    except RequestRejected as exc:
        return error_response(ApiError.rejected(exc))
    except EngineDead:
        return error_response(ApiError.engine_dead())
    try:
        if parsed.stream:
            return await _stream(request, replica, parsed, pending)
        try:
            async for _ in _items(pending, len(parsed.requests)):
                pass
        except EngineDead:
            return error_response(ApiError.engine_dead())
        results = [pending.results[i] for i in range(len(parsed.requests))]
        texts = [_text(replica, r.output_token_ids) for r in results]
        return web.json_response(full_body(parsed, results, replica.settings.served_model_name,
                                           texts))
    finally:
        # Reached with requests still pending only on disconnect or error: free them.
        for req in parsed.requests:
            replica.abort(req.request_id)


async def _stream(request: web.Request, replica: SimReplica, parsed: ParsedRequest,
                  pending: _Pending) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    chat = parsed.chat
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    model = replica.settings.served_model_name

    async def send(choices: list[dict[str, Any]], **extra: Any) -> None:
        chunk = {"id": parsed.request_id, "object": obj, "created": created, "model": model,
                 "choices": choices, **extra}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

    if chat:
        await send([{"index": 0, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}])
    first_index: int | None = None
    sent_prompt_ids: set[int] = set()
    try:
        async for index, tokens in _items(pending, len(parsed.requests)):
            if first_index is None:
                first_index = index  # vLLM's usage chunk takes this prompt's cached tokens
            choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": None}
            text = _text(replica, tokens)
            if chat:
                choice["delta"] = {"content": text}
            else:
                choice["text"] = text
            if parsed.return_token_ids:
                if not chat and index not in sent_prompt_ids:
                    sent_prompt_ids.add(index)
                    choice["prompt_token_ids"] = list(parsed.requests[index].prompt_token_ids)
                choice["token_ids"] = tokens
            await send([choice])
    except EngineDead:
        # Headers (200) are gone: vLLM sends the error as the stream's last event.
        await resp.write(b"data: " + json.dumps(ApiError.engine_dead().body()).encode()
                         + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp
    results = [pending.results[i] for i in range(len(parsed.requests))]
    for index, result in enumerate(results):
        last: dict[str, Any] = {"index": index, "logprobs": None,
                                "finish_reason": result.finish_reason, "stop_reason": None}
        if chat:
            last["delta"] = {}
        else:
            last["text"] = ""
        await send([last])
    if parsed.include_usage:
        await send([], usage=usage(results, results[first_index or 0].cached_tokens))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


# -- handlers ---------------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def models(request: web.Request) -> web.Response:
    replica = request.app[REPLICA_KEY]
    s = replica.settings
    root = str(s.model_dir) if s.model_dir else s.served_model_name
    return web.json_response({"object": "list", "data": [model_card(replica.model, root)]})


async def health(request: web.Request) -> web.Response:
    # vLLM answers 503 once its engine is dead, until the server has shut down.
    return web.Response(status=503 if request.app[REPLICA_KEY].engine.dead else 200)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": VLLM_VERSION})


async def tokenize(request: web.Request) -> web.Response:
    replica = request.app[REPLICA_KEY]
    try:
        body = await _json_body(request)
        if not isinstance(body, dict):
            raise ApiError("request body must be a JSON object")
        check_model(replica.model, body)
        prompts, _ = await asyncio.to_thread(prompt_token_lists, replica.model, body,
                                             "messages" in body)
    except ApiError as exc:
        return error_response(exc)
    tokens = prompts[0]
    return web.json_response({"count": len(tokens), "max_model_len": replica.model.max_model_len,
                              "tokens": tokens, "token_strs": None})


async def detokenize(request: web.Request) -> web.Response:
    replica = request.app[REPLICA_KEY]
    try:
        body = await _json_body(request)
        if not isinstance(body, dict):
            raise ApiError("request body must be a JSON object")
        check_model(replica.model, body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**63
                for t in tokens):
            raise ApiError("tokens must be a list of non-negative integer token ids",
                           param="tokens")
        if replica.tokenizer is None:
            raise ApiError("this simulated replica was started without --model, so it has no "
                           "tokenizer to detokenize with", param="tokens")
    except ApiError as exc:
        return error_response(exc)
    text = await asyncio.to_thread(replica.tokenizer.decode, tokens)
    return web.json_response({"prompt": str(text)})


async def metrics(request: web.Request) -> web.Response:
    replica = request.app[REPLICA_KEY]
    return web.Response(body=generate_latest(replica.registry),
                        content_type="text/plain", charset="utf-8")


async def reset_prefix_cache(request: web.Request) -> web.Response:
    replica = request.app[REPLICA_KEY]
    return web.json_response({"success": replica.reset_prefix_cache()})


@web.middleware
async def _unserved_as_api_error(request: web.Request, handler: Any) -> web.StreamResponse:
    """A path or method the sim does not serve (vLLM's /v1/responses, /v1/messages,
    /v1/embeddings, ...) answered in vLLM's error shape, not aiohttp's plain-text page:
    a gateway relays a replica's refusal to its client as it is."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as exc:
        return error_response(ApiError(
            f"{request.method} {request.path} is not served by the simulated replica",
            status=exc.status, err_type=None if exc.status == 404 else "MethodNotAllowed"))


def build_app(replica: SimReplica) -> web.Application:
    """The aiohttp app serving `replica`; starting the app starts the replica's driver."""
    app = web.Application(client_max_size=256 * 1024 * 1024,
                          middlewares=[_unserved_as_api_error])
    app[REPLICA_KEY] = replica

    async def lifecycle(_app: web.Application) -> AsyncIterator[None]:
        await replica.start()
        yield
        await replica.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    return app


async def serve(replica: SimReplica, host: str, port: int,
                stop: asyncio.Event | None = None) -> bool:
    """Serve until `stop` is set or the engine dies; returns whether the engine died."""
    runner = web.AppRunner(build_app(replica), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    log.info("simulated replica %s listening on http://%s:%d",
             replica.settings.served_model_name, host, port)
    waits = [asyncio.ensure_future(replica.died.wait())]
    if stop is not None:
        waits.append(asyncio.ensure_future(stop.wait()))
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
        # Stops listening first, then lets in-flight handlers write their answers.
        await runner.cleanup()
    return replica.died.is_set()
