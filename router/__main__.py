"""`python -m router COMMAND`: the gateway, its indexer and the hashing tools."""

from __future__ import annotations

import sys

from router.cli.subcommands import dispatch
from router.without_torch import keep_torch_out

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("router.cli.serve", "run the cache-aware gateway"),
    "indexer": ("router.cli.indexer", "feed the shared index from the replicas' KV events"),
    "tokenize": ("router.cli.tokenize", "print the prompt token ids a request renders to"),
    "hash": ("router.cli.hash", "print the block keys of token ids read from stdin"),
    "diagnose": ("router.cli.diagnose", "explain where two prompts stop sharing cached blocks"),
}

if __name__ == "__main__":
    # Before any command imports transformers (router/without_torch.py says why).
    keep_torch_out()
    sys.exit(dispatch("python -m router", __doc__ or "", COMMANDS))
