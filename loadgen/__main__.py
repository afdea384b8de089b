"""`python -m loadgen COMMAND`: workloads, policy comparisons and the demo."""

from __future__ import annotations

import signal
import sys
from types import FrameType

from router.cli.subcommands import dispatch
from router.without_torch import keep_torch_out

COMMANDS: dict[str, tuple[str, str]] = {
    "single-engine": ("loadgen.single_engine", "run the chat workload on one in-process sim"),
    "compare": ("loadgen.compare", "compare routing policies on one seeded workload"),
    "demo": ("loadgen.demo", "the README demo: 4 sims, gateway, three policies"),
}



def _stop(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    # SIGTERM (`timeout`, a CI runner, a supervisor) ends a run as Ctrl-C does: through
    # its finally blocks, which stop the sims, gateways, peers and redis-server it
    # started. Without this the process died at once and left them all running.
    signal.signal(signal.SIGTERM, _stop)
    # The harness renders chats with the tokenizer and never needs a model
    # (router/without_torch.py).
    keep_torch_out()
    sys.exit(dispatch("python -m loadgen", __doc__ or "", COMMANDS))
