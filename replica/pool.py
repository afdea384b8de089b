"""vLLM v1's KV block pool and its prefix cache, as the simulated replica runs them.

Follows vllm/v1/core/block_pool.py, kv_cache_utils.py (FreeKVCacheBlockQueue) and
single_type_kv_cache_manager.py (full attention, one KV-cache group) so that a sim and a
real replica given the same request sequence cache, hit and evict the same blocks:

- The pool has `num_blocks` blocks; block 0 is vLLM's null block and never holds KV, so
  `num_blocks - 1` are usable (the same count `--num-gpu-blocks-override` gives vLLM).
- Only full blocks are cached, keyed by router.hashing's chained keys. A hit is the run of
  cached keys from block 0 up to the first miss: a missing block implies every later
  block misses too (chained keys). It is capped at (num_tokens - 1) // block_size blocks
  because vLLM always recomputes the last prompt token to get its logits.
- Blocks held by running requests are referenced (ref_cnt); a block with ref_cnt 0 sits
  in the free queue, still cached, until allocation pops it from the head (LRU) and
  evicts its key (BlockRemoved). A hit on a free cached block takes it out of the queue.
- A finished request's blocks are freed in reverse order, so a chain's tail is evicted
  before its head and what stays cached is always a prefix. Uncached blocks go to the
  queue's head (reused first), cached ones to its tail.
- Identical blocks are not de-duplicated: two requests that miss on the same prefix in
  one step both store it (and both announce it), as vLLM does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from router.hashing import BlockChain, HashConfig, LoraRef, block_extra_keys, event_key
from router.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    encoded_ids,
)

# What vLLM's KVCacheManager stamps on BlockStored for a full-attention model's group 0.
KV_CACHE_SPEC_KIND = "full_attention"
GROUP_IDX = 0


class PoolExhaustedError(RuntimeError):
    """More blocks were asked of the pool than it has free (a scheduler bug)."""


@dataclass(eq=False)
class Block:
    """One KV block: its id, how many running requests hold it, and its cache key."""

    block_id: int
    ref_cnt: int = 0
    key: bytes | None = None


class BlockPool:
    """The blocks, the LRU free queue and the key -> cached block map."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (block 0 is vLLM's null block)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the first entry is the next block reused.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        # Duplicates allowed: key -> {block_id: block}, iteration order = insertion order.
        self._cached: dict[bytes, dict[int, Block]] = {}
        self.events: list[KVEvent] = []
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    def usage(self) -> float:
        """vLLM's kv_cache_usage_perc: referenced blocks over usable blocks.

        Cached but unreferenced blocks count as free, so an idle replica reads 0.0.
        """
        return 1.0 - self.num_free / self.usable_blocks

    def num_cached_blocks(self) -> int:
        return sum(len(v) for v in self._cached.values())

    def cached_block(self, key: bytes) -> Block | None:
        blocks = self._cached.get(key)
        return next(iter(blocks.values())) if blocks else None

    def touch(self, blocks: Sequence[Block]) -> None:
        """Reference hit blocks; a free one leaves the free queue (no longer evictable)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[Block]:
        """Pop n blocks from the head of the free queue, evicting any cached key they hold."""
        if n > self.num_free:
            raise PoolExhaustedError(f"cannot get {n} free blocks; {self.num_free} free")
        out: list[Block] = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.key is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: Block) -> None:
        assert block.key is not None
        holders = self._cached.get(block.key)
        if holders is not None and holders.pop(block.block_id, None) is not None:
            if not holders:
                del self._cached[block.key]
            self.evictions += 1
            self.events.append(
                BlockRemoved(block_hashes=[event_key(block.key)], medium=MEDIUM_GPU,
                             group_idx=GROUP_IDX)
            )
        block.key = None

    def insert(self, block: Block, key: bytes) -> None:
        """Make a just-filled block findable under its key."""
        block.key = key
        self._cached.setdefault(key, {})[block.block_id] = block

    def free_blocks(self, ordered: Sequence[Block]) -> None:
        """Drop one reference from each block; `ordered` lists the first to evict first."""
        evict_first: list[int] = []
        evict_last: list[int] = []
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.key is None or not self.enable_caching:
                    evict_first.append(block.block_id)
                else:
                    evict_last.append(block.block_id)
        # Uncached blocks can never be hit, so they are reused first (front of the queue).
        for block_id in reversed(evict_first):
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)
        for block_id in evict_last:
            self._free[block_id] = None

    def reset(self) -> bool:
        """Forget every cached key; refused (False) while any request holds blocks."""
        if self.num_free != self.usable_blocks:
            return False
        self._cached.clear()
        for block in self.blocks:
            block.key = None
        self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events


@dataclass
class SequenceState:
    """What the cache manager needs of a request: its tokens and their block keys."""

    request_id: str
    chain: BlockChain
    num_prompt_tokens: int
    lora_id: int | None = None
    num_computed_tokens: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.chain.tokens

    @property
    def num_tokens(self) -> int:
        return len(self.chain.tokens)


@dataclass
class CacheHit:
    """The cached leading blocks found for a request and the tokens they cover."""

    blocks: list[Block] = field(default_factory=list)
    num_tokens: int = 0


class KVCacheManager:
    """Per-request block tables over one BlockPool (vLLM's KVCacheManager, one group)."""

    def __init__(self, hash_config: HashConfig, num_blocks: int, max_model_len: int,
                 enable_caching: bool = True) -> None:
        self.hash = hash_config
        self.block_size = hash_config.block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, self.block_size, enable_caching)
        self.req_blocks: dict[str, list[Block]] = {}
        self.num_cached_block: dict[str, int] = {}

    def get_computed_blocks(self, seq: SequenceState) -> CacheHit:
        """The longest cached prefix, leaving at least the last token to compute."""
        if not self.enable_caching:
            return CacheHit()
        max_blocks = max(seq.num_tokens - 1, 0) // self.block_size
        hit: list[Block] = []
        for key in seq.chain.keys[:max_blocks]:
            block = self.pool.cached_block(key)
            if block is None:
                break
            hit.append(block)
        return CacheHit(hit, len(hit) * self.block_size)

    def blocks_to_allocate(self, seq: SequenceState, num_tokens: int, hit: CacheHit) -> int:
        """Free blocks needed to give `seq` slots for `num_tokens` tokens."""
        required = -(-num_tokens // self.block_size)
        held = len(self.req_blocks.get(seq.request_id, ()))
        if seq.request_id in self.num_cached_block:
            return max(required - held, 0)
        new = max(required - held - len(hit.blocks), 0)
        # A hit block sitting in the free queue stops being free once touched.
        return new + sum(1 for b in hit.blocks if b.ref_cnt == 0)

    def allocate_slots(self, seq: SequenceState, num_new_tokens: int, hit: CacheHit | None = None,
                       full_sequence_must_fit: bool = False) -> bool:
        """Reserve blocks for `num_new_tokens` more tokens and cache newly full blocks.

        Returns False (changing nothing) when the pool lacks the free blocks; with
        `full_sequence_must_fit` (vLLM's default admission gate) the whole current
        sequence must fit, not just this chunk.
        """
        hit = hit or CacheHit()
        num_computed = seq.num_computed_tokens + hit.num_tokens
        if full_sequence_must_fit:
            full = min(seq.num_tokens, self.max_model_len)
            if self.blocks_to_allocate(seq, full, hit) > self.pool.num_free:
                return False
        need_slots = min(num_computed + num_new_tokens, self.max_model_len)
        if self.blocks_to_allocate(seq, need_slots, hit) > self.pool.num_free:
            return False
        blocks = self.req_blocks.setdefault(seq.request_id, [])
        if seq.request_id not in self.num_cached_block:
            self.pool.touch(hit.blocks)
            blocks.extend(hit.blocks)
            self.num_cached_block[seq.request_id] = len(blocks)
        required = -(-need_slots // self.block_size)
        if required > len(blocks):
            blocks.extend(self.pool.get_new_blocks(required - len(blocks)))
        # Only tokens the step will have computed are cached (never a draft or the
        # just-sampled token), hence the cap at the sequence's current length.
        self._cache_full_blocks(seq, min(num_computed + num_new_tokens, seq.num_tokens))
        return True

    def _cache_full_blocks(self, seq: SequenceState, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        rid = seq.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        num_full = num_tokens // self.block_size
        if num_full <= num_cached:
            return
        blocks = self.req_blocks[rid]
        keys = seq.chain.keys
        for i in range(num_cached, num_full):
            self.pool.insert(blocks[i], keys[i])
        self.num_cached_block[rid] = num_full
        self.pool.events.append(self._stored_event(seq, num_cached, num_full))

    def report_cached_blocks(self, seq: SequenceState, num_blocks: int) -> None:
        """Announce a hit prefix again (vLLM's emit_cached_block_events); changes no state."""
        if num_blocks > 0:
            self.pool.events.append(self._stored_event(seq, 0, num_blocks))

    def _stored_event(self, seq: SequenceState, first: int, end: int) -> BlockStored:
        size = self.block_size
        chain = seq.chain
        extra: list[Any] = []
        for i in range(first, end):
            keys = block_extra_keys(i * size, (i + 1) * size, lora=chain.lora,
                                    cache_salt=chain.cache_salt, mm_items=chain.mm_items)
            extra.append(None if keys is None else _untagged(keys))
        return BlockStored(
            block_hashes=[event_key(k) for k in chain.keys[first:end]],
            parent_block_hash=event_key(chain.keys[first - 1]) if first > 0 else None,
            token_ids=encoded_ids(chain.tokens[first * size:end * size]),
            block_size=size,
            lora_id=seq.lora_id if chain.lora is not None else None,
            medium=MEDIUM_GPU,
            lora_name=chain.lora.name if chain.lora is not None else None,
            extra_keys=extra,
            group_idx=GROUP_IDX,
            kv_cache_spec_kind=KV_CACHE_SPEC_KIND,
        )

    def free(self, seq: SequenceState) -> None:
        """Release a finished or preempted request's blocks, tail first."""
        blocks = self.req_blocks.pop(seq.request_id, [])
        self.num_cached_block.pop(seq.request_id, None)
        self.pool.free_blocks(list(reversed(blocks)))


def _untagged(keys: tuple[Any, ...]) -> list[Any]:
    """vLLM's to_event_extra_keys: drop each key's tag; an mm key keeps (id, offset)."""
    return [list(k[1:]) if k[0] == "mm" else k[1] for k in keys]


def new_sequence(request_id: str, hash_config: HashConfig, prompt: Sequence[int],
                 cache_salt: str | None = None, lora: LoraRef | None = None,
                 lora_id: int | None = None) -> SequenceState:
    """A request's sequence state, its prompt already keyed."""
    chain = BlockChain(hash_config, cache_salt=cache_salt, lora=lora)
    chain.extend(prompt)
    return SequenceState(request_id, chain, len(prompt), lora_id)
