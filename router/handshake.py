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

The events reach the indexer (router/events/), not the gateway: a BlockStored whose
block-0 extra key is a probe salt (`is_probe_salt`) is not indexed but stored through
the PrefixIndex (`put_probe`), where `run_handshake` finds it by salt (`get_probe`).
That works alike for an in-gateway indexer on the memory index and for the separate
indexer process writing to Redis, and it proves the events reach the index the gateway
reads: a replica whose observation never arrives is reported as "no_events".

Everything here but `run_handshake` is pure (no aiohttp: it is imported for types only).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from router.hashing import HASH_ALGOS, HashConfig, UnknownSeedError, chain_hashes, event_key
from router.index import IndexUnavailable, ObservedBlocks, PrefixIndex

if TYPE_CHECKING:
    import aiohttp

log = logging.getLogger(__name__)

PROBE_SALT_PREFIX = "cacheroute-probe-"


@dataclass(frozen=True)
class Probe:
    """A probe prompt: token ids and the unique salt that makes its keys new."""

    token_ids: tuple[int, ...]
    cache_salt: str


@dataclass(frozen=True)
class HandshakeResult:
    """Whether a replica's keys agree with the gateway's, and if not, what differs.

    mismatch: None when verified; "block_size", "hash_algo" or "hash_seed" for the
    setting that most likely differs; "no_events" when the replica answered the probe
    but no KV event for it reached the index in time (events off, wrong kv_events
    endpoint, indexer not running); "probe_failed" when the probe request itself failed.
    rekeyed: the indexer re-keys the replica's blocks with the gateway's settings, so
    the replica stays routable by prefix although its own keys differ (`routable`).
    """

    verified: bool
    mismatch: str | None = None
    detail: str = ""
    rekeyed: bool = False

    @property
    def routable_by_prefix(self) -> bool:
        """Whether the index's matches for this replica can be trusted."""
        return self.verified or self.rekeyed


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
    result = _compare_keys(probe, ours, observed)
    if not result.verified and observed.rekeyed:
        return replace(result, rekeyed=True, detail=result.detail + (
            "; the indexer re-keys its blocks with the gateway's settings, so it stays "
            "routable by prefix"))
    return result


def _compare_keys(probe: Probe, ours: HashConfig, observed: ObservedBlocks) -> HandshakeResult:
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
        "PYTHONHASHSEED is not the gateway's hash_seed (values not shown: a seed is a secret)",
    )


async def run_handshake(
    session: aiohttp.ClientSession,
    replica_url: str,
    model: str,
    config: HashConfig,
    index: PrefixIndex,
    *,
    timeout_s: float,
    vocab_size: int,
    probe_every_s: float = 1.0,
    request_timeout_s: float = 10.0,
    sending: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
) -> HandshakeResult:
    """Probe the replica at `replica_url` and compare the keys its events report with ours.

    Sends a probe (POST /v1/completions: token-id prompt, unique cache_salt, max_tokens
    1), then polls `index.get_probe` until the indexer has stored the replica's
    observation or `timeout_s` passes. A fresh probe goes out every `probe_every_s`: a
    subscriber that joined after a probe's event was published (ZMQ PUB drops it) sees
    the next one. `config` is what the gateway assumes for this replica; `vocab_size`
    bounds the probe's token ids. Each probe's POST runs inside `sending()`: the fleet
    counts it as a request of ours in flight there, so a scrape that catches it does
    not take it for another client's.
    """
    import aiohttp  # here, not at the top: the rest of this module stays pure

    deadline = time.monotonic() + timeout_s
    url = replica_url.rstrip("/") + "/v1/completions"
    sent: list[Probe] = []
    errors: list[str] = []
    index_error = ""  # the last get_probe failure, while the index stays unreachable
    next_probe = time.monotonic()
    while True:
        now = time.monotonic()
        if now >= next_probe:
            probe = make_probe(config.block_size, vocab_size)
            body = {"model": model, "prompt": list(probe.token_ids), "max_tokens": 1,
                    "cache_salt": probe.cache_salt}
            timeout = aiohttp.ClientTimeout(total=max(0.1, min(request_timeout_s,
                                                               deadline - now)))
            try:
                with sending():
                    async with session.post(url, json=body, timeout=timeout) as resp:
                        text = await resp.text()
                    if resp.status == 200:
                        sent.append(probe)
                    else:
                        errors.append(f"HTTP {resp.status}: {text[:200]}")
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
            next_probe = time.monotonic() + probe_every_s
        for probe in sent:
            try:
                observed = await index.get_probe(probe.cache_salt)
            except IndexUnavailable as exc:
                index_error = str(exc)
                break
            index_error = ""
            if observed is not None:
                return compare(probe, config, observed)
        if time.monotonic() >= deadline:
            break
        # The observation arrives through the replica's events and the indexer: poll it.
        await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
    if index_error:
        return HandshakeResult(
            False, "index_unavailable",
            f"the index could not be read for the probe's observation: {index_error}")
    if not sent:
        return HandshakeResult(
            False, "probe_failed",
            f"the probe request to {url} failed: {errors[-1] if errors else 'no attempt'}")
    return HandshakeResult(
        False, "no_events",
        f"the replica answered {len(sent)} probe(s) but no KV event for them reached the "
        f"index within {timeout_s:.1f}s: check that it publishes KV events "
        "(--kv-events-config), that kv_events points at its publisher, and that an "
        "indexer feeds the index the gateway reads")
