"""The sim's OpenAI surface without I/O: request bodies in, engine requests and response bodies out.

`parse_request` turns a /v1/completions or /v1/chat/completions body into one
EngineRequest per prompt (vLLM serves a batch of completion prompts as one request with
one choice per prompt), applying vLLM 0.32's checks in vLLM's order (request_rules.py).
It tokenizes, so callers run it off the event loop. The body builders lay out choices
and usage as vLLM's serving code does, batch quirks included.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from replica import request_rules as rules
from replica.engine import EngineDead, EngineRequest, RequestRejected, RequestResult
from router import lax_fields
from router.client_error import ClientError
from router.lax_fields import Endpoint


class ApiError(Exception):
    """A client (or engine) error turned into vLLM's {"error": {...}} body at the edge."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 err_type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.err_type = err_type or {404: "NotFoundError", 500: "InternalServerError"}.get(
            status, "BadRequestError")

    @classmethod
    def rejected(cls, exc: RequestRejected) -> ApiError:
        return cls(exc.message, param=exc.param, err_type=exc.err_type)

    @classmethod
    def engine_dead(cls) -> ApiError:
        """vLLM's answer once its EngineCore has died (EngineDeadError -> 500)."""
        return cls(EngineDead.MESSAGE, status=500)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": self.status}}


@dataclass(frozen=True)
class ModelSurface:
    """What request parsing needs to know about the served model."""

    served_model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any | None = None
    # The longest token string in the vocabulary: vLLM's character bound on text prompts.
    max_chars_per_token: int | None = None


@dataclass
class ParsedRequest:
    """One HTTP request as the engine sees it: a request per prompt, in prompt order."""

    request_id: str
    requests: list[EngineRequest]
    chat: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool


def check_model(model: ModelSurface, body: dict[str, Any]) -> None:
    name = body.get("model")
    if name is not None and name != model.served_model_name:
        raise ApiError(f"The model `{name}` does not exist.", status=404, param="model")


def _prompts_without_tokenizer(body: dict[str, Any]) -> list[list[int]]:
    prompt = lax_fields.prompt(body.get("prompt"))  # as vLLM reads it: [1.0, 2] is ids
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) and p for p in prompt):
        return [list(p) for p in prompt]  # type: ignore[arg-type]
    raise ApiError("this simulated replica was started without --model: prompt must be a "
                   "list of token ids or a list of such lists", param="prompt")


def _text_lengths(body: dict[str, Any], count: int) -> list[int | None]:
    """Characters of each completion prompt that was text (None for token ids)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [len(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [len(p) for p in prompt]
    return [None] * count


def prompt_token_lists(model: ModelSurface, body: dict[str, Any],
                       chat: bool) -> tuple[list[list[int]], list[int | None]]:
    """Each prompt's token ids, and its text length when it was text (for vLLM's checks)."""
    tok = model.tokenizer
    if tok is None:
        if chat:
            raise ApiError("this simulated replica was started without --model, so it has no "
                           "tokenizer or chat template: use /v1/completions with a prompt of "
                           "token ids", param="messages")
        prompts = _prompts_without_tokenizer(body)
        return prompts, [None] * len(prompts)
    from router.tokenize import RequestError

    try:
        if chat:
            ids = list(tok.chat_tokens(body))
            chars = None
            if len(ids) > model.max_model_len and body.get("truncate_prompt_tokens") is None:
                chars = len(tok.render_chat(body))  # only the refusal's wording needs it
            return [ids], [chars]
        prompts = [list(p) for p in tok.completion_prompts(body)]
    except RequestError as exc:
        raise ApiError(str(exc), param=getattr(exc, "param", None)) from exc
    if body.get("truncate_prompt_tokens") is not None:
        return prompts, [None] * len(prompts)
    return prompts, _text_lengths(body, len(prompts))


def parse_request(model: ModelSurface, body: Any, chat: bool) -> ParsedRequest:
    """Validate and tokenize a request body as vLLM 0.32 does; raises ApiError."""
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    try:
        return _parse(model, body, chat)
    except RequestRejected as exc:
        raise ApiError.rejected(exc) from exc


def _parse(model: ModelSurface, body: dict[str, Any], chat: bool) -> ParsedRequest:
    # 1. What building vLLM's request object refuses: its validators, then pydantic's types.
    rules.check_request_fields(body, chat)
    rules.non_finite_int_errors(body, chat)
    rules.string_field_errors(body)
    salt = rules.validate_cache_salt(body.get("cache_salt"))
    kind: Endpoint = "chat" if chat else "completions"
    try:  # the fields pydantic reads leniently for vLLM ("3", 3.0, "true"), read alike
        lax_fields.check(body, kind)
    except ClientError as exc:
        raise ApiError(exc.message, param=exc.param) from None
    stream = bool(lax_fields.field(body, "stream", kind))
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError("stream_options must be an object", param="stream_options")
    try:
        include_usage = lax_fields.stream_option(opts, "include_usage")
    except ClientError as exc:
        raise ApiError(exc.message, param=exc.param) from None
    n = lax_fields.field(body, "n", kind)
    if n is not None and n > 1:
        raise ApiError("the simulated replica supports only n=1", param="n")
    xargs = body.get("vllm_xargs") or {}
    if not isinstance(xargs, dict):
        raise ApiError("vllm_xargs must be an object", param="vllm_xargs")
    # 2. The serving layer: model, then the renderer's output bound and prompt lengths.
    check_model(model, body)
    if not chat:
        rules.check_suffix(body)
    requested, param = rules.requested_max_tokens(body, chat)
    rules.check_max_output_tokens(requested, param, model.max_model_len)
    prompts, text_chars = prompt_token_lists(model, body, chat)
    for ids, chars in zip(prompts, text_chars, strict=True):
        rules.check_prompt_length(len(ids), model.max_model_len, text_chars=chars,
                                  max_chars_per_token=model.max_chars_per_token)
    # 3. Per prompt: the capped output budget, sampling parameters, then the engine's input checks.
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    skip_cache = rules.skips_prefix_cache(body, chat)
    requests = []
    for i, ids in enumerate(prompts):
        max_tokens = rules.capped_max_tokens(model.max_model_len, requested, len(ids))
        rules.check_sampling(body, max_tokens)
        rules.check_logprobs(body, chat, model.vocab_size)
        rules.check_token_ids_in_vocab(body, model.vocab_size)
        if not ids:
            raise rules.validation_error("The decoder prompt cannot be empty")
        if model.tokenizer is not None and max(ids) >= model.vocab_size:
            # vLLM validates ids only when it has a tokenizer, against the larger of the
            # tokenizer's and the model's vocabulary.
            raise ApiError(f"Token id {max(ids)} is out of vocabulary")
        requests.append(EngineRequest(
            f"{rid}-{i}", ids, max_tokens, cache_salt=salt, skip_prefix_cache=skip_cache,
            report_cached_blocks=xargs.get("kv_cache_report_mode") == "full"))
    return ParsedRequest(rid, requests, chat, stream, include_usage,
                         bool(lax_fields.field(body, "return_token_ids", kind)))


def usage(results: list[RequestResult], cached_tokens: int) -> dict[str, Any]:
    """vLLM's usage: tokens summed over the batch; cached_tokens is ONE prompt's count.

    vLLM reports the last prompt's cached tokens in a full response and the first
    arriving output's in a stream's usage chunk, not a sum; callers pick which.
    """
    prompt = sum(r.prompt_tokens for r in results)
    completion = sum(len(r.output_token_ids) for r in results)
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def full_body(parsed: ParsedRequest, results: list[RequestResult], model_name: str,
              texts: list[str]) -> dict[str, Any]:
    """A non-streaming response: one choice per prompt, index = prompt position."""
    choices = []
    for i, (req, result, text) in enumerate(zip(parsed.requests, results, texts, strict=True)):
        choice: dict[str, Any] = {"index": i, "logprobs": None,
                                  "finish_reason": result.finish_reason, "stop_reason": None}
        if parsed.chat:
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
        else:
            choice["text"] = text
            choice["prompt_logprobs"] = None
            if parsed.return_token_ids:
                choice["prompt_token_ids"] = list(req.prompt_token_ids)
        if parsed.return_token_ids:
            choice["token_ids"] = result.output_token_ids
        choices.append(choice)
    body: dict[str, Any] = {
        "id": parsed.request_id,
        "object": "chat.completion" if parsed.chat else "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": usage(results, results[-1].cached_tokens),
    }
    if parsed.chat and parsed.return_token_ids:
        body["prompt_token_ids"] = list(parsed.requests[0].prompt_token_ids)
    return body


def model_card(model: ModelSurface, root: str) -> dict[str, Any]:
    """A /v1/models entry as vLLM's ModelCard serializes (one default ModelPermission)."""
    now = int(time.time())
    permission = {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                  "created": now, "allow_create_engine": False, "allow_sampling": True,
                  "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                  "allow_fine_tuning": False, "organization": "*", "group": None,
                  "is_blocking": False}
    return {"id": model.served_model_name, "object": "model", "created": now,
            "owned_by": "vllm", "root": root, "parent": None,
            "max_model_len": model.max_model_len, "permission": [permission]}
