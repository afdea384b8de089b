"""Exact token shapes of the workload generators."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadgen.workloads import (
    TOKEN_HIGH,
    TOKEN_LOW,
    AgentWorkload,
    ChatWorkload,
    GroupsWorkload,
    PlannedRequest,
    PrefixRepetitionWorkload,
    RandomWorkload,
    TraceWorkload,
    expand_hash_ids,
    poisson_arrivals,
    read_trace,
    segment_tokens,
    trace_block_tokens,
)
from router.hashing import HashConfig, chain_hashes, first_divergence, shared_prefix_blocks

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "loadgen" / "traces"


def _chat(**kw: object) -> ChatWorkload:
    args: dict = dict(requests=4, conversations=4, shared_prefix_tokens=100, preamble_tokens=10,
                      question_tokens=20, answer_tokens=5, seed=7)
    args.update(kw)
    return ChatWorkload(**args)


def test_segment_tokens_are_seeded_and_in_range() -> None:
    a = segment_tokens(1, "x", 500)
    assert a == segment_tokens(1, "x", 500)
    assert a != segment_tokens(2, "x", 500)
    assert a != segment_tokens(1, "y", 500)
    assert segment_tokens(1, "x", 20) == a[:20]
    assert all(TOKEN_LOW <= t < TOKEN_HIGH for t in a)
    assert segment_tokens(1, "x", 0) == ()


def test_chat_plan_deals_requests_round_the_conversations() -> None:
    plan = _chat(requests=7, conversations=3).plan()
    assert [(p.conversation_id, p.turn) for p in plan] == [
        ("conv-0", 0), ("conv-1", 0), ("conv-2", 0),
        ("conv-0", 1), ("conv-1", 1), ("conv-2", 1), ("conv-0", 2),
    ]


@pytest.mark.parametrize("position", ["first", "after-system", "last"])
def test_chat_first_turn_layout(position: str) -> None:
    w = _chat(preamble_position=position)
    r0, r1 = (w.render(p) for p in w.plan()[:2])
    system = w.system
    assert len(system) == 100
    assert len(r0.prompt_token_ids) == 100 + 10 + 20
    if position == "first":
        assert r0.prompt_token_ids[10:110] == system
        # Each request's own preamble comes first, so requests share nothing.
        assert first_divergence(r0.prompt_token_ids, r1.prompt_token_ids) == 0
    else:
        assert r0.prompt_token_ids[:100] == system
        assert first_divergence(r0.prompt_token_ids, r1.prompt_token_ids) == 100
    assert r0.max_tokens == 5
    assert r0.cache_salt is None


def test_chat_history_resends_questions_and_answers_but_no_preamble() -> None:
    w = _chat(requests=3, conversations=1, preamble_position="last")
    plan = w.plan()
    r0 = w.render(plan[0])
    pre0, q0 = r0.prompt_token_ids[100:110], r0.prompt_token_ids[110:]
    w.record_answer(plan[0], [11, 12, 13])
    r1 = w.render(plan[1])
    p1 = r1.prompt_token_ids
    assert p1[:100] == w.system
    assert p1[100:120] == q0                  # the question is resent
    assert p1[120:123] == (11, 12, 13)        # then the answer as it came back
    assert p1[123:133] != pre0                # a fresh preamble, the old one is gone
    assert len(p1) == 100 + 20 + 3 + 10 + 20
    assert first_divergence(r0.prompt_token_ids, p1) == 100


def test_chat_turn_before_answer_is_an_error() -> None:
    w = _chat(requests=2, conversations=1)
    plan = w.plan()
    w.render(plan[0])
    with pytest.raises(RuntimeError, match="turn 1 rendered before turn 0"):
        w.render(plan[1])


def test_chat_salt_per_conversation_and_chat_text() -> None:
    w = _chat(requests=2, conversations=2, salt="conversation", chat_text=True,
              preamble_position="first")
    r0 = w.render(w.plan()[0])
    assert r0.cache_salt == "conv-0"
    assert r0.messages is not None
    assert [m.role for m in r0.messages] == ["system", "user"]
    assert len(r0.messages[0].content.split()) == 10 + 100
    assert len(r0.messages[1].content.split()) == 20


def test_agent_stable_prefix_and_sizes() -> None:
    w = AgentWorkload(conversations=2, turns=2, instruction_tokens=480, tools=24,
                      tool_tokens=180, question_tokens=60, answer_tokens=80)
    assert w.prefix_tokens == 4800
    plan = w.plan()
    assert [p.index for p in plan] == [0, 1, 2, 3]
    assert [p.turn for p in plan] == [0, 0, 1, 1]
    assert {p.conversation_id for p in plan[:2]} == {p.conversation_id for p in plan[2:]} == {
        "agent-0", "agent-1"}
    a, b = w.render(plan[0]), w.render(plan[1])
    assert len(a.prompt_token_ids) == 4860
    assert first_divergence(a.prompt_token_ids, b.prompt_token_ids) == 4800


def test_agent_turn_order_varies_between_turns() -> None:
    w = AgentWorkload(conversations=8, turns=4, seed=0)
    orders = [tuple(p.conversation_id for p in w.plan()[t * 8:(t + 1) * 8]) for t in range(4)]
    assert all(sorted(o) == [f"agent-{c}" for c in range(8)] for o in orders)
    assert len(set(orders)) == 4
    assert orders == [tuple(p.conversation_id for p in AgentWorkload(
        conversations=8, turns=4, seed=0).plan()[t * 8:(t + 1) * 8]) for t in range(4)]


def test_agent_shuffle_changes_tokens_from_the_first_moved_tool_on() -> None:
    w = AgentWorkload(conversations=3, turns=1, instruction_tokens=50, tools=6, tool_tokens=20,
                      layout="shuffle", seed=3)
    stable = AgentWorkload(conversations=3, turns=1, instruction_tokens=50, tools=6,
                           tool_tokens=20, layout="stable", seed=3)
    checked = 0
    for p in w.plan():
        order = w.tool_order(p.index)
        assert sorted(order) == list(range(6))
        moved = next((i for i, k in enumerate(order) if k != i), None)
        shuffled = w.render(p).prompt_token_ids
        plain = stable.render(p).prompt_token_ids
        assert len(shuffled) == len(plain) == 50 + 6 * 20 + 60
        if moved is None:
            assert shuffled == plain
        else:
            assert first_divergence(shuffled, plain) == 50 + moved * 20
            checked += 1
    assert checked >= 2


def test_agent_timestamp_first_line_changes_each_second() -> None:
    w = AgentWorkload(conversations=3, turns=1, instruction_tokens=50, tools=2, tool_tokens=10,
                      layout="timestamp")
    p = w.plan()
    a, b, c = w.render(p[0], at=0.2), w.render(p[1], at=0.9), w.render(p[2], at=1.0)
    # "2026-01-01 00:00:00\n": 20 tokens, then the instructions.
    assert bytes(a.prompt_token_ids[:20]).decode() == "2026-01-01 00:00:00\n"
    assert first_divergence(a.prompt_token_ids, b.prompt_token_ids) == 20 + 50 + 20
    assert first_divergence(a.prompt_token_ids, c.prompt_token_ids) == 18


@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_trace_equal_ids_give_equal_blocks(block_size: int) -> None:
    a = expand_hash_ids([5, 6, 7], 1300)
    b = expand_hash_ids([5, 6, 9], 1100)
    assert len(a) == 1300 and len(b) == 1100
    assert a[:1024] == b[:1024]
    assert shared_prefix_blocks(a, b, block_size) == 1024 // block_size
    config = HashConfig(block_size=block_size)
    ka, kb = chain_hashes(config, a), chain_hashes(config, b)
    shared = 1024 // block_size
    assert ka[:shared] == kb[:shared]
    assert ka[shared] != kb[shared]
    # The partial last id is a prefix of the id's full 512 tokens.
    assert a[1024:] == trace_block_tokens(7)[: 1300 - 1024]


def test_expand_rejects_lengths_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        expand_hash_ids([1, 2], 1025)


def test_trace_workload_arrivals_speedup_limit_and_skips(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 1000, "input_length": 3000, "output_length": 5,
         "hash_ids": [1, 3, 4, 5, 6, 7]},
        {"timestamp": 3000, "input_length": 512, "output_length": 0, "hash_ids": [1]},
        {"timestamp": 4000, "input_length": 100, "output_length": 9, "hash_ids": [8]},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    w = TraceWorkload(path, speedup=2.0, limit=2, max_input_tokens=2048, max_output_tokens=4)
    assert [p.arrival for p in w.plan()] == [0.0, 1.5]
    reqs = w.rendered
    assert [len(r.prompt_token_ids) for r in reqs] == [600, 512]
    assert [r.max_tokens for r in reqs] == [4, 1]
    assert w.skipped == 1
    assert reqs[1].prompt_token_ids == reqs[0].prompt_token_ids[:512]


def test_trace_workload_start_replays_a_later_window(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 1000, "input_length": 3000, "output_length": 5,
         "hash_ids": [1, 3, 4, 5, 6, 7]},
        {"timestamp": 3000, "input_length": 512, "output_length": 3, "hash_ids": [1]},
        {"timestamp": 4000, "input_length": 100, "output_length": 9, "hash_ids": [8]},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    w = TraceWorkload(path, start=1, limit=2, max_input_tokens=2048)
    # Record 1 is too long (skipped), records 2 and 3 replay from record 1's time.
    assert [p.arrival for p in w.plan()] == [2.0, 3.0]
    assert [len(r.prompt_token_ids) for r in w.rendered] == [512, 100]
    assert w.skipped == 1
    assert w.describe()["start"] == 1
    with pytest.raises(ValueError, match="start"):
        TraceWorkload(path, start=-1)
    # A window with nothing to replay is refused, not run as zero requests.
    with pytest.raises(ValueError, match=r"from record 4 starts past its end \(it has 4 records\)"):
        TraceWorkload(path, start=4)
    with pytest.raises(ValueError, match="from record 1 has no prompt of at most 50 tokens"):
        TraceWorkload(path, start=1, max_input_tokens=50)


def test_the_vendored_mooncake_trace_reads() -> None:
    records = list(read_trace(TRACES / "mooncake_conversation.jsonl", limit=3))
    assert [r.input_length for r in records] == [6758, 7322, 7236]
    assert records[0].hash_ids[:3] == (0, 1, 2)
    prompts = [expand_hash_ids(r.hash_ids, r.input_length) for r in records]
    # Records 0 and 1 share only hash id 0: one 512-token block.
    assert first_divergence(prompts[0], prompts[1]) == 512


@pytest.mark.parametrize(("name", "requests", "bound"), [
    ("mooncake_conversation.jsonl", 12031, 0.373),
    ("mooncake_synthetic.jsonl", 3993, 0.650),
])
def test_vendored_traces_match_their_readme(name: str, requests: int, bound: float) -> None:
    """The facts loadgen/traces/README.md states: request counts and the oracle bounds."""
    records = list(read_trace(TRACES / name))
    assert len(records) == requests
    # Unlimited cache over full 512-token blocks; hash ids are already chained, so a
    # block hits when its id was stored before, up to the first miss.
    seen: set[int] = set()
    hit = total = 0
    for r in records:
        cap = min((r.input_length - 1) // 512, len(r.hash_ids))
        run = 0
        while run < cap and r.hash_ids[run] in seen:
            run += 1
        hit += run * 512
        total += r.input_length
        seen.update(r.hash_ids[: r.input_length // 512])
    assert round(hit / total, 3) == bound


def test_the_default_trace_is_inside_the_repository() -> None:
    from loadgen.compare import DEFAULT_TRACE

    assert DEFAULT_TRACE == TRACES / "mooncake_conversation.jsonl"
    assert DEFAULT_TRACE.is_file()


def test_groups_shape() -> None:
    w = GroupsWorkload(groups=3, users=2, prefix_tokens=64, question_tokens=32,
                       output_tokens=8, requests=40, rates=(10.0, 20.0), stage_seconds=1.0)
    reqs = w.rendered
    assert len(reqs) == 40
    assert all(len(r.prompt_token_ids) == 96 and r.max_tokens == 8 for r in reqs)
    by_user = {}
    for r in reqs:
        by_user.setdefault(r.conversation_id, r.prompt_token_ids)
        assert by_user[r.conversation_id] == r.prompt_token_ids  # a user's prompt is fixed
    users = sorted(by_user)
    for a in users:
        for b in users:
            if a == b:
                continue
            same_group = a.split("-")[1] == b.split("-")[1]
            assert first_divergence(by_user[a], by_user[b]) == (64 if same_group else 0)
    arrivals = [r.arrival for r in reqs]
    assert arrivals == sorted(arrivals)


def test_poisson_steps_up_the_rate() -> None:
    arrivals = poisson_arrivals(0, "x", [10.0, 100.0], 10.0, 2000)
    first = sum(1 for t in arrivals if t < 10.0)
    second = sum(1 for t in arrivals if 10.0 <= t < 20.0)
    # Poisson counts: 100 +- 30 and 1000 +- 95 at four standard deviations.
    assert 60 < first < 140
    assert 870 < second < 1130
    assert arrivals == poisson_arrivals(0, "x", [10.0, 100.0], 10.0, 2000)


def test_prefix_repetition_and_random_shapes() -> None:
    w = PrefixRepetitionWorkload(requests=20, num_prefixes=3, prefix_tokens=40, suffix_tokens=10,
                                 output_tokens=4)
    reqs = w.rendered
    assert all(len(r.prompt_token_ids) == 50 for r in reqs)
    for a in reqs:
        for b in reqs:
            if a.index < b.index:
                same = a.conversation_id == b.conversation_id
                assert first_divergence(a.prompt_token_ids, b.prompt_token_ids) == (
                    40 if same else 0)
    r = RandomWorkload(requests=30, input_tokens=100, output_tokens=10, range_ratio=0.5,
                       prefix_tokens=8)
    lens = [len(x.prompt_token_ids) for x in r.rendered]
    assert all(8 + 50 <= n <= 8 + 150 for n in lens)
    assert len(set(lens)) > 5
    assert all(5 <= x.max_tokens <= 15 for x in r.rendered)
    assert all(x.prompt_token_ids[:8] == r.rendered[0].prompt_token_ids[:8] for x in r.rendered)


def test_stateless_render_ignores_answers() -> None:
    w = RandomWorkload(requests=2, input_tokens=10, output_tokens=2)
    p = w.plan()[1]
    before = w.render(p)
    w.record_answer(p, [1, 2])
    assert w.render(PlannedRequest(1, p.conversation_id, 0)) == before
