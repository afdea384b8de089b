"""Harness process helpers: ports that stay free until their server binds them."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

from replica.processes import (
    _ephemeral_low,
    children,
    cpu_seconds,
    descendants,
    free_port,
    stop_process,
)


def test_free_ports_are_below_the_ephemeral_range_and_bindable() -> None:
    # An outgoing connection's local port comes from the ephemeral range; a port below
    # it can only be taken by another listener.
    low = _ephemeral_low()
    ports = {free_port() for _ in range(50)}
    assert all(p < low for p in ports), sorted(ports)
    assert len(ports) > 40  # spread, not one port handed out again and again
    port = ports.pop()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))



def test_free_port_never_hands_out_one_port_twice_before_servers_bind() -> None:
    # A 32-sim fleet picks ~100 ports before any of its servers binds one: none repeats.
    ports = [free_port() for _ in range(400)]
    assert len(set(ports)) == len(ports)


@contextlib.contextmanager
def _python_child(program: str) -> Iterator[subprocess.Popen[bytes]]:
    """A Python process running `program` with our pipes as its stdin and stdout; closing
    its stdin (on leaving) is what `program` waits for, then it is stopped."""
    child = subprocess.Popen([sys.executable, "-c", program],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        yield child
    finally:
        assert child.stdin is not None
        child.stdin.close()
        stop_process(child)


def test_cpu_seconds_counts_a_child_s_work_and_children_finds_it() -> None:
    # The child spins until it has used 0.3 s of CPU by its own clock, then says so and
    # waits for its stdin to close: no sleep on either side.
    with _python_child("import sys, time\n"
                       "while time.process_time() < 0.3: pass\n"
                       "print('spun', flush=True)\n"
                       "sys.stdin.read()\n") as child:
        assert child.stdout is not None and child.stdout.readline() == b"spun\n"
        assert child.pid in children(os.getpid())
        # /proc counts whole clock ticks (10 ms) and splits them between user and
        # system; process_time does not: allow a few ticks.
        assert cpu_seconds(child.pid) >= 0.25
        assert cpu_seconds(os.getpid()) > 0


def test_descendants_reach_a_grandchild_and_stop_there() -> None:
    # The child starts a grandchild that waits on its stdin (the child's), prints its
    # id, and waits for the grandchild: closing our end of the pipe ends both.
    with _python_child("import subprocess, sys\n"
                       "g = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'])\n"
                       "print(g.pid, flush=True)\n"
                       "g.wait()\n") as child:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        mine = descendants(os.getpid())
        assert child.pid in mine and grandchild in mine
        assert grandchild not in children(os.getpid())  # not ours directly
        assert descendants(child.pid) == [grandchild]
        assert os.getpid() not in mine
