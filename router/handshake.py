"""The hash handshake: prove a replica keys blocks as the gateway does, or say why not.

The most common misconfiguration of KV-aware routing is a replica whose block keys
differ from the gateway's (another block size, hash algorithm or PYTHONHASHSEED). It
fails silently: every index lookup misses and cache-aware routing degrades to load
routing with nobody told. The handshake catches it when the gateway first sees a
replica (and periodically):

1. send a short probe prompt with a unique cache_salt (so it cannot hit anything cached
   and its keys are new), max_tokens 1;
2. read back the BlockStored event the replica publishes for it (its token ids carry the
   probe's, its extra keys the salt);
3. compare the replica's keys with the gateway's own for the same tokens and salt.

On a mismatch the replica is marked unverified and the likely culprit is named, by
re-keying the observed tokens under each alternative setting the gateway can try
(block size from the event itself, the other algorithms with the configured seed); a
seed is the only setting that cannot be recovered, so it is what remains.

This module is pure: the gateway's fleet code sends the probe and collects the event.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from router.hashing import HASH_ALGOS, HashConfig, UnknownSeedError, chain_hashes, event_key

PROBE_SALT_PREFIX = "cacheroute-probe-"


@dataclass(frozen=True)
class Probe:
    """A probe prompt: token ids and the unique salt that makes its keys new."""

    token_ids: tuple[int, ...]
    cache_salt: str


@dataclass(frozen=True)
class ObservedBlocks:
    """What a replica's BlockStored event said about the probe's blocks."""

    block_size: int
    keys: tuple[int, ...]
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class HandshakeResult:
    """Whether a replica's keys agree with the gateway's, and if not, what differs."""

    verified: bool
    mismatch: str | None = None  # "block_size", "hash_algo", "hash_seed" or None
    detail: str = ""


def make_probe(block_size: int, vocab_size: int = 1000, blocks: int = 2) -> Probe:
    """A probe of `blocks` full blocks plus one token, with a fresh unique salt."""
    rng = secrets.SystemRandom()
    # Token ids kept low so any vocabulary, however small, accepts them.
    tokens = tuple(rng.randrange(3, max(vocab_size, 4)) for _ in range(blocks * block_size + 1))
    return Probe(token_ids=tokens, cache_salt=PROBE_SALT_PREFIX + secrets.token_hex(8))


def is_probe_salt(salt: object) -> bool:
    """Whether an event's block-0 extra key is a handshake probe's salt."""
    return isinstance(salt, str) and salt.startswith(PROBE_SALT_PREFIX)


def _keys(config: HashConfig, tokens: Sequence[int], salt: str) -> tuple[int, ...]:
    return tuple(event_key(k) for k in chain_hashes(config, tokens, cache_salt=salt))


def compare(probe: Probe, ours: HashConfig, observed: ObservedBlocks) -> HandshakeResult:
    """Compare the replica's reported keys for the probe with the gateway's own."""
    if observed.block_size != ours.block_size:
        return HandshakeResult(
            False, "block_size",
            f"replica uses block size {observed.block_size}, gateway expects {ours.block_size}",
        )
    n = len(observed.keys)
    tokens = observed.token_ids[: n * observed.block_size]
    expected = _keys(ours, tokens, probe.cache_salt)
    if expected == observed.keys:
        return HandshakeResult(True, None, f"{n} probe blocks keyed identically")
    for algo in HASH_ALGOS:
        if algo == ours.algo:
            continue
        try:
            alt = HashConfig(algo=algo, block_size=ours.block_size, seed=ours.seed)
            if _keys(alt, tokens, probe.cache_salt) == observed.keys:
                return HandshakeResult(
                    False, "hash_algo",
                    f"replica hashes with {algo}, gateway expects {ours.algo}",
                )
        except UnknownSeedError:
            continue
    return HandshakeResult(
        False, "hash_seed",
        f"block size and algorithm ({ours.algo}) agree but keys differ: the replica's "
        f"PYTHONHASHSEED is not the gateway's hash_seed ({ours.seed!r})",
    )
