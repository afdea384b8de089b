"""`python -m router COMMAND`: the gateway, its indexer and the hashing tools."""

from __future__ import annotations

import sys

from router._cli import main

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("router.serve", "run the cache-aware gateway"),
    "indexer": ("router.indexer", "feed the shared index from the replicas' KV events"),
    "tokenize": ("router.tokenize_cmd", "print the prompt token ids a request renders to"),
    "hash": ("router.hash_cmd", "print the block keys of token ids read from stdin"),
    "diagnose": ("router.diagnose", "explain where two prompts stop sharing cached blocks"),
    "bench-hash": ("router.bench_hash", "measure hashing and tokenization throughput"),
}

if __name__ == "__main__":
    sys.exit(main("python -m router", __doc__ or "", COMMANDS))
