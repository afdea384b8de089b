"""`python -m loadgen COMMAND`: workloads, policy comparisons and the demo."""

from __future__ import annotations

import sys

from router.cli.subcommands import dispatch

COMMANDS: dict[str, tuple[str, str]] = {
    "single-engine": ("loadgen.single_engine", "run the chat workload on one in-process sim"),
    "compare": ("loadgen.compare", "compare routing policies on one seeded workload"),
    "demo": ("loadgen.demo", "the README demo: 4 sims, gateway, three policies"),
}

if __name__ == "__main__":
    sys.exit(dispatch("python -m loadgen", __doc__ or "", COMMANDS))
