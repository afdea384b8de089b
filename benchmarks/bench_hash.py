"""Hashing and tokenization throughput at prompt sizes.

    .venv/bin/python benchmarks/bench_hash.py [--model DIR] [--sizes 1000,8000] [--repeats 3]

The gateway tokenizes and hashes every request before it can route it, so these costs
sit on the request path. This prints, for prompts of about 1k, 8k, 32k and 128k tokens:
block hashing (every algorithm; full chain and one new turn on top of a known chain;
the gateway's path, ids already checked, beside the per-block loop with int() on
every id it replaced, interleaved, as a ratio),
and chat tokenization in full (a fresh tokenizer; a warm one without segment reuse)
and incremental (one new ~200-token turn on a conversation whose history the segment
cache has seen), checking that the incremental ids equal the full ones, and the gateway's
encoding without character offsets beside the tokenizer's plain encode (interleaved). The synthetic
turns reuse a small word list, which flatters the warm full case (the tokenizer's own
word cache hits almost always); real text sits between the cold and warm numbers.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import msgspec

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from replica.tiny_model import build_tiny_model  # noqa: E402
from router import native  # noqa: E402
from router.hashing import HASH_ALGOS, BlockChain, HashConfig, chain_hashes  # noqa: E402
from router.request import _TokenIds  # noqa: E402
from router.tokenize import PromptTokenizer  # noqa: E402

SIZES = (1_000, 8_000, 32_000, 128_000)
TURN_WORDS = 140  # about 200 tokens with the tiny model's tokenizer
_WORDS = (
    "cache prefix block token request replica gateway route model server latency prompt "
    "system user assistant tool call function weather city temperature date error retry "
    "queue memory throughput batch stream event index hash chain score policy session "
    "history turn answer question summary document code value key list number the of and"
).split()


def _turn(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(TURN_WORDS)) + f" ({rng.randint(0, 10**6)})"


def conversation(tokenizer: Any, target_tokens: int, seed: int = 0) -> list[dict[str, str]]:
    """A system prompt plus alternating turns rendering to at least `target_tokens`."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": "You are a helpful assistant. " + _turn(rng)}]
    # Estimate from one turn's size, then top up: rendering 128k tokens per turn is slow.
    per_turn = max(1, len(tokenizer.encode(_turn(random.Random(seed)), add_special_tokens=False)))
    n_turns = max(1, target_tokens // (per_turn + 4))
    for i in range(n_turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": _turn(rng)})
    while len(tokenizer.chat_tokens({"messages": messages})) < target_tokens:
        messages.append({"role": "user" if len(messages) % 2 else "assistant", "content": _turn(rng)})
    if messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": _turn(rng)})
    return messages


def _best_of(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _per_block_wrapper(config: HashConfig, ids: list[int]) -> list[bytes]:
    """The loop before d7c33bc, kept to measure against: int() on every id, then each
    block through config.hash_fn (a Python wrapper around serializer and digest)."""
    tokens = list(map(int, ids))
    size, hash_fn = config.block_size, config.hash_fn
    parent, keys = config.root_hash(), []
    for start in range(0, len(tokens) - size + 1, size):
        parent = hash_fn((parent, tuple(tokens[start:start + size]), None))
        keys.append(parent)
    return keys


def _interleaved_best(a: Callable[[], Any], b: Callable[[], Any], repeats: int,
                      ) -> tuple[float, float]:
    """Best times of a and b, run alternately (this machine's speed drifts)."""
    times_a: list[float] = []
    times_b: list[float] = []
    for _ in range(repeats):
        for fn, times in ((a, times_a), (b, times_b)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return min(times_a), min(times_b)


def _python_only(fn: Callable[[], Any]) -> Callable[[], Any]:
    """fn with router._keys switched off: the pure-Python path (router/native.py)."""
    def run() -> Any:
        saved, native._keys = native._keys, None
        try:
            return fn()
        finally:
            native._keys = saved
    return run


def _interleaved_medians(a: Callable[[], Any], b: Callable[[], Any], repeats: int) -> str:
    """a against b, run alternately: each one's median and range, and the ratio of the
    medians (a shared machine's speed drifts; one pair can move several times over)."""
    times_a: list[float] = []
    times_b: list[float] = []
    for _ in range(repeats):
        for fn, times in ((a, times_a), (b, times_b)):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    ma, mb = statistics.median(times_a), statistics.median(times_b)
    return (f"{ma:.3f} ms [{min(times_a):.3f}-{max(times_a):.3f}] against {mb:.3f} ms "
            f"[{min(times_b):.3f}-{max(times_b):.3f}]: x{ma / mb:.2f}")


def _check_and_pack(ids: list[Any]) -> bytes | memoryview:
    """The gateway's check of a token-id prompt, then the chain cache's pack of it."""
    if not native.checked_ids(ids):
        msgspec.convert(ids, _TokenIds)
    return native.pack_ids(ids, len(ids))


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds / 1e6:8.2f} Mtok/s  {seconds * 1e3:9.2f} ms"


def _bench_size(model_dir: Path, size: int, block_size: int, algos: tuple[str, ...],
                repeats: int, rng: random.Random) -> list[str]:
    messages = conversation(PromptTokenizer.from_dir(model_dir), size)
    body = {"messages": messages}
    next_body = {"messages": [*messages, {"role": "assistant", "content": _turn(rng)},
                              {"role": "user", "content": _turn(rng)}]}
    ids = PromptTokenizer.from_dir(model_dir).chat_tokens(body)
    # A fresh tokenizer per repeat: a full tokenization with an empty segment cache.
    cold = iter([PromptTokenizer.from_dir(model_dir) for _ in range(repeats)])
    t_full = _best_of(lambda: next(cold).chat_tokens(body), repeats)
    warm = PromptTokenizer.from_dir(model_dir)
    warm.chat_tokens(body)
    next_ids = warm.chat_tokens(next_body)
    text = warm.render_chat(next_body)
    exact = next_ids == warm.encode(text, add_special_tokens=False)
    t_incr = _best_of(lambda: warm.chat_tokens(next_body), repeats)
    t_render = _best_of(lambda: warm.render_chat(next_body), repeats)
    # The same tokenizer, warm (its BPE word cache filled) but without segment reuse.
    t_warm_full = _best_of(lambda: warm.encode(text, add_special_tokens=False), repeats)
    # PromptTokenizer.encode leaves out the character offsets the tokenizer's own encode
    # also computes (encode_batch_fast): the same ids, interleaved with the plain call.
    backend = warm._backend
    t_fast, t_plain = _interleaved_best(
        lambda: warm.encode(text, add_special_tokens=False),
        lambda: backend.encode(text, add_special_tokens=False), max(repeats, 5))

    lines = [f"\n~{size // 1000}k tokens: history {len(ids)}, next turn +{len(next_ids) - len(ids)}"]
    lines.append(f"  tokenize full (cold)          {_rate(len(ids), t_full)}")
    lines.append(f"  tokenize full (warm BPE)      {_rate(len(next_ids), t_warm_full)}")
    lines.append(f"  tokenize incremental (cached) {_rate(len(next_ids), t_incr)}"
                 f"  exact={exact}  speedup x{t_full / t_incr:.1f}")
    lines.append(f"    of which template render    {t_render * 1e3:9.2f} ms")
    lines.append(f"  encode without offsets        {t_fast * 1e3:9.2f} ms, with them "
                 f"{t_plain * 1e3:.2f} ms: x{t_fast / t_plain:.2f}")
    for algo in algos:
        config = HashConfig(algo=algo, block_size=block_size, seed="0")
        t_hash = _best_of(partial(chain_hashes, config, next_ids), repeats)
        # The gateway's own path: its ids are Python ints already (checked=True).
        t_checked, t_wrapper = _interleaved_best(
            lambda: BlockChain(config).extend(next_ids, checked=True),  # noqa: B023
            partial(_per_block_wrapper, config, next_ids), max(repeats, 5))
        assert _per_block_wrapper(config, next_ids) == chain_hashes(config, next_ids)
        known = chain_hashes(config, ids)
        extend_times = []
        for _ in range(repeats):
            chain = BlockChain(config)
            chain.keys = list(known)
            chain.tokens = list(ids[: len(known) * block_size])
            start = time.perf_counter()
            chain.extend(next_ids[len(chain.tokens):])
            extend_times.append(time.perf_counter() - start)
        lines.append(f"  hash {algo:<12} full           {_rate(len(next_ids), t_hash)}"
                     f"  new turn only {min(extend_times) * 1e3:7.3f} ms"
                     f"  ids checked {t_checked * 1e3:.2f} ms, per-block wrapper "
                     f"{t_wrapper * 1e3:.2f} ms: x{t_checked / t_wrapper:.2f}")
        if native.AVAILABLE:
            def keys() -> list[bytes]:
                return BlockChain(config).extend(next_ids, checked=True)  # noqa: B023
            assert keys() == _python_only(keys)()
            lines.append(f"    C extension (router._keys) against Python, medians of "
                         f"{max(repeats, 15)} interleaved: "
                         f"{_interleaved_medians(keys, _python_only(keys), max(repeats, 15))}")
    if native.AVAILABLE:
        check = partial(_check_and_pack, next_ids)
        compared = _interleaved_medians(check, _python_only(check), max(repeats, 15))
        lines.append(f"  check + pack the ids, C against msgspec + struct: {compared}")
    return lines


def bench(model_dir: Path, block_size: int, algos: tuple[str, ...], repeats: int,
          sizes: tuple[int, ...] = SIZES) -> list[str]:
    """Run every measurement; return the report lines."""
    lines = [f"model {model_dir}, block size {block_size}, best of {repeats}"]
    rng = random.Random(1)
    for size in sizes:
        lines += _bench_size(model_dir, size, block_size, algos, repeats, rng)
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None,
                        help="model directory (default: build the tiny model in a temp dir)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--algo", choices=HASH_ALGOS, action="append", default=None,
                        help="hash algorithm to measure (repeatable; default: all)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES),
                        help="comma-separated prompt sizes in tokens")


def run(args: argparse.Namespace) -> int:
    try:
        sizes = tuple(int(s) for s in args.sizes.split(",") if s.strip())
    except ValueError:
        print(f"error: --sizes must be comma-separated integers, got {args.sizes!r}")
        return 2
    if args.block_size <= 0 or args.repeats <= 0 or not sizes or min(sizes) <= 0:
        print("error: --block-size, --repeats and --sizes must be positive")
        return 2
    algos = tuple(args.algo or HASH_ALGOS)
    with tempfile.TemporaryDirectory(prefix="cacheroute-bench-") as tmp:
        model_dir = args.model
        if model_dir is None:
            model_dir = build_tiny_model(Path(tmp) / "tiny")
        for line in bench(model_dir, args.block_size, algos, args.repeats, sizes):
            print(line, flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
