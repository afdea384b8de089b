"""The report's figures from hand-made records, and the files it writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadgen.driver import RequestRecord, RunResult, predicted_ttft_s
from loadgen.floor import TtftFloor
from loadgen.oracle import OracleRequest, bounds
from loadgen.report import (
    PolicyRun,
    cpu_lines,
    floor_lines,
    floor_reach,
    markdown_table,
    outside_lines,
    prediction_lines,
    size_lines,
    summarize,
    write_report,
)
from loadgen.rounds import aggregate


def _rec(i: int, replica: str | None, sent: float, ttft: float, e2e: float, prompt: int,
         cached: int, out: int = 4, error: str | None = None) -> RequestRecord:
    r = RequestRecord(index=i, request_id=f"req-{i}", conversation_id=f"c{i}", turn=0,
                      scheduled_s=None, sent_s=sent, prompt_len=prompt, max_tokens=out,
                      prompt_tokens=prompt, cached_tokens=cached, output_tokens=out,
                      replica=replica, status=200, answer_from_server=True)
    if error is None:
        r.first_token_s = sent + ttft
        r.end_s = sent + e2e
        r.chunk_times_s = [sent + ttft, sent + ttft + 0.01, sent + ttft + 0.03]
    else:
        r.error = error
    return r


def _run() -> RunResult:
    records = [
        _rec(0, "r0", 0.0, 0.100, 0.200, 100, 0),
        _rec(1, "r0", 0.5, 0.020, 0.120, 100, 80),
        _rec(2, "r0", 1.0, 0.030, 0.130, 100, 80),
        _rec(3, "r1", 1.5, 0.040, 0.140, 100, 0),
        _rec(4, None, 2.0, 0.0, 0.0, 100, 0, error="HTTP 503: no replica"),
    ]
    return RunResult(records=records, wall_s=2.0, started_unix=0.0)


def test_summary_row_figures() -> None:
    row = summarize(PolicyRun("cache_aware", _run(), replicas=["r0", "r1", "r2"]))
    assert row["requests"] == 5 and row["completed"] == 4 and row["errors"] == 1
    assert row["prompt_tokens"] == 400 and row["cached_tokens"] == 160
    assert row["hit_rate"] == pytest.approx(0.4)
    assert row["ttft_p50_s"] == pytest.approx(0.035)       # median of 20, 30, 40, 100 ms
    assert row["ttft_mean_s"] == pytest.approx(0.0475)
    assert row["e2e_p50_s"] == pytest.approx(0.135)
    assert row["itl_p50_s"] == pytest.approx(0.015)         # gaps 10 and 20 ms per request
    assert row["throughput_rps"] == pytest.approx(2.0)      # 4 completed in 2 s
    assert row["output_tps"] == pytest.approx(8.0)
    assert row["requests_per_replica"] == {"r0": 3, "r1": 1, "r2": 0}
    # Mean over all three replicas (4/3), the idle one included: 3 / (4/3).
    assert row["imbalance_max_over_mean"] == pytest.approx(2.25)


def test_time_scale_converts_to_simulated_seconds() -> None:
    row = summarize(PolicyRun("x", _run(), replicas=["r0", "r1"]), time_scale=10.0)
    assert row["ttft_p50_s"] == pytest.approx(0.35)
    assert row["throughput_rps"] == pytest.approx(0.2)


def test_what_a_first_token_spends_outside_the_replicas() -> None:
    # The replicas timed the 4 completed requests at 30 ms in all (7.5 ms each); the
    # client saw 47.5 ms on average: 40 ms between them (router, hops, client).
    row = summarize(PolicyRun("x", _run(), ["r0", "r1"], replica_ttft=(4, 0.030)))
    assert row["replica_ttft_mean_s"] == pytest.approx(0.0075)
    assert row["ttft_outside_mean_s"] == pytest.approx(0.040)
    scaled = summarize(PolicyRun("x", _run(), ["r0", "r1"], replica_ttft=(4, 0.030)),
                       time_scale=10.0)
    assert scaled["ttft_outside_mean_s"] == pytest.approx(0.40)
    # Not the same requests (a replica timed one the client never saw complete): no figure.
    for timed in [(5, 0.030), None]:
        row = summarize(PolicyRun("x", _run(), ["r0", "r1"], replica_ttft=timed))
        assert row["ttft_outside_mean_s"] is None and row["replica_ttft_mean_s"] is None


def test_router_cpu_per_request_over_rounds() -> None:
    # 4 requests completed (the fifth failed): 6 and 10 ms of CPU, 1.5 and 2.5 ms each.
    rows = [summarize(PolicyRun("cache_aware", _run(), ["r0", "r1"], round=i,
                                router_cpu_s=cpu)) for i, cpu in enumerate((0.006, 0.010))]
    assert [r["router_cpu_per_request_s"] for r in rows] == pytest.approx([0.0015, 0.0025])
    peer = summarize(PolicyRun("smg:cache_aware", _run(), ["r0", "r1"], router_cpu_s=0.0))
    unknown = summarize(PolicyRun("vllm-router:kv_aware", _run(), ["r0", "r1"]))
    assert peer["router_cpu_per_request_s"] == 0.0
    assert unknown["router_cpu_per_request_s"] is None
    lines = cpu_lines(aggregate([*rows, peer, unknown]))
    assert lines[0].startswith("- Router CPU per request:")
    # A router that used less than the clock's tick still has its line; unknown has none.
    assert lines[1:] == ["  - cache_aware: 2.00 ms (1.50-2.50)",
                         "  - smg:cache_aware: 0.00 ms (0.00-0.00)"]
    assert cpu_lines(aggregate([unknown])) == []


def test_what_our_gateway_spent_before_going_upstream() -> None:
    # Its Server-Timing header: parse + route + admit, in ms; upstream is not counted.
    run = _run()
    for i, r in enumerate(run.completed()):
        r.server_timing = (f"parse;dur=0.10, route;dur={0.5 + i:.2f}, admit;dur=0.40, "
                           "upstream;dur=30.00")
    row = summarize(PolicyRun("cache_aware", run, ["r0", "r1"], replica_ttft=(4, 0.030)))
    assert row["before_upstream_mean_s"] == pytest.approx(0.0025)  # 1.0 + mean(0, 1, 2, 3)
    line = next(x for x in outside_lines(aggregate([row])) if "cache_aware" in x)
    assert line.endswith("; 2.5 ms (2.5-2.5) of it in the gateway before going upstream")
    # A peer (no header), a header without those stages, or a malformed one: no figure.
    for header in [None, "upstream;dur=30.00", "parse;dur=x, route;dur=1, admit;dur=1"]:
        run.completed()[0].server_timing = header
        row = summarize(PolicyRun("x", run, ["r0", "r1"], replica_ttft=(4, 0.030)))
        assert row["before_upstream_mean_s"] is None
        assert not any("before going upstream" in x for x in outside_lines(aggregate([row])))


def test_time_held_at_the_gateway_is_reported_beside_the_rest() -> None:
    # Server-Timing's hold (waited for a replica's prefill queue before the decision,
    # router/prefill_hold.py) and gate (after it, for the queue ahead on its replica,
    # policy.step_gate), each over every request, held or not; neither is part of the
    # gateway's own time.
    run = _run()
    for i, r in enumerate(run.completed()):
        r.server_timing = (f"parse;dur=0.10, route;dur=0.50, hold;dur={4.0 * (i % 2):.2f}, "
                           f"gate;dur={8.0 * (i == 0):.2f}, admit;dur=0.40, upstream;dur=30.00")
    row = summarize(PolicyRun("cache_aware", run, ["r0", "r1"], replica_ttft=(4, 0.030)))
    assert row["held_mean_s"] == pytest.approx(0.002) and row["held_requests"] == 2
    assert row["gated_mean_s"] == pytest.approx(0.002) and row["gated_requests"] == 1
    assert row["before_upstream_mean_s"] == pytest.approx(0.001)
    line = next(x for x in outside_lines(aggregate([row])) if "cache_aware" in x)
    assert line.endswith("; held there for a replica's queue to fall under a step "
                         "(hold_cap) 2.0 ms a request (2.0-2.0); gated there for its queue "
                         "ahead to reach a first token (step_gate) 2.0 ms a request (2.0-2.0)")
    # Nothing held or gated, a record from before the gate had its stage, or a peer
    # without either: no such clause.
    for header in ["parse;dur=0.10, route;dur=0.50, hold;dur=0.00, gate;dur=0.00, "
                   "admit;dur=0.40", "parse;dur=0.10, route;dur=0.50, hold;dur=0.00, "
                   "admit;dur=0.40", None]:
        for r in run.completed():
            r.server_timing = header
        row = summarize(PolicyRun("x", run, ["r0", "r1"], replica_ttft=(4, 0.030)))
        assert row["gated_mean_s"] is None or row["gated_mean_s"] == 0
        lines = outside_lines(aggregate([row]))
        assert not any("held there" in x or "gated there" in x for x in lines)


def test_first_tokens_against_what_the_gateway_predicted() -> None:
    # TTFTs 100, 20, 30, 40 ms; predicted 60, 20, 50, 10: measured - predicted is
    # +40, 0, -20, +30 ms. A peer's answers carry no prediction: no figure, no line.
    run = _run()
    for r, predicted in zip(run.completed(), (0.060, 0.020, 0.050, 0.010), strict=True):
        r.predicted_ttft_s = predicted
    row = summarize(PolicyRun("cache_aware", run, ["r0", "r1"]), time_scale=2.0)
    assert row["ttft_predicted_requests"] == 4
    assert row["ttft_error_p50_s"] == pytest.approx(2 * 0.015)  # median of -20, 0, 30, 40
    assert row["ttft_error_p10_s"] == pytest.approx(2 * -0.014)  # numpy's linear rule
    assert row["ttft_error_p90_s"] == pytest.approx(2 * 0.037)
    peer = summarize(PolicyRun("vllm-router:kv_aware", _run(), ["r0", "r1"]))
    assert peer["ttft_predicted_requests"] == 0 and peer["ttft_error_p50_s"] is None
    lines = prediction_lines(aggregate([row, peer]))
    assert len(lines) == 2 and "predicted" in lines[0]
    assert lines[1] == ("  - cache_aware: p10 -28 (-28 to -28), p50 +30 (+30 to +30), "
                        "p90 +74 (+74 to +74) ms")
    assert prediction_lines(aggregate([peer])) == []


@pytest.mark.parametrize("header, seconds", [
    ("311.7", 0.3117), ("0", 0.0), (None, None), ("", None), ("fast", None), ("-5", None),
    ("nan", None), ("inf", None)])
def test_the_predicted_ttft_header_is_read_or_left_out(header: str | None,
                                                        seconds: float | None) -> None:
    got = predicted_ttft_s(header)
    assert got == (None if seconds is None else pytest.approx(seconds))


def test_report_files(tmp_path: Path) -> None:
    oracle = bounds([OracleRequest([1, 2, 3, 4, 5]), OracleRequest([1, 2, 3, 4, 6])],
                    block_size=4, fleet_blocks=8)
    runs = [PolicyRun("round_robin", _run(), ["r0", "r1"], oracle),
            PolicyRun("cache_aware", _run(), ["r0", "r1"], oracle, note="a note")]
    files = write_report(tmp_path / "out", runs, {"workload": "test"})
    assert files.results_json.exists() and files.table_md.exists()
    assert sorted(p.name for p in files.plots) == [
        "over_time.png", "requests_per_replica.png", "ttft_cdf.png"]
    for p in files.plots:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(files.results_json.read_text())
    assert [row["policy"] for row in data["policies"]] == ["round_robin", "cache_aware"]
    assert data["policies"][0]["oracle_unlimited_hit_rate"] == pytest.approx(4 / 10)
    assert len(data["requests"]["cache_aware"]) == 5
    assert "prompt_token_ids" not in data["requests"]["cache_aware"][0]
    md = files.table_md.read_text()
    assert "| cache_aware | 35.0 | " in md
    assert "40.0% | 40.0% | 40.0% |" in md   # hit rate, oracle pooled, oracle unlimited
    assert "- cache_aware: a note" in md


def test_table_has_one_row_per_policy_and_matching_columns() -> None:
    rows = [summarize(PolicyRun(p, _run(), ["r0", "r1"])) for p in ("a", "b")]
    lines = markdown_table(rows).splitlines()
    assert len(lines) == 4
    assert len({line.count("|") for line in lines}) == 1


def test_replica_counts_stand_in_when_the_router_names_no_replica() -> None:
    run = _run()
    for r in run.records:
        r.replica = None
    row = summarize(PolicyRun("vllm-router:x", run, ["r0", "r1"],
                              replica_counts={"r0": 1, "r1": 3}))
    assert row["requests_per_replica"] == {"r0": 1, "r1": 3}
    assert row["imbalance_max_over_mean"] == pytest.approx(1.5)
    assert row["predicted_cached_tokens"] is None


def test_repeated_rounds_lead_with_medians_spreads_and_peer_ratios(tmp_path: Path) -> None:
    runs = [PolicyRun("cache_aware", _run(), ["r0", "r1"], round=0, replica_ttft=(4, 0.03)),
            PolicyRun("vllm-router:kv_aware", _run(), ["r0", "r1"], round=0),
            PolicyRun("cache_aware", _run(), ["r0", "r1"], round=1, replica_ttft=(4, 0.07)),
            PolicyRun("vllm-router:kv_aware", _run(), ["r0", "r1"], round=1)]
    files = write_report(tmp_path / "out", runs, {"workload": "test"}, plots=False)
    data = json.loads(files.results_json.read_text())
    assert [a["policy"] for a in data["over_rounds"]] == ["cache_aware", "vllm-router:kv_aware"]
    assert data["over_rounds"][0]["ttft_p50_s"]["median"] == pytest.approx(0.035)
    assert data["ratios_against_best_peer"]["ttft_p50_s"]["ratio"] == pytest.approx(1.0)
    assert sorted(data["requests"]) == ["cache_aware", "cache_aware@round1",
                                        "vllm-router:kv_aware", "vllm-router:kv_aware@round1"]
    md = files.table_md.read_text()
    assert "| cache_aware | 2 | 35.0 (35.0-35.0) |" in md
    assert "cache_aware TTFT p50: 1.00x of the best peer's" in md
    assert "| cache_aware (round 2) |" in md
    # 47.5 ms at the client, 7.5 and 17.5 at the replicas; the peer's replicas untimed.
    assert "  - cache_aware: 35.0 ms (30.0-40.0) of a 47.5 ms mean" in md
    assert "  - vllm-router:kv_aware:" not in md


def test_the_floor_plus_the_least_hop_is_what_no_queue_could_reach() -> None:
    # Floors 0.1 / 0.2 / 0.3 s (p50 0.2); the least mean outside the replicas is the peer's
    # 30 ms; the best peer (least p50) is vllm-router's at 460 ms: 230 / 460 = 0.5x.
    floor = TtftFloor((0.1, 0.2, 0.3))
    aggregated: list[dict[str, Any]] = [
        {"policy": "cache_aware", "ttft_p50_s": {"median": 0.30},
         "ttft_outside_mean_s": {"median": 0.05}},
        {"policy": "vllm-router:kv_aware", "ttft_p50_s": {"median": 0.46},
         "ttft_outside_mean_s": {"median": 0.03}},
        {"policy": "smg:cache_aware", "ttft_p50_s": {"median": 0.50},
         "ttft_outside_mean_s": None},
    ]
    hop, reach, peer, ratio = floor_reach(floor, aggregated) or (0, 0, "", 0)
    assert (hop, peer) == (pytest.approx(0.03), "vllm-router:kv_aware")
    assert reach == pytest.approx(0.23) and ratio == pytest.approx(0.5)
    line = floor_lines(floor, aggregated)[-1]
    assert "(30.0 ms, a mean): p50 230.0 ms, 0.50x vllm-router:kv_aware's" in line
    # No peer in the run, or no outside figure anywhere: nothing to say.
    assert floor_reach(floor, aggregated[:1]) is None
    assert floor_reach(floor, [{**a, "ttft_outside_mean_s": None} for a in aggregated]) is None


def test_ttft_by_prompt_size_over_rounds() -> None:
    # Short and long prompts apart: a window's p50 alone hides which of them a router
    # loses on. Requests per round are the most any round had in a bin.
    def run(prompts_and_ttfts: list[tuple[int, float]]) -> RunResult:
        records = [_rec(i, "r0", float(i), ttft, ttft + 0.1, prompt, 0)
                   for i, (prompt, ttft) in enumerate(prompts_and_ttfts)]
        return RunResult(records=records, wall_s=10.0, started_unix=0.0)

    rows = [summarize(PolicyRun("cache_aware", run(pairs), ["r0"], round=i))
            for i, pairs in enumerate([[(100, 0.010), (511, 0.030), (5000, 0.400)],
                                       [(100, 0.020), (200, 0.040), (8192, 0.300)]])]
    assert rows[0]["ttft_p50_size_<512_s"] == pytest.approx(0.020)
    assert rows[1]["ttft_p50_size_<512_s"] == pytest.approx(0.030)
    assert rows[0]["ttft_p50_size_512-2k_s"] is None and rows[0]["requests_size_512-2k"] == 0
    lines = size_lines(aggregate(rows), rows)
    assert lines[2] == "| policy | <512 (2) | 2k-8k (1) | 8k-16k (1) |"
    assert lines[4] == "| cache_aware | 25.0 (20.0-30.0) | 400.0 (400.0-400.0) | 300.0 (300.0-300.0) |"
    # One size only (an agent workload's turns, say): no table.
    one = [summarize(PolicyRun("x", run([(100, 0.01), (300, 0.02)]), ["r0"]))]
    assert size_lines(aggregate(one), one) == []


def _scaled_run(k: float) -> RunResult:
    """_run() with every first token k times as late."""
    run = _run()
    for r in run.records:
        if r.first_token_s is not None and r.sent_s is not None:
            r.first_token_s = r.sent_s + k * (r.first_token_s - r.sent_s)
    return run


def test_each_layout_is_held_against_the_peers_run_as_many_instances(tmp_path: Path) -> None:
    # One gateway against one vllm-router, four against four: never one against four. Ours
    # is 0.5x of the single peer and 2x of the four (which are faster than the single one).
    runs = [PolicyRun(name, _scaled_run(k), ["r0", "r1"], round=i)
            for i in (0, 1)
            for name, k in (("cache_aware", 1.0), ("vllm-router:kv_aware", 2.0),
                            ("cache_aware*4", 1.0), ("vllm-router:kv_aware*4", 0.5))]
    files = write_report(tmp_path / "out", runs, {"workload": "test"}, plots=False)
    data = json.loads(files.results_json.read_text())
    single = data["ratios_against_best_peer"]["ttft_p50_s"]
    assert single["best_peer"] == "vllm-router:kv_aware"
    assert single["ratio"] == pytest.approx(0.5)
    four = data["ratios_against_best_peer_by_instances"]["4"]["ttft_p50_s"]
    assert four["best_peer"] == "vllm-router:kv_aware*4"
    assert four["ratio"] == pytest.approx(2.0)
    md = files.table_md.read_text()
    assert "- cache_aware TTFT p50: 0.50x of the best peer's" in md
    assert "- cache_aware*4 TTFT p50: 2.00x of the best peer's" in md
