"""vLLM 0.32's chained prefix-cache block keys, computed outside vLLM.

A replica skips the prefill of a prompt block only when it holds a block with the same
key, and keys chain: block i's key is

    H(serialize((key of block i-1, tuple(block i's token ids), extra_keys)))

with block 0's parent being NONE_HASH = H(serialize(seed)). One differing byte in any of
these (algorithm, serializer, seed, block size, extra keys) and every lookup misses, so
this module follows vllm/v1/core/kv_cache_utils.py and vllm/utils/hashing.py exactly:

- sha256 / xxhash serialize with pickle protocol 5 (HIGHEST_PROTOCOL on Python 3.11+);
  sha256_cbor / xxhash_cbor with canonical CBOR. xxhash means xxh3_128 (16 bytes).
- The seed is the replica's PYTHONHASHSEED string when set (even "0"); otherwise the
  fixed "vllm-none-hash" for the sha256 algorithms, and fresh random bytes per engine
  process for the xxhash ones, which no gateway can reproduce (`UnknownSeedError`).
- extra_keys is None when empty (not an empty tuple: pickle and CBOR differ), else a
  tuple, in this order: ("lora", name, path) on every block, ("mm", identifier, offset)
  for multimodal items overlapping the block, ("cache_salt", salt) on block 0 only,
  ("prompt_embeds", digest).
- Only full blocks are hashed; a trailing partial block has no key.

KV events carry keys as `event_key(digest)`: the digest's last 8 bytes as an unsigned
64-bit integer. The chain itself always uses the full digest.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cbor2
import xxhash

from router.native import chain_keys

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_SEED = "vllm-none-hash"
_CRYPTO_ALGOS = frozenset({"sha256", "sha256_cbor"})
_EVENT_KEY_MASK = (1 << 64) - 1

# vLLM pickles with HIGHEST_PROTOCOL; pin 5 so a future Python cannot silently differ.
_PICKLE_PROTOCOL = 5


class UnknownSeedError(ValueError):
    """The replica's root hash is random per process, so no gateway can reproduce it."""


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _xxhash(obj: Any) -> bytes:
    return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL))


def _xxhash_cbor(obj: Any) -> bytes:
    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256": _sha256,
    "sha256_cbor": _sha256_cbor,
    "xxhash": _xxhash,
    "xxhash_cbor": _xxhash_cbor,
}

def chain_blocks(algo: str, parent: bytes, blocks: Iterable[tuple[int, ...]],
                 extra_keys: tuple[Any, ...] | None) -> list[bytes]:
    """The chained keys of consecutive blocks that share one extra_keys, after `parent`.

    The gateway's per-request floor on a long new prompt (512 blocks at 8k tokens), so
    each algorithm has its own loop calling the serializer and the digest in C with
    nothing in between (HASH_FUNCTIONS' wrappers cost a Python call per block, and a
    functools.partial with keywords a dict per block).
    """
    keys: list[bytes] = []
    append = keys.append
    dumps, sha256, xxh = pickle.dumps, hashlib.sha256, xxhash.xxh3_128_digest
    cbor = cbor2.dumps
    if algo == "sha256":
        for block in blocks:
            parent = sha256(dumps((parent, block, extra_keys), _PICKLE_PROTOCOL)).digest()
            append(parent)
    elif algo == "xxhash":
        for block in blocks:
            parent = xxh(dumps((parent, block, extra_keys), _PICKLE_PROTOCOL))
            append(parent)
    elif algo == "sha256_cbor":
        for block in blocks:
            parent = sha256(cbor((parent, block, extra_keys), canonical=True)).digest()
            append(parent)
    elif algo == "xxhash_cbor":
        for block in blocks:
            parent = xxh(cbor((parent, block, extra_keys), canonical=True))
            append(parent)
    else:
        raise ValueError(f"unknown hash algorithm {algo!r}")
    return keys


@dataclass(frozen=True)
class LoraRef:
    """A LoRA adapter as vLLM keys it: its name and the path it was loaded from."""

    name: str
    path: str


@dataclass(frozen=True)
class MultiModalItem:
    """A multimodal input's placeholder span and the identifier vLLM hashes it by."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True)
class HashConfig:
    """What a fleet must agree on for keys to meet: algorithm, block size, seed.

    `seed` is the replica's PYTHONHASHSEED value, or None when it is unset.
    """

    algo: str = "sha256"
    block_size: int = 16
    # For the xxhash algorithms a known seed lets an attacker craft colliding blocks
    # offline, so the seed never appears in a repr (logs, /ready, error messages).
    seed: str | None = field(default=None, repr=False)
    _root: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.algo not in HASH_FUNCTIONS:
            raise ValueError(
                f"unknown hash algorithm {self.algo!r}; expected one of {', '.join(HASH_ALGOS)}"
            )
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        resolved = self.resolved_seed()
        if resolved is not None:
            object.__setattr__(self, "_root", HASH_FUNCTIONS[self.algo](resolved))

    @property
    def hash_fn(self) -> Callable[[Any], bytes]:
        return HASH_FUNCTIONS[self.algo]

    def resolved_seed(self) -> str | None:
        """The seed string vLLM derives NONE_HASH from, or None if it is random."""
        if self.seed is not None:
            return self.seed
        if self.algo in _CRYPTO_ALGOS:
            return DEFAULT_SEED
        return None

    def check_reproducible(self) -> None:
        """Raise UnknownSeedError when a replica with these settings has a random root."""
        if not self._root:
            raise UnknownSeedError(
                f"hash algorithm {self.algo!r} without a seed: vLLM then seeds block 0 with "
                "random bytes per engine process, so no gateway can compute its keys. Set "
                "the same PYTHONHASHSEED on every replica and give it to the gateway "
                "(hash_seed), or use sha256."
            )

    def root_hash(self) -> bytes:
        """NONE_HASH: the parent of block 0."""
        self.check_reproducible()
        return self._root


def block_extra_keys(
    start: int,
    end: int,
    *,
    lora: LoraRef | None = None,
    cache_salt: str | None = None,
    mm_items: Sequence[MultiModalItem] = (),
    prompt_embeds_digest: bytes | None = None,
) -> tuple[Any, ...] | None:
    """The extra keys vLLM mixes into the key of the block spanning tokens [start, end)."""
    keys: list[Any] = []
    if lora is not None:
        keys.append(("lora", lora.name, lora.path))
    for item in mm_items:
        # An item overlaps the block when it starts before the block ends and ends after
        # it starts; vLLM records its offset relative to the block (may be negative).
        if item.offset < end and item.offset + item.length > start:
            keys.append(("mm", item.identifier, item.offset - start))
    if start == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    if prompt_embeds_digest is not None:
        keys.append(("prompt_embeds", prompt_embeds_digest))
    return tuple(keys) if keys else None


def hash_block(
    config: HashConfig,
    parent: bytes | None,
    tokens: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> bytes:
    """One block's key: H((parent key or NONE_HASH, tuple(tokens), extra_keys))."""
    if not parent:
        parent = config.root_hash()
    # int() guards against numpy integers, which pickle differently from Python ints.
    return config.hash_fn((parent, tuple(int(t) for t in tokens), extra_keys))


def event_key(digest: bytes) -> int:
    """The 64-bit integer vLLM's KV events publish for a block key (its last 8 bytes)."""
    return int.from_bytes(digest, "big") & _EVENT_KEY_MASK


def _run_keys(algo: str, parent: bytes, tokens: Sequence[int], start: int, stop: int,
              size: int, extra: tuple[Any, ...] | None) -> list[bytes]:
    """The keys of the full blocks of tokens[start:stop], each with `extra`, after
    `parent`: in C where the extension takes them, else chain_blocks' loop."""
    native = None if extra is not None else chain_keys(algo, parent, tokens, start, stop, size)
    if native is not None:
        return native
    # zip over one iterator, `size` times: the full blocks as tuples, made in C.
    blocks = zip(*[iter(tokens[start:stop])] * size, strict=False)
    return chain_blocks(algo, parent, blocks, extra)


def continue_keys(config: HashConfig, parent: bytes, tokens: Sequence[int], start: int,
                  stop: int) -> list[bytes]:
    """The keys BlockChain.extend gives the full blocks of tokens[start:stop] of a plain
    chain (no LoRA, no multimodal items) whose block start/size - 1 has key `parent`;
    `start` is past block 0 and on a block boundary. Nothing before `start` is read, so
    a conversation's next turn is keyed without copying its history (ChainCache)."""
    size = config.block_size
    if start < size or start % size:
        raise ValueError(f"continue_keys starts past block 0 on a block boundary, not at {start}")
    return _run_keys(config.algo, parent, tokens, start, stop - (stop - start) % size, size,
                     block_extra_keys(size, 2 * size))


def plain_chain_keys(config: HashConfig, tokens: Sequence[int], stop: int,
                     cache_salt: str | None) -> list[bytes]:
    """The keys BlockChain(config, cache_salt=cache_salt).extend(tokens[:stop]) gives a
    plain chain (no LoRA, no multimodal items), without copying the tokens into a chain:
    a packed prompt (router.native.prompt_ids) stays packed, no Python int per id."""
    config.check_reproducible()
    size = config.block_size
    stop -= stop % size
    if stop < size:
        return []
    first = config.hash_fn((config.root_hash(), tuple(tokens[:size]),
                            block_extra_keys(0, size, cache_salt=cache_salt)))
    return [first, *_run_keys(config.algo, first, tokens, size, stop, size,
                              block_extra_keys(size, 2 * size))]


@dataclass
class BlockChain:
    """The keys of one token sequence's full blocks, extended as the sequence grows.

    A conversation resends its history every turn; `extend` hashes only the blocks the
    new tokens completed, so a long history costs nothing to re-key.
    """

    config: HashConfig
    cache_salt: str | None = None
    lora: LoraRef | None = None
    mm_items: tuple[MultiModalItem, ...] = ()
    tokens: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.config.check_reproducible()
        pending, self.tokens = self.tokens, []
        if pending:
            self.extend(pending)

    @property
    def num_full_blocks(self) -> int:
        return len(self.keys)

    def event_keys(self) -> list[int]:
        """The chain's keys as KV events publish them."""
        return [event_key(k) for k in self.keys]

    def extend(self, new_tokens: Sequence[int], *, checked: bool = False) -> list[bytes]:
        """Append tokens and return the keys of the blocks they completed.

        checked: the tokens are Python ints already (a request's ids as msgspec checked
        them, a tokenizer's output), so the conversion below is skipped: it costs 0.7 ms
        at 8k tokens here, a third of hashing them.
        """
        # numpy integers would pickle differently from Python ints.
        self.tokens.extend(new_tokens if checked else map(int, new_tokens))
        size = self.config.block_size
        tokens = self.tokens
        start = len(self.keys) * size
        if start + size > len(tokens):
            return []
        hash_fn = self.config.hash_fn
        parent = self.keys[-1] if self.keys else self.config.root_hash()
        added: list[bytes] = []
        # Block 0 (the salt) and blocks overlapping multimodal items have extra keys of
        # their own: one at a time. Every other block's depend only on the LoRA, so the
        # rest of the run goes to chain_blocks' loop in one call.
        while start + size <= len(tokens) and (start == 0 or self.mm_items):
            end = start + size
            extra = block_extra_keys(start, end, lora=self.lora, cache_salt=self.cache_salt,
                                     mm_items=self.mm_items)
            parent = hash_fn((parent, tuple(tokens[start:end]), extra))
            added.append(parent)
            start = end
        full_end = len(tokens) - len(tokens) % size
        if start < full_end:
            added += _run_keys(self.config.algo, parent, tokens, start, full_end, size,
                               block_extra_keys(size, 2 * size, lora=self.lora))
        self.keys.extend(added)
        return added

    def fork(self, tokens: Sequence[int]) -> BlockChain:
        """A chain for `tokens` reusing this chain's keys for the blocks they share."""
        shared = shared_prefix_blocks(self.tokens, tokens, self.config.block_size)
        shared = min(shared, len(self.keys))
        size = self.config.block_size
        child = BlockChain(
            self.config, self.cache_salt, self.lora, self.mm_items
        )
        child.tokens = [int(t) for t in tokens[: shared * size]]
        child.keys = self.keys[:shared]
        child.extend(tokens[shared * size :])
        return child


def chain_hashes(
    config: HashConfig,
    tokens: Sequence[int],
    *,
    cache_salt: str | None = None,
    lora: LoraRef | None = None,
    mm_items: Sequence[MultiModalItem] = (),
) -> list[bytes]:
    """The keys of every full block of `tokens`, in chain order."""
    chain = BlockChain(config, cache_salt=cache_salt, lora=lora, mm_items=tuple(mm_items))
    chain.extend(tokens)
    return chain.keys


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first position where the token lists differ (the shorter length if none)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def shared_prefix_blocks(a: Sequence[int], b: Sequence[int], block_size: int) -> int:
    """How many leading full blocks two token lists share (same salt and LoRA assumed)."""
    return first_divergence(a, b) // block_size


def max_cacheable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """The most blocks a new request can hit: vLLM always recomputes the last prompt token."""
    return max(num_prompt_tokens - 1, 0) // block_size
