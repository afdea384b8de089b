"""`python -m router hash | tokenize | diagnose` and the hashing benchmark as a user runs them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from router.cli.diagnose import explain_divergence
from router.hashing import HashConfig, LoraRef, chain_hashes, event_key
from router.tokenize import PromptTokenizer

REPO = Path(__file__).resolve().parents[2]


def _router(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "router", *args], input=stdin, cwd=REPO,
        capture_output=True, text=True, timeout=120,
    )


# -- hash -----------------------------------------------------------------------

def test_hash_prints_chain_in_order() -> None:
    tokens = list(range(100, 170))
    proc = _router("hash", "--block-size", "16", "--algo", "sha256_cbor", "--seed", "0",
                   stdin=json.dumps(tokens))
    assert proc.returncode == 0, proc.stderr
    expected = chain_hashes(HashConfig("sha256_cbor", 16, "0"), tokens)
    assert proc.stdout.split() == [k.hex() for k in expected]
    assert len(expected) == 4  # 70 tokens: the partial fifth block has no key


def test_hash_int_with_salt_and_lora() -> None:
    tokens = list(range(64))
    proc = _router("hash", "--block-size", "32", "--algo", "xxhash", "--seed", "7",
                   "--salt", "tenant-A", "--lora", "sql", "--lora-path", "/a/sql", "--int",
                   stdin=json.dumps(tokens))
    assert proc.returncode == 0, proc.stderr
    config = HashConfig("xxhash", 32, "7")
    keys = chain_hashes(config, tokens, cache_salt="tenant-A", lora=LoraRef("sql", "/a/sql"))
    assert [int(x) for x in proc.stdout.split()] == [event_key(k) for k in keys]


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        (["--block-size", "16"], "not json", "stdin is not JSON"),
        (["--block-size", "16"], '{"a": 1}', "must be a JSON list of token ids, got dict"),
        (["--block-size", "16"], "[1, 2.5]", "token at index 1 is 2.5"),
        (["--block-size", "16"], "[1, -3]", "token at index 1 is -3"),
        (["--block-size", "16", "--algo", "xxhash"], "[1]", "'xxhash' without a seed"),
        (["--block-size", "0"], "[1]", "block_size must be a positive integer, got 0"),
        (["--block-size", "16", "--lora", "x"], "[1]", "--lora and --lora-path go together"),
    ],
)
def test_hash_bad_input_exits_2_naming_value(args: list[str], stdin: str, message: str) -> None:
    proc = _router("hash", *args, stdin=stdin)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert proc.stdout == ""


# -- tokenize -------------------------------------------------------------------

def test_tokenize_chat_and_completion(tmp_path: Path, tiny_model_dir: Path) -> None:
    tok = PromptTokenizer.from_dir(tiny_model_dir)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}]}
    completion = {"model": "tiny", "prompt": "Hi there"}
    for body, expected in ((chat, tok.chat_tokens(chat)),
                           (completion, tok.completion_tokens(completion))):
        path = tmp_path / "req.json"
        path.write_text(json.dumps(body))
        proc = _router("tokenize", "--model", str(tiny_model_dir), str(path))
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == expected
    assert tok.chat_tokens(chat) != tok.completion_tokens(completion)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is not JSON"),
        ("[1, 2]", "must hold a JSON object, got list"),
        ('{"input": "x"}', "needs either 'messages'"),
        ('{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
    ],
)
def test_tokenize_bad_request_exits_2(tmp_path: Path, tiny_model_dir: Path,
                                      content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    proc = _router("tokenize", "--model", str(tiny_model_dir), str(path))
    assert proc.returncode == 2
    assert message in proc.stderr


# -- diagnose -------------------------------------------------------------------

def _chat(system: str, user: str) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def test_explain_divergence_pure() -> None:
    a = list(range(100))
    b = [*range(70), 999, *range(71, 100)]
    div = explain_divergence(a, b, 16, lambda ids: ",".join(map(str, ids)), context_tokens=3)
    assert div.index == 70
    assert div.reusable_blocks == 4
    assert div.common_text == "67,68,69"
    assert div.text_a == "70,71,72"
    assert div.text_b == "999,71,72"
    assert div.recomputed_tokens_b == 100 - 64
    same = explain_divergence(a, a[:50], 16, str)
    assert same.index is None and not same.identical and same.reusable_blocks == 3
    assert explain_divergence(a, a, 16, str).identical


def test_diagnose_shows_what_broke_the_chain(tmp_path: Path, tiny_model_dir: Path) -> None:
    long_rules = "Follow the rules of the house. " * 12
    a = _chat(long_rules + "Today is 2025-01-01.", "Summarise the report.")
    b = _chat(long_rules + "Today is 2025-01-02.", "Summarise the report.")
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    proc = _router("diagnose", "diverge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                   "--model", str(tiny_model_dir), "--block-size", "16")
    assert proc.returncode == 0, proc.stderr

    tok = PromptTokenizer.from_dir(tiny_model_dir)
    ids_a, ids_b = tok.chat_tokens(a), tok.chat_tokens(b)
    div = explain_divergence(ids_a, ids_b, 16, tok.decode)
    assert div.index is not None and div.index > 60
    assert f"first difference at token {div.index}" in proc.stdout
    assert f"reusable: {div.index // 16} blocks" in proc.stdout
    lines = proc.stdout.splitlines()
    assert any(line.startswith("common: ...") and line.endswith("Today is 2025-01-")
               for line in lines), proc.stdout
    assert any(line.startswith("A then: 01.<|im_end|>") for line in lines), proc.stdout
    assert any(line.startswith("B then: 02.<|im_end|>") for line in lines), proc.stdout


def test_diagnose_rendered_text_files(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "a.txt").write_text("<s><|im_start|>user\nrequest id 1234: hello<|im_end|>\n")
    (tmp_path / "b.txt").write_text("<s><|im_start|>user\nrequest id 9876: hello<|im_end|>\n")
    proc = _router("diagnose", "diverge", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"),
                   "--model", str(tiny_model_dir), "--block-size", "4")
    assert proc.returncode == 0, proc.stderr
    assert "first difference at token" in proc.stdout
    assert "user\\nrequest id\n" in proc.stdout  # the shared text before the break
    assert "A then:  1234: hello" in proc.stdout and "B then:  9876: hello" in proc.stdout


def test_diagnose_without_model_needs_ids(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps({"prompt": "x"}))
    (tmp_path / "b.json").write_text("[1, 2, 3]")
    proc = _router("diagnose", "diverge", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert proc.returncode == 2
    assert "needs tokenizing: pass --model DIR" in proc.stderr
    (tmp_path / "a.json").write_text("[1, 2, 3, 4, 5]")
    proc = _router("diagnose", "diverge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                   "--block-size", "2")
    assert proc.returncode == 0, proc.stderr
    assert "B extends" not in proc.stdout and "A extends the other after token 3" in proc.stdout
    assert "reusable: 1 blocks" in proc.stdout


def test_bench_hash_runs_small(tiny_model_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_hash.py"), "--model",
         str(tiny_model_dir), "--sizes", "1000", "--repeats", "1", "--algo", "sha256"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "exact=True" in proc.stdout
    assert "hash sha256" in proc.stdout and "Mtok/s" in proc.stdout


def test_bench_gateway_measures_a_bare_hop_beside_the_gateway(tiny_model_dir: Path) -> None:
    # --splice: a byte-splicing Python hop to replica 0 is one more target, in the added
    # latency and the routed requests/s, and the gateway's latency is also given net of it.
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_gateway.py"), "--rounds", "1",
         "--per-round", "1", "--cold-sizes", "64", "--seconds", "1", "--cpu-requests", "0",
         "--no-peers", "--splice", "--model-dir", str(tiny_model_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    added = re.search(r"token ids 0k cold\s+\| python splice hop\s+\|\s+([\d.]+) \|"
                      r"\s+([+-][\d.]+)", out)
    assert added is not None, out
    assert float(added.group(1)) > 0  # its p50, through the hop to the replica
    assert re.search(r"\| cacheroute beyond a hop\s+\|\s+\|\s+[+-][\d.]+ \| \(cacheroute - "
                     r"python splice hop\)", out), out
    rate = re.search(r"^\s+python splice hop\s+([\d.]+) \[", out, re.M)
    assert rate is not None and float(rate.group(1)) > 0, out


def test_splice_hop_names_a_bad_port() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "splice_hop.py"), "80x",
                           "127.0.0.1", "8000"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "'80x'" in proc.stderr
