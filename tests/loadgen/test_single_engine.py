"""single-engine: exact cache counts derived by hand from vLLM's block rules.

Rules used below (B = block size): only full blocks are cached; a hit is the leading run
of cached blocks, at most (n - 1) // B of an n-token prompt; a finished request leaves
the full blocks of its prompt + answer minus the last answer token (never computed).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadgen import single_engine
from loadgen.single_engine import add_arguments, engine_config, run_on_engine, workload_from

REPO = Path(__file__).resolve().parents[2]


def _args(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def _cached(*argv: str) -> list[int]:
    args = _args(*argv)
    result = run_on_engine(workload_from(args), engine_config(args, caching=True))
    return [r.cached_tokens for r in result.requests]


def test_fresh_conversations_share_the_system_prompts_full_blocks() -> None:
    # S=100 at B=16: 6 full blocks (96 tokens) are shared; block 6 mixes the last 4
    # system tokens with each request's own question, so it never hits.
    summary = single_engine.summarize(_args(
        "--requests", "5", "--conversations", "5", "--shared-prefix-tokens", "100",
        "--question-tokens", "20", "--answer-tokens", "5", "--block-size", "16"))
    assert [r["prompt_tokens"] for r in summary["requests"]] == [120] * 5
    assert [r["cached_tokens"] for r in summary["requests"]] == [0, 96, 96, 96, 96]
    assert summary["prompt_tokens"] == 600
    assert summary["cached_tokens"] == 384
    assert summary["hit_rate"] == pytest.approx(384 / 600)
    assert summary["evictions"] == 0
    assert summary["ttft_ms_mean"] < summary["ttft_ms_mean_no_cache"]


def test_a_conversation_hits_its_resent_history_and_answer() -> None:
    # C=1, S=100, Q=20, A=10, B=16, K=0.
    # turn 0: 120 tokens, nothing cached; leaves 120 + 10 - 1 = 129 computed -> 8 blocks.
    # turn 1: 100 + 20 + 10 + 20 = 150 tokens; all 8 blocks lead it -> 128 (cap 149//16 = 9);
    #         leaves 150 + 9 = 159 computed -> 9 blocks.
    # turn 2: 180 tokens; 9 blocks -> 144 (cap 11).
    cached = _cached("--requests", "3", "--conversations", "1", "--shared-prefix-tokens", "100",
                     "--question-tokens", "20", "--answer-tokens", "10", "--block-size", "16")
    assert cached == [0, 128, 144]


@pytest.mark.parametrize(("position", "expected"), [
    # Preamble first: every prompt starts with its own preamble, nothing is ever shared.
    ("first", [0, 0, 0]),
    # After the system prompt: only the 6 system blocks (96 tokens) survive it.
    ("after-system", [0, 96, 96]),
    # Last: turn 1 = sys + q0 + a0 + pre1 + q1, but turn 0 cached sys + pre0 + q0: 96.
    # Turn 2 = sys + q0 + a0 + q1 ...; turn 1 cached sys + q0 + a0 (130 tokens) = 8 blocks.
    ("last", [0, 96, 128]),
])
def test_preamble_position(position: str, expected: list[int]) -> None:
    cached = _cached("--requests", "3", "--conversations", "1", "--shared-prefix-tokens", "100",
                     "--preamble-tokens", "30", "--preamble-position", position,
                     "--question-tokens", "20", "--answer-tokens", "10", "--block-size", "16")
    assert cached == expected


def test_salt_per_conversation_isolates_conversations() -> None:
    cached = _cached("--requests", "4", "--conversations", "2", "--shared-prefix-tokens", "100",
                     "--question-tokens", "20", "--answer-tokens", "10", "--block-size", "16",
                     "--salt", "conversation")
    # Fresh conversations share nothing across salts; each second turn hits its own 8 blocks.
    assert cached == [0, 0, 128, 128]


def test_a_full_pool_evicts_tails_first_and_keeps_the_shared_prefix() -> None:
    # 8 usable blocks of 16 (128 tokens; vLLM adds its null block). Each request's 120 prompt
    # tokens + 4 computed answer tokens fill all 8. A finished request frees its blocks
    # tail first: [partial block 8, block 7 (cached), blocks 6..1]. The next request hits
    # blocks 1-6 (96 tokens) and takes 2 new blocks off the free queue's head: the
    # uncached partial one, then cached block 7, which is one eviction per request.
    args = ["--requests", "4", "--conversations", "4", "--shared-prefix-tokens", "100",
            "--question-tokens", "20", "--answer-tokens", "5", "--block-size", "16",
            "--max-model-len", "128"]
    small = single_engine.summarize(_args(*args, "--kv-tokens", str(8 * 16)))
    big = single_engine.summarize(_args(*args, "--kv-tokens", str(64 * 16)))
    assert big["evictions"] == 0
    assert small["evictions"] == 3
    assert [r["cached_tokens"] for r in small["requests"]] == [0, 96, 96, 96]
    assert [r["cached_tokens"] for r in big["requests"]] == [0, 96, 96, 96]


def test_concurrency_batches_conversations_but_keeps_turns_in_order() -> None:
    argv = ["--requests", "6", "--conversations", "2", "--shared-prefix-tokens", "100",
            "--question-tokens", "20", "--answer-tokens", "10", "--block-size", "16"]
    one = single_engine.summarize(_args(*argv))["requests"]
    two = single_engine.summarize(_args(*argv, "--concurrency", "3"))["requests"]
    # Same hits either way: vLLM caches a block when it is scheduled, so conv-1's first
    # turn, admitted in the same step as conv-0's, still hits the 6 system blocks; each
    # later turn waits for its own previous answer (the third slot stays idle).
    for run in (one, two):
        assert [r["cached_tokens"] for r in run] == [0, 96, 128, 128, 144, 144]
    # Batched in one step, the two first turns share one step's cost, so they finish together.
    assert two[0]["ttft_ms"] == two[1]["ttft_ms"]
    assert two[1]["ttft_ms"] > one[1]["ttft_ms"]


def test_cli_json_object() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "loadgen", "single-engine", "--requests", "3",
         "--conversations", "3", "--shared-prefix-tokens", "64", "--question-tokens", "8",
         "--answer-tokens", "2", "--block-size", "16", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=True,
    )
    summary = json.loads(out.stdout)
    assert {"hit_rate", "prompt_tokens", "cached_tokens", "evictions", "ttft_ms_mean",
            "ttft_ms_mean_no_cache", "requests"} <= set(summary)
    # 72-token prompts: 4 system blocks shared, cap (72 - 1) // 16 = 4.
    assert [r["cached_tokens"] for r in summary["requests"]] == [0, 64, 64]
    assert summary["hit_rate"] == pytest.approx(128 / 216)
