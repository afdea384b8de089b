"""`python -m replica COMMAND`: run replicas (simulated or real vLLM) and build test models."""

from __future__ import annotations

import sys

from router.cli.subcommands import dispatch

COMMANDS: dict[str, tuple[str, str]] = {
    "tiny-model": ("replica.tiny_model", "build a tiny random Llama with a tokenizer, offline"),
    "sim": ("replica.sim_cmd", "run a simulated vLLM replica"),
    "vllm": ("replica.vllm_launcher", "run a real vLLM replica with the fleet's cache settings"),
    "calibrate": ("replica.calibrate", "fit the sim's prefill profile to a real replica"),
}

if __name__ == "__main__":
    sys.exit(dispatch("python -m replica", __doc__ or "", COMMANDS))
