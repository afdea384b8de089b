"""What one KV-event batch means for the index, sans I/O: events in, IndexOps out.

`BatchPlanner.plan(batch)` turns a decoded batch into the index writes it amounts to
(`IndexOp`s, in order, consecutive ones merged) and the handshake probes it carried.
It keeps what must be remembered between batches; the sequence tracker (sequence.py)
says when to forget it (`forget`: the replica was cleared or restarted).

Each add names the parent of its first block (the event's parent_block_hash, re-keyed
if need be), so the index can tell a run stored behind a hole (a batch lost to a decode
error, or stored before we subscribed) and keep its bisecting lookup exact
(router/index/).

BlockRemoved carries no LoRA name, so the scope ("model@lora") of each LoRA block is
remembered per replica until it is removed; base-model blocks need no bookkeeping.

Rekey mode, for a replica whose keys differ from the gateway's (another seed, algorithm
or hash function): the planner recomputes each stored block's key with the gateway's
`HashConfig` from the event's token ids, and keeps a replica-key -> gateway-key map so
BlockRemoved still applies. Supported: the same block size, cache salts and LoRA
adapters whose paths are given (`lora_paths`, since events carry only the name).
Not supported, counted in `stats.rekey_unsupported` and skipped: a different block size
(the gateway's blocks would straddle the replica's, and a gateway block is held only if
every replica block it overlaps is held: regroup tokens along the chain), multimodal
and prompt-embeds extra keys. A stored block whose parent was never seen (it was stored
before we subscribed) cannot be rekeyed either: `stats.rekey_misses`.
With rekey_mode "auto" the planner first compares one root block's key with the
gateway's (`stats.key_check`) and re-keys only if they differ; until then, and for good
if they agree, it indexes the replica's keys as they are.

Hash-handshake probes (router/handshake.py): a BlockStored whose block-0 salt is a
probe's is not indexed (nor are blocks stored under it); the replica's keys and tokens
for it are returned as `ProbeSeen`, for `index.put_probe`, where the gateway that sent
the probe reads them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from router.events.stats import StreamStats
from router.handshake import is_probe_salt
from router.hashing import HashConfig, LoraRef, block_extra_keys, event_key, hash_block
from router.index import IndexOp
from router.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    block_key_int,
    stored_token_ids,
)

log = logging.getLogger(__name__)

# Probe chains remembered per stream; past this the set starts over (probes are rare).
_MAX_PROBE_BLOCKS = 10_000

RekeyMode = Literal["always", "auto"]
# vLLM reports "GPU" even on CPU. A block held only on another medium (an offload tier)
# must be loaded back before it saves a prefill, so such events are ignored unless asked.
DEFAULT_MEDIA: frozenset[str | None] = frozenset({"GPU", None})


@dataclass
class _Held:
    """Where one replica block lives in the index, when that is not (model, same key)."""

    key: int
    scope: str
    digest: bytes | None = None  # the gateway's full digest: the parent of the next block


@dataclass(frozen=True)
class ProbeSeen:
    """A handshake probe's blocks as the replica stored them, for `index.put_probe`.

    `rekeyed`: the replica's blocks are indexed under the gateway's keys (rekey mode).
    """

    salt: str
    block_size: int
    keys: tuple[int, ...]
    token_ids: tuple[int, ...]
    rekeyed: bool = False


@dataclass
class BatchPlan:
    """A batch's index writes in order, the probes it carried, and its events that counted."""

    ops: list[IndexOp] = field(default_factory=list)
    probes: list[ProbeSeen] = field(default_factory=list)
    applied: int = 0
    # The last op's keys while it can still grow: vLLM sends one BlockRemoved per
    # evicted block, and rebuilding a tuple per event made a batch of n removals cost
    # n^2/2 copies (512 evictions: 131k).
    _open: list[int] | None = field(default=None, repr=False)

    def push(self, kind: Literal["add", "remove"], scope: str, keys: Sequence[int],
             parent: int | None = None) -> None:
        # Consecutive events of one kind and scope become one index write; order across
        # kinds is kept. An add keeps its parent (the index checks that the replica
        # holds it), so it joins the last add only as a chain root or that add's
        # continuation.
        last = self.ops[-1] if self.ops else None
        if last is not None and self._open is not None and last.kind == kind and \
                last.scope == scope and (kind == "remove" or parent is None or
                                         (bool(self._open) and parent == self._open[-1])):
            self._open.extend(keys)
            return
        self.close()
        self.ops.append(IndexOp(kind, scope, (), parent))
        self._open = list(keys)

    def append(self, op: IndexOp) -> None:
        """An op that never merges with its neighbours (a clear)."""
        self.close()
        self.ops.append(op)

    def close(self) -> BatchPlan:
        """Seal the last op's keys (plan() does; call it after pushing by hand)."""
        if self._open is not None:
            # Built directly: dataclasses.replace cost ~3 us, once per op of every batch.
            last = self.ops[-1]
            self.ops[-1] = IndexOp(last.kind, last.scope, tuple(self._open), last.parent)
            self._open = None
        return self


class BatchPlanner:
    """One replica's batches -> index writes, with the state that needs across batches.

    `model` is the index scope of the replica's base-model blocks (LoRA blocks go under
    "model@lora"). `rekey`: the gateway's HashConfig for this replica, to index its
    blocks under the gateway's keys; with `rekey_mode` "always" every block is re-keyed,
    with "auto" only once the replica's first root block shows its keys differ (see
    `_decide_keys`). `lora_paths`: adapter name -> path, needed to rekey LoRA blocks.
    Events on a medium outside `media` are ignored. Counters go to `stats`.
    """

    def __init__(
        self,
        replica_id: str,
        model: str,
        stats: StreamStats,
        *,
        rekey: HashConfig | None = None,
        rekey_mode: RekeyMode = "always",
        lora_paths: Mapping[str, str] | None = None,
        media: frozenset[str | None] = DEFAULT_MEDIA,
    ) -> None:
        if rekey is not None:
            rekey.check_reproducible()
        if rekey_mode not in ("always", "auto"):
            raise ValueError(f"rekey_mode must be 'always' or 'auto', got {rekey_mode!r}")
        self.replica_id = replica_id
        self.model = model
        self.stats = stats
        self._rekey = rekey
        self._rekey_mode = rekey_mode
        self._lora_paths = dict(lora_paths or {})
        self._media = media
        # Blocks of handshake probe chains, so blocks stored under them are not indexed.
        self._probe_blocks: set[int] = set()
        self._held: dict[int, _Held] = {}

    @property
    def rekeying(self) -> bool:
        """Whether the replica's blocks are re-keyed with the gateway's settings."""
        if self._rekey is None:
            return False
        return self._rekey_mode == "always" or self.stats.key_check == "differ"

    def forget(self, *, restart: bool = False) -> None:
        """The replica's entries were cleared; after a restart, compare its keys again."""
        self._held.clear()
        # A restarted replica may come back with other settings.
        if restart and self._rekey_mode == "auto":
            self.stats.key_check = None

    def plan(self, batch: EventBatch) -> BatchPlan:
        """The index calls a batch's events amount to, updating the held-block map."""
        plan = BatchPlan()
        events = batch.events
        i, n = 0, len(events)
        while i < n:
            event = events[i]
            i += 1
            if type(event) is BlockRemoved and self._plain_removals() and \
                    event.medium in self._media:
                # vLLM sends one BlockRemoved per evicted block: a full cache's batch is
                # hundreds in a row. The common case (base-model blocks under the
                # replica's own keys) takes the whole run in one pass.
                keys = [h if type(h) is int else block_key_int(h) for h in event.block_hashes]
                while i < n and type(nxt := events[i]) is BlockRemoved and \
                        nxt.medium in self._media:
                    hashes = nxt.block_hashes
                    if len(hashes) == 1 and type(hashes[0]) is int:
                        keys.append(hashes[0])
                    else:
                        keys.extend(h if type(h) is int else block_key_int(h) for h in hashes)
                    plan.applied += 1
                    i += 1
                plan.push("remove", self.model, keys)
                plan.applied += 1
            elif isinstance(event, AllBlocksCleared):
                self._held.clear()
                self._probe_blocks.clear()
                plan.append(IndexOp("clear"))
                plan.applied += 1
            elif event.medium not in self._media:
                self.stats.events_ignored += 1
            elif isinstance(event, BlockStored):
                if self._plan_stored(event, plan):
                    plan.applied += 1
            elif isinstance(event, BlockRemoved):
                self._plan_removed(event, plan)
                plan.applied += 1
        plan.close()
        if self._rekey is not None and self.rekeying:
            # Decided once the whole batch is planned (its root block may decide it).
            size = self._rekey.block_size
            plan.probes = [replace(p, rekeyed=p.block_size == size) for p in plan.probes]
        return plan

    def _scope(self, lora_name: str | None) -> str:
        return self.model if not lora_name else f"{self.model}@{lora_name}"

    def _plan_stored(self, event: BlockStored, plan: BatchPlan) -> bool:
        replica_keys = [h if type(h) is int else block_key_int(h) for h in event.block_hashes]
        at_root = event.parent_block_hash is None
        if at_root and self._rekey is not None and self.stats.key_check is None and (
                self._rekey_mode == "auto"):
            self._decide_keys(event, replica_keys)
        if self._plan_probe(event, replica_keys, plan):
            return True
        scope = self._scope(event.lora_name)
        digests = self._rekeyed(event, replica_keys) if self.rekeying else None
        # The parent as the index knows it, so the index can tell a run behind a hole.
        parent_hash = event.parent_block_hash
        parent = None if parent_hash is None else block_key_int(parent_hash)
        if digests is not None:
            keys = [event_key(d) for d in digests]
            if parent is not None:
                held = self._held.get(parent)
                parent = None if held is None else held.key
            for rk, key, digest in zip(replica_keys, keys, digests, strict=True):
                self._held[rk] = _Held(key, scope, digest)
        elif self.rekeying:
            return False
        else:
            # Passthrough: the replica's keys are the gateway's (or, in "auto" before the
            # first comparison, may be: indexing them then costs nothing if they differ).
            keys = replica_keys
            if scope != self.model:
                for rk in replica_keys:
                    self._held[rk] = _Held(rk, scope)
        plan.push("add", scope, keys, parent)
        return True

    def _plan_probe(self, event: BlockStored, replica_keys: list[int], plan: BatchPlan) -> bool:
        """Whether the event is a handshake probe's (then kept for the gateway, not indexed)."""
        parent = event.parent_block_hash
        salt: str | None = None
        if parent is None:
            first = (event.extra_keys or [None])[0] or []
            if not (first and is_probe_salt(first[-1])):
                return False
            salt = str(first[-1])
        elif block_key_int(parent) not in self._probe_blocks:
            return False
        # else: a block stored under a probe (its decode filled it): not indexed either.
        if len(self._probe_blocks) > _MAX_PROBE_BLOCKS:
            self._probe_blocks.clear()
        self._probe_blocks.update(replica_keys)
        self.stats.probes += 1
        if salt is not None:
            try:
                tokens = stored_token_ids(event)
            except EventDecodeError:  # unreadable: the handshake waits for another probe
                self.stats.decode_errors += 1
                return True
            plan.probes.append(ProbeSeen(salt, event.block_size, tuple(replica_keys),
                                          tuple(tokens)))
        return True

    def _decide_keys(self, event: BlockStored, replica_keys: list[int]) -> None:
        """rekey_mode "auto": compare a root block's key with the gateway's, once.

        A root block's key depends only on its tokens, its extra keys and the settings,
        all of which the event carries (or the gateway knows), so one comparison tells
        whether the replica keys blocks as the gateway does. Agree: index its keys as
        they are (nothing to compute, and blocks stored before we subscribed still
        count). Differ: re-key from now on.
        """
        assert self._rekey is not None
        if event.block_size != self._rekey.block_size:
            agree = False
        else:
            digests = self._rekeyed(event, replica_keys[:1], count=False)
            if digests is None:
                return  # extra keys we cannot reproduce: wait for another root block
            agree = event_key(digests[0]) == replica_keys[0]
        self.stats.key_check = "agree" if agree else "differ"
        if agree:
            log.info("replica %s keys blocks as the gateway does: indexing its keys as they are",
                     self.replica_id)
        else:
            log.warning("replica %s keys blocks differently from the gateway's settings "
                        "(block size %d vs %d): %s", self.replica_id, event.block_size,
                        self._rekey.block_size,
                        "re-keying its blocks with the gateway's settings"
                        if event.block_size == self._rekey.block_size else
                        "its blocks cannot be re-keyed (another block size) and are skipped")

    def _plain_removals(self) -> bool:
        """Whether removals need no per-block lookup: no probe in flight, no block held
        under another scope or key."""
        return not self._probe_blocks and not self._held and not self.rekeying

    def _plan_removed(self, event: BlockRemoved, plan: BatchPlan) -> None:
        if self._plain_removals():
            # The common case (base-model blocks indexed under the replica's keys, no
            # probe in flight): nothing to look up per block.
            plan.push("remove", self.model, [h if type(h) is int else block_key_int(h)
                                             for h in event.block_hashes])
            return
        for h in event.block_hashes:
            rk = block_key_int(h)
            if rk in self._probe_blocks:
                self._probe_blocks.discard(rk)
                continue
            held = self._held.pop(rk, None)
            if held is not None:
                plan.push("remove", held.scope, [held.key])
            elif not self.rekeying:
                plan.push("remove", self.model, [rk])
            # In rekey mode an unknown block was never indexed: nothing to remove.

    def _rekeyed(self, event: BlockStored, replica_keys: list[int], *, count: bool = True
                 ) -> list[bytes] | None:
        """The gateway's digests for a stored run of blocks, or None if they cannot be had.

        `count`: add the reason to stats (not for `_decide_keys`' trial run).
        """
        config = self._rekey
        assert config is not None
        size = config.block_size
        try:
            tokens = stored_token_ids(event)
        except EventDecodeError:
            tokens = []  # unreadable: as unsupported as too few
        if event.block_size != size or len(tokens) < size * len(replica_keys):
            if count:
                self.stats.rekey_unsupported += 1
            return None
        parent: bytes | None = None
        at_root = event.parent_block_hash is None
        if not at_root:
            assert event.parent_block_hash is not None
            held = self._held.get(block_key_int(event.parent_block_hash))
            if held is None or held.digest is None:
                if count:
                    self.stats.rekey_misses += 1
                return None
            parent = held.digest
        lora: LoraRef | None = None
        if event.lora_name:
            path = self._lora_paths.get(event.lora_name)
            if path is None:
                if count:
                    self.stats.rekey_unsupported += 1
                return None
            lora = LoraRef(event.lora_name, path)
        extras = event.extra_keys or []
        digests: list[bytes] = []
        for i in range(len(replica_keys)):
            first = at_root and i == 0
            items = list(extras[i] or []) if i < len(extras) else []
            # Events carry extra keys untagged, in vLLM's order: LoRA name, multimodal
            # (identifier, offset) pairs, then the cache salt on block 0.
            if lora is not None and items and items[0] == lora.name:
                items.pop(0)
            salt = items.pop() if first and items and isinstance(items[-1], str) else None
            if items:
                if count:
                    self.stats.rekey_unsupported += 1
                return None
            start = 0 if first else size * (i + 1)  # only "is this block 0" matters
            extra = block_extra_keys(start, start + size, lora=lora, cache_salt=salt)
            parent = hash_block(config, parent, tokens[i * size:(i + 1) * size], extra)
            digests.append(parent)
        return digests

