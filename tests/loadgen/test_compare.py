"""One small compare run end to end: 2 sims, a private redis-server, 2 gateways (and
one policy as 2 instances)."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from servers import REPO, wait_until

from loadgen.compare import (
    add_arguments,
    instances,
    parse_policies,
    round_order,
    routers_line,
    run_comparison,
    runnable,
    warm_run_wanted,
)
from loadgen.gateway_under_test import (
    choose_profile,
    config_overrides,
    gateway_config,
    gateway_prefill,
    policy_variant,
)
from loadgen.harness import HarnessError, unbuilt_c_paths, unbuilt_warning
from loadgen.target_fleet import TargetFleet, TargetReplica
from loadgen.workload_flags import build_workload
from replica.profiles import load_profile
from router.policy.types import PrefillProfile


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_compare_two_policies_end_to_end(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "report"
    args = _args(
        "--replicas", "2", "--policies", "round_robin,cache_aware*2", "--vllm-router", "none",
        "--index", "redis", "--workload", "chat", "--requests", "9", "--conversations", "3",
        "--shared-prefix-tokens", "64", "--question-tokens", "16", "--answer-tokens", "4",
        "--concurrency", "1", "--kv-tokens", "4096", "--max-model-len", "1024",
        "--model-dir", str(tiny_model_dir), "--out", str(out), "--deadline-s", "120",
        "--no-plots")
    comparison = run_comparison(args)
    assert comparison.index.startswith("redis://127.0.0.1:")
    assert not comparison.index.endswith(":6379/0")
    data = json.loads((out / "results.json").read_text())
    rows = {row["policy"]: row for row in data["policies"]}
    assert list(rows) == ["round_robin", "cache_aware*2"]
    for row in rows.values():
        assert row["completed"] == 9 and row["errors"] == 0
        assert row["prompt_tokens"] == 3 * 80 + 3 * 100 + 3 * 120
        assert sum(row["requests_per_replica"].values()) == 9
        assert row["unattributed_requests"] == 0
        assert row["answers_substituted"] == 0
        # The indexer fed the Redis index from the sims' KV events: the gateway expected hits.
        assert 0 < row["predicted_cached_tokens"] <= row["cached_tokens"] + 9 * 16
        # Unlimited cache, stream order: first turns 0, 64, 64 (4 system blocks); second
        # turns 80 each (5 blocks of 83 computed tokens); third turns 96 each.
        assert row["oracle_unlimited_hit_rate"] == pytest.approx(656 / 900)
        assert row["oracle_pooled_hit_rate"] == pytest.approx(656 / 900)
    # Every request says where the gateway's time went (its Server-Timing header).
    for policy in rows:
        for request in data["requests"][policy]:
            timing = request["server_timing"]
            assert timing and all(f"{stage};dur=" in timing
                                  for stage in ("parse", "route", "admit", "upstream")), timing
    # Every answer says what first token the gateway's cost model predicted where it went
    # (round_robin's decisions ignore it; the model still ran).
    for policy in rows:
        predicted = [r["predicted_ttft_s"] for r in data["requests"][policy]]
        assert all(p is not None and p > 0 for p in predicted), predicted
        assert rows[policy]["ttft_predicted_requests"] == 9
        assert rows[policy]["ttft_error_p50_s"] is not None
    # Round robin alternates the two replicas, request i on replica i % 2, while request i
    # is turn i // 3 of conversation i % 3: worked through by hand, 0 + 0 + 64 * 4 (the
    # system prompt) + 80 * 3 (each third turn finds its own first turn) = 496 tokens.
    rr = rows["round_robin"]
    assert sorted(rr["requests_per_replica"].values()) == [4, 5]
    assert rr["cached_tokens"] == 496
    assert rows["cache_aware*2"]["cached_tokens"] >= rr["cached_tokens"]
    # Two gateways on one index, requests alternating between them.
    assert rows["cache_aware*2"]["note"] == ("2 gateways sharing the index; requests per "
                                             "instance 5/4")
    assert "note" not in rows["round_robin"] or "gateways" not in rows["round_robin"]["note"]
    md = (out / "report.md").read_text()
    assert "| round_robin |" in md and "| cache_aware*2 |" in md
    assert "index: redis" in md
    # The floor no router beats (each request alone, the oracle's prefix cached): below
    # every policy's measured TTFT percentiles, and printed beside them.
    floor = data["ttft_floor"]
    assert 0 < floor["p50_s"] <= floor["p99_s"]
    for row in rows.values():
        assert floor["p50_s"] < row["ttft_p50_s"] and floor["p99_s"] < row["ttft_p99_s"]
    assert f"p50 {floor['p50_s'] * 1000:.1f} ms" in md and "TTFT floor" in md
    # Configured as a user would: `replica calibrate` against a sim, not its coefficients.
    profile = comparison.gateway_profile
    assert profile is not None and profile.choice == "calibrated" and profile.prefill
    sim = load_profile("h100-llama3.1-8b")
    assert 0.5 * sim.token_s < profile.prefill["per_token_s"] < 2 * sim.token_s
    assert profile.prefill != gateway_prefill(sim)
    assert "gateway profile: calibrated (wall seconds): base_s=" in md


def test_gateway_config_exposes_routing_and_names_replicas() -> None:
    fleet = TargetFleet([TargetReplica("sim-0", "http://127.0.0.1:1", "tcp://127.0.0.1:2", None)],
                        block_size=32, blocks_per_replica=10, max_model_len=512,
                        stop=lambda: None)
    cfg = gateway_config("least_loaded", fleet, 9000, "memory", Path("/m"), 5,
                         {"base_s": 0.1, "per_token_s": 0.2, "per_token_context_s": 0.0})
    assert cfg["proxy"]["expose_routing_headers"] is True
    assert cfg["policy"]["name"] == "least_loaded" and cfg["policy"]["seed"] == 5
    assert cfg["replicas"][0]["name"] == "sim-0"
    assert cfg["replicas"][0]["block_size"] == 32
    assert cfg["replicas"][0]["hash_seed"] == "5"


def test_default_gateway_profile_leaves_the_gateways_own() -> None:
    fleet = TargetFleet([TargetReplica("sim-0", "http://127.0.0.1:1", None, None)],
                        block_size=16, blocks_per_replica=10, max_model_len=512,
                        stop=lambda: None)
    cfg = gateway_config("cache_aware", fleet, 9000, "memory", Path("/m"), 0, None)
    assert "prefill" not in cfg["policy"]
    sim = load_profile("h100-llama3.1-8b")
    exact = PrefillProfile(**gateway_prefill(sim))
    # The gateway's prediction of a lone prefill is the sim's, cold or behind a cache hit.
    for tokens, cached in ((16, 0), (2_000, 0), (30_000, 0), (8_000, 7_984), (20_000, 4_096)):
        assert exact.seconds(tokens - cached, tokens) == pytest.approx(
            sim.prefill_seconds(tokens, cached), rel=1e-9)


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_the_gateways_profile_is_in_wall_seconds_whatever_the_sims_time_scale(
        scale: float, tmp_path: Path) -> None:
    # The gateway times first bytes and drains its queues by the wall clock: sims K
    # times faster than real time are, to it, replicas K times faster. A profile in
    # simulated seconds made it K times pessimistic until its learned bias caught up.
    args = _args("--out", "x", "--gateway-profile", "exact", "--time-scale", str(scale))
    fleet = TargetFleet([], block_size=16, blocks_per_replica=10, max_model_len=512,
                        stop=lambda: None)
    profile = choose_profile(args, fleet, tmp_path)
    sim = gateway_prefill(load_profile("h100-llama3.1-8b"))
    assert profile.prefill is not None
    assert profile.prefill == pytest.approx({k: v / scale for k, v in sim.items()})


def test_peers_are_named_and_smg_is_skipped_on_token_ids_with_a_reason() -> None:
    tokens = _args("--out", "x", "--policies", "cache_aware", "--vllm-router", "kv_aware",
                   "--smg", "cache_aware,prefix_hash")
    policies = parse_policies(tokens)
    assert policies == ["cache_aware", "vllm-router:kv_aware", "smg:cache_aware",
                        "smg:prefix_hash"]
    keep, skipped = runnable(policies, tokens.api)
    assert keep == ["cache_aware", "vllm-router:kv_aware"]
    assert len(skipped) == 2
    assert all("refuses token-id prompts" in s and "--api chat" in s for s in skipped)
    keep, skipped = runnable(policies, "chat")
    assert keep == policies and skipped == []
    # auto adds SMG only where it can run: chat traffic.
    auto = _args("--out", "x", "--policies", "cache_aware", "--vllm-router", "none")
    assert parse_policies(auto) == ["cache_aware"]
    chat = _args("--out", "x", "--policies", "cache_aware", "--vllm-router", "none",
                 "--api", "chat")
    assert parse_policies(chat) == ["cache_aware", "smg:cache_aware", "smg:prefix_hash"]
    with pytest.raises(SystemExit, match="unknown policy 'sglang:x'"):
        parse_policies(_args("--out", "x", "--policies", "sglang:x"))


def test_rounds_rotate_the_policy_order() -> None:
    policies = ["a", "b", "c"]
    assert [round_order(policies, r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_chat_agent_through_smg_and_ours_over_two_rounds(tmp_path: Path,
                                                        tiny_model_dir: Path) -> None:
    out = tmp_path / "report"
    args = _args(
        "--replicas", "2", "--policies", "cache_aware", "--vllm-router", "none",
        "--smg", "cache_aware", "--api", "chat", "--repeats", "2",
        "--gateway-profile", "exact", "--index", "memory", "--workload", "agent",
        "--conversations", "2", "--turns", "2", "--instruction-tokens", "64", "--tools", "2",
        "--tool-tokens", "24", "--question-tokens", "16", "--answer-tokens", "4",
        "--concurrency", "2", "--kv-tokens", "4096", "--max-model-len", "2048",
        "--model-dir", str(tiny_model_dir), "--out", str(out), "--deadline-s", "60",
        "--warmup", "2", "--no-plots")
    comparison = run_comparison(args)
    assert comparison.skipped == []
    runs = [(r.policy, r.round) for r in comparison.runs]
    assert runs == [("cache_aware", 0), ("smg:cache_aware", 0),
                    ("smg:cache_aware", 1), ("cache_aware", 1)]
    # Before round 1, round 1's first policy ran the workload once, unreported.
    warm = comparison.warm_run
    assert warm is not None and (warm.policy, warm.round) == ("cache_aware", -1)
    assert len(warm.result.completed()) == 4
    assert warm.replica_counts is not None and sum(warm.replica_counts.values()) == 4
    data = json.loads((out / "results.json").read_text())
    for row in data["policies"]:
        assert row["completed"] == 4 and row["errors"] == 0, row
        # Every request reached a sim, counted at the sims themselves (SMG names none).
        assert sum(row["requests_per_replica"].values()) == 4
        assert row["prompt_tokens"] > 4 * (64 + 2 * 24)  # the tools' JSON comes on top
        assert row["answers_substituted"] == 0
    smg = [row for row in data["policies"] if row["policy"] == "smg:cache_aware"]
    assert len(smg) == 2 and all(row["cached_tokens"] > 0 for row in smg)
    assert [a["policy"] for a in data["over_rounds"]] == ["cache_aware", "smg:cache_aware"]
    ratios = data["ratios_against_best_peer"]
    assert ratios["ttft_p50_s"]["best_peer"] == "smg:cache_aware"
    # The oracle replays the chat prompts as the replicas tokenized them (template, tools).
    assert data["policies"][0]["oracle_unlimited_hit_rate"] > 0
    md = (out / "report.md").read_text()
    assert "| smg:cache_aware | 2 |" in md
    assert "gateway profile: exact" in md
    assert "cache_aware ran the whole workload once before round 1" in md
    assert "api: chat: messages (and tools)" in md
    # Our gateway (not SMG) first tokenized the two sessions' shared prompt and tools.
    assert "then tokenized, once, the 1 prefix(es) that several conversations share" in md


def test_a_warm_run_is_on_by_default_only_with_rounds_to_interleave() -> None:
    out = ("--out", "unused")
    assert not warm_run_wanted(_args(*out))
    assert warm_run_wanted(_args(*out, "--repeats", "3"))
    assert not warm_run_wanted(_args(*out, "--repeats", "3", "--no-warm-run"))
    assert warm_run_wanted(_args(*out, "--warm-run"))


def test_policy_set_overrides_the_gateway_policy() -> None:
    args = _args("--out", "x", "--policy-set", "load_cost_s=0.25",
                 "--policy-set", "weights={prefix: 0.2}")
    overrides = config_overrides(args)
    assert overrides == {"load_cost_s": 0.25, "weights": {"prefix": 0.2}}
    fleet = TargetFleet([TargetReplica("sim-0", "http://127.0.0.1:1", None, None)],
                        block_size=16, blocks_per_replica=10, max_model_len=512,
                        stop=lambda: None)
    cfg = gateway_config("cache_aware", fleet, 9000, "memory", Path("/m"), 0,
                         {"base_s": 0.1, "per_token_s": 0.2, "per_token_context_s": 0.0},
                         overrides)
    assert cfg["policy"]["name"] == "cache_aware" and cfg["policy"]["load_cost_s"] == 0.25
    assert config_overrides(_args("--out", "x")) == {}
    for bad in ("load_cost_s", "name=random", "nope.x=1", "listen.port=1"):
        with pytest.raises(HarnessError):
            config_overrides(_args("--out", "x", "--policy-set", bad))
    index = config_overrides(_args("--out", "x", "--index-set", "deadline_ms=100"), "index_set")
    assert index == {"deadline_ms": 100}
    cfg = gateway_config("cache_aware", fleet, 9000, "memory", Path("/m"), 0,
                         {"base_s": 0.1, "per_token_s": 0.2, "per_token_context_s": 0.0},
                         None, index)
    assert cfg["index"] == {"backend": "memory", "deadline_ms": 100}
    with pytest.raises(HarnessError):
        config_overrides(_args("--out", "x", "--index-set", "backend=redis"), "index_set")


def test_policy_variants_carry_their_own_settings_and_bad_ones_are_named() -> None:
    assert policy_variant("cache_aware") == ("cache_aware", {})
    assert policy_variant("cache_aware@work_weight=0@hot_cost_s=0.5") == (
        "cache_aware", {"work_weight": 0, "hot_cost_s": 0.5})
    args = _args("--out", "x", "--policies", "round_robin,cache_aware@work_weight=0",
                 "--vllm-router", "none", "--smg", "none")
    assert parse_policies(args) == ["round_robin", "cache_aware@work_weight=0"]
    with pytest.raises(SystemExit, match="unknown policy 'nope@work_weight=0'"):
        parse_policies(_args("--out", "x", "--policies", "nope@work_weight=0"))
    name, variant = policy_variant("cache_aware@health.scrape_interval_s=1@tolerance=0.2")
    assert variant == {"health.scrape_interval_s": 1, "tolerance": 0.2}
    fleet = TargetFleet([TargetReplica("sim-0", "http://127.0.0.1:1", None, None)],
                        block_size=16, blocks_per_replica=10, max_model_len=512,
                        stop=lambda: None)
    cfg = gateway_config(name, fleet, 9000, "memory", Path("/m"), 0, None, variant)
    assert cfg["health"] == {"scrape_interval_s": 1}
    assert cfg["policy"]["tolerance"] == 0.2 and "health.scrape_interval_s" not in cfg["policy"]
    assert gateway_config(name, fleet, 9000, "memory", Path("/m"), 0, None,
                          {"listen.workers": 2})["listen"] == {
        "host": "127.0.0.1", "port": 9000, "workers": 2}
    assert gateway_config(name, fleet, 9000, "redis://h:1", Path("/m"), 0, None,
                          {"index.share_segments": False})["index"] == {
        "backend": "redis://h:1", "share_segments": False}
    for bad in ("cache_aware@work_weight", "cache_aware@name=random", "cache_aware@=1",
                "cache_aware@listen.port=1", "cache_aware@health.=1", "cache_aware@tenants.x=1",
                "cache_aware@index.backend=memory"):
        with pytest.raises(HarnessError, match="policy variant"):
            policy_variant(bad)


def test_a_policy_can_name_its_own_count_of_instances() -> None:
    assert instances("cache_aware", 1) == ("cache_aware", 1)
    assert instances("cache_aware*4", 1) == ("cache_aware", 4)
    assert instances("vllm-router:cache_aware*4", 2) == ("vllm-router:cache_aware", 4)
    assert instances("cache_aware@work_weight=0*3", 1) == ("cache_aware@work_weight=0", 3)
    args = _args("--out", "x", "--policies", "cache_aware,cache_aware*4",
                 "--vllm-router", "cache_aware*4", "--smg", "none")
    assert parse_policies(args) == ["cache_aware", "cache_aware*4", "vllm-router:cache_aware*4"]
    assert routers_line(["cache_aware", "cache_aware*4"], 1) == (
        "one instance per policy, except cache_aware*4 (4); requests round-robin over a "
        "policy's instances")
    assert routers_line(["cache_aware"], 2) == (
        "2 instances per policy, requests round-robin over them")
    for bad in ("cache_aware*0", "cache_aware*x", "*4"):
        with pytest.raises(HarnessError, match="NAME\\*N"):
            instances(bad, 1)


def test_workload_flags_pick_per_workload_defaults() -> None:
    agent = build_workload(_args("--out", "x", "--workload", "agent", "--conversations", "2",
                                 "--turns", "3"))
    assert len(agent.plan()) == 6
    assert agent.describe()["prefix_tokens"] == 480 + 24 * 180
    groups = build_workload(_args("--out", "x", "--workload", "groups", "--requests", "5",
                                  "--groups", "2", "--users", "2"))
    assert groups.describe()["prefix_tokens"] == 6000
    trace = build_workload(_args("--out", "x", "--workload", "trace", "--requests", "20",
                                 "--max-model-len", "8192", "--answer-tokens", "32"))
    described = trace.describe()
    assert described["max_input_tokens"] == 8192 - 1 - 32
    assert described["requests"] == 20


@pytest.mark.parametrize(("flags", "message"), [
    (["--rates", "2,x"], "argument --rates: want comma-separated numbers (req/s), got 'x'"),
    (["--rates", "2,0"], "argument --rates: rates must be above 0, got '0'"),
    (["--trace", "/nonexistent/t.jsonl"],
     "argument --trace: no such trace file: '/nonexistent/t.jsonl'"),
    (["--trace-start", "-3"], "argument --trace-start: must be 0 or more, got -3"),
    (["--trace-start", "x"], "argument --trace-start: not a whole number: 'x'"),
    # Refused before "starting 0 sim replicas" was printed and the index started.
    (["--replicas", "0"], "argument --replicas: want a whole number of at least 1, got '0'"),
    (["--concurrency", "-2"],
     "argument --concurrency: want a whole number of at least 1, got '-2'"),
])
def test_bad_workload_flags_are_named_before_anything_starts(
        flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        _args("--out", "x", *flags)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_groups_rates_are_stepped_up_in_order() -> None:
    groups = build_workload(_args("--out", "x", "--workload", "groups", "--requests", "40",
                                  "--groups", "2", "--users", "2", "--rates", "2,6.5",
                                  "--stage-seconds", "1"))
    assert groups.describe()["rates"] == [2.0, 6.5]


def test_demo_runs_the_agent_workload_under_three_policies() -> None:
    from loadgen import demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    cargs = _args(*demo.compare_argv(parser.parse_args(["--out", "o"])))
    assert parse_policies(cargs) == ["round_robin", "least_loaded", "cache_aware"]
    assert cargs.replicas == 4 and cargs.index == "auto" and cargs.time_scale == 1.0
    workload = build_workload(cargs)
    assert workload.describe()["prefix_tokens"] == 4800
    assert len(workload.plan()) == 64


@pytest.mark.vllm
def test_compare_on_a_real_vllm_replica(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "report"
    args = _args(
        "--replica-kind", "vllm", "--replicas", "1", "--policies", "round_robin",
        "--vllm-router", "none", "--index", "memory", "--workload", "chat",
        "--requests", "6", "--conversations", "2", "--shared-prefix-tokens", "100",
        "--question-tokens", "20", "--answer-tokens", "8", "--concurrency", "1",
        "--block-size", "32", "--kv-tokens", "8192", "--max-model-len", "2048",
        "--model-dir", str(tiny_model_dir), "--out", str(out), "--deadline-s", "120",
        "--no-plots")
    run_comparison(args)
    data = json.loads((out / "results.json").read_text())
    records = data["requests"]["round_robin"]
    assert [r["error"] for r in records] == [None] * 6
    assert [r["prompt_tokens"] for r in records] == [120, 120, 148, 148, 176, 176]
    # Block size 32: the 100-token system prompt fills 3 blocks (96); turn 1 finds turn 0's
    # 127 computed tokens (120 + 8 - 1) = 3 blocks; turn 2 finds 155 = 4 blocks (128).
    assert [r["cached_tokens"] for r in records] == [0, 96, 96, 96, 128, 128]
    assert all(r["answer_from_server"] for r in records)
    assert data["policies"][0]["oracle_unlimited_hit_rate"] == pytest.approx(544 / 888)
    assert "ttft_floor" not in data  # a real server's step cost is not known exactly


def test_repeats_below_one_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(HarnessError, match="--repeats must be at least 1, got 0"):
        run_comparison(_args("--out", str(tmp_path / "o"), "--repeats", "0"))


def test_a_baseline_checkout_runs_beside_ours(tmp_path: Path, tiny_model_dir: Path) -> None:
    # This checkout stands in for an earlier commit's worktree: what is tested is that
    # each of our policies runs again from the named checkout, interleaved, and the
    # report names its commit; peers are not doubled.
    repo = Path(__file__).resolve().parents[2]
    args = _args(
        "--replicas", "2", "--policies", "cache_aware", "--vllm-router", "none",
        "--baseline-repo", str(repo), "--index", "memory", "--workload", "chat",
        "--requests", "4", "--conversations", "2", "--shared-prefix-tokens", "64",
        "--question-tokens", "16", "--answer-tokens", "4", "--concurrency", "1",
        "--kv-tokens", "4096", "--max-model-len", "1024", "--model-dir", str(tiny_model_dir),
        "--out", str(tmp_path / "report"), "--deadline-s", "120", "--no-plots",
        "--gateway-profile", "default")
    assert parse_policies(args) == ["cache_aware", "baseline~cache_aware"]
    comparison = run_comparison(args)
    rows = {r.policy: r for r in comparison.runs}
    assert list(rows) == ["cache_aware", "baseline~cache_aware"]
    assert all(len(r.result.completed()) == 4 for r in rows.values())
    assert rows["baseline~cache_aware"].note.startswith("code of commit ")
    with pytest.raises(SystemExit, match=r"--baseline-repo .*: not a cacheroute checkout"):
        parse_policies(_args("--out", "o", "--baseline-repo", str(tmp_path)))


def test_sigterm_stops_every_process_the_run_started(tmp_path: Path,
                                                     tiny_model_dir: Path) -> None:
    """A compare ended by SIGTERM (a `timeout`, a CI runner) takes down its sims,
    gateways and redis-server with it, as Ctrl-C does."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "loadgen", "compare", "--replicas", "2", "--policies",
         "cache_aware", "--vllm-router", "none", "--index", "redis", "--workload", "chat",
         "--requests", "5000", "--conversations", "8", "--shared-prefix-tokens", "64",
         "--question-tokens", "16", "--answer-tokens", "4", "--concurrency", "2",
         "--kv-tokens", "4096", "--max-model-len", "1024", "--model-dir",
         str(tiny_model_dir), "--out", str(tmp_path / "report"), "--deadline-s", "600",
         "--no-plots"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started: list[psutil.Process] = []
    try:
        def serving() -> bool:  # the sims, the index and a gateway are up: requests flow
            started[:] = psutil.Process(proc.pid).children(recursive=True)
            names = " ".join(" ".join(p.cmdline()) for p in started)
            return "replica sim" in names and "redis-server" in names and \
                "router serve" in names
        wait_until(serving, 120, "the compare's processes to start", proc=proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) != 0
        gone, alive = psutil.wait_procs(started, timeout=30)
        assert not alive, [" ".join(p.cmdline()) for p in alive]
        assert len(gone) >= 4  # 2 sims, redis-server, the gateway
    finally:
        if proc.poll() is None:
            proc.kill()
        for child in started:  # only if the assertions above failed: they are ours
            if child.is_running():
                child.kill()


def test_a_checkout_without_its_built_c_extensions_is_named(tmp_path: Path) -> None:
    # A git worktree made for a before/after gets router/*.c but not the ignored .so
    # files: its gateways would quietly run the Python fallbacks (the lanes-slack
    # candidates of 2026-12-07 did, against a baseline that had them).
    (tmp_path / "router" / "index").mkdir(parents=True)
    (tmp_path / "router" / "_keys.c").write_text("")
    (tmp_path / "router" / "index" / "_upkeep.c").write_text("")
    assert unbuilt_c_paths(tmp_path) == ["router/_keys.c", "router/index/_upkeep.c"]
    (tmp_path / "router" / "_keys.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    assert unbuilt_c_paths(tmp_path) == ["router/index/_upkeep.c"]
    warning = unbuilt_warning(tmp_path)
    assert warning is not None and "router/index/_upkeep.c" in warning
    assert "router/_keys.c" not in warning and "build_ext --inplace" in warning
    (tmp_path / "router" / "index" / "_upkeep.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    assert unbuilt_c_paths(tmp_path) == []
    assert unbuilt_warning(tmp_path) is None
