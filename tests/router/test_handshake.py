"""The handshake names the setting that differs between a replica and the gateway."""

from __future__ import annotations

import pytest

from router.handshake import ObservedBlocks, compare, is_probe_salt, make_probe
from router.hashing import HashConfig, chain_hashes, event_key


def observe(config: HashConfig, tokens: tuple[int, ...], salt: str) -> ObservedBlocks:
    """What a replica with `config` would publish for the probe."""
    keys = tuple(event_key(k) for k in chain_hashes(config, tokens, cache_salt=salt))
    n = len(keys) * config.block_size
    return ObservedBlocks(config.block_size, keys, tokens[:n])


GATEWAY = HashConfig(algo="sha256", block_size=32, seed="7")


def test_same_settings_verify() -> None:
    probe = make_probe(32)
    result = compare(probe, GATEWAY, observe(GATEWAY, probe.token_ids, probe.cache_salt))
    assert result.verified and result.mismatch is None


@pytest.mark.parametrize(
    ("replica", "mismatch"),
    [
        (HashConfig(algo="sha256", block_size=64, seed="7"), "block_size"),
        (HashConfig(algo="sha256_cbor", block_size=32, seed="7"), "hash_algo"),
        (HashConfig(algo="xxhash", block_size=32, seed="7"), "hash_algo"),
        (HashConfig(algo="sha256", block_size=32, seed="8"), "hash_seed"),
        (HashConfig(algo="sha256", block_size=32, seed=None), "hash_seed"),
    ],
)
def test_mismatch_names_the_setting(replica: HashConfig, mismatch: str) -> None:
    probe = make_probe(32, blocks=3)
    result = compare(probe, GATEWAY, observe(replica, probe.token_ids, probe.cache_salt))
    assert not result.verified
    assert result.mismatch == mismatch
    assert result.detail


def test_probes_are_unique_and_recognisable() -> None:
    a, b = make_probe(32), make_probe(32)
    assert a.cache_salt != b.cache_salt
    assert is_probe_salt(a.cache_salt) and not is_probe_salt("tenant-salt")
    assert len(a.token_ids) == 2 * 32 + 1
