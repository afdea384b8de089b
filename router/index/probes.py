"""The probe store: what a replica's KV events said about a hash-handshake probe.

The indexer sees a probe's BlockStored event (router/events/) and keeps it under the
probe's cache salt; the gateway that sent the probe reads it back by that salt
(router/handshake.py) and compares the replica's keys with its own. Both index backends
keep these observations beside their block entries, for a short TTL, never as entries a
lookup could see: `MemoryProbes` for the in-process index, and the msgpack record
`encode_observation` / `decode_observation` that RedisIndex stores under its probe key.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec


@dataclass(frozen=True)
class ObservedBlocks:
    """What a replica's BlockStored event said about the probe's blocks.

    `rekeyed`: the indexer re-keys this replica's blocks with the gateway's settings
    (router.events rekey mode), so its index entries are right even if its keys differ.
    """

    block_size: int
    keys: tuple[int, ...]
    token_ids: tuple[int, ...]
    replica: str = ""
    rekeyed: bool = False


class _ProbeRecord(msgspec.Struct, array_like=True):
    """A stored probe observation, as msgpack (decoded with every field's type checked)."""

    replica: str
    block_size: int
    keys: list[int]
    token_ids: list[int]
    rekeyed: bool


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_ProbeRecord)


def encode_observation(observed: ObservedBlocks) -> bytes:
    """The msgpack record of an observation: [replica, block_size, keys, token_ids, rekeyed]."""
    return _encoder.encode(_ProbeRecord(observed.replica, observed.block_size,
                                        list(observed.keys), list(observed.token_ids),
                                        observed.rekeyed))


def decode_observation(raw: bytes) -> ObservedBlocks:
    """An observation from its msgpack record (msgspec.ValidationError if malformed)."""
    r = _decoder.decode(raw)
    return ObservedBlocks(r.block_size, tuple(r.keys), tuple(r.token_ids), replica=r.replica,
                          rekeyed=r.rekeyed)


class MemoryProbes:
    """Observations by salt, each until its expiry, in process."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._probes: dict[str, tuple[float, ObservedBlocks]] = {}

    def put(self, salt: str, observed: ObservedBlocks, ttl_s: float) -> None:
        """Keep `observed` under `salt` for ttl_s."""
        now = self._clock()
        # Expired observations go on every put: probes are rare, so this stays small.
        for old in [k for k, (exp, _) in self._probes.items() if exp <= now]:
            del self._probes[old]
        self._probes[salt] = (now + ttl_s, observed)

    def get(self, salt: str) -> ObservedBlocks | None:
        """The observation kept under `salt`, or None (never put, or expired)."""
        entry = self._probes.get(salt)
        if entry is None or entry[0] <= self._clock():
            return None
        return entry[1]
