"""`python -m replica sim`: run one simulated vLLM replica on loopback (or any host).

Capacity flags mirror vLLM's: --num-blocks counts blocks the way
--num-gpu-blocks-override does (block 0 is the null block), --kv-tokens gives the usable
capacity in tokens instead. --seed is the replica's PYTHONHASHSEED (the block-key root,
as for real vLLM; also seeds the generated tokens), defaulting to the environment's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path

from replica.engine import EngineConfig
from replica.profiles import DEFAULT_PROFILE, load_profile
from replica.server import SimReplica, SimSettings, serve
from router.cli.arg_types import tcp_port
from router.hashing import HASH_ALGOS, HashConfig
from router.without_torch import keep_torch_out

DEFAULT_NUM_BLOCKS = 8193  # 131,072 tokens at block size 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sim's flags (names follow vLLM's where vLLM has one)."""
    parser.add_argument("--port", type=tcp_port, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--block-size", type=int, default=16)
    cap = parser.add_mutually_exclusive_group()
    cap.add_argument("--num-blocks", type=int, default=None,
                     help=f"KV blocks including vLLM's null block (default {DEFAULT_NUM_BLOCKS})")
    cap.add_argument("--kv-tokens", type=int, default=None,
                     help="usable KV capacity in tokens (rounded down to whole blocks)")
    parser.add_argument("--hash-algo", default="sha256", choices=HASH_ALGOS)
    parser.add_argument("--seed", default=None,
                        help="the replica's PYTHONHASHSEED (default: the environment's)")
    parser.add_argument("--model", default=None, help="model directory (tokenizer, chat template)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                        help="bind a ZMQ PUB for KV events here, e.g. tcp://127.0.0.1:5557")
    parser.add_argument("--kv-replay", default=None, metavar="ENDPOINT",
                        help="bind the replay ROUTER here, e.g. tcp://127.0.0.1:5558")
    parser.add_argument("--prefill-profile", default=DEFAULT_PROFILE,
                        help="built-in profile name or a JSON file from `replica calibrate`")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="run this many times faster than the profile's virtual time")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--crash-on-token", type=int, default=None, metavar="ID",
                        help="fault injection: the engine dies on a prompt holding this token "
                             "id, as vLLM's EngineCore does on a poison request (in-flight "
                             "requests get 500, then the server exits)")
    parser.add_argument("--log-level", default="WARNING")


def _special_ids(model_dir: Path) -> frozenset[int]:
    """Ids of the tokenizer's added (special) tokens, which generated text avoids."""
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return frozenset()
    data = json.loads(path.read_text())
    return frozenset(int(t["id"]) for t in data.get("added_tokens", []))


def _model_vocab_size(model_dir: Path) -> int:
    """The model's own vocabulary size (config.json), 0 when it does not say."""
    path = model_dir / "config.json"
    if not path.exists():
        return 0
    return int(json.loads(path.read_text()).get("vocab_size") or 0)


def _max_chars_per_token(model_dir: Path) -> int | None:
    """The longest token string in the vocabulary (vLLM bounds text prompts by it)."""
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    vocab = data.get("model", {}).get("vocab") or {}
    # BPE/WordPiece vocabularies are {token: id}; Unigram's are [[token, score], ...].
    tokens = list(vocab) if isinstance(vocab, dict) else [str(t[0]) for t in vocab]
    tokens += [str(t["content"]) for t in data.get("added_tokens", [])]
    return max((len(t) for t in tokens), default=None)


def build_settings(args: argparse.Namespace) -> tuple[SimSettings, object | None]:
    """Validated settings and the tokenizer (None without --model); raises ValueError."""
    block = args.block_size
    if block < 1:
        raise ValueError(f"--block-size must be a positive integer, got {block}")
    if args.kv_tokens is not None:
        if args.kv_tokens < block:
            raise ValueError(f"--kv-tokens must hold at least one block of {block} tokens, "
                             f"got {args.kv_tokens}")
        num_blocks = args.kv_tokens // block + 1
    else:
        num_blocks = DEFAULT_NUM_BLOCKS if args.num_blocks is None else args.num_blocks
        if num_blocks < 2:
            raise ValueError(f"--num-blocks must be at least 2 (block 0 is vLLM's null "
                             f"block), got {num_blocks}")
    seed = args.seed if args.seed is not None else os.environ.get("PYTHONHASHSEED")
    if seed is None and args.hash_algo.startswith("xxhash"):
        # vLLM seeds xxhash keys with fresh random bytes per process; so does the sim.
        seed = os.urandom(32).hex()
    hash_config = HashConfig(algo=args.hash_algo, block_size=block, seed=seed)
    tokenizer = None
    vocab_size = 32000
    reserved: frozenset[int] = frozenset()
    model_len = 8192
    model_dir = Path(args.model) if args.model else None
    if model_dir is not None:
        from router.tokenize import PromptTokenizer

        tokenizer = PromptTokenizer.from_dir(model_dir)
        vocab_size = max(tokenizer.vocab_size, _model_vocab_size(model_dir))
        reserved = _special_ids(model_dir)
        model_len = tokenizer.max_model_len or model_len
    capacity = (num_blocks - 1) * block
    max_model_len = args.max_model_len or min(model_len, capacity)
    if tokenizer is not None:
        tokenizer.max_model_len = max_model_len
    engine = EngineConfig(
        hash=hash_config, num_blocks=num_blocks, max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        profile=load_profile(args.prefill_profile),
        seed=int.from_bytes(hash_config.root_hash()[:8], "big"),
        vocab_size=vocab_size, reserved_token_ids=reserved, crash_on_token=args.crash_on_token,
    )
    if args.crash_on_token is not None and args.crash_on_token < 0:
        raise ValueError(f"--crash-on-token must be a token id >= 0, got {args.crash_on_token}")
    if args.time_scale <= 0:
        raise ValueError("--time-scale must be > 0")
    name = args.served_model_name or (model_dir.name if model_dir else "sim")
    return SimSettings(engine=engine, served_model_name=name, model_dir=model_dir,
                       time_scale=args.time_scale, kv_events=args.kv_events,
                       kv_replay=args.kv_replay,
                       max_chars_per_token=_max_chars_per_token(model_dir) if model_dir else None,
                       ), tokenizer


async def _main(settings: SimSettings, tokenizer: object | None, host: str, port: int) -> bool:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    return await serve(SimReplica(settings, tokenizer), host, port, stop)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT (exit 0) or until the engine dies (exit 1)."""
    # A sim with --model loads the tokenizer, and with it transformers; it never needs
    # torch, which would cost each of a fleet's sims ~5 s and ~380 MB at start
    # (router/without_torch.py).
    keep_torch_out()
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings, tokenizer = build_settings(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"replica sim: {exc}", file=sys.stderr)
        return 2
    try:
        died = asyncio.run(_main(settings, tokenizer, args.host, args.port))
    except OSError as exc:  # the address is taken, or not this host's
        print(f"replica sim: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 1 if died else 0
