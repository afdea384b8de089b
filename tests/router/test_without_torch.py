"""The gateway's processes keep torch out (router/without_torch.py) and tokenize the same."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from router.tokenize import PromptTokenizer
from router.without_torch import _NoTorchAdvice, keep_torch_out

REPO = Path(__file__).resolve().parents[2]

# A chat with tools: the tools section is what pulls in the most of transformers' Jinja.
CHAT = {"model": "tiny", "messages": [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the weather in Lyon?"}],
    "tools": [{"type": "function", "function": {
        "name": "weather", "description": "today's weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]}


def test_the_router_entry_point_imports_no_torch_and_tokenizes_the_same(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(CHAT))
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "router", "tokenize",
         "--model", str(tiny_model_dir), str(path)],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", proc.stderr, re.M)
    assert "transformers" in imported  # the tokenizer was loaded, through transformers
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]
    assert "PyTorch was not found" not in proc.stderr
    # This process may hold torch (vLLM's environment): the ids must not depend on it.
    assert json.loads(proc.stdout) == PromptTokenizer.from_dir(tiny_model_dir).chat_tokens(CHAT)


def test_an_imported_torch_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = types.ModuleType("torch")
    monkeypatch.setitem(sys.modules, "torch", torch)
    assert keep_torch_out() is False
    assert sys.modules["torch"] is torch


def test_a_torch_not_yet_imported_cannot_be() -> None:
    # By hand rather than monkeypatch: "not in sys.modules" must be restored as such.
    before = sys.modules.pop("torch", None)
    filters = list(logging.getLogger("transformers").filters)
    try:
        assert keep_torch_out() is True
        with pytest.raises(ModuleNotFoundError):
            import torch  # noqa: F401
    finally:
        if before is None:
            sys.modules.pop("torch", None)
        else:
            sys.modules["torch"] = before
        logging.getLogger("transformers").filters[:] = filters


def test_only_the_notice_about_torch_is_dropped() -> None:
    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("transformers", logging.WARNING, __file__, 1, msg, None, None)

    drop = _NoTorchAdvice()
    assert not drop.filter(record("PyTorch was not found. Models won't be available and only "
                                  "tokenizers, configuration and file/data utilities can be used."))
    assert drop.filter(record("Token indices sequence length is longer than the maximum"))


def test_bench_startup_runs_small(tiny_model_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_startup.py"), "--rounds", "1",
         "--model", str(tiny_model_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    kept = re.search(r"torch kept out\s+listening after ([\d.]+) s .* libtorch mapped in 0 of 1",
                     proc.stdout)
    assert kept is not None and float(kept.group(1)) > 0, proc.stdout
    if importlib.util.find_spec("torch") is not None:
        assert re.search(r"torch imported\s+listening after .* libtorch mapped in 1 of 1",
                         proc.stdout), proc.stdout


def test_bench_startup_names_bad_rounds() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_startup.py"), "--rounds", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--rounds must be positive, got 0" in proc.stdout
