"""The gateway's copy of vLLM 0.32's rules, the conversations it routes /v1/responses and
/v1/messages by, batched prompts at the edge, and the messages it gives instead of vLLM.

The rules are checked against the sim's (replica/request_rules.py), whose vLLM source
references they copy, so the two cannot drift apart unnoticed.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from replica import request_rules as sim_rules
from replica.engine import RequestRejected
from router.config import LimitsConfig, TenantKeyConfig, TenantsConfig
from router.endpoints import anthropic_chat, chat_view, responses_chat
from router.request import ClientError, parse_request
from router.tenants import ClientSaltRejected, TenantRegistry
from router.upstream import ProxyOutcome, StreamState, UpstreamRequest
from router.vllm_rules import check_context, skips_prefix_cache

LEN = 8192


def sim_verdict(body: dict[str, Any], chat: bool, prompt_len: int,
                text: bool) -> tuple[str, str | None] | int:
    """What the sim (vLLM's rules in vLLM's order) does: the refusal, or the budget."""
    requested, param = sim_rules.requested_max_tokens(body, chat)
    try:
        sim_rules.check_max_output_tokens(requested, param, LEN)
        sim_rules.check_prompt_length(prompt_len, LEN, text_chars=1 if text else None,
                                      max_chars_per_token=None)
        budget = sim_rules.capped_max_tokens(LEN, requested, prompt_len)
        sim_rules.check_sampling(body, budget)
    except RequestRejected as exc:
        return exc.message, exc.param
    return budget


def gateway_verdict(body: dict[str, Any], chat: bool, prompt_len: int,
                    text: bool) -> tuple[str, str | None] | None:
    try:
        check_context(body, chat, prompt_len, LEN, text_prompt=text)
    except ClientError as exc:
        assert exc.status == 400
        return exc.message, exc.param
    return None


@pytest.mark.parametrize(("body", "chat", "prompt_len", "text"), [
    ({"max_tokens": 2000}, True, 6994, True),  # the issue's chat: served, capped to 1,198
    ({}, True, 8000, True),  # no budget: the rest of the context
    ({"max_completion_tokens": 10, "max_tokens": 9000}, True, 100, True),
    ({"max_tokens": 9000}, True, 100, True),
    ({"max_completion_tokens": 8193}, True, 5, True),
    ({}, False, 8190, False),  # completions default 16, capped to 2
    ({}, False, 8192, False),  # nothing left: max_tokens 0
    ({"max_tokens": 5}, False, 8193, False),
    ({"max_tokens": 5}, False, 9000, False),
    ({"max_tokens": 5}, True, 9000, True),  # text: vLLM only knows "at least" 8193
    ({"max_tokens": None}, False, 8000, True),
])
def test_context_rule_is_the_sims(body: dict[str, Any], chat: bool, prompt_len: int,
                                  text: bool) -> None:
    expected = sim_verdict(body, chat, prompt_len, text)
    got = gateway_verdict(body, chat, prompt_len, text)
    if isinstance(expected, int):
        assert got is None and expected >= 1
    else:
        assert got == expected


def test_the_issues_chat_is_served_and_a_too_long_prompt_refused_in_vllms_words() -> None:
    assert gateway_verdict({"max_tokens": 2000}, True, 6994, True) is None
    refused = gateway_verdict({"max_tokens": 5}, False, 9000, False)
    assert refused == (
        "This model's maximum context length is 8192 tokens. However, your prompt contains "
        "9000 input tokens, which exceeds this limit even without any output tokens. Please "
        "reduce the length of the input prompt. (parameter=input_tokens, value=9000)",
        "input_tokens")


@pytest.mark.parametrize("body", [
    {}, {"prompt_logprobs": 0}, {"prompt_logprobs": None}, {"echo": True},
    {"echo": True, "logprobs": 2}, {"echo": False, "prompt_logprobs": 1},
    {"echo": True, "top_logprobs": 0}, {"logprobs": 3},
])
@pytest.mark.parametrize("chat", [True, False])
def test_cache_skipping_is_the_sims(body: dict[str, Any], chat: bool) -> None:
    assert skips_prefix_cache(body, chat) == sim_rules.skips_prefix_cache(body, chat)


def test_anthropic_messages_become_vllms_chat_messages() -> None:
    body = {"model": "m", "max_tokens": 5,
            "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}]}
    assert anthropic_chat(body) == [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "yo"}]
    image = {"type": "image", "source": {"type": "url", "url": "http://x"}}
    assert anthropic_chat({**body, "messages": [{"role": "user", "content": [image]}]}) is None
    tools = [{"name": "w", "description": "d", "input_schema": {"type": "object"}}]
    view = chat_view("/v1/messages", {**body, "tools": tools})
    assert view is not None and view["tools"] == [{"type": "function", "function": {
        "name": "w", "description": "d", "parameters": {"type": "object"}}}]


def test_responses_input_becomes_chat_messages_or_load_routing() -> None:
    assert responses_chat({"input": "hi", "instructions": "brief"}) == [
        {"role": "system", "content": "brief"}, {"role": "user", "content": "hi"}]
    items = [{"role": "user", "content": [{"type": "input_text", "text": "a"}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "b"}]}]
    assert responses_chat({"input": items}) == [{"role": "user", "content": "a"},
                                                {"role": "assistant", "content": "b"}]
    # Earlier turns stored in a replica, or tool items: not known, routed on load.
    assert responses_chat({"input": "hi", "previous_response_id": "resp_1"}) is None
    assert responses_chat({"input": [{"type": "function_call_output", "output": "x"}]}) is None


REGISTRY = TenantRegistry.from_config(TenantsConfig(keys=(
    TenantKeyConfig(key="k-salted", tenant="acme"),
    TenantKeyConfig(key="k-public", tenant="docs", salted=False),
), allow_anonymous=True), b"0123456789abcdef0123456789abcdef")


@pytest.mark.parametrize("prompt", [["a", "b"], [[1, 2], [3]]])
def test_batched_prompts_are_accepted_and_keyed_by_the_first(prompt: list[Any]) -> None:
    tenant = REGISTRY.identify(None)
    parsed = parse_request(
        json.dumps({"model": "tiny", "prompt": prompt}).encode(), "completions",
        served_models={"tiny"}, limits=LimitsConfig(), tenant=tenant, registry=REGISTRY)
    assert parsed.token_ids == (None if isinstance(prompt[0], str) else prompt[0])


def test_an_unsalted_tenants_cache_salt_is_refused_with_a_true_message() -> None:
    public = REGISTRY.authenticate("k-public")
    salted = REGISTRY.authenticate("k-salted")
    assert public is not None and salted is not None
    with pytest.raises(ClientSaltRejected) as caught:
        REGISTRY.effective_salt(public, "mine")
    assert "is set by the gateway" not in str(caught.value)
    assert "'docs' is unsalted" in str(caught.value)
    with pytest.raises(ClientSaltRejected, match="cache_salt is set by the gateway for tenant "
                                                 "'acme'"):
        REGISTRY.effective_salt(salted, "mine")


@pytest.mark.parametrize("strip", [True, False])
def test_completion_choices_lose_only_the_prompt_ids_the_gateway_asked_for(strip: bool) -> None:
    up = UpstreamRequest(path="/v1/completions", body={}, headers={}, stream=False,
                         strip_token_ids=strip)
    state = StreamState(up, ProxyOutcome())
    body = {"choices": [{"index": i, "text": "x", "token_ids": [5], "prompt_token_ids": [1, 2]}
                        for i in range(2)]}
    assert state.absorb(body) is strip
    for choice in body["choices"]:
        assert ("prompt_token_ids" in choice) is not strip
        assert ("token_ids" in choice) is not strip
    assert state.token_ids == [5]  # the first prompt's generated ids, for recording
