"""router._keys (C) against the Python path it replaces: the same keys, the same checks.

tests/router/test_hashing.py compares the gateway's keys with vLLM's own hasher, which
with the extension built runs through it; here the two paths of the gateway are compared
with each other, on the edges of every integer encoding, and the fallback is exercised.
"""

from __future__ import annotations

import random
import struct

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router import native
from router.hashing import BlockChain, HashConfig, chain_blocks
from router.request import _TokenIds
from router.routing import ChainCache

# Where pickle and CBOR change encoding: 1/2/4-byte ints, LONG1 from 2**31, CBOR's
# immediate values below 24 and its 8-byte form from 2**32.
EDGES = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
         2**40 + 7, 2**56 - 1, 2**56, 2**63 - 1]


def _python_keys(algo: str, parent: bytes, tokens: list[int], size: int) -> list[bytes]:
    blocks = zip(*[iter(tokens)] * size, strict=False)
    return chain_blocks(algo, parent, blocks, None)


def test_the_extension_is_built_here() -> None:
    # The project's setup builds it; without this a broken build would leave every test
    # below comparing the Python path with itself.
    assert native.AVAILABLE


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 16, 32])
def test_keys_equal_the_python_path_on_every_encoding_edge(algo: str, size: int) -> None:
    rng = random.Random(size)
    for _ in range(60):
        tokens = [rng.choice(EDGES) if rng.random() < 0.4 else rng.randrange(300_000)
                  for _ in range(size * rng.randint(1, 5))]
        parent = rng.randbytes(rng.choice([16, 32]))
        got = native.chain_keys(algo, parent, tokens, 0, len(tokens), size)
        assert got == _python_keys(algo, parent, tokens, size)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=2**63 - 1), min_size=16, max_size=96),
       st.binary(min_size=32, max_size=32), st.sampled_from(["sha256", "sha256_cbor"]))
def test_keys_equal_the_python_path_for_any_ids(ids: list[int], parent: bytes,
                                                algo: str) -> None:
    n = len(ids) - len(ids) % 16
    got = native.chain_keys(algo, parent, ids, 0, n, 16)
    assert got == _python_keys(algo, parent, ids[:n], 16)


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_the_largest_block_and_parent_it_takes_serialize_exactly(algo: str) -> None:
    # 4,096 ids of the widest encoding after a 255-byte parent: the serialization's
    # upper bound, which the extension's buffer must hold.
    tokens = [2**63 - 1 - i for i in range(4096)]
    parent = bytes(range(255))
    assert native.chain_keys(algo, parent, tokens, 0, 4096, 4096) == \
        _python_keys(algo, parent, tokens, 4096)
    assert native.chain_keys(algo, parent, tokens * 2, 0, 8192, 8192) is None  # too long


def test_a_run_inside_the_list_is_keyed_from_its_start() -> None:
    tokens = list(range(1000, 1064))
    parent = b"p" * 32
    whole = _python_keys("sha256", parent, tokens, 16)
    # Blocks 2..3 chained from block 1's key: what BlockChain.extend asks for.
    assert native.chain_keys("sha256", whole[1], tokens, 32, 64, 16) == whole[2:]


@pytest.mark.parametrize("bad", [True, -1, 2**63, 1.0, "7", None])
def test_an_id_it_cannot_encode_leaves_the_python_path_to_decide(bad: object) -> None:
    tokens: list[object] = [5] * 15 + [bad]
    assert native.chain_keys("sha256", b"p" * 32, tokens, 0, 16, 16) is None  # type: ignore[arg-type]
    assert native.checked_ids(tokens) is False


def test_xxhash_algorithms_are_left_to_python() -> None:
    assert native.chain_keys("xxhash", b"p" * 16, [1] * 16, 0, 16, 16) is None


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash"])
def test_block_chain_keys_are_the_same_with_and_without_the_extension(
        algo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(7)
    config = HashConfig(algo=algo, block_size=16, seed="11")
    tokens = [rng.randrange(150_000) for _ in range(16 * 40 + 5)]

    def keys() -> list[bytes]:
        chain = BlockChain(config, cache_salt="tenant-salt")
        for cut in (0, 100, 333, 512, len(tokens)):  # grown in uneven steps
            chain.extend(tokens[len(chain.tokens):cut], checked=True)
        return chain.keys

    with_native = keys()
    monkeypatch.setattr(native, "_keys", None)
    assert keys() == with_native
    assert len(with_native) == 40


def test_checked_ids_agrees_with_msgspec() -> None:
    rng = random.Random(3)
    pool: list[object] = [*EDGES, True, False, -1, -(2**40), 2**63, 2**70, 1.5, "3", None, [1]]
    for _ in range(500):
        ids = [rng.choice(pool) for _ in range(rng.randint(0, 6))]
        try:
            msgspec.convert(ids, _TokenIds)
            expected = True
        except msgspec.ValidationError:
            expected = False
        assert native.checked_ids(ids) is expected, ids


def test_pack_ids_is_little_endian_int64_with_or_without_the_extension(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ids = [0, 1, 2**31, 2**63 - 1, 12345]
    assert native.pack_ids(ids, 4) == struct.pack("<4q", *ids[:4])
    monkeypatch.setattr(native, "_keys", None)
    assert native.pack_ids(ids, 5) == struct.pack("<5q", *ids)


def test_the_chain_cache_answers_the_same_with_and_without_the_extension(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(9)
    config = HashConfig(block_size=16)
    prompt = [rng.randrange(32_000) for _ in range(16 * 64)]
    grown = prompt + [rng.randrange(32_000) for _ in range(16 * 8)]
    fresh = ChainCache()
    with_native = [fresh.event_keys(config, p, "s") for p in (prompt, grown)]
    monkeypatch.setattr(native, "_keys", None)
    fresh = ChainCache()
    assert [fresh.event_keys(config, p, "s") for p in (prompt, grown)] == with_native
    # The second prompt reused the first's 64 blocks and hashed only its 8 new ones.
    assert fresh.reused_blocks == 64 and fresh.hashed_blocks == 72
