"""Token ids of long prompt segments, shared between gateways through Redis.

Every gateway keeps its own segment cache (router/tokenize.py): the ids of each piece of
rendered prompt text between special tokens. A piece it has not seen is encoded in full:
a 3,000-token system prompt takes ~5 ms here, an agent's 6,000-token tools section 11.
With several gateways (or `listen.workers` processes) each encodes every long shared
prefix once for itself, so the first request of a group that reaches a gateway new to it
waits for that (issue #16: 30-48 ms against 2-5 ms on a shared 2-core machine).

So before encoding, a gateway asks Redis for the ids of the long pieces (at least
`min_chars`) its cache lacks, in one MGET under a deadline; what comes back goes into its
cache, and only the rest is encoded. After encoding it reports the long pieces it had to
encode: a counter per piece counts encodes fleet-wide, and from the second one on the
ids are stored. A one-off prompt (most of a trace's) costs a small counter for
`ttl_s`, not its ids; a prefix two gateways needed is encoded at most twice in the
fleet. Values are 4 bytes per token.

Keys (NS the namespace; {T} the tokenizer's identity inside a hash tag, so that one
MGET touches one Redis Cluster slot; D the sha256 of the piece's UTF-8 text):

    NS:{seg:T}:i:D    STRING  the piece's token ids, uint32 little-endian; PX ttl
    NS:{seg:T}:n:D    STRING  how many gateways encoded it within ttl (INCR); PX ttl

The tokenizer's identity is a digest of its tokenizer.json: gateways only share ids
where their tokenizers would produce the same ones. sha256 of the text (not a fast
hash) so that no client can craft a piece colliding with another tenant's; ids read
back are checked against the vocabulary. The ids only steer routing (vLLM tokenizes
the prompt itself), so a stale or wrong value would cost a cache miss, not an answer.
With Redis slow or away, every piece is encoded locally, as without sharing. A gateway
that the shared work (router/shared_work.py) shows alone neither asks nor reports: one
gateway serving unique long prompts would otherwise pay a round trip and a write per
request for nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import RedisError

from router.deadlines import within

log = logging.getLogger(__name__)

# Below this a piece encodes in about the time a round trip takes (0.4 ms per KB here).
DEFAULT_MIN_CHARS = 4096
DEFAULT_TTL_S = 600.0
# Reported pieces remembered for deduplication before the expired ones are dropped.
_MAX_REMEMBERED = 10_000


def encode_ids(ids: Sequence[int]) -> bytes:
    """Token ids as uint32 little-endian."""
    packed = array("I", ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def decode_ids(raw: bytes, vocab_size: int) -> tuple[int, ...] | None:
    """The ids of a stored value, or None if it cannot be this tokenizer's."""
    if not raw or len(raw) % 4:
        return None
    packed = array("I")
    packed.frombytes(raw)
    if sys.byteorder != "little":
        packed.byteswap()
    if vocab_size and max(packed) >= vocab_size:
        return None
    return tuple(packed)


@dataclass
class SharedSegments:
    """This gateway's side of the shared segment ids: fetch before encoding, report after."""

    client: Redis
    namespace: str = "cr"
    min_chars: int = DEFAULT_MIN_CHARS
    ttl_s: float = DEFAULT_TTL_S
    timeout_s: float = 0.05
    fetched: int = 0  # pieces whose ids came from Redis
    reported: int = 0  # pieces this gateway encoded and counted
    failures: int = 0
    clock: Callable[[], float] = time.monotonic
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    # Count keys this gateway reported, and when: a burst of requests sharing a piece
    # nobody had sent finds it missing in every request, but counts as one encode.
    _reported_at: dict[bytes, float] = field(default_factory=dict)

    def _keys(self, tokenizer_id: str, piece: str) -> tuple[bytes, bytes]:
        digest = hashlib.sha256(piece.encode("utf-8", "surrogatepass")).digest()
        base = f"{self.namespace}:{{seg:{tokenizer_id}}}:".encode()
        return base + b"i:" + digest, base + b"n:" + digest

    async def fetch(self, tokenizer_id: str, pieces: Sequence[str],
                    vocab_size: int) -> dict[str, tuple[int, ...]]:
        """The ids Redis holds for `pieces` (those it does not hold are left out). Never
        raises: a failed or late read returns nothing and the pieces are encoded."""
        if not pieces:
            return {}
        try:
            values = await within(self.client.mget([self._keys(tokenizer_id, p)[0]
                                                    for p in pieces]), self.timeout_s)
        except (RedisError, OSError, TimeoutError) as exc:
            self.failures += 1
            log.debug("shared segments read failed: %s", exc)
            return {}
        out: dict[str, tuple[int, ...]] = {}
        for piece, raw in zip(pieces, values, strict=True):
            # The index's client does not decode responses: values are bytes.
            ids = decode_ids(raw, vocab_size) if isinstance(raw, bytes) else None
            if ids is not None:
                out[piece] = ids
        self.fetched += len(out)
        return out

    def report(self, tokenizer_id: str, encoded: Sequence[tuple[str, tuple[int, ...]]]) -> None:
        """Count pieces this gateway had to encode, storing the ids of those another
        encode was already counted for (in the background: routing does not wait)."""
        now = self.clock()
        if len(self._reported_at) > _MAX_REMEMBERED:
            self._reported_at = {k: t for k, t in self._reported_at.items()
                                 if now - t < self.ttl_s}
        fresh: list[tuple[bytes, bytes, tuple[int, ...]]] = []  # ids key, count key, ids
        for piece, ids in encoded:
            ids_key, count_key = self._keys(tokenizer_id, piece)
            if now - self._reported_at.get(count_key, -math.inf) >= self.ttl_s:
                self._reported_at[count_key] = now
                fresh.append((ids_key, count_key, ids))
        if not fresh:
            return
        task = asyncio.get_running_loop().create_task(self._report(fresh))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _report(self, encoded: Sequence[tuple[bytes, bytes, tuple[int, ...]]]) -> None:
        ttl_ms = int(self.ttl_s * 1000)
        try:
            pipe = self.client.pipeline(transaction=False)
            for _, count_key, _ in encoded:
                pipe.incr(count_key)
                pipe.pexpire(count_key, ttl_ms)
            counts = (await within(pipe.execute(), 4 * self.timeout_s))[0::2]
            second = [(ids_key, ids) for (ids_key, _, ids), n
                      in zip(encoded, counts, strict=True) if int(n) >= 2]
            if second:
                pipe = self.client.pipeline(transaction=False)
                for ids_key, ids in second:
                    pipe.set(ids_key, encode_ids(ids), px=ttl_ms)
                await within(pipe.execute(), 4 * self.timeout_s)
            self.reported += len(encoded)
        except (RedisError, OSError, TimeoutError) as exc:
            self.failures += 1
            log.debug("shared segments report failed: %s", exc)

    async def drain(self) -> None:
        """Wait for the reports in flight (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
