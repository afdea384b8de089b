"""Processes a harness starts and always stops: free ports, waits with deadlines, Redis.

One home for what the tests, the benchmarks, the sim fleet and `loadgen compare` all need
when they run real servers on loopback:

    port = free_port()
    with redis_server() as redis:             # a private redis-server, never 6379
        ... redis.url ...
    wait_until(lambda: port_open(port), 10, "the gateway to listen", proc=proc)
    stop_process(proc)                        # SIGTERM, SIGKILL after a grace period

Every wait has a deadline and fails with a message naming what it waited for; a wait
tied to a process fails as soon as that process exits instead of running out the clock.
Only processes the caller started are ever signalled, by their Popen handle.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

STOP_GRACE_S = 10.0
POLL_INTERVAL_S = 0.05
REDIS_START_TIMEOUT_S = 30.0


class WaitTimeout(TimeoutError):
    """A condition did not hold by its deadline; the message says which and how long."""


class ProcessExited(RuntimeError):
    """A process exited while something was waiting for it to become ready."""


# Ports handed out below the kernel's ephemeral range. A port the kernel picks for
# bind(0) comes from that range, and so does the local port of every outgoing
# connection: a server that binds its port a minute later (vLLM's engine binds its KV
# replay socket only after loading the model) can find it taken by some client's
# connection meanwhile. Below the range only another listener can take it.
_PORTS_FROM = 15_000
_ports = random.Random()
# Ports this process handed out recently: a port is free until its server binds it, so
# two picks before either server starts could be the same port (a fleet of 32 sims picks
# ~100 ports from ~17,000: a collision about one start in five). Bounded: the oldest
# handed-out ports become eligible again.
_handed: collections.deque[int] = collections.deque(maxlen=4096)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on right now, below the ephemeral range
    (so no outgoing connection takes it before its server binds)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    high = _ephemeral_low() - 1
    for _ in range(64):
        port = _ports.randint(_PORTS_FROM, high) if high > _PORTS_FROM else 0
        if port in _handed:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            port = int(s.getsockname()[1])
            _handed.append(port)
            return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port = int(s.getsockname()[1])
        _handed.append(port)
        return port


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _check_alive(proc: subprocess.Popen[bytes] | None, what: str) -> None:
    if proc is not None and proc.poll() is not None:
        raise ProcessExited(f"process {proc.pid} exited with {proc.returncode} before {what}")


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, *,
               proc: subprocess.Popen[bytes] | None = None,
               interval: float = POLL_INTERVAL_S) -> None:
    """Poll `predicate` until it is true; WaitTimeout after `timeout` seconds.

    With `proc`, fail at once (ProcessExited) when that process exits first.
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        _check_alive(proc, what)
        if time.monotonic() > deadline:
            raise WaitTimeout(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)  # polling a condition against a deadline


async def wait_until_async(predicate: Callable[[], Awaitable[bool]], within_s: float,
                           what: str, *, proc: subprocess.Popen[bytes] | None = None,
                           interval: float = POLL_INTERVAL_S) -> None:
    """`wait_until` for an async predicate, sleeping on the event loop between polls."""
    deadline = time.monotonic() + within_s
    while not await predicate():
        _check_alive(proc, what)
        if time.monotonic() > deadline:
            raise WaitTimeout(f"timed out after {within_s:g}s waiting for {what}")
        await asyncio.sleep(interval)  # polling a condition against a deadline


def wait_for_port(port: int, timeout: float = 30.0, proc: subprocess.Popen[bytes] | None = None,
                  host: str = "127.0.0.1") -> None:
    """Block until something accepts TCP connections on host:port, or fail."""
    wait_until(lambda: port_open(port, host), timeout, f"{host}:{port} to accept connections",
               proc=proc)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a running process has used, from /proc/PID/stat (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the name in () may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """Ids of the running processes whose parent is `pid` (Linux /proc)."""
    return _children_by_parent().get(pid, [])


def descendants(pid: int) -> list[int]:
    """Ids of the running processes below `pid`: its children, theirs, and so on (Linux
    /proc, one pass)."""
    below = _children_by_parent()
    out: list[int] = []
    todo = list(below.get(pid, ()))
    while todo:
        child = todo.pop()
        out.append(child)
        todo.extend(below.get(child, ()))
    return out


def _children_by_parent() -> dict[int, list[int]]:
    """Every running process's id under its parent's, from one listing of /proc."""
    below: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # gone since the listing, or not ours to read
            below.setdefault(parent, []).append(int(entry))
    return below


def pin_to(cpus: frozenset[int] | None) -> Callable[[], None] | None:
    """A Popen preexec_fn that confines the new process to `cpus` before it runs, so its
    every thread and child stays there too (None: leave it where its parent runs)."""
    if cpus is None:
        return None
    mask = set(cpus)

    def pin() -> None:
        os.sched_setaffinity(0, mask)

    return pin


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> int:
    """Stop a process this program started: SIGTERM, then SIGKILL after `grace_s`.

    A paused (SIGSTOP) process is resumed first: a stopped process cannot act on
    SIGTERM, so it would always run out the grace period and lose its clean exit.
    Returns the exit status.
    """
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


@dataclass
class RedisServer:
    """A redis-server process the caller owns on a loopback port; stop, restart at will.

    Nothing is persisted (no RDB, no AOF): every start is an empty Redis. Its output goes
    to `log_path` when given, else nowhere.
    """

    port: int = field(default_factory=free_port)
    log_path: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    cpus: frozenset[int] | None = None  # where it may run (None: where its starter does)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = REDIS_START_TIMEOUT_S) -> RedisServer:
        """Start redis-server and wait until it accepts connections."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        cmd = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--protected-mode", "yes"]
        if self.log_path is None:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                                         preexec_fn=pin_to(self.cpus))
        else:
            with self.log_path.open("wb") as log:
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL,
                                             preexec_fn=pin_to(self.cpus))
        try:
            wait_for_port(self.port, timeout, proc=self.proc)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
        self.proc = None

    def restart(self) -> None:
        """Stop and start again on the same port (empty: nothing is persisted)."""
        self.stop()
        self.start()


@contextmanager
def redis_server(log_path: Path | None = None,
                 cpus: frozenset[int] | None = None) -> Iterator[RedisServer]:
    """A private, empty redis-server on a free loopback port, stopped on exit."""
    server = RedisServer(log_path=log_path, cpus=cpus).start()
    try:
        yield server
    finally:
        server.stop()
