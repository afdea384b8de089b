"""The simulated replica's OpenAI-compatible HTTP surface, driven in real time.

`SimReplica` owns the engine, the optional tokenizer and the KV-event publisher. One
task drives the engine: it runs a step, sleeps the step's virtual cost divided by the
time scale, then publishes the step's KV events and hands sampled tokens to the waiting
handlers. Handlers only tokenize, validate and wait on their request's queue, so a
client disconnect (aiohttp cancels the handler: the runner is built with
handler_cancellation) aborts the request and frees its blocks.

Endpoints mirror vLLM 0.32's where a gateway touches them: /v1/completions and
/v1/chat/completions (streaming or not, usage with prompt_tokens_details.cached_tokens,
top-level cache_salt), /v1/models, /health, /tokenize, /metrics (vLLM's metric names
and labels) and POST /reset_prefix_cache. Errors are vLLM's OpenAI-style bodies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from replica.engine import Engine, EngineConfig, EngineRequest, RequestRejected, RequestResult
from replica.kv_publisher import KVEventPublisher

log = logging.getLogger(__name__)

_CACHE_SALT_MAX = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
# vLLM's classic TTFT buckets (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


class ApiError(Exception):
    """A client error turned into vLLM's {"error": {...}} body at the edge."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    @property
    def err_type(self) -> str:
        return {400: "BadRequestError", 404: "NotFoundError"}.get(self.status, "BadRequestError")


def error_response(exc: ApiError) -> web.Response:
    body = {"error": {"message": exc.message, "type": exc.err_type, "param": exc.param,
                      "code": exc.status}}
    return web.json_response(body, status=exc.status)


def validate_cache_salt(value: object) -> str | None:
    """vLLM's validate_cache_salt: non-empty, at most 128 chars, no '@' '/' '\\' or NUL."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ApiError("Parameter 'cache_salt' must be a non-empty string if provided.",
                       param="cache_salt")
    if len(value) > _CACHE_SALT_MAX or any(c in _CACHE_SALT_FORBIDDEN for c in value):
        raise ApiError("Parameter 'cache_salt' must be at most 128 characters and must not "
                       "contain '@', '/', '\\\\', or NUL.", param="cache_salt")
    return value


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


@dataclass
class _Pending:
    queue: asyncio.Queue[list[int] | RequestResult] = field(default_factory=asyncio.Queue)
    arrival_wall: float = field(default_factory=time.monotonic)
    first_token_wall: float | None = None


class SimReplica:
    """The engine, its real-time driver, tokenizer and event publisher."""

    def __init__(self, settings: SimSettings, tokenizer: Any | None = None) -> None:
        self.settings = settings
        self.engine = Engine(settings.engine)
        self.tokenizer = tokenizer
        self.publisher: KVEventPublisher | None = None
        self._pending: dict[str, _Pending] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.registry = CollectorRegistry()
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.",
                              ["model_name", "engine"], buckets=TTFT_BUCKETS,
                              registry=self.registry)
        self.registry.register(_EngineCollector(self))

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

    def submit(self, req: EngineRequest) -> _Pending:
        """Queue a request for the engine; raises RequestRejected."""
        req.arrival = self.engine.now
        self.engine.add_request(req)
        pending = _Pending()
        self._pending[req.request_id] = pending
        self._wake.set()
        return pending

    def abort(self, request_id: str) -> None:
        if self._pending.pop(request_id, None) is not None:
            self.engine.abort(request_id)

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    async def _drive(self) -> None:
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
                    pending = self._pending.get(rid)
                    if pending is None:
                        continue
                    if pending.first_token_wall is None:
                        pending.first_token_wall = now
                        self.ttft.labels(**self.labels).observe(now - pending.arrival_wall)
                    pending.queue.put_nowait(tokens)
                for result in out.finished:
                    done = self._pending.pop(result.request_id, None)
                    if done is not None:
                        done.queue.put_nowait(result)
                if out.num_scheduled_tokens == 0 and not out.finished:
                    break  # nothing schedulable: wait for the next request


class _EngineCollector:
    """Reads the engine's counters at scrape time, under vLLM's metric names."""

    def __init__(self, replica: SimReplica) -> None:
        self.replica = replica

    def collect(self) -> Iterable[Metric]:
        eng = self.replica.engine
        stats = eng.stats
        names = ["model_name", "engine"]
        values = [self.replica.settings.served_model_name, self.replica.settings.engine_label]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    eng.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    eng.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    eng.kv_usage())
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.", stats.queries)
        yield counter("vllm:prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.", stats.hits)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      stats.preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                      stats.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      stats.generation_tokens)
        yield counter("vllm:request_success", "Count of successfully processed requests.",
                      stats.finished)
        # Not a vLLM metric (vLLM only samples eviction ages): the sim counts every eviction.
        yield counter("sim:kv_block_evictions", "Cached KV blocks evicted for reuse.",
                      stats.evictions)
        yield gauge("sim:kv_cached_blocks", "Blocks currently holding a cached key.",
                    eng.kv.pool.num_cached_blocks())


# -- request parsing --------------------------------------------------------------

REPLICA_KEY = web.AppKey("replica", SimReplica)


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    return body


def _check_model(replica: SimReplica, body: dict[str, Any]) -> None:
    model = body.get("model")
    if model is not None and model != replica.settings.served_model_name:
        raise ApiError(f"The model `{model}` does not exist.", status=404, param="model")


def _int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"{name} must be an integer, got {json.dumps(value)}", param=name)
    return value


def _token_id_prompt(prompt: Any) -> list[int] | None:
    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in x)

    if is_ids(prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and is_ids(prompt[0]):
        return list(prompt[0])
    return None


async def _prompt_tokens(replica: SimReplica, body: dict[str, Any], chat: bool) -> list[int]:
    tok = replica.tokenizer
    if tok is None:
        if chat:
            raise ApiError("this simulated replica was started without --model, so it has no "
                           "tokenizer or chat template: use /v1/completions with a prompt of "
                           "token ids", param="messages")
        ids = _token_id_prompt(body.get("prompt"))
        if ids is None:
            raise ApiError("this simulated replica was started without --model: prompt must "
                           "be a non-empty list of token ids", param="prompt")
        return ids
    from router.tokenize import RequestError

    try:
        if chat:
            return list(await asyncio.to_thread(tok.chat_tokens, body))
        prompts = await asyncio.to_thread(tok.completion_prompts, body)
    except RequestError as exc:
        raise ApiError(str(exc), param=getattr(exc, "param", None)) from exc
    if len(prompts) != 1:
        raise ApiError("the simulated replica serves one prompt per request", param="prompt")
    return list(prompts[0])


@dataclass
class _Parsed:
    req: EngineRequest
    stream: bool
    include_usage: bool
    return_token_ids: bool


async def _parse(replica: SimReplica, body: dict[str, Any], chat: bool) -> _Parsed:
    _check_model(replica, body)
    salt = validate_cache_salt(body.get("cache_salt"))
    n = _int_field(body, "n")
    if n is not None and n != 1:
        raise ApiError("the simulated replica supports only n=1", param="n")
    max_tokens = _int_field(body, "max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError("stream must be a boolean", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError("stream_options must be an object", param="stream_options")
    if opts and not stream:
        raise ApiError("Stream options can only be defined when `stream=True`.",
                       param="stream_options")
    tokens = await _prompt_tokens(replica, body, chat)
    if replica.tokenizer is not None and max(tokens) >= replica.settings.engine.vocab_size:
        # vLLM validates ids only when it has a tokenizer, against the larger of the
        # tokenizer's and the model's vocabulary.
        raise ApiError(f"Token id {max(tokens)} is out of vocabulary")
    limit = replica.settings.engine.max_model_len
    if max_tokens is None:
        # vLLM's defaults: 16 for completions, the rest of the context for chat.
        max_tokens = 16 if not chat else max(limit - len(tokens), 1)
    if max_tokens < 1:
        raise ApiError(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    xargs = body.get("vllm_xargs") or {}
    if not isinstance(xargs, dict):
        raise ApiError("vllm_xargs must be an object", param="vllm_xargs")
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    req = EngineRequest(rid, tokens, max_tokens, cache_salt=salt,
                        skip_prefix_cache=body.get("prompt_logprobs") is not None,
                        report_cached_blocks=xargs.get("kv_cache_report_mode") == "full")
    return _Parsed(req, stream,
                   bool(opts.get("include_usage", False)), body.get("return_token_ids") is True)


def _usage(result: RequestResult) -> dict[str, Any]:
    completion = len(result.output_token_ids)
    return {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}


def _text(replica: SimReplica, ids: list[int]) -> str:
    tok = replica.tokenizer
    return str(tok.decode(ids)) if tok is not None and ids else ""


async def _events(pending: _Pending) -> AsyncIterator[list[int] | RequestResult]:
    while True:
        item = await pending.queue.get()
        yield item
        if isinstance(item, RequestResult):
            return


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    replica = request.app[REPLICA_KEY]
    try:
        parsed = await _parse(replica, await _json_body(request), chat)
        pending = replica.submit(parsed.req)
    except ApiError as exc:
        return error_response(exc)
    except RequestRejected as exc:
        return error_response(ApiError(exc.message, param=exc.param))
    rid = parsed.req.request_id
    try:
        if parsed.stream:
            return await _stream(request, replica, parsed, pending, chat)
        result: RequestResult | None = None
        async for item in _events(pending):
            if isinstance(item, RequestResult):
                result = item
        assert result is not None
        return web.json_response(_full_body(replica, parsed, result, chat))
    finally:
        # Reached with the request still pending only on disconnect or error: free it.
        replica.abort(rid)


def _full_body(replica: SimReplica, parsed: _Parsed, result: RequestResult,
               chat: bool) -> dict[str, Any]:
    text = _text(replica, result.output_token_ids)
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": result.finish_reason,
                              "stop_reason": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
    else:
        choice["text"] = text
        choice["prompt_logprobs"] = None
    if parsed.return_token_ids:
        choice["token_ids"] = result.output_token_ids
    body: dict[str, Any] = {
        "id": result.request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": replica.settings.served_model_name,
        "choices": [choice],
        "usage": _usage(result),
    }
    if parsed.return_token_ids:
        body["prompt_token_ids"] = list(parsed.req.prompt_token_ids)
    return body


async def _stream(request: web.Request, replica: SimReplica, parsed: _Parsed, pending: _Pending,
                  chat: bool) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    rid = parsed.req.request_id
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    model = replica.settings.served_model_name

    async def send(choices: list[dict[str, Any]], **extra: Any) -> None:
        chunk = {"id": rid, "object": obj, "created": created, "model": model,
                 "choices": choices, **extra}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

    if chat:
        await send([{"index": 0, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}])
    result: RequestResult | None = None
    async for item in _events(pending):
        if isinstance(item, RequestResult):
            result = item
            break
        text = _text(replica, item)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": None}
        if chat:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        if parsed.return_token_ids:
            choice["token_ids"] = item
        await send([choice])
    assert result is not None
    last: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": result.finish_reason,
                            "stop_reason": None}
    if chat:
        last["delta"] = {}
    else:
        last["text"] = ""
    await send([last])
    if parsed.include_usage:
        await send([], usage=_usage(result))
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
    card = {"id": s.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "vllm", "root": str(s.model_dir) if s.model_dir else s.served_model_name,
            "parent": None, "max_model_len": s.engine.max_model_len, "permission": []}
    return web.json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def tokenize(request: web.Request) -> web.Response:
    replica = request.app[REPLICA_KEY]
    try:
        body = await _json_body(request)
        _check_model(replica, body)
        tokens = await _prompt_tokens(replica, body, chat="messages" in body)
    except ApiError as exc:
        return error_response(exc)
    return web.json_response({"count": len(tokens), "tokens": tokens, "token_strs": None,
                              "max_model_len": replica.settings.engine.max_model_len})


async def metrics(request: web.Request) -> web.Response:
    replica = request.app[REPLICA_KEY]
    return web.Response(body=generate_latest(replica.registry),
                        content_type="text/plain", charset="utf-8")


async def reset_prefix_cache(request: web.Request) -> web.Response:
    replica = request.app[REPLICA_KEY]
    return web.json_response({"success": replica.reset_prefix_cache()})


def build_app(replica: SimReplica) -> web.Application:
    """The aiohttp app serving `replica`; starting the app starts the replica's driver."""
    app = web.Application(client_max_size=256 * 1024 * 1024)
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
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    return app


async def serve(replica: SimReplica, host: str, port: int,
                stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set (or forever)."""
    runner = web.AppRunner(build_app(replica), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    log.info("simulated replica %s listening on http://%s:%d",
             replica.settings.served_model_name, host, port)
    try:
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        await runner.cleanup()
