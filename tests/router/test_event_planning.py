"""KV-event batches -> index writes, sans I/O: the planner's ops applied to both backends.

No sockets: each batch goes to `BatchPlanner.plan`, and its ops to the index as the
transport sends them (`index.apply`), so the lookups show what the replica holds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec

from router.events.planning import BatchPlan, BatchPlanner, ProbeSeen
from router.events.sequence import Apply, Clear, SequenceTracker
from router.events.stats import StreamStats
from router.handshake import compare, make_probe
from router.hashing import BlockChain, HashConfig, LoraRef
from router.index import IndexOp, ObservedBlocks, PrefixIndex
from router.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    encode_batch,
    encoded_ids,
)

MODEL = "tiny"


def stored(keys: Sequence[int], parent: int | None = None, *, tokens: Sequence[int] = (),
           block_size: int = 4, lora: str | None = None, medium: str = "GPU",
           extra_keys: list[list[Any] | None] | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=list(keys), parent_block_hash=parent,
        token_ids=encoded_ids(list(tokens) or [0] * (block_size * len(keys))),
        block_size=block_size,
        lora_id=1 if lora else None, medium=medium, lora_name=lora, extra_keys=extra_keys,
    )


def removed(keys: Sequence[int]) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(keys), medium="GPU")


def batch(*events: KVEvent) -> EventBatch:
    return EventBatch(ts=time.time(), events=list(events))


class Replica:
    """One replica's planner, its batches applied to `index` as the transport does."""

    def __init__(self, index: PrefixIndex, replica_id: str = "r1", **kwargs: Any) -> None:
        self.index = index
        self.replica_id = replica_id
        self.stats = StreamStats()
        self.planner = BatchPlanner(replica_id, MODEL, self.stats, **kwargs)

    async def publish(self, *events: KVEvent) -> BatchPlan:
        plan = self.planner.plan(batch(*events))
        await self.index.apply(self.replica_id, plan.ops)
        return plan


async def test_stored_removed_and_cleared_follow_the_replica(index: PrefixIndex) -> None:
    replica = Replica(index)
    applied = (await replica.publish(stored([1, 2, 3]))).applied
    applied += (await replica.publish(stored([4], parent=3))).applied
    assert await index.lookup(MODEL, [1, 2, 3, 4]) == {"r1": 4}
    plan = await replica.publish(removed([4]), removed([3]))
    # vLLM sends one BlockRemoved per evicted block: one index write for the run.
    assert plan.ops == [IndexOp("remove", MODEL, (4, 3))]
    assert await index.lookup(MODEL, [1, 2, 3, 4]) == {"r1": 2}
    plan2 = await replica.publish(AllBlocksCleared(), stored([7]))
    assert [op.kind for op in plan2.ops] == ["clear", "add"]
    assert await index.lookup(MODEL, [1, 2]) == {}
    assert await index.lookup(MODEL, [7]) == {"r1": 1}
    assert applied + plan.applied + plan2.applied == 6


async def test_an_add_joins_the_last_only_as_a_root_or_its_continuation(
    index: PrefixIndex,
) -> None:
    plan = await Replica(index).publish(stored([1, 2]), stored([3], parent=2), stored([9]),
                                        stored([5], parent=4))
    # The add behind another parent keeps it, for the index to check that r1 holds it.
    assert plan.ops == [IndexOp("add", MODEL, (1, 2, 3, 9)),
                        IndexOp("add", MODEL, (5,), parent=4)]
    assert await index.lookup(MODEL, [1, 2, 3]) == {"r1": 3}


async def test_lora_blocks_live_in_their_own_scope_and_are_removed_there(
    index: PrefixIndex,
) -> None:
    replica = Replica(index)
    await replica.publish(stored([1, 2], lora="sql"), stored([5, 6]))
    assert await index.lookup(f"{MODEL}@sql", [1, 2]) == {"r1": 2}
    assert await index.lookup(MODEL, [1, 2]) == {}
    assert await index.lookup(MODEL, [5, 6]) == {"r1": 2}
    await replica.publish(removed([2]), removed([6]))
    assert await index.lookup(f"{MODEL}@sql", [1, 2]) == {"r1": 1}
    assert await index.lookup(MODEL, [5, 6]) == {"r1": 1}


async def test_events_on_another_medium_are_ignored(index: PrefixIndex) -> None:
    replica = Replica(index)
    plan = await replica.publish(stored([1], medium="CPU"), stored([2]))
    assert (plan.applied, replica.stats.events_ignored) == (1, 1)
    assert await index.lookup(MODEL, [1]) == {}


async def test_a_run_of_removals_is_one_write_broken_only_where_the_order_needs(
    index: PrefixIndex,
) -> None:
    replica = Replica(index)
    await replica.publish(stored(range(1, 9)))
    as_digest = (8).to_bytes(32, "big")  # a raw digest: its last 8 bytes are the key
    plan = await replica.publish(
        removed([8]), BlockRemoved(block_hashes=[as_digest], medium="GPU"),
        BlockRemoved(block_hashes=[7], medium="CPU"),  # another medium: skipped, not a break
        removed([7, 6]), removed([5]), stored([20]), removed([4]))
    assert plan.ops == [IndexOp("remove", MODEL, (8, 8, 7, 6, 5)), IndexOp("add", MODEL, (20,)),
                        IndexOp("remove", MODEL, (4,))]
    assert (plan.applied, replica.stats.events_ignored) == (6, 1)
    assert await index.lookup(MODEL, list(range(1, 9))) == {"r1": 3}
    assert await index.lookup(MODEL, [20]) == {"r1": 1}


async def test_clear_on_one_replica_leaves_the_others(index: PrefixIndex) -> None:
    r1, r2 = Replica(index, "r1"), Replica(index, "r2")
    await r1.publish(stored([1, 2]))
    await r2.publish(stored([1, 2, 3]))
    assert await index.lookup(MODEL, [1, 2, 3]) == {"r1": 2, "r2": 3}
    await r1.publish(AllBlocksCleared())
    assert await index.lookup(MODEL, [1, 2, 3]) == {"r2": 3}


async def test_a_store_lost_to_a_bad_payload_leaves_a_hole_the_lookup_sees(
    index: PrefixIndex,
) -> None:
    chain = list(range(1, 41))
    stats = StreamStats()
    tracker = SequenceTracker("r1", stats, has_replay=True)
    replica = Replica(index)
    payloads = [encode_batch(batch(stored(chain[:10]))),
                # The batch storing blocks 10..19 arrives unreadable: its seq counts, its
                # blocks are lost, and the next batch continues the chain from block 19.
                b"\x93not msgpack at all",
                encode_batch(batch(stored(chain[20:], parent=chain[19])))]
    for seq, payload in enumerate(payloads):
        for step in tracker.receive(seq, payload).steps:
            if isinstance(step, Apply) and step.batch is not None:
                await index.apply("r1", replica.planner.plan(step.batch).ops)
    assert stats.decode_errors == 1
    # The bisecting lookup (the default) gives the run up to the hole, as a walk does.
    assert await index.lookup(MODEL, chain) == {"r1": 10}


async def test_rekey_indexes_a_differently_seeded_replica_under_the_gateways_keys(
    index: PrefixIndex,
) -> None:
    gateway = HashConfig("sha256", block_size=4)
    seeded = HashConfig("sha256", block_size=4, seed="other-seed")
    tokens = list(range(100, 112))  # 3 blocks
    lora = LoraRef("sql", "/adapters/sql")
    theirs = BlockChain(seeded, cache_salt="tenant-A", tokens=tokens).event_keys()
    ours = BlockChain(gateway, cache_salt="tenant-A", tokens=tokens).event_keys()
    theirs_lora = BlockChain(seeded, lora=lora, tokens=tokens[:8]).event_keys()
    ours_lora = BlockChain(gateway, lora=lora, tokens=tokens[:8]).event_keys()
    assert not set(theirs) & set(ours)
    replica = Replica(index, rekey=gateway, lora_paths={"sql": "/adapters/sql"})
    # Two events along one chain: the second's parent must map to our digest.
    await replica.publish(stored(theirs[:2], tokens=tokens[:8], extra_keys=[["tenant-A"], None]))
    await replica.publish(stored(theirs[2:], parent=theirs[1], tokens=tokens[8:]))
    await replica.publish(
        stored(theirs_lora, tokens=tokens[:8], lora="sql", extra_keys=[["sql"], ["sql"]]))
    assert await index.lookup(MODEL, ours) == {"r1": 3}
    assert await index.lookup(MODEL, theirs) == {}
    assert await index.lookup(f"{MODEL}@sql", ours_lora) == {"r1": 2}
    await replica.publish(removed([theirs[2]]), removed([theirs_lora[1]]))
    assert await index.lookup(MODEL, ours) == {"r1": 2}
    assert await index.lookup(f"{MODEL}@sql", ours_lora) == {"r1": 1}
    # A block whose parent was never seen, and another block size: skipped, counted.
    await replica.publish(stored([555], parent=999, tokens=[1, 2, 3, 4]))
    await replica.publish(stored([556], tokens=[1] * 8, block_size=8))
    assert (replica.stats.rekey_misses, replica.stats.rekey_unsupported) == (1, 1)


async def test_a_probe_is_kept_for_the_handshake_and_never_indexed(index: PrefixIndex) -> None:
    salt = "cacheroute-probe-0123"
    tokens = list(range(50, 58))
    replica = Replica(index)
    plans = [await replica.publish(stored([1, 2], tokens=tokens, extra_keys=[[salt], None])),
             await replica.publish(stored([3], parent=2)),  # decode filled a block under it
             await replica.publish(stored([5], extra_keys=[["tenant-salt"]]), removed([3]))]
    assert plans[0].probes == [ProbeSeen(salt, 4, (1, 2), tuple(tokens), rekeyed=False)]
    assert [p.probes for p in plans[1:]] == [[], []]
    assert await index.lookup(MODEL, [1, 2, 3]) == {}
    assert await index.lookup(MODEL, [5]) == {"r1": 1}
    assert replica.stats.probes == 2
    assert sum(p.applied for p in plans) == 4


async def test_unreadable_token_ids_leave_the_blocks_indexed_and_are_read_nowhere_else(
    index: PrefixIndex,
) -> None:
    # Token ids are decoded only where read (the handshake's probes, re-keying): a
    # stored event whose ids are not a list of ints still says which blocks the replica
    # holds; a probe or a re-keyed run it carries is skipped and counted.
    bad = msgspec.Raw(msgspec.msgpack.encode(["not", "ids"]))
    replica = Replica(index)
    await replica.publish(msgspec.structs.replace(stored([1, 2]), token_ids=bad))
    assert await index.lookup(MODEL, [1, 2]) == {"r1": 2}
    plan = await replica.publish(msgspec.structs.replace(
        stored([7], extra_keys=[["cacheroute-probe-0123"]]), token_ids=bad))
    assert plan.probes == [] and replica.stats.decode_errors == 1
    rekeying = Replica(index, "r2", rekey=HashConfig("sha256", block_size=4, seed="x"))
    await rekeying.publish(msgspec.structs.replace(stored([3]), token_ids=bad))
    assert rekeying.stats.rekey_unsupported == 1 and await index.lookup(MODEL, [3]) == {}


async def test_auto_rekey_indexes_an_agreeing_replica_as_it_is(index: PrefixIndex) -> None:
    config = HashConfig("sha256", block_size=4, seed="0")
    tokens = list(range(200, 212))
    keys = BlockChain(config, tokens=tokens).event_keys()
    replica = Replica(index, rekey=config, rekey_mode="auto")
    await replica.publish(stored(keys[:2], tokens=tokens[:8]))
    # Parent stored before we subscribed: passthrough indexes it all the same.
    await replica.publish(stored([777], parent=999))
    await replica.publish(stored(keys[2:], parent=keys[1], tokens=tokens[8:]))
    assert replica.stats.key_check == "agree" and not replica.planner.rekeying
    assert await index.lookup(MODEL, keys) == {"r1": 3}
    assert await index.lookup(MODEL, [777]) == {"r1": 1}
    assert replica.stats.rekey_misses == 0
    await replica.publish(removed([keys[2]]))
    assert await index.lookup(MODEL, keys) == {"r1": 2}


async def test_auto_rekey_turns_on_for_a_differing_replica_and_marks_its_probes(
    index: PrefixIndex,
) -> None:
    gateway = HashConfig("sha256", block_size=4, seed="0")
    seeded = HashConfig("sha256", block_size=4, seed="1")
    tokens = list(range(300, 312))
    theirs = BlockChain(seeded, tokens=tokens).event_keys()
    ours = BlockChain(gateway, tokens=tokens).event_keys()
    probe = make_probe(4, vocab_size=500)
    probe_keys = BlockChain(seeded, cache_salt=probe.cache_salt,
                            tokens=list(probe.token_ids)).event_keys()
    replica = Replica(index, rekey=gateway, rekey_mode="auto")
    assert not replica.planner.rekeying  # undecided: nothing compared yet
    await replica.publish(stored(theirs[:2], tokens=tokens[:8]))
    await replica.publish(stored(theirs[2:], parent=theirs[1], tokens=tokens[8:]))
    plan = await replica.publish(stored(probe_keys, tokens=probe.token_ids[:8],
                                        extra_keys=[[probe.cache_salt], None]))
    assert replica.stats.key_check == "differ" and replica.planner.rekeying
    assert await index.lookup(MODEL, ours) == {"r1": 3}
    assert await index.lookup(MODEL, theirs) == {}
    [seen] = plan.probes
    assert seen.rekeyed and seen.keys == tuple(probe_keys)
    # What the transport stores with put_probe, and the handshake then reads.
    observed = ObservedBlocks(seen.block_size, seen.keys, seen.token_ids, replica="r1",
                              rekeyed=seen.rekeyed)
    result = compare(probe, gateway, observed)
    assert (result.verified, result.mismatch, result.rekeyed) == (False, "hash_seed", True)
    assert result.routable_by_prefix
    await replica.publish(removed([theirs[2]]))
    assert await index.lookup(MODEL, ours) == {"r1": 2}


async def test_auto_rekey_compares_again_after_the_replica_restarts(index: PrefixIndex) -> None:
    gateway = HashConfig("sha256", block_size=4, seed="0")
    tokens = list(range(400, 408))
    before = BlockChain(gateway, tokens=tokens).event_keys()
    # Restarted with another PYTHONHASHSEED: its keys no longer agree.
    after = BlockChain(HashConfig("sha256", block_size=4, seed="9"), tokens=tokens).event_keys()
    replica = Replica(index, rekey=gateway, rekey_mode="auto")
    tracker = SequenceTracker("r1", replica.stats, has_replay=False)
    steps: list[Clear | Apply] = []

    async def receive(seq: int, ts: float, *events: KVEvent) -> None:
        """The tracker's steps for one batch, performed as the transport does."""
        for step in tracker.receive(seq, encode_batch(EventBatch(ts, list(events)))).steps:
            steps.append(step)
            if isinstance(step, Clear):
                replica.planner.forget(restart=step.restart)
                await index.clear_replica("r1")
            elif step.batch is not None:
                await index.apply("r1", replica.planner.plan(step.batch).ops)
                tracker.applied(step.seq, step.batch)

    await receive(0, 1.0, stored(before, tokens=tokens))
    await receive(1, 2.0, removed([555]))  # (a restart shows as seq 0 after seq > 0)
    assert replica.stats.key_check == "agree"
    await receive(0, 3.0, stored(after, tokens=tokens))  # seq 0 again
    assert steps[-2:] == [Clear(restart=True), steps[-1]]
    assert replica.stats.restarts == 1
    assert replica.stats.key_check == "differ" and replica.planner.rekeying
    assert await index.lookup(MODEL, before) == {"r1": 2}  # re-keyed into our keys
    assert await index.lookup(MODEL, after) == {}
