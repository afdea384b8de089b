"""`python -m loadgen compare --gateways 2`: two instances of every router over 2 sims.

issue #16: ours as two gateway processes sharing one Redis index, vllm-router as two
independent instances, SMG as two instances joined by its mesh; requests round-robin
over the instances. A tiny chat workload: the smoke test of the harness, not a result.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from loadgen.compare import add_arguments, run_comparison
from loadgen.harness import HarnessError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_two_instances_of_each_router_share_the_requests(tmp_path: Path,
                                                         tiny_model_dir: Path) -> None:
    out = tmp_path / "report"
    args = _args(
        "--replicas", "2", "--gateways", "2", "--policies", "cache_aware",
        "--vllm-router", "cache_aware", "--smg", "cache_aware", "--api", "chat",
        "--gateway-profile", "exact", "--index", "redis", "--workload", "chat",
        "--requests", "8", "--conversations", "2", "--shared-prefix-tokens", "64",
        "--question-tokens", "16", "--answer-tokens", "4", "--concurrency", "2",
        "--kv-tokens", "4096", "--max-model-len", "1024", "--model-dir", str(tiny_model_dir),
        "--out", str(out), "--deadline-s", "120", "--warmup", "2", "--no-plots")
    comparison = run_comparison(args)
    assert comparison.skipped == []
    data = json.loads((out / "results.json").read_text())
    rows = {row["policy"]: row for row in data["policies"]}
    assert list(rows) == ["cache_aware", "vllm-router:cache_aware", "smg:cache_aware"]
    for row in rows.values():
        assert row["completed"] == 8 and row["errors"] == 0, row
        assert sum(row["requests_per_replica"].values()) == 8
        assert "requests per instance 4/4" in row["note"], row["note"]
        # The sims timed the same 8 first tokens the client did, each a part of it.
        assert 0 < row["replica_ttft_mean_s"] < row["ttft_mean_s"], row
        # Both instances' processes were counted while the requests ran (Rust peers may
        # spend less than a clock tick on 8 requests).
        assert row["router_cpu_per_request_s"] is not None, row
    # Two Python gateways and their indexer health-check, scrape and route: some ticks.
    assert rows["cache_aware"]["router_cpu_per_request_s"] > 0
    assert "2 gateways sharing the index" in rows["cache_aware"]["note"]
    assert "joined by its mesh" in rows["smg:cache_aware"]["note"]
    assert "independent" in rows["vllm-router:cache_aware"]["note"]
    # Our two gateways read one index the indexer feeds: the second turns were predicted.
    assert rows["cache_aware"]["predicted_cached_tokens"] > 0
    md = (out / "report.md").read_text()
    assert "2 instances per policy" in md
    assert "- Router CPU per request:" in md and "  - smg:cache_aware: " in md


def test_more_than_one_gateway_needs_a_shared_index(tmp_path: Path,
                                                     tiny_model_dir: Path) -> None:
    args = _args("--replicas", "1", "--gateways", "2", "--policies", "cache_aware",
                 "--vllm-router", "none", "--index", "memory", "--requests", "2",
                 "--model-dir", str(tiny_model_dir), "--out", str(tmp_path / "r"),
                 "--gateway-profile", "exact", "--no-plots")
    with pytest.raises(HarnessError, match="--gateways 2 needs a Redis index"):
        run_comparison(args)
