"""Start N simulated replicas (`python -m replica sim` processes) on free loopback ports.

    with SimFleet(3, block_size=16, num_blocks=2048, kv_events=True) as fleet:
        fleet.replicas[0].url, fleet.replicas[0].kv_events_endpoint, ...
        fleet.kill(1); fleet.restart(1)       # same ports: a router's config stays valid

Every replica is healthy (/health answers 200) when the constructor's `start()` returns,
and every process is stopped on exit: SIGTERM, then SIGKILL after a grace period. A
paused (SIGSTOP) replica is resumed before it is terminated, so it can exit cleanly.
`AsyncSimFleet` is the same fleet for async code (its blocking steps run in a thread).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from replica.processes import STOP_GRACE_S, ProcessExited, WaitTimeout, stop_process, wait_until
from replica.processes import free_port as free_port  # re-exported: tests and benchmarks use it

STARTUP_TIMEOUT_S = 60.0


@dataclass
class RunningReplica:
    """One sim process and where to reach it."""

    name: str
    url: str
    port: int
    kv_events_endpoint: str | None
    replay_endpoint: str | None
    proc: subprocess.Popen[bytes]
    cmd: list[str] = field(repr=False)
    log_path: Path = field(repr=False)
    paused: bool = False

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def is_healthy(url: str) -> bool:
    """Whether a replica (sim or vLLM) at `url` answers GET /health with 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError):
        return False


class SimFleet:
    """N sim replicas as subprocesses; a context manager that always stops them."""

    def __init__(self, n: int, *, block_size: int = 16, num_blocks: int | None = None,
                 kv_tokens: int | None = None, kv_events: bool = True,
                 time_scale: float = 1.0, prefill_profile: str = "instant",
                 hash_algo: str = "sha256", seed: str | None = "0",
                 model_dir: str | Path | None = None, served_model_name: str | None = None,
                 extra_args: Sequence[str] = (), startup_timeout: float = STARTUP_TIMEOUT_S,
                 name_prefix: str = "sim", crash_on_token: int | None = None) -> None:
        if n < 1:
            raise ValueError("a fleet needs at least one replica")
        self.n = n
        self.block_size = block_size
        self.startup_timeout = startup_timeout
        self.replicas: list[RunningReplica] = []
        self._base_args = ["--block-size", str(block_size), "--hash-algo", hash_algo,
                           "--prefill-profile", prefill_profile, "--time-scale", str(time_scale)]
        if num_blocks is not None:
            self._base_args += ["--num-blocks", str(num_blocks)]
        if kv_tokens is not None:
            self._base_args += ["--kv-tokens", str(kv_tokens)]
        if seed is not None:
            self._base_args += ["--seed", seed]
        if model_dir is not None:
            self._base_args += ["--model", str(model_dir)]
        if crash_on_token is not None:
            # Every replica's engine dies on a prompt holding this token (a poison request).
            self._base_args += ["--crash-on-token", str(crash_on_token)]
        if served_model_name is not None:
            self._base_args += ["--served-model-name", served_model_name]
        self._base_args += list(extra_args)
        self._kv_events = kv_events
        self._name_prefix = name_prefix

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> SimFleet:
        """Launch every replica and wait until all are healthy."""
        try:
            for i in range(self.n):
                self.replicas.append(self._launch(i))
            for r in self.replicas:
                self._wait_healthy(r)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Terminate every replica (kill after the grace period)."""
        for r in self.replicas:
            self._terminate(r)

    def __enter__(self) -> SimFleet:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    # -- faults ----------------------------------------------------------------------

    def kill(self, i: int) -> None:
        """SIGKILL replica i (a crash: no clean shutdown)."""
        r = self.replicas[i]
        if r.proc.poll() is None:
            r.proc.kill()
            r.proc.wait(timeout=STOP_GRACE_S)
        r.paused = False

    def pause(self, i: int) -> None:
        """SIGSTOP replica i: it holds its sockets but answers nothing."""
        self.replicas[i].proc.send_signal(signal.SIGSTOP)
        self.replicas[i].paused = True

    def resume(self, i: int) -> None:
        """SIGCONT a paused replica."""
        self.replicas[i].proc.send_signal(signal.SIGCONT)
        self.replicas[i].paused = False

    def restart(self, i: int) -> None:
        """Stop replica i and start a fresh one on the same ports (empty cache, seq from 0)."""
        old = self.replicas[i]
        self._terminate(old)
        new = self._spawn(old.name, old.port, old.kv_events_endpoint, old.replay_endpoint,
                          old.cmd)
        self.replicas[i] = new
        self._wait_healthy(new)

    # -- internals -------------------------------------------------------------------

    def _launch(self, i: int) -> RunningReplica:
        port = free_port()
        events = f"tcp://127.0.0.1:{free_port()}" if self._kv_events else None
        replay = f"tcp://127.0.0.1:{free_port()}" if self._kv_events else None
        cmd = [sys.executable, "-m", "replica", "sim", "--port", str(port),
               "--host", "127.0.0.1", *self._base_args]
        if events and replay:
            cmd += ["--kv-events", events, "--kv-replay", replay]
        return self._spawn(f"{self._name_prefix}-{i}", port, events, replay, cmd)

    def _spawn(self, name: str, port: int, events: str | None, replay: str | None,
               cmd: list[str]) -> RunningReplica:
        fd, log_name = tempfile.mkstemp(prefix=f"{name}-{port}-", suffix=".log")
        with os.fdopen(fd, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        return RunningReplica(name, f"http://127.0.0.1:{port}", port, events, replay, proc,
                              cmd, Path(log_name))

    def _wait_healthy(self, r: RunningReplica) -> None:
        try:
            wait_until(lambda: is_healthy(r.url), self.startup_timeout,
                       f"{r.name} on {r.url} to answer /health", proc=r.proc)
        except (ProcessExited, WaitTimeout) as exc:
            raise type(exc)(f"{exc}:\n{r.log_tail()}") from None

    @staticmethod
    def _terminate(r: RunningReplica) -> None:
        stop_process(r.proc)  # resumes a paused replica first, so it can exit cleanly
        r.paused = False
        r.log_path.unlink(missing_ok=True)


class AsyncSimFleet:
    """SimFleet for `async with`; start, stop and restart run off the event loop."""

    def __init__(self, n: int, **kwargs: object) -> None:
        self.fleet = SimFleet(n, **kwargs)  # type: ignore[arg-type]

    @property
    def replicas(self) -> list[RunningReplica]:
        return self.fleet.replicas

    @property
    def urls(self) -> list[str]:
        return self.fleet.urls

    async def __aenter__(self) -> AsyncSimFleet:
        await asyncio.to_thread(self.fleet.start)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await asyncio.to_thread(self.fleet.stop)

    def kill(self, i: int) -> None:
        self.fleet.kill(i)

    def pause(self, i: int) -> None:
        self.fleet.pause(i)

    def resume(self, i: int) -> None:
        self.fleet.resume(i)

    async def restart(self, i: int) -> None:
        await asyncio.to_thread(self.fleet.restart, i)
