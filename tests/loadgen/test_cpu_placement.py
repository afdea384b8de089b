"""--router-cpus: routers on their own CPUs, the replicas and the client on the rest."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest

from loadgen.compare import _cpus_line, _placed
from loadgen.harness import HarnessError, LoggedProcess, parse_cpus
from replica.processes import RedisServer

ALLOWED = frozenset(os.sched_getaffinity(0))
FIRST = min(ALLOWED)


def test_cpu_lists_parse_and_bad_ones_name_the_flag() -> None:
    assert parse_cpus("--router-cpus", str(FIRST)) == {FIRST}
    assert parse_cpus("--router-cpus", f"{FIRST}-{FIRST}") == {FIRST}
    with pytest.raises(HarnessError, match=r"--router-cpus 'zero': expected CPU numbers"):
        parse_cpus("--router-cpus", "zero")
    beyond = max(ALLOWED) + 1
    with pytest.raises(HarnessError, match=rf"--router-cpus '{beyond}': this process may run"):
        parse_cpus("--router-cpus", str(beyond))


def test_a_logged_process_and_its_threads_run_only_on_its_cpus(tmp_path: Path) -> None:
    # A thread started inside the child must inherit the mask: a router's worker threads
    # (tokio's, the tokenizer pool) are where its CPU goes.
    code = ("import os, threading; out = []; t = threading.Thread("
            "target=lambda: out.append(sorted(os.sched_getaffinity(0)))); t.start(); t.join(); "
            "print('main', sorted(os.sched_getaffinity(0)), 'thread', out[0], flush=True)")
    proc = LoggedProcess("pinned", [sys.executable, "-c", code], cpus=frozenset({FIRST}))
    proc.start(tmp_path)
    try:
        assert proc.proc is not None
        assert proc.proc.wait(timeout=30) == 0
        assert proc.log_tail().strip() == f"main [{FIRST}] thread [{FIRST}]"
    finally:
        proc.stop()


def test_redis_can_be_placed_on_the_routers_cpus() -> None:
    server = RedisServer(cpus=frozenset({FIRST})).start()
    try:
        assert server.proc is not None
        assert os.sched_getaffinity(server.proc.pid) == {FIRST}
    finally:
        server.stop()


def test_placement_moves_this_process_off_the_router_cpus_and_back() -> None:
    args = argparse.Namespace(router_cpus=str(FIRST))
    if len(ALLOWED) < 2:
        with pytest.raises(HarnessError, match="leaves no CPU for the replicas"):
            with _placed(args):
                pass
        return
    with _placed(args):
        assert os.sched_getaffinity(0) == ALLOWED - {FIRST}
        assert args.router_cpu_set == {FIRST}
        line = _cpus_line(args)
        assert line.startswith(f"routers (gateways, indexer, Redis; peers) on CPU {FIRST};")
    assert os.sched_getaffinity(0) == ALLOWED


def test_without_the_flag_nothing_moves() -> None:
    args = argparse.Namespace(router_cpus=None)
    with _placed(args):
        assert os.sched_getaffinity(0) == ALLOWED
        assert args.router_cpu_set is None
    assert _cpus_line(args) == f"shared: routers, replicas and the client on all {len(ALLOWED)} CPUs"
