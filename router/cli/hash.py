"""`python -m router hash`: the block keys of token ids read from stdin, one per line.

For checking a gateway's keys against a replica's KV events by hand: feed the prompt's
token ids (e.g. from `python -m router tokenize`) and compare with the events'
block_hashes (`--int` prints their 64-bit form).
"""

from __future__ import annotations

import argparse
import json
import sys

from router.hashing import (
    HASH_ALGOS,
    HashConfig,
    LoraRef,
    UnknownSeedError,
    chain_hashes,
    event_key,
)


class InputError(ValueError):
    """Input the user can fix; the message names the bad value."""


def parse_token_ids(text: str) -> list[int]:
    """A JSON list of non-negative integer token ids, or InputError naming what is wrong."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"stdin is not JSON ({exc.msg} at position {exc.pos}): {text[:60]!r}") from exc
    if not isinstance(value, list):
        raise InputError(f"stdin must be a JSON list of token ids, got {type(value).__name__}")
    for i, t in enumerate(value):
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise InputError(f"token at index {i} is {json.dumps(t)}, not a non-negative integer")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-size", type=int, required=True)
    parser.add_argument("--algo", choices=HASH_ALGOS, default="sha256")
    parser.add_argument("--seed", default=None, help="the replica's PYTHONHASHSEED, if set")
    parser.add_argument("--salt", default=None, help="the request's cache_salt")
    parser.add_argument("--lora", default=None, help="LoRA adapter name")
    parser.add_argument("--lora-path", default=None, help="LoRA adapter path (with --lora)")
    parser.add_argument("--int", dest="as_int", action="store_true",
                        help="print the 64-bit integers KV events carry instead of hex digests")


def run(args: argparse.Namespace) -> int:
    try:
        if (args.lora is None) != (args.lora_path is None):
            raise InputError("--lora and --lora-path go together (vLLM keys a LoRA by both)")
        config = HashConfig(algo=args.algo, block_size=args.block_size, seed=args.seed)
        config.check_reproducible()
        tokens = parse_token_ids(sys.stdin.read())
    except (InputError, UnknownSeedError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    lora = LoraRef(args.lora, args.lora_path) if args.lora is not None else None
    for key in chain_hashes(config, tokens, cache_salt=args.salt, lora=lora):
        print(event_key(key) if args.as_int else key.hex())
    return 0
