"""Fixtures shared by every test package: real servers on free loopback ports.

Each fixture that starts a process owns it and stops it, whatever the test did.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from vllm_server import VllmServer, start_vllm_server

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    """Block until something accepts TCP connections on 127.0.0.1:port, or fail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before port {port} opened")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)  # polling a port, not synchronising test logic
    raise TimeoutError(f"nothing listened on 127.0.0.1:{port} within {timeout}s")


@dataclass
class RedisServer:
    """A redis-server process this test session owns; can be stopped and restarted."""

    port: int
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed; run the README's test setup")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port, proc=self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh, empty redis-server on a free loopback port, stopped after the test."""
    server = RedisServer(port=free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama with its tokenizer, built offline once per session."""
    cached = os.environ.get("CACHEROUTE_TINY_MODEL")
    if cached and (Path(cached) / "config.json").exists():
        return Path(cached)
    out = tmp_path_factory.mktemp("tiny-model")
    subprocess.run(
        [sys.executable, "-m", "replica", "tiny-model", "--out", str(out)],
        check=True, cwd=REPO,
    )
    return out


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: Path) -> Iterator[VllmServer]:
    """One real vLLM server for the session, serving the tiny model on loopback.

    Settings: block size 32, sha256, PYTHONHASHSEED "0", prefix caching, prompt token
    details, KV events with replay. Attributes (tests/vllm_server.py `VllmServer`):
    url ("http://127.0.0.1:PORT"), port, model_dir, served_model_name ("tiny"),
    block_size (32), hash (router.hashing.HashConfig("sha256", 32, "0")),
    kv_events_endpoint and replay_endpoint ("tcp://127.0.0.1:PORT"), log_path, pid.
    Share it read-mostly: it is one prefix cache for every test using it. For other
    settings, start your own with `start_vllm_server(model_dir, seed=..., ...)`.
    """
    with start_vllm_server(tiny_model_dir) as server:
        yield server
