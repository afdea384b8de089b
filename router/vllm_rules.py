"""vLLM 0.32's request rules that the gateway applies before a replica would.

Copied from the sim's replica/request_rules.py (router/ does not import replica/), which
cites vLLM's source for each; keep the two in step when vLLM's version changes.

- The context-length rule (`check_context`): vLLM does NOT add max_tokens to the prompt.
  It refuses a requested max_tokens above max_model_len (TokenizeParams.__post_init__,
  vllm/renderers/params.py) and a prompt above max_model_len (_token_len_check), then
  caps the output budget to what the context leaves (get_max_tokens,
  vllm/entrypoints/serve/utils/api_utils.py), and SamplingParams._verify_args refuses a
  budget below 1 (a prompt of exactly max_model_len tokens). So a 6,994-token chat with
  max_tokens 2000 at 8192 is served, capped to 1,198 tokens, finish_reason "length".
- Prefix-cache skipping (`skips_prefix_cache`): vLLM never reads the prefix cache for a
  request that computes prompt logprobs, so such a request gets no cache credit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.lax_fields import field
from router.request import ClientError

COMPLETION_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest.max_tokens default


def validation_error(message: str, parameter: str | None = None,
                     value: object = None) -> ClientError:
    """A VLLMValidationError as vLLM's HTTP layer words it: str() appends
    " (parameter=..., value=...)" and the error's param is the parameter."""
    extras = []
    if parameter is not None:
        extras.append(f"parameter={parameter}")
    if value is not None:
        extras.append(f"value={value}")
    text = f"{message} ({', '.join(extras)})" if extras else message
    return ClientError(text, parameter, type="BadRequestError")


def requested_max_tokens(body: Mapping[str, Any], chat: bool) -> tuple[int | None, str]:
    """The output budget the client asked for and the field holding it.

    Chat: max_completion_tokens wins over max_tokens; neither means "the rest of the
    context". Completions: max_tokens, 16 when absent or null.
    """
    if chat:
        if body.get("max_completion_tokens") is not None:
            return field(body, "max_completion_tokens", "chat"), "max_completion_tokens"
        return field(body, "max_tokens", "chat"), "max_tokens"
    value = field(body, "max_tokens", "completions")
    return (COMPLETION_DEFAULT_MAX_TOKENS if value is None else value), "max_tokens"


def check_context(body: Mapping[str, Any], chat: bool, prompt_tokens: int, max_model_len: int,
                  *, text_prompt: bool) -> None:
    """Refuse what vLLM 0.32 refuses for a prompt of `prompt_tokens` tokens, in its words.

    `text_prompt`: the prompt was text (every chat, a text completion prompt). vLLM
    tokenizes text truncated to max_model_len + 1 tokens, so it can only say "at least"
    that many. vLLM's earlier character bound on text (max_model_len times the longest
    token's characters) is not mirrored: the replica still applies it.
    """
    requested, param = requested_max_tokens(body, chat)
    if isinstance(requested, int) and requested > max_model_len:
        raise validation_error(
            f"{param}={requested} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.", param, requested)
    if prompt_tokens > max_model_len:
        shown = max_model_len + 1 if text_prompt else prompt_tokens
        qualifier = "at least " if shown == max_model_len + 1 else ""
        raise validation_error(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {qualifier}{shown} input tokens, which exceeds this limit "
            "even without any output tokens. Please reduce the length of the input prompt.",
            "input_tokens", shown)
    left = max_model_len - prompt_tokens
    budget = left if not isinstance(requested, int) else min(left, requested)
    if budget < 1:
        raise validation_error(f"max_tokens must be at least 1, got {budget}.",
                               "max_tokens", budget)


def skips_prefix_cache(body: Mapping[str, Any], chat: bool) -> bool:
    """Whether vLLM skips reading the prefix cache: whenever prompt logprobs are computed.

    SamplingParams.__post_init__ sets skip_reading_prefix_cache when prompt_logprobs is
    not None; to_sampling_params sets prompt_logprobs from `prompt_logprobs`, or, with
    `echo`, from `logprobs` (completions) or `top_logprobs` (chat, where it defaults to
    0, so any chat echo skips the cache).
    """
    if body.get("prompt_logprobs") is not None:
        return True
    if not field(body, "echo", "chat" if chat else "completions"):
        return False
    return chat or body.get("logprobs") is not None
