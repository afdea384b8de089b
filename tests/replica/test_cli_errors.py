"""`python -m replica ...` given bad values or an unusable place: one line naming what
is wrong, no traceback, and a non-zero exit (2 for a bad flag, 1 for the environment)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from replica.processes import free_port

REPO = Path(__file__).resolve().parents[2]


def _replica(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "replica", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize(("args", "code", "message"), [
    (["sim", "--port", "70000"], 2, "argument --port: '70000' is not a TCP port (1-65535)"),
    (["sim", "--port", "18999", "--num-blocks", "-1"], 2,
     "--num-blocks must be at least 2 (block 0 is vLLM's null block), got -1"),
    (["sim", "--port", "18999", "--kv-tokens", "8"], 2,
     "--kv-tokens must hold at least one block of 16 tokens, got 8"),
    (["sim", "--port", "18999", "--block-size", "0"], 2,
     "--block-size must be a positive integer, got 0"),
    (["vllm", "--port", "x"], 2, "argument --port: 'x' is not a TCP port (1-65535)"),
    (["calibrate", "--url", "http://127.0.0.1:9", "--lengths", "1,x"], 2,
     "argument --lengths: want comma-separated whole numbers, got '1,x'"),
    (["calibrate", "--url", "http://127.0.0.1:9", "--lengths", "0"], 2,
     "argument --lengths: want prompt lengths of at least 1 token, got '0'"),
    (["calibrate", "--url", "http://127.0.0.1:9", "--token-range", "5,2"], 2,
     "argument --token-range: want LO,HI with 0 <= LO < HI, got '5,2'"),
])
def test_a_bad_flag_is_named(args: list[str], code: int, message: str) -> None:
    proc = _replica(*args)
    assert (proc.returncode, proc.stdout) == (code, "")
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_sim_on_a_taken_port_says_so() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _replica("sim", "--port", str(port))
    assert proc.returncode == 1
    assert f"replica sim: cannot listen on 127.0.0.1:{port}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_calibrate_against_nothing_names_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc = _replica("calibrate", "--url", url, "--repeats", "1")
    assert proc.returncode == 1
    assert f"replica calibrate: {url}: ConnectError" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_tiny_model_into_an_unusable_place_names_it(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = blocker / "model"  # under a file: no directory can be made there
    proc = _replica("tiny-model", "--out", str(out))
    assert proc.returncode == 1
    assert f"replica tiny-model: cannot write the model to '{out}'" in proc.stderr
    assert "Traceback" not in proc.stderr
