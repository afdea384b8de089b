"""Prompt hygiene: a tenant whose prompts stop sharing their prefix is reported once."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.hygiene import HygieneFinding, PromptHygiene, shared_prefix_len

SYSTEM = list(range(1000, 1300))  # a 300-token system prompt every request starts with


def flat(parts: list[list[int]]) -> list[int]:
    return [t for part in parts for t in part]


def question(rng: random.Random) -> list[int]:
    return [rng.randrange(50_000) for _ in range(40)]


def test_stable_prefix_gives_no_finding() -> None:
    h, rng = PromptHygiene(), random.Random(1)
    assert all(h.observe("acme", SYSTEM + question(rng)) is None for _ in range(200))


def test_timestamp_at_the_top_is_found_at_its_position() -> None:
    h, rng = PromptHygiene(), random.Random(2)
    for _ in range(40):
        assert h.observe("acme", SYSTEM + question(rng)) is None
    findings: list[HygieneFinding] = []
    for i in range(40):
        # Token 5 now carries a timestamp that changes every request.
        prompt = [*SYSTEM[:5], 900_000 + i, *SYSTEM[5:], *question(rng)]
        finding = h.observe("acme", prompt)
        if finding is not None:
            findings.append(finding)
    assert findings == [HygieneFinding("acme", position=5, previous_shared=256)]
    assert "token 5" in findings[0].describe()
    # Reported within the window (16): the median turns once most recent requests diverge.
    h2, rng2 = PromptHygiene(), random.Random(2)
    for _ in range(40):
        h2.observe("acme", SYSTEM + question(rng2))
    first = next(
        i
        for i in range(40)
        if h2.observe("acme", [*SYSTEM[:5], 900_000 + i, *SYSTEM[5:], *question(rng2)]) is not None
    )
    assert first <= 9


def test_reordered_tool_json_is_found_near_where_tools_start() -> None:
    h, rng = PromptHygiene(), random.Random(3)
    tools = [list(range(5000 + 30 * t, 5030 + 30 * t)) for t in range(8)]
    head = SYSTEM[:20]
    for _ in range(40):
        h.observe("bot", head + flat(tools) + question(rng))
    findings = []
    for _ in range(40):
        order = tools[:]
        rng.shuffle(order)
        f = h.observe("bot", head + flat(order) + question(rng))
        if f is not None:
            findings.append(f)
    assert len(findings) == 1
    assert findings[0].previous_shared == 256
    # A new order still often starts like some recent one (20 + 30k tokens), but the
    # typical shared length drops to around the first tool or two.
    assert 20 <= findings[0].position <= 110


def test_tenants_are_judged_separately() -> None:
    h, rng = PromptHygiene(), random.Random(4)
    for i in range(80):
        assert h.observe("steady", SYSTEM + question(rng)) is None
        prompt = SYSTEM + question(rng) if i < 40 else [i, *SYSTEM]
        f = h.observe("changed", prompt)
        assert f is None or f.tenant == "changed"


def test_tenants_that_never_shared_much_are_not_reported() -> None:
    h, rng = PromptHygiene(), random.Random(5)
    for _ in range(100):
        assert h.observe("chatty", question(rng) + SYSTEM) is None


def test_memory_is_bounded() -> None:
    h = PromptHygiene(prefix_tokens=8, history=4, window=2, max_tenants=3)
    for t in range(10):
        for i in range(20):
            h.observe(f"t{t}", list(range(i, i + 100)))
    assert h.tenants == 3
    state = h._tenants["t9"]
    assert len(state.prefixes) == 4 and all(len(p) == 8 * 8 for p in state.prefixes)
    assert len(state.shared) <= 4


def test_bad_parameters() -> None:
    with pytest.raises(ValueError, match="drop_ratio"):
        PromptHygiene(drop_ratio=1.0)
    with pytest.raises(ValueError, match="positive"):
        PromptHygiene(window=0)


@given(st.lists(st.integers(0, 5), max_size=30), st.lists(st.integers(0, 5), max_size=30))
def test_shared_prefix_len_matches_a_plain_scan(a: list[int], b: list[int]) -> None:
    from array import array

    expected = 0
    while expected < min(len(a), len(b)) and a[expected] == b[expected]:
        expected += 1
    assert shared_prefix_len(array("q", a).tobytes(), array("q", b).tobytes(), 8) == expected


@given(st.lists(st.lists(st.integers(0, 3), max_size=12), min_size=1, max_size=20))
def test_shared_lengths_are_the_longest_prefix_shared_with_recent_prompts(
    prompts: list[list[int]],
) -> None:
    h = PromptHygiene(prefix_tokens=10, history=5, window=50)
    for i, prompt in enumerate(prompts):
        h.observe("t", prompt)
        if i == 0:
            continue
        recent = [p[:10] for p in prompts[max(0, i - 5) : i]]

        def common(a: list[int], b: list[int]) -> int:
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            return n

        assert h._tenants["t"].shared[-1] == max(common(prompt[:10], r) for r in recent)


async def test_the_gateway_counts_a_finding_for_answered_requests_plain_and_streamed() -> None:
    """Observed once a request is answered (off its time to first byte), for plain and
    streamed answers alike: the finding reaches /metrics."""
    import json

    import aiohttp
    from aiohttp import web
    from servers import free_port, serving

    from router.app import build_app, running_gateway
    from router.config import build_config

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"id": "c", "object": "text_completion", "choices": [
                {"index": 0, "text": "x", "finish_reason": "length"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"id": "c", "object": "text_completion",
                 "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({})

    replica = web.Application()
    replica.router.add_get("/health", health)
    replica.router.add_post("/v1/completions", completions)
    port = free_port()
    async with serving(replica) as url:
        config = build_config({
            "listen": {"host": "127.0.0.1", "port": port},
            "replicas": [{"url": url, "models": ["m"]}],
            "tenants": {"keys": [{"key": "sk-h", "tenant": "h"}]},
            "health": {"interval_s": 60}},
            {"CACHEROUTE_SALT_SECRET": "hygiene-test-secret-0123456789"})
        rng = random.Random(5)
        async with running_gateway(build_app(config), "127.0.0.1", port), \
                aiohttp.ClientSession(headers={"Authorization": "Bearer sk-h"}) as session:
            base = f"http://127.0.0.1:{port}"
            for i in range(80):
                # 40 prompts sharing a 300-token head, then 40 with token 5 changing.
                head = SYSTEM if i < 40 else [*SYSTEM[:5], 900_000 + i, *SYSTEM[6:]]
                body = {"model": "m", "prompt": head + question(rng), "max_tokens": 1,
                        "stream": i % 2 == 1}
                async with session.post(f"{base}/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()
            async with session.get(f"{base}/metrics") as resp:
                metrics = await resp.text()
    line = 'cacheroute_hygiene_findings_total{kind="prefix_divergence"} 1.0'
    assert line in metrics.splitlines()
