"""router.hashing against vLLM's own block hasher, byte for byte, and the chain's rules."""

from __future__ import annotations

import random
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils

from router.hashing import (
    DEFAULT_SEED,
    HASH_ALGOS,
    BlockChain,
    HashConfig,
    LoraRef,
    UnknownSeedError,
    block_extra_keys,
    chain_hashes,
    continue_keys,
    event_key,
    hash_block,
    max_cacheable_blocks,
    shared_prefix_blocks,
)


def _vllm_request(tokens: list[int], salt: str | None, lora: LoraRef | None) -> Any:
    """The fields of vllm.v1.request.Request that vLLM's block hasher reads."""
    return SimpleNamespace(
        block_hashes=[],
        num_tokens=len(tokens),
        all_token_ids=tokens,
        mm_features=[],
        lora_request=(
            SimpleNamespace(lora_name=lora.name, lora_path=lora.path) if lora else None
        ),
        cache_salt=salt,
        prompt_embeds=None,
    )


@pytest.fixture
def vllm_seed(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Set vLLM's NONE_HASH for (algo, PYTHONHASHSEED) the way an engine process does."""

    def init(algo: str, seed: str | None) -> Any:
        if seed is None:
            monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        else:
            monkeypatch.setenv("PYTHONHASHSEED", seed)
        fn = get_hash_fn_by_name(algo)
        kv_cache_utils.init_none_hash(fn)
        return fn

    yield init


def _vllm_chain(fn: Any, block_size: int, tokens: list[int], salt: str | None,
                lora: LoraRef | None) -> list[bytes]:
    hasher = kv_cache_utils.get_request_block_hasher(block_size, fn)
    return [bytes(h) for h in hasher(_vllm_request(tokens, salt, lora))]


CASES = [
    (algo, block_size, seed)
    for algo in HASH_ALGOS
    for block_size in (16, 32, 64)
    for seed in ("0", "12345")
] + [("sha256", 16, None), ("sha256_cbor", 32, None)]


@pytest.mark.parametrize(("algo", "block_size", "seed"), CASES)
def test_chain_equals_vllm(vllm_seed: Any, algo: str, block_size: int, seed: str | None) -> None:
    fn = vllm_seed(algo, seed)
    config = HashConfig(algo=algo, block_size=block_size, seed=seed)
    rng = random.Random(f"{algo}-{block_size}-{seed}")
    salts: list[str | None] = [None, "tenant-A", "s" * 128]
    loras: list[LoraRef | None] = [None, LoraRef("sql-lora", "/adapters/sql"), LoraRef("x", "")]
    for trial in range(12):
        tokens = [rng.randrange(0, 200_000) for _ in range(rng.randrange(0, block_size * 6))]
        salt = salts[trial % len(salts)]
        lora = loras[(trial // len(salts)) % len(loras)]
        ours = chain_hashes(config, tokens, cache_salt=salt, lora=lora)
        theirs = _vllm_chain(fn, block_size, tokens, salt, lora)
        assert ours == theirs, (trial, salt, lora)
        assert len(ours) == len(tokens) // block_size
        assert [event_key(k) for k in ours] == [
            kv_cache_utils.maybe_convert_block_hash(kv_cache_utils.BlockHash(k)) for k in theirs
        ]


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_root_hash_is_vllm_none_hash(vllm_seed: Any, algo: str) -> None:
    vllm_seed(algo, "0")
    assert HashConfig(algo=algo, seed="0").root_hash() == bytes(kv_cache_utils.NONE_HASH)


def test_unset_seed_sha256_uses_fixed_default(vllm_seed: Any) -> None:
    vllm_seed("sha256", None)
    assert kv_cache_utils.get_none_hash_seed() == DEFAULT_SEED == "vllm-none-hash"
    assert HashConfig("sha256").root_hash() == bytes(kv_cache_utils.NONE_HASH)


def test_unset_seed_xxhash_is_random_in_vllm_and_refused_here(vllm_seed: Any) -> None:
    vllm_seed("xxhash", None)
    first = bytes(kv_cache_utils.NONE_HASH)
    vllm_seed("xxhash", None)
    assert bytes(kv_cache_utils.NONE_HASH) != first  # vLLM: new random root per process
    config = HashConfig("xxhash_cbor", block_size=16)
    with pytest.raises(UnknownSeedError, match=r"'xxhash_cbor' without a seed.*PYTHONHASHSEED"):
        config.root_hash()
    with pytest.raises(UnknownSeedError):
        chain_hashes(config, list(range(32)))


def test_hash_block_uses_vllm_hash_block_tokens(vllm_seed: Any) -> None:
    fn = vllm_seed("sha256_cbor", "7")
    config = HashConfig("sha256_cbor", block_size=4, seed="7")
    extra = block_extra_keys(0, 4, lora=LoraRef("a", "/p"), cache_salt="salt")
    assert extra == (("lora", "a", "/p"), ("cache_salt", "salt"))
    first = hash_block(config, None, [1, 2, 3, 4], extra)
    assert first == bytes(kv_cache_utils.hash_block_tokens(fn, None, [1, 2, 3, 4], extra))
    second = hash_block(config, first, [5, 6, 7, 8], None)
    assert second == bytes(kv_cache_utils.hash_block_tokens(
        fn, kv_cache_utils.BlockHash(first), [5, 6, 7, 8], None))


def test_extra_keys_none_when_empty() -> None:
    assert block_extra_keys(0, 16) is None
    assert block_extra_keys(16, 32, cache_salt="only-block-0") is None


def test_max_cacheable_blocks_recomputes_last_token() -> None:
    assert max_cacheable_blocks(100, 32) == 3
    assert max_cacheable_blocks(64, 32) == 1
    assert max_cacheable_blocks(0, 32) == 0


# -- chain rules (property tests) ----------------------------------------------

CONFIG = HashConfig("sha256", block_size=4, seed="0")
token_lists = st.lists(st.integers(min_value=0, max_value=50_000), min_size=4, max_size=40)


@settings(max_examples=60, deadline=None, database=None)
@given(tokens=token_lists, data=st.data())
def test_changed_token_changes_its_block_and_all_later(tokens: list[int], data: Any) -> None:
    pos = data.draw(st.integers(min_value=0, max_value=len(tokens) - 1))
    changed = list(tokens)
    changed[pos] = tokens[pos] + 1
    a, b = chain_hashes(CONFIG, tokens), chain_hashes(CONFIG, changed)
    block = pos // CONFIG.block_size
    assert a[:block] == b[:block]
    assert all(x != y for x, y in zip(a[block:], b[block:], strict=True))
    assert shared_prefix_blocks(tokens, changed, CONFIG.block_size) == block


@settings(max_examples=40, deadline=None, database=None)
@given(tokens=token_lists, salt=st.text(min_size=1, max_size=20))
def test_salt_changes_every_key(tokens: list[int], salt: str) -> None:
    # The salt is an extra key of block 0 only, but every later key chains from block 0.
    plain = chain_hashes(CONFIG, tokens)
    salted = chain_hashes(CONFIG, tokens, cache_salt=salt)
    assert len(plain) == len(salted) >= 1
    assert all(x != y for x, y in zip(plain, salted, strict=True))


@settings(max_examples=40, deadline=None, database=None)
@given(tokens=token_lists, cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=5))
def test_extend_incrementally_equals_one_go(tokens: list[int], cuts: list[int]) -> None:
    chain = BlockChain(CONFIG, cache_salt="t")
    added: list[bytes] = []
    start = 0
    for cut in sorted(c for c in cuts if c <= len(tokens)):
        added += chain.extend(tokens[start:cut])
        start = cut
    added += chain.extend(tokens[start:])
    expected = chain_hashes(CONFIG, tokens, cache_salt="t")
    assert chain.keys == expected == added
    assert chain.event_keys() == [event_key(k) for k in expected]


@settings(max_examples=40, deadline=None, database=None)
@given(base=token_lists, tail=st.lists(st.integers(0, 50_000), max_size=20),
       keep=st.integers(min_value=0, max_value=40))
def test_fork_reuses_shared_keys(base: list[int], tail: list[int], keep: int) -> None:
    parent = BlockChain(CONFIG, tokens=list(base))
    other = base[: min(keep, len(base))] + tail
    child = parent.fork(other)
    assert child.keys == chain_hashes(CONFIG, other)
    shared = shared_prefix_blocks(base, other, CONFIG.block_size)
    assert all(child.keys[i] is parent.keys[i] for i in range(min(shared, len(child.keys))))


@pytest.mark.parametrize("algo", sorted(HASH_ALGOS))
@pytest.mark.parametrize("native_on", [True, False])
def test_continue_keys_are_the_chains_keys_past_a_cut(
        algo: str, native_on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from router import native

    if not native_on:
        monkeypatch.setattr(native, "_keys", None)
    config = HashConfig(algo=algo, block_size=16, seed="5")
    rng = random.Random(algo)
    tokens = [rng.randrange(150_000) for _ in range(16 * 30 + 7)]
    whole = chain_hashes(config, tokens, cache_salt="s")
    for cut in (1, 2, 17, 29):
        # From the last key before the cut, reading nothing before it: the same keys,
        # the trailing partial block left out.
        assert continue_keys(config, whole[cut - 1], tokens, cut * 16, len(tokens)) == whole[cut:]
        assert continue_keys(config, whole[cut - 1], tokens, cut * 16, cut * 16 + 40) == \
            whole[cut:cut + 2]
    for start in (0, 8, 33):  # block 0 carries the salt; a cut inside a block is no cut
        with pytest.raises(ValueError, match="block boundary"):
            continue_keys(config, whole[0], tokens, start, len(tokens))


def test_event_key_is_last_eight_bytes() -> None:
    digest = bytes(range(32))
    assert event_key(digest) == int.from_bytes(digest[-8:], "big")


def test_numpy_ids_are_keyed_as_python_ints_unless_declared_checked() -> None:
    # numpy integers pickle differently from Python ints: unchecked ids are converted,
    # which is what makes them key as vLLM keys the same ids (Python ints).
    import numpy as np

    ids = list(range(3 * CONFIG.block_size))
    expected = chain_hashes(CONFIG, ids)
    assert BlockChain(CONFIG).extend(np.array(ids, dtype=np.int64).tolist()) == expected
    assert BlockChain(CONFIG).extend(list(np.array(ids, dtype=np.int64))) == expected
    assert BlockChain(CONFIG).extend(ids, checked=True) == expected
    # The conversion is what the unchecked path is for: skipping it changes the keys.
    assert BlockChain(CONFIG).extend(list(np.array(ids, dtype=np.int64)), checked=True) != expected
