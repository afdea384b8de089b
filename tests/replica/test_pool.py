"""The block pool and cache manager against vLLM's block rules, with counts worked by hand."""

from __future__ import annotations

from replica.pool import BlockPool, KVCacheManager, SequenceState, new_sequence
from router.hashing import HashConfig, chain_hashes, event_key
from router.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, stored_token_ids

CFG = HashConfig(block_size=16)


def _run_prefill(kv: KVCacheManager, rid: str, tokens: list[int],
                 salt: str | None = None) -> tuple[SequenceState, int]:
    """Admit a request, compute its whole prompt in one chunk, return (seq, hit tokens)."""
    seq = new_sequence(rid, CFG, tokens, cache_salt=salt)
    hit = kv.get_computed_blocks(seq)
    assert kv.allocate_slots(seq, seq.num_tokens - hit.num_tokens, hit,
                             full_sequence_must_fit=True)
    seq.num_computed_tokens = seq.num_tokens
    return seq, hit.num_tokens


def test_block_zero_is_the_null_block_and_usage_counts_referenced_blocks() -> None:
    pool = BlockPool(num_blocks=11, block_size=16)
    assert pool.num_free == 10
    blocks = pool.get_new_blocks(4)
    assert [b.block_id for b in blocks] == [1, 2, 3, 4]
    assert pool.usage() == 0.4
    pool.free_blocks(list(reversed(blocks)))
    assert pool.usage() == 0.0


def test_hit_is_capped_one_token_short_of_the_prompt() -> None:
    kv = KVCacheManager(CFG, num_blocks=64, max_model_len=512)
    prompt = list(range(64))  # exactly 4 blocks
    seq, hit = _run_prefill(kv, "a", prompt)
    assert hit == 0
    kv.free(seq)
    # (64 - 1) // 16 = 3 blocks: the last prompt token is always recomputed.
    _, hit = _run_prefill(kv, "b", prompt)
    assert hit == 48


def test_hit_stops_at_first_miss_and_partial_blocks_never_cache() -> None:
    kv = KVCacheManager(CFG, num_blocks=64, max_model_len=512)
    seq, _ = _run_prefill(kv, "a", list(range(40)))  # 2 full blocks + 8 tokens
    kv.free(seq)
    assert kv.pool.num_cached_blocks() == 2
    # Same first block, second block differs in its last token: hit = block 0 only.
    other = [*list(range(31)), 999, *list(range(32, 60))]
    _, hit = _run_prefill(kv, "b", other)
    assert hit == 16


def test_eviction_pops_lru_head_and_goes_leaf_first() -> None:
    kv = KVCacheManager(CFG, num_blocks=9, max_model_len=128)  # 8 usable blocks
    a = [1] * 64
    b = [2] * 64
    c = [3] * 64
    for rid, toks in (("a", a), ("b", b)):
        seq, _ = _run_prefill(kv, rid, toks)
        kv.free(seq)
    events = kv.pool.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockStored]
    # Free queue now: b's blocks after a's, each request's tail ahead of its head.
    seq, _ = _run_prefill(kv, "c", [3] * 32)  # needs 2 blocks: evicts a's last two blocks
    removed = [e for e in kv.pool.take_events() if isinstance(e, BlockRemoved)]
    a_keys = [event_key(k) for k in chain_hashes(CFG, a)]
    assert [e.block_hashes for e in removed] == [[a_keys[3]], [a_keys[2]]]
    assert kv.pool.evictions == 2
    kv.free(seq)
    # a still holds its first two blocks: a prefix survived, not a hole.
    _, hit = _run_prefill(kv, "a2", a)
    assert hit == 32
    del c


def test_hit_on_free_block_removes_it_from_the_free_queue() -> None:
    kv = KVCacheManager(CFG, num_blocks=9, max_model_len=128)
    seq, _ = _run_prefill(kv, "a", list(range(64)))
    kv.free(seq)
    assert kv.pool.num_free == 8
    seq2, hit = _run_prefill(kv, "b", list(range(64)))
    assert hit == 48
    # 3 hit blocks touched out of the queue + 1 new block for the recomputed tail.
    assert kv.pool.num_free == 4
    assert all(b.ref_cnt == 1 for b in kv.req_blocks["b"])
    del seq2


def test_block_stored_event_fields_match_vllm() -> None:
    kv = KVCacheManager(CFG, num_blocks=64, max_model_len=512)
    prompt = list(range(100, 140))  # 2 full blocks
    _run_prefill(kv, "a", prompt, salt="tenant-A")
    (event,) = kv.pool.take_events()
    keys = chain_hashes(CFG, prompt, cache_salt="tenant-A")
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [event_key(k) for k in keys]
    assert event.parent_block_hash is None
    assert stored_token_ids(event) == prompt[:32]
    assert event.block_size == 16
    assert event.extra_keys == [["tenant-A"], None]
    assert (event.medium, event.group_idx, event.kv_cache_spec_kind) == ("GPU", 0, "full_attention")
    assert event.lora_id is None and event.lora_name is None


def test_extension_chunk_names_its_parent_and_full_hit_emits_nothing() -> None:
    kv = KVCacheManager(CFG, num_blocks=64, max_model_len=512)
    base = list(range(33))
    seq, _ = _run_prefill(kv, "a", base)
    kv.free(seq)
    kv.pool.take_events()
    seq, hit = _run_prefill(kv, "b", base)  # 2 blocks hit, nothing new fills
    assert hit == 32
    assert kv.pool.take_events() == []
    kv.free(seq)
    longer = base + list(range(500, 520))  # 53 tokens: block 2 fills now
    _run_prefill(kv, "c", longer)
    (event,) = kv.pool.take_events()
    assert isinstance(event, BlockStored)
    keys = chain_hashes(CFG, longer)
    assert event.block_hashes == [event_key(keys[2])]
    assert event.parent_block_hash == event_key(keys[1])


def test_identical_misses_in_one_step_both_store() -> None:
    kv = KVCacheManager(CFG, num_blocks=64, max_model_len=512)
    prompt = list(range(32, 80))
    _run_prefill(kv, "a", prompt)
    _run_prefill(kv, "b", prompt[:])  # a still running: b hits a's blocks
    # b hit 2 blocks of a's 3 ((48 - 1) // 16 = 2) and recomputes the third into a new block.
    events = kv.pool.take_events()
    assert len(events) == 2 and isinstance(events[1], BlockStored)
    assert events[1].block_hashes == [event_key(chain_hashes(CFG, prompt)[2])]
    assert kv.pool.num_cached_blocks() == 4  # the third block is held twice


def test_reset_refused_while_blocks_are_held_then_clears() -> None:
    kv = KVCacheManager(CFG, num_blocks=64, max_model_len=512)
    seq, _ = _run_prefill(kv, "a", list(range(48)))
    assert kv.pool.reset() is False
    kv.free(seq)
    kv.pool.take_events()
    assert kv.pool.reset() is True
    assert kv.pool.take_events() == [AllBlocksCleared()]
    _, hit = _run_prefill(kv, "b", list(range(48)))
    assert hit == 0


def test_admission_needs_the_whole_sequence_to_fit() -> None:
    kv = KVCacheManager(CFG, num_blocks=9, max_model_len=128)  # 8 usable
    _run_prefill(kv, "a", list(range(80)))  # 5 blocks held
    seq = new_sequence("b", CFG, list(range(1000, 1064)))  # needs 4, 3 free
    hit = kv.get_computed_blocks(seq)
    assert not kv.allocate_slots(seq, 16, hit, full_sequence_must_fit=True)
    assert kv.pool.num_free == 3
    assert kv.allocate_slots(seq, 16, hit)  # a 16-token chunk alone would fit
