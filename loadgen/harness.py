"""The processes a comparison starts (gateways, indexers, peers, vLLM servers), logged.

Ports, deadline waits and stopping come from replica.processes; this module adds what a
comparison needs on top: each process's output in a log file of the run, and a failure
that quotes the end of that log, so a router that would not start says why.
"""

from __future__ import annotations

import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from replica.processes import ProcessExited, WaitTimeout, pin_to, stop_process, wait_until

REPO = Path(__file__).resolve().parent.parent
MODEL_NAME = "tiny"
START_TIMEOUT_S = 60.0


class HarnessError(RuntimeError):
    """A component of the harness failed to start or answer; the message says which."""


def unbuilt_c_paths(repo: Path) -> list[str]:
    """The gateway's C extensions whose source the checkout holds but which are not built
    beside it (a git worktree made for a comparison gets the sources, not the ignored
    build outputs): its gateways would run the slower pure-Python fallbacks, which is not
    what a user's install runs, and a before/after would compare the builds."""
    return [str(c.relative_to(repo)) for c in sorted((repo / "router").rglob("_*.c"))
            if not any(c.parent.glob(f"{c.stem}.*.so"))]


def unbuilt_warning(repo: Path) -> str | None:
    """The warning `compare` and `bench_gateway` print before measuring a checkout whose C
    extensions are not built, or None when they all are."""
    if not (unbuilt := unbuilt_c_paths(repo)):
        return None
    return (f"warning: {repo}: {', '.join(unbuilt)} not built there; its gateways run the "
            "pure-Python fallback (build it there: python setup.py build_ext --inplace)")


def http_status(url: str, method: str = "GET", timeout: float = 2.0) -> int | None:
    """The HTTP status `url` answers with, or None when nothing answers."""
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return None


def parse_cpus(flag: str, text: str) -> frozenset[int]:
    """A CPU list such as "0" or "0,2-3", checked against the CPUs this process may use;
    a HarnessError naming `flag` and the bad value otherwise."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise HarnessError(f"{flag} {text!r}: expected CPU numbers such as 0 or 0,2-3") from None
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        raise HarnessError(f"{flag} {text!r}: this process may run on CPUs "
                           f"{','.join(map(str, sorted(allowed)))} only")
    return frozenset(cpus)


def answers_ok(url: str) -> bool:
    """Whether GET `url` answers 200."""
    return http_status(url) == 200


@dataclass
class LoggedProcess:
    """A subprocess the harness started and always stops, its output in a log file."""

    name: str
    cmd: list[str]
    env: dict[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    # The CPUs it may run on, its threads and children included (None: the harness's).
    cpus: frozenset[int] | None = None
    cwd: Path = REPO  # the checkout it runs from (`python -m ...` finds the code there)

    def start(self, log_dir: Path) -> None:
        self.log_path = log_dir / f"{self.name}.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env, cwd=self.cwd,
                                         preexec_fn=pin_to(self.cpus))

    def wait_until(self, ready: Callable[[], bool], timeout: float = START_TIMEOUT_S) -> None:
        """Poll `ready` until it holds; fail fast, quoting the log, if the process exits."""
        try:
            wait_until(ready, timeout, f"{self.name} to be ready", proc=self.proc)
        except (ProcessExited, WaitTimeout) as exc:
            raise HarnessError(f"{exc}:\n{self.log_tail()}") from None

    def log_tail(self, chars: int = 3000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
