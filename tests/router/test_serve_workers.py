"""`python -m router serve` with several worker processes on one port, as real processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import yaml
from servers import REPO, RedisServer, free_port

from replica.processes import port_open, stop_process, wait_until

WORKER_HEADER = "x-cacheroute-worker"


def write_config(tmp_path: Path, port: int, index: str, **listen: Any) -> Path:
    raw = {
        "listen": {"host": "127.0.0.1", "port": port, **listen},
        "index": index,
        # Nothing listens there: /health answers whatever the fleet's state.
        "replicas": [{"url": f"http://127.0.0.1:{free_port()}", "models": ["m"]}],
        "tenants": {"allow_anonymous": True},
        "proxy": {"expose_routing_headers": True},
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def serve(config: Path, *flags: str, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "router", "serve", "--config", str(config),
             "--log-level", "INFO", *flags],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def worker_of_next_connection(port: int) -> int:
    """The pid of the worker that answers one fresh connection."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
        return int(resp.headers[WORKER_HEADER])


def stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_two_workers_share_the_port_and_stop_on_sigterm(
        redis_server: RedisServer, tmp_path: Path) -> None:
    port = free_port()
    config = write_config(tmp_path, port, redis_server.url, workers=2)
    log = tmp_path / "gateway.log"
    proc = serve(config, log=log)
    try:
        wait_until(lambda: port_open(port), 60, f"the gateway on port {port}", proc=proc)
        workers = {p.pid for p in psutil.Process(proc.pid).children()}
        assert len(workers) == 2, log.read_text()
        seen: set[int] = set()

        def both_answered() -> bool:
            seen.add(worker_of_next_connection(port))
            return seen == workers

        # SO_REUSEPORT hashes each new connection to one listener: a few suffice.
        wait_until(both_answered, 30, "new connections to reach both workers")

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
        assert all(stopped(pid) for pid in workers)
        assert not port_open(port)
        assert "2 workers" in log.read_text() and "all workers stopped" in log.read_text()
    finally:
        stop_process(proc)


def test_workers_run_on_the_event_loop_the_config_names(
        redis_server: RedisServer, tmp_path: Path) -> None:
    port = free_port()
    config = write_config(tmp_path, port, redis_server.url, workers=2, event_loop="uvloop")
    log = tmp_path / "gateway.log"
    proc = serve(config, log=log)
    try:
        wait_until(lambda: log.read_text().count("event loop uvloop") == 2, 60,
                   "both workers to report their loop", proc=proc)
        assert worker_of_next_connection(port) in \
            {p.pid for p in psutil.Process(proc.pid).children()}
        assert "event loop asyncio" not in log.read_text()
    finally:
        stop_process(proc)


def test_workers_stop_when_their_supervisor_is_killed(
        redis_server: RedisServer, tmp_path: Path) -> None:
    port = free_port()
    config = write_config(tmp_path, port, redis_server.url)
    log = tmp_path / "gateway.log"
    proc = serve(config, "--workers", "2", log=log)
    workers: set[int] = set()
    try:
        wait_until(lambda: port_open(port), 60, f"the gateway on port {port}", proc=proc)
        workers = {p.pid for p in psutil.Process(proc.pid).children()}
        assert len(workers) == 2
        proc.kill()  # no chance to stop its workers itself
        proc.wait(timeout=10)
        wait_until(lambda: all(stopped(pid) for pid in workers), 30,
                   "the orphaned workers to stop")
        assert "supervisor" in log.read_text() and "is gone" in log.read_text()
    finally:
        stop_process(proc)
        for pid in workers:  # only if the assertion above failed: they are ours
            if not stopped(pid):
                psutil.Process(pid).kill()


def test_several_workers_need_a_shared_index(tmp_path: Path) -> None:
    port = free_port()
    config = write_config(tmp_path, port, "memory")
    proc = subprocess.run(
        [sys.executable, "-m", "router", "serve", "--config", str(config), "--workers", "3"],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert ("configuration error: listen.workers: is 3 but index is memory: each worker "
            "would keep an index of its own") in proc.stderr
    assert not port_open(port)
