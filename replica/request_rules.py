"""vLLM 0.32's request rules for /v1/completions and /v1/chat/completions, as plain functions.

The sim applies them in vLLM's order, so a request vLLM refuses gets the same status, message
and param here, and one vLLM serves is served with the same max_tokens:

1. The request model's "before" validators (vllm/entrypoints/openai/*/protocol.py):
   cache_salt, stream_options, an empty completion prompt, prompt_logprobs with
   streaming, a chat's tool_choice without tools: `check_request_fields`. Then pydantic:
   an integer field holding NaN or +-Infinity (Python's JSON reader accepts them) fails
   validation ("Input should be a finite number"): `non_finite_int_errors`; `user` that
   is not a string: `string_field_errors`.
2. TokenizeParams.__post_init__ (vllm/renderers/params.py), before tokenization: a
   requested max_tokens larger than max_model_len is refused: `check_max_output_tokens`.
3. TokenizeParams._text_len_check, then _token_len_check: a prompt longer than
   max_model_len is refused; max_tokens is not added to it: `check_prompt_length`.
4. get_max_tokens (vllm/entrypoints/serve/utils/api_utils.py): max_tokens is capped to
   the context left, min(max_model_len - prompt_len, requested): `capped_max_tokens`.
5. SamplingParams._verify_args (vllm/sampling_params.py): penalties, temperature, top_p,
   top_k, min_p, then max_tokens >= 1 (so a prompt of exactly max_model_len tokens is
   refused here, with max_tokens 0): `check_sampling`.
6. SamplingParams._validate_logprobs, in the engine's input processor: sample and prompt
   logprobs at most --max-logprobs (20): `check_logprobs`; then logit_bias and
   stop_token_ids inside the vocabulary: `check_token_ids_in_vocab`.

A completion's suffix is refused by the renderer, after the model check
(`check_suffix`): the sim renders no fill-in-the-middle prompts.

Messages are vLLM's create_error_response text: a VLLMValidationError's str() appends
" (parameter=..., value=...)" when it names them, and a pydantic error is wrapped in
"1 validation error:" with type "Bad Request" and param "body.<field>".
"""

from __future__ import annotations

import math
from typing import Any

from replica.engine import RequestRejected
from router import lax_fields
from router.client_error import ClientError

# One copy of the rules that raise nothing, shared with the gateway (re-exported).
from router.vllm_rules import COMPLETION_DEFAULT_MAX_TOKENS as COMPLETION_DEFAULT_MAX_TOKENS
from router.vllm_rules import requested_max_tokens as requested_max_tokens
from router.vllm_rules import skips_prefix_cache as skips_prefix_cache

# Integer fields of vLLM's request models, in model-definition order (pydantic reports
# errors in this order).
COMPLETION_INT_FIELDS = ("logprobs", "max_tokens", "n", "seed", "top_k", "min_tokens",
                         "truncate_prompt_tokens", "prompt_logprobs", "priority",
                         "routed_experts_prompt_start", "thinking_token_budget",
                         "stream_interval")
CHAT_INT_FIELDS = ("top_logprobs", "max_tokens", "max_completion_tokens", "n", "seed",
                   "thinking_token_budget", "top_k", "min_tokens", "truncate_prompt_tokens",
                   "prompt_logprobs", "priority", "routed_experts_prompt_start",
                   "stream_interval")
# vLLM's OpenAI defaults for the sampling floats it validates.
_SAMPLING_DEFAULTS = {"presence_penalty": 0.0, "frequency_penalty": 0.0,
                      "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0,
                      "min_p": 0.0}
_CACHE_SALT_MAX = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


def validation_error(message: str, parameter: str | None = None,
                     value: object = None) -> RequestRejected:
    """A VLLMValidationError as vLLM's HTTP layer words it (str() adds parameter/value)."""
    extras = []
    if parameter is not None:
        extras.append(f"parameter={parameter}")
    if value is not None:
        extras.append(f"value={value}")
    text = f"{message} ({', '.join(extras)})" if extras else message
    return RequestRejected(text, parameter)


def validate_cache_salt(value: object) -> str | None:
    """vLLM's validate_cache_salt: non-empty, at most 128 chars, no '@' '/' '\\' or NUL."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise validation_error("Parameter 'cache_salt' must be a non-empty string if provided.",
                               "cache_salt")
    if len(value) > _CACHE_SALT_MAX or any(c in _CACHE_SALT_FORBIDDEN for c in value):
        raise validation_error("Parameter 'cache_salt' must be at most 128 characters and must "
                               "not contain '@', '/', '\\\\', or NUL.", "cache_salt")
    return value


def check_request_fields(body: dict[str, Any], chat: bool) -> None:
    """The request model's "before" validators the sim's fields meet, in vLLM's wording."""
    validate_cache_salt(body.get("cache_salt"))
    if body.get("stream_options") and not body.get("stream"):
        raise validation_error("Stream options can only be defined when `stream=True`.",
                               "stream_options")
    if not chat and body.get("prompt") in (None, "") and body.get("prompt_embeds") in (None, []):
        raise validation_error("Either prompt or prompt_embeds must be provided and non-empty.",
                               "prompt")
    for name in ("prompt_logprobs", "top_logprobs" if chat else "logprobs"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise validation_error(f"`{name}` must be an integer.", name, value)
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is not None:
        if body.get("stream") and (prompt_logprobs > 0 or prompt_logprobs == -1):
            raise validation_error("`prompt_logprobs` are not available when `stream=True`.",
                                   "prompt_logprobs")
        if prompt_logprobs < 0 and prompt_logprobs != -1:
            raise validation_error("`prompt_logprobs` must be a positive value or -1.",
                                   "prompt_logprobs", prompt_logprobs)
    top = body.get("top_logprobs" if chat else "logprobs")
    if top is not None and top < 0 and top != -1:
        name = "top_logprobs" if chat else "logprobs"
        raise validation_error(f"`{name}` must be a positive value or -1.", name, top)
    if chat and top is not None and (top == -1 or top > 0) and not body.get("logprobs"):
        raise validation_error("when using `top_logprobs`, `logprobs` must be set to true.",
                               "top_logprobs")
    if chat:
        check_tool_usage(body)


_TOOL_CHOICE_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def check_tool_usage(body: dict[str, Any]) -> None:
    """ChatCompletionRequest.check_tool_usage and check_generation_prompt, in vLLM's words."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools == []:
        raise validation_error("`tools` must not be an empty array. Either provide at least "
                               "one tool or omit the field entirely.", "tools")
    if choice is not None and choice != "none":
        if tools is None:
            raise validation_error("When using `tool_choice`, `tools` must be set.",
                                   "tool_choice")
        if choice not in ("auto", "required") and not isinstance(choice, dict):
            raise validation_error(f"Invalid value for `tool_choice`: {choice}! Only named "
                                   'tools, "none", "auto" or "required" are supported.',
                                   "tool_choice")
        if isinstance(choice, dict):
            function = choice.get("function")
            if not isinstance(function, dict):
                raise validation_error(f"Invalid value for `function`: `{function}` in "
                                       f"`tool_choice`! {_TOOL_CHOICE_USAGE}",
                                       "tool_choice.function")
            if "name" not in function:
                raise validation_error("Expected field `name` in `function` in `tool_choice`! "
                                       f"{_TOOL_CHOICE_USAGE}", "tool_choice.function.name")
            name = function["name"]
            if not isinstance(name, str) or not name:
                raise validation_error(f"Invalid `name` in `function`: `{name}` in "
                                       f"`tool_choice`! {_TOOL_CHOICE_USAGE}",
                                       "tool_choice.function.name")
            names = [tool.get("function", {}).get("name") for tool in tools
                     if isinstance(tool, dict) and isinstance(tool.get("function"), dict)]
            if name not in names:
                raise validation_error("The tool specified in `tool_choice` does not match "
                                       "any of the specified `tools`", "tool_choice")
    if body.get("continue_final_message") and body.get("add_generation_prompt"):
        raise validation_error("Cannot set both `continue_final_message` and "
                               "`add_generation_prompt` to True.")


def string_field_errors(body: dict[str, Any]) -> None:
    """`user` must be a string or null, as pydantic checks it (no coercion from numbers)."""
    value = body.get("user")
    if value is None or isinstance(value, str):
        return
    raise RequestRejected(
        "1 validation error:\n  {'type': 'string_type', 'loc': 'body.user', "
        f"'msg': 'Input should be a valid string', 'input': '{value}'}}", "body.user",
        err_type="Bad Request")


def _is_non_finite(value: object) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def non_finite_int_errors(body: dict[str, Any], chat: bool) -> None:
    """Refuse NaN/Infinity in integer fields, as pydantic does (400, type "Bad Request")."""
    fields = CHAT_INT_FIELDS if chat else COMPLETION_INT_FIELDS
    bad = [name for name in fields if _is_non_finite(body.get(name))]
    if not bad:
        return
    label = "error" if len(bad) == 1 else "errors"
    lines = "".join(
        f"  {{'type': 'finite_number', 'loc': 'body.{name}', "
        f"'msg': 'Input should be a finite number', 'input': '{body[name]}'}}\n"
        for name in bad)
    raise RequestRejected(f"{len(bad)} validation {label}:\n{lines}".rstrip(),
                          f"body.{bad[0]}", err_type="Bad Request")


def check_max_output_tokens(requested: int | None, param: str, max_model_len: int) -> None:
    """TokenizeParams: more requested output tokens than the whole context is refused."""
    if requested is not None and requested > max_model_len:
        raise validation_error(
            f"{param}={requested} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.", param, requested)


def check_prompt_length(num_tokens: int, max_model_len: int, *, text_chars: int | None = None,
                        max_chars_per_token: int | None = None) -> None:
    """TokenizeParams' length checks: a prompt over max_model_len tokens is refused.

    `text_chars` is the length of a text prompt (a chat's rendered template) when there
    was one: vLLM refuses it by characters first when it exceeds max_model_len *
    max_chars_per_token, and otherwise tokenizes it truncated to max_model_len + 1
    tokens, so it can only report "at least" that many. Token-id prompts report their
    count, with "at least" too when it happens to be exactly max_model_len + 1.
    """
    if text_chars is not None and max_chars_per_token:
        max_chars = max_model_len * max_chars_per_token
        if text_chars > max_chars:
            raise validation_error(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"your prompt contains {text_chars} characters (more than {max_chars} "
                f"characters, which is the upper bound for {max_model_len} input tokens). "
                "Please reduce the length of the input prompt.", "input_text", text_chars)
    if num_tokens <= max_model_len:
        return
    if text_chars is not None:
        num_tokens = max_model_len + 1
    qualifier = "at least " if num_tokens == max_model_len + 1 else ""
    raise validation_error(
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"prompt contains {qualifier}{num_tokens} input tokens, which exceeds this limit "
        "even without any output tokens. Please reduce the length of the input prompt.",
        "input_tokens", num_tokens)


def capped_max_tokens(max_model_len: int, requested: int | None, prompt_len: int) -> int:
    """get_max_tokens: the output budget is the context left, or less if asked for less."""
    left = max_model_len - prompt_len
    return left if requested is None else min(left, requested)


def _float(body: dict[str, Any], name: str) -> float:
    try:
        value = lax_fields.number(body, name)  # as pydantic reads it for vLLM: "0.5" too
    except ClientError as exc:
        raise RequestRejected(exc.message, name) from None
    return _SAMPLING_DEFAULTS[name] if value is None else value


# vLLM's --max-logprobs default (ModelConfig.max_logprobs); the sim has no flag for it.
MAX_LOGPROBS = 20


def check_logprobs(body: dict[str, Any], chat: bool, vocab_size: int) -> None:
    """SamplingParams._validate_logprobs (run by the engine's input processor, after
    _verify_args): sample and prompt logprobs at most MAX_LOGPROBS, -1 meaning the whole
    vocabulary. A chat's top_logprobs is its sample logprobs, when logprobs is true."""
    if chat:
        sample = body.get("top_logprobs") if body.get("logprobs") else None
    else:
        sample = body.get("logprobs")
    for kind, value, param in (("sample", sample, "logprobs"),
                               ("prompt", body.get("prompt_logprobs"), "prompt_logprobs")):
        if not isinstance(value, int) or isinstance(value, bool) or not value:
            continue
        wanted = vocab_size if value == -1 else value
        if wanted > MAX_LOGPROBS:
            raise validation_error(f"Requested {kind} logprobs of {wanted}, which is greater "
                                   f"than max allowed: {MAX_LOGPROBS}", param, wanted)


def check_token_ids_in_vocab(body: dict[str, Any], vocab_size: int) -> None:
    """SamplingParams._validate_logit_bias, then _validate_stop_token_ids (after the
    logprobs): token ids they name must lie in the model's vocabulary."""
    bias = body.get("logit_bias")
    stop = body.get("stop_token_ids")
    for param, ids in (("logit_bias", bias if isinstance(bias, dict) else None),
                       ("stop_token_ids", stop if isinstance(stop, list) else None)):
        if not ids:
            continue
        try:
            wanted = [int(t) for t in ids]
        except (TypeError, ValueError):
            continue  # not ids at all: pydantic's to refuse, which the sim does not copy
        bad = [t for t in wanted if t < 0 or t >= vocab_size]
        if bad:
            raise validation_error(f"token_id(s) {bad} in {param} contain out-of-vocab token "
                                   f"ids. Vocabulary size: {vocab_size}", param, bad)


def check_suffix(body: dict[str, Any]) -> None:
    """The completion renderer's suffix rules, for a sim whose models have no fill-in-the-
    middle rendering: any suffix is refused, in the words vLLM uses for its case."""
    if body.get("suffix") is None:
        return
    prompt = body.get("prompt")
    if body.get("echo"):
        message = "Echo is unsupported with suffix."
    elif body.get("truncate_prompt_tokens") is not None:
        message = "suffix is not supported with truncate_prompt_tokens"
    elif isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                     and all(isinstance(p, str) for p in prompt)):
        message = "suffix is only supported for models with FIM completion rendering"
    else:
        message = "suffix requires text prompt input for FIM completion rendering"
    raise RequestRejected(message, "suffix")


def check_sampling(body: dict[str, Any], max_tokens: int) -> None:
    """SamplingParams.__post_init__'s n check, then _verify_args for the fields the sim
    reads, in vLLM's order."""
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n < 1:
        raise validation_error(f"n must be at least 1, got {n}.")
    for name in ("presence_penalty", "frequency_penalty"):
        v = _float(body, name)
        if not -2.0 <= v <= 2.0:
            raise validation_error(f"{name} must be in [-2, 2], got {v}.")
    rep = _float(body, "repetition_penalty")
    if not math.isfinite(rep):
        raise validation_error(f"repetition_penalty must be a finite number, got {rep}.")
    if rep <= 0.0:
        raise validation_error(f"repetition_penalty must be greater than zero, got {rep}.")
    temp = _float(body, "temperature")
    if not math.isfinite(temp):
        raise validation_error(f"temperature must be a finite number, got {temp}.",
                               "temperature", temp)
    if temp < 0.0:
        raise validation_error(f"temperature must be non-negative, got {temp}.",
                               "temperature", temp)
    if temp > 2.0:
        raise validation_error(f"temperature must be in [0, 2], got {temp}.", "temperature", temp)
    top_p = _float(body, "top_p")
    if not 0.0 < top_p <= 1.0:
        raise validation_error(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p)
    top_k = body.get("top_k")
    if isinstance(top_k, int) and top_k < -1:
        raise validation_error(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    min_p = _float(body, "min_p")
    if not 0.0 <= min_p <= 1.0:
        raise validation_error(f"min_p must be in [0, 1], got {min_p}.")
    if max_tokens < 1:
        raise validation_error(f"max_tokens must be at least 1, got {max_tokens}.",
                               "max_tokens", max_tokens)
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and not isinstance(min_tokens, bool):
        if min_tokens < 0:
            raise validation_error(
                f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
        if min_tokens > max_tokens:
            raise validation_error(f"min_tokens must be less than or equal to "
                                   f"max_tokens={max_tokens}, got {min_tokens}.")
