"""Real servers for tests: free loopback ports and a redis-server the test owns.

The process helpers themselves live in replica/processes.py (shared with the benchmarks
and the harness); this module hands them to tests under a name that no conftest.py in
the tree can shadow (`from servers import RedisServer, free_port`).
"""

from __future__ import annotations

from pathlib import Path

from replica.processes import RedisServer, free_port, wait_for_port, wait_until

REPO = Path(__file__).resolve().parent.parent

__all__ = ["REPO", "RedisServer", "free_port", "wait_for_port", "wait_until"]
