"""The driver against real simulated replicas on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loadgen.driver import Driver, DriverConfig
from loadgen.workloads import ChatWorkload, RandomWorkload
from replica.fleet import AsyncSimFleet, SimFleet


@pytest.fixture(scope="module")
def sim() -> Iterator[SimFleet]:
    with SimFleet(1, block_size=16, num_blocks=512, kv_events=False,
                  extra_args=["--max-model-len", "1024"]) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def slow_sim() -> Iterator[SimFleet]:
    # 100x slower than the H100 profile's virtual time: every step takes over 0.5 s.
    with SimFleet(1, block_size=16, num_blocks=512, kv_events=False, time_scale=0.01,
                  prefill_profile="h100-llama3.1-8b") as fleet:
        yield fleet


def _reset(fleet: SimFleet) -> None:
    import urllib.request

    req = urllib.request.Request(f"{fleet.urls[0]}/reset_prefix_cache", method="POST")
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200


def _chat() -> ChatWorkload:
    return ChatWorkload(requests=6, conversations=2, shared_prefix_tokens=100,
                        question_tokens=20, answer_tokens=10)


async def test_closed_loop_streams_usage_and_resends_real_answers(sim: SimFleet) -> None:
    _reset(sim)
    seen: list[int] = []
    driver = Driver(DriverConfig(base_url=sim.urls[0], model="sim", concurrency=2,
                                 deadline_s=60), on_record=lambda r: seen.append(r.index))
    result = await driver.run(_chat())
    recs = result.records
    assert [r.index for r in recs] == [0, 1, 2, 3, 4, 5]
    assert sorted(seen) == [0, 1, 2, 3, 4, 5]
    assert all(r.ok and r.status == 200 for r in recs)
    assert [r.prompt_tokens for r in recs] == [120, 120, 150, 150, 180, 180]
    assert [r.prompt_len for r in recs] == [120, 120, 150, 150, 180, 180]
    # The same hand-derived counts as the in-process engine (test_single_engine): the
    # resent answers are the server's own tokens, so turn t hits turn t-1's answer blocks.
    assert [r.cached_tokens for r in recs] == [0, 96, 128, 128, 144, 144]
    assert all(r.output_tokens == 10 and len(r.output_token_ids) == 10 for r in recs)
    assert all(r.answer_from_server for r in recs)
    for r in recs:
        assert r.ttft_s is not None and r.e2e_s is not None
        assert 0 < r.ttft_s <= r.e2e_s
        assert len(r.itl_s) == len(r.chunk_times_s) - 1 >= 1
    # A conversation's turn starts only after its previous turn ended.
    for a, b in zip(recs, recs[2:], strict=False):
        assert a.end_s is not None and b.sent_s >= a.end_s
    assert result.wall_s >= max(r.end_s or 0 for r in recs)


async def test_open_loop_follows_the_seeded_schedule(sim: SimFleet) -> None:
    _reset(sim)
    cfg = DriverConfig(base_url=sim.urls[0], model="sim", mode="open", rate=50.0, seed=3,
                       deadline_s=60)
    result = await Driver(cfg).run(RandomWorkload(requests=8, input_tokens=40, output_tokens=3))
    again = await Driver(cfg).run(RandomWorkload(requests=8, input_tokens=40, output_tokens=3))
    scheduled = [r.scheduled_s for r in result.records]
    assert scheduled == [r.scheduled_s for r in again.records]   # seeded
    assert all(s is not None for s in scheduled)
    assert scheduled == sorted(scheduled)
    for r in result.records:
        assert r.ok and r.output_tokens == 3
        assert r.scheduled_s is not None and r.sent_s >= r.scheduled_s


async def test_open_loop_without_a_rate_is_refused(sim: SimFleet) -> None:
    with pytest.raises(ValueError, match="open loop needs a rate"):
        await Driver(DriverConfig(base_url=sim.urls[0], model="sim", mode="open")).run(_chat())


async def test_rejections_are_recorded_and_the_run_goes_on(sim: SimFleet) -> None:
    w = RandomWorkload(requests=3, input_tokens=600, output_tokens=2, range_ratio=0.0,
                       prefix_tokens=500)   # 1,100-token prompts against max-model-len 1024
    result = await Driver(DriverConfig(base_url=sim.urls[0], model="sim", concurrency=1,
                                       max_requests=2)).run(w)
    assert len(result.records) == 2
    for r in result.records:
        assert r.status == 400 and not r.ok
        assert r.error is not None and r.error.startswith("HTTP 400")
        assert "maximum context length is 1024" in r.error


async def test_deadline_bounds_the_run(slow_sim: SimFleet) -> None:
    w = RandomWorkload(requests=4, input_tokens=64, output_tokens=20)
    result = await Driver(DriverConfig(base_url=slow_sim.urls[0], model="sim", concurrency=2,
                                       deadline_s=1.0)).run(w)
    assert result.wall_s < 5.0
    errors = [r.error for r in result.records]
    assert errors[:2] == ["cancelled: deadline"] * 2
    assert errors[2:] == ["not sent: deadline"] * 2


async def test_chat_text_resends_the_servers_answer_text(tiny_model_dir) -> None:
    w = ChatWorkload(requests=2, conversations=1, shared_prefix_tokens=60, question_tokens=10,
                     answer_tokens=6, chat_text=True)
    async with AsyncSimFleet(1, block_size=16, num_blocks=512, kv_events=False,
                             model_dir=tiny_model_dir, served_model_name="sim") as fleet:
        result = await Driver(DriverConfig(base_url=fleet.urls[0], model="sim", api="chat",
                                           concurrency=1, deadline_s=60)).run(w)
    first, second = result.records
    assert first.ok and second.ok
    assert first.output_text and first.answer_from_server
    assert first.prompt_tokens is not None and second.prompt_tokens is not None
    # The second turn renders the first turn's prompt, then its answer's text: every full
    # block of the first prompt is a prefix of the second and hits.
    assert second.cached_tokens is not None
    assert second.cached_tokens >= first.prompt_tokens // 16 * 16
    assert second.prompt_tokens > first.prompt_tokens + 10


async def test_a_failover_after_the_head_is_recorded_on_the_replica_that_answered() -> None:
    """The gateway's head names the replica that accepted the stream first; after a
    failover an SSE comment names the one that answered (router/proxy.py)."""
    import json

    from aiohttp import web
    from servers import serving

    async def completions(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "x-cacheroute-replica": "up0"})
        await resp.prepare(request)
        chunk = {"choices": [{"index": 0, "text": "a", "token_ids": [7],
                              "finish_reason": "length"}],
                 "usage": {"prompt_tokens": 40, "completion_tokens": 1}}
        await resp.write(b": x-cacheroute-replica: up1\n\ndata: " + json.dumps(chunk).encode()
                         + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with serving(app) as url:
        result = await Driver(DriverConfig(base_url=url, model="m", concurrency=1,
                                           max_requests=1)).run(
            RandomWorkload(requests=1, input_tokens=40, output_tokens=1))
    [rec] = result.records
    assert rec.ok and rec.output_token_ids == [7]
    assert rec.replica == "up1"
