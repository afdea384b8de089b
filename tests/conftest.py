"""Fixtures shared by every test package: real servers on free loopback ports.

Each fixture that starts a process owns it and stops it, whatever the test did. Every
async test also runs under the loop watchdog (tests/loop_watchdog.py): it fails if the
test's event loop blocks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The watchdog plugin's hooks and fixture, registered by being names in this conftest.
from loop_watchdog import (  # noqa: F401
    loop_watchdog_fixture,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_call,
    pytest_terminal_summary,
)
from servers import REPO, RedisServer, free_port
from vllm_server import VllmServer, start_vllm_server


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
    Tool calls are enabled as deployments serving agents enable them (hermes parser):
    without those flags vLLM refuses any request that carries tools.
    """
    tools = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    with start_vllm_server(tiny_model_dir, extra_args=tools) as server:
        yield server
