"""Workloads sent as chat: rendered and tokenized as the gateway and the sims do, the
prompts keep the prefix structure of their token-id twins."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loadgen.workloads import (
    WORD_PER_ID,
    AgentWorkload,
    GroupsWorkload,
    Lexicon,
    PlannedRequest,
    TimedRequest,
    TraceWorkload,
    lexicon_from_tokenizer,
)
from router.tokenize import PromptTokenizer

TRACE = Path(__file__).resolve().parents[2] / "loadgen" / "traces" / "mooncake_synthetic.jsonl"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PromptTokenizer:
    return PromptTokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def lexicon(tiny_model_dir: Path) -> Lexicon:
    return lexicon_from_tokenizer(tiny_model_dir)


def _ids(tokenizer: PromptTokenizer, req: TimedRequest) -> list[int]:
    assert req.messages is not None
    body: dict[str, Any] = {"model": "tiny",
                            "messages": [{"role": m.role, "content": m.content}
                                         for m in req.messages]}
    if req.tools:
        body["tools"] = list(req.tools)
    return tokenizer.chat_tokens(body)


def _common(a: list[int], b: list[int]) -> int:
    """Length of the common token prefix."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_lexicon_words_are_single_tokens(tiny_model_dir: Path, lexicon: Lexicon) -> None:
    ids = list(range(256, 756))
    text = lexicon.text(ids)
    assert len(text.split()) == 500
    # One token per id once the served tokenizer reads it: chat prompts are as long as
    # their token-id twins, not several times longer.
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    # The first word lacks the leading space its single-token form has: one extra token.
    assert 500 <= len(hf.encode(text, add_special_tokens=False).ids) <= 501
    assert WORD_PER_ID.text([7, 8]) == "w7 w8"


def test_agent_chat_keeps_shared_prefix_history_and_tool_order(
        tokenizer: PromptTokenizer, lexicon: Lexicon) -> None:
    w = AgentWorkload(conversations=2, turns=2, instruction_tokens=120, tools=4, tool_tokens=40,
                      question_tokens=20, answer_tokens=8, chat_text=True, lexicon=lexicon)
    plan = w.plan()
    first = [w.render(p) for p in plan[:2]]
    assert all(len(r.tools) == 4 for r in first)
    assert [t["function"]["name"] for t in first[0].tools] == [  # type: ignore[index]
        "tool_0", "tool_1", "tool_2", "tool_3"]
    a, b = (_ids(tokenizer, r) for r in first)
    shared = _common(a, b)
    # Instructions and tools are shared by every session; the question is not.
    assert shared >= 120 + 4 * 39
    assert shared < min(len(a), len(b)) - 10
    for p, r in zip(plan[:2], first, strict=True):
        w.record_answer(p, r.fallback_answer, None)
    nxt = plan[2]
    own = a if nxt.conversation_id == plan[0].conversation_id else b
    again = _ids(tokenizer, w.render(nxt))
    # A session's next turn resends its whole previous prompt (up to the generation prompt).
    assert _common(own, again) >= len(own) - 3
    assert len(again) > len(own) + 20


def test_agent_chat_shuffle_diverges_at_the_first_moved_tool(
        tokenizer: PromptTokenizer, lexicon: Lexicon) -> None:
    w = AgentWorkload(conversations=2, turns=1, instruction_tokens=120, tools=6, tool_tokens=40,
                      layout="shuffle", chat_text=True, lexicon=lexicon)
    a, b = (w.render(p) for p in w.plan())
    first_moved = next(i for i, (x, y) in enumerate(
        zip(w.tool_order(0), w.tool_order(1), strict=True)) if x != y)
    ids_a, ids_b = _ids(tokenizer, a), _ids(tokenizer, b)
    # The instructions always match; the tools before the first moved one too.
    assert _common(ids_a, ids_b) >= 120 + first_moved * 39
    assert _common(ids_a, ids_b) < 120 + (first_moved + 1) * 90


def test_groups_chat_shares_the_group_prefix_only(
        tokenizer: PromptTokenizer, lexicon: Lexicon) -> None:
    w = GroupsWorkload(groups=2, users=2, prefix_tokens=300, question_tokens=50,
                       output_tokens=4, requests=12, chat_text=True, lexicon=lexicon)
    by_user: dict[str, list[int]] = {}
    for p in w.plan():
        req = w.render(p)
        assert req.messages is not None and [m.role for m in req.messages] == ["system", "user"]
        by_user[p.conversation_id] = _ids(tokenizer, req)
    assert len(by_user) == 4
    same_group = _common(by_user["group-0-user-0"], by_user["group-0-user-1"])
    other_group = _common(by_user["group-0-user-0"], by_user["group-1-user-0"])
    assert 300 <= same_group < 300 + 20
    assert other_group < 10


def test_trace_chat_keeps_shared_hash_blocks(
        tokenizer: PromptTokenizer, lexicon: Lexicon) -> None:
    w = TraceWorkload(TRACE, limit=40, max_input_tokens=8000, chat_text=True, lexicon=lexicon)
    plain = TraceWorkload(TRACE, limit=40, max_input_tokens=8000)
    checked = 0
    reqs = [(w.render(p), plain.render(p)) for p in w.plan()]
    pairs = [(x, y) for i, x in enumerate(reqs) for y in reqs[i + 1:]]
    for (chat_a, ids_a), (chat_b, ids_b) in pairs:
        token_shared = _common(list(ids_a.prompt_token_ids), list(ids_b.prompt_token_ids))
        if token_shared < 512 or checked >= 5:
            continue
        chat_shared = _common(_ids(tokenizer, chat_a), _ids(tokenizer, chat_b))
        # The same blocks, shifted by the template's few leading tokens (and, rarely, a
        # word two differing ids share).
        assert token_shared <= chat_shared <= token_shared + 24
        checked += 1
    assert checked > 0


def test_token_runs_carry_no_chat() -> None:
    w = GroupsWorkload(groups=1, users=1, prefix_tokens=10, question_tokens=5,
                       output_tokens=1, requests=1)
    req = w.render(PlannedRequest(0, "group-0-user-0", 0))
    assert req.messages is None and req.tools == ()
