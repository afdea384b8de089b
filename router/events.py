"""KV-event subscriber: a replica's BlockStored / BlockRemoved stream -> PrefixIndex updates.

vLLM binds a ZMQ PUB socket (and, optionally, a ROUTER for replay) and we connect a SUB.
PUB/SUB drops messages when a subscriber falls behind the high-water mark, and the
sequence number restarts at 0 when the replica restarts, so the index is only as right
as the stream's bookkeeping:

- seq == last + 1: apply the batch.
- seq <= last: a duplicate (replay overlaps), ignored; unless the batch is newer than
  anything seen (its timestamp; seq 0 when there is none to compare), which means the
  replica restarted with an empty cache: clear the replica's entries at once and follow
  the new stream.
- seq > last + 1: a gap. Ask the replay socket for last onwards, with a deadline. If the
  batch it returns under `last` is not the one we applied (another timestamp), the
  replica restarted while we were not listening: clear, and rebuild from its seq 0.
  If the replay is unavailable or does not cover the gap (its buffer rolled over), clear
  the replica and rebuild from new events. Under-claiming is safe (a missed hit); keeping
  blocks the replica evicted would send requests to a replica that must recompute them.
- The connection to the publisher dropped and came back (the ZMQ socket monitor says
  so): the next batch may be a restarted replica's even if its seq follows ours, so it is
  checked through the replay as a gap would be (without replay: clear, follow).
- First contact (and after `mark_stale`, or an index failure): whatever the index holds
  for this replica may be stale, so clear it and replay from 0 to rebuild from the
  replica's buffer.

A payload that fails to decode is counted and skipped; its sequence number still counts
as received (its events are lost, as a dropped message's would be).

Each add names the parent of its first block (the event's parent_block_hash, re-keyed
if need be), so the index can tell a run stored behind a hole (a batch lost to a decode
error, or stored before we subscribed) and keep its bisecting lookup exact
(router/index.py).

BlockRemoved carries no LoRA name, so the scope ("model@lora") of each LoRA block is
remembered per replica until it is removed; base-model blocks need no bookkeeping.

Rekey mode, for a replica whose keys differ from the gateway's (another seed, algorithm
or hash function): the stream recomputes each stored block's key with the gateway's
`HashConfig` from the event's token ids, and keeps a replica-key -> gateway-key map so
BlockRemoved still applies. Supported: the same block size, cache salts and LoRA
adapters whose paths are given (`lora_paths`, since events carry only the name).
Not supported, counted in `stats.rekey_unsupported` and skipped: a different block size
(the gateway's blocks would straddle the replica's, and a gateway block is held only if
every replica block it overlaps is held: regroup tokens along the chain), multimodal
and prompt-embeds extra keys. A stored block whose parent was never seen (it was stored
before we subscribed) cannot be rekeyed either: `stats.rekey_misses`.
With rekey_mode "auto" the stream first compares one root block's key with the
gateway's (`stats.key_check`) and re-keys only if they differ; until then, and for good
if they agree, it indexes the replica's keys as they are.

Hash-handshake probes (router/handshake.py): a BlockStored whose block-0 salt is a
probe's is not indexed (nor are blocks stored under it); the replica's keys and tokens
for it go to `index.put_probe`, where the gateway that sent the probe reads them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from router.handshake import is_probe_salt
from router.hashing import HashConfig, LoraRef, block_extra_keys, event_key, hash_block
from router.index import IndexOp, IndexUnavailable, PrefixIndex
from router.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    block_key_int,
    decode_batch,
    parse_seq,
    seq_bytes,
)

log = logging.getLogger(__name__)

DEFAULT_REPLAY_TIMEOUT_S = 2.0
# A probe's observation is read by the gateway within its handshake deadline (seconds).
DEFAULT_PROBE_TTL_S = 120.0
# Probe chains remembered per stream; past this the set starts over (probes are rare).
_MAX_PROBE_BLOCKS = 10_000

RekeyMode = Literal["always", "auto"]
# vLLM reports "GPU" even on CPU. A block held only on another medium (an offload tier)
# must be loaded back before it saves a prefill, so such events are ignored unless asked.
DEFAULT_MEDIA: frozenset[str | None] = frozenset({"GPU", None})
# vLLM publishes with hwm 100,000; a SUB with a smaller queue would drop what vLLM kept.
_SUB_HWM = 100_000


@dataclass
class StreamStats:
    """Counters of one replica's event stream (plain numbers; metrics are exported elsewhere)."""

    batches: int = 0
    events_applied: int = 0
    events_ignored: int = 0
    duplicates: int = 0
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    restarts: int = 0
    clears: int = 0
    decode_errors: int = 0
    index_errors: int = 0
    rekey_misses: int = 0
    rekey_unsupported: int = 0
    probes: int = 0
    # rekey_mode "auto": None until a root block was compared, then "agree" or "differ".
    key_check: str | None = None
    disconnects: int = 0
    last_seq: int | None = None
    last_event_ts: float | None = None
    last_received_at: float | None = None

    def lag_s(self, now: float | None = None) -> float | None:
        """Seconds between the newest applied batch's replica timestamp and now."""
        if self.last_event_ts is None:
            return None
        return (time.time() if now is None else now) - self.last_event_ts


@dataclass
class _Held:
    """Where one replica block lives in the index, when that is not (model, same key)."""

    key: int
    scope: str
    digest: bytes | None = None  # the gateway's full digest: the parent of the next block


@dataclass(frozen=True)
class _ProbeSeen:
    salt: str
    block_size: int
    keys: tuple[int, ...]
    token_ids: tuple[int, ...]


@dataclass
class _Plan:
    ops: list[IndexOp] = field(default_factory=list)
    probes: list[_ProbeSeen] = field(default_factory=list)
    applied: int = 0

    def push(self, kind: Literal["add", "remove"], scope: str, keys: Sequence[int],
             parent: int | None = None) -> None:
        # Consecutive events of one kind and scope become one index write (vLLM sends
        # one BlockRemoved per evicted block); order across kinds is kept. An add keeps
        # its parent (the index checks that the replica holds it), so it joins the last
        # add only as a chain root or that add's continuation.
        last = self.ops[-1] if self.ops else None
        if last is not None and last.kind == kind and last.scope == scope and (
                kind == "remove" or parent is None or parent == last.keys[-1]):
            self.ops[-1] = IndexOp(kind, scope, last.keys + tuple(keys), last.parent)
        else:
            self.ops.append(IndexOp(kind, scope, tuple(keys), parent))


class ReplayUnavailable(RuntimeError):
    """The replica's replay socket did not answer in time."""


class ReplicaEventStream:
    """One replica's KV-event subscription, applied to the index by an asyncio task.

    `model` is the index scope of the replica's base-model blocks (LoRA blocks go under
    "model@lora"). `rekey`: the gateway's HashConfig for this replica, to index its
    blocks under the gateway's keys; with `rekey_mode` "always" every block is re-keyed,
    with "auto" only once the replica's first root block shows its keys differ (see
    `_decide_keys`). `lora_paths`: adapter name -> path, needed to rekey LoRA blocks.
    Handshake probes (block-0 salt `is_probe_salt`) are never indexed: they are stored
    with `index.put_probe` for `probe_ttl_s`, under the replica's own keys.
    `start()` connects and returns; `stop()` closes; `stats` is read at any time.
    """

    def __init__(
        self,
        replica_id: str,
        endpoint: str,
        replay_endpoint: str | None,
        index: PrefixIndex,
        model: str,
        *,
        topic: str = "",
        rekey: HashConfig | None = None,
        rekey_mode: RekeyMode = "always",
        lora_paths: Mapping[str, str] | None = None,
        media: frozenset[str | None] = DEFAULT_MEDIA,
        replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
        probe_ttl_s: float = DEFAULT_PROBE_TTL_S,
        context: zmq.asyncio.Context | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if rekey is not None:
            rekey.check_reproducible()
        if rekey_mode not in ("always", "auto"):
            raise ValueError(f"rekey_mode must be 'always' or 'auto', got {rekey_mode!r}")
        self.replica_id = replica_id
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.model = model
        self.stats = StreamStats()
        self._index = index
        self._topic = topic.encode()
        self._rekey = rekey
        self._rekey_mode = rekey_mode
        self._probe_ttl_s = probe_ttl_s
        # Blocks of handshake probe chains, so blocks stored under them are not indexed.
        self._probe_blocks: set[int] = set()
        self._lora_paths = dict(lora_paths or {})
        self._media = media
        self._replay_timeout_s = replay_timeout_s
        self._own_context = context is None
        self._ctx = context or zmq.asyncio.Context()
        self._clock = clock
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._monitor_task: asyncio.Task[None] | None = None
        # Set when the connection to the publisher dropped: the next batch may come from
        # a restarted replica even if its seq happens to follow ours.
        self._reconnected = False
        # Serialises message handling with mark_stale(), which the gateway calls.
        self._lock = asyncio.Lock()
        self._last_seq: int | None = None
        self._ts_seq: int | None = None  # the seq whose batch stats.last_event_ts is from
        self._held: dict[int, _Held] = {}

    def start(self) -> None:
        """Connect the SUB socket and start applying events."""
        if self._task is not None:
            return
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, _SUB_HWM)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint)  # vLLM binds; ZMQ reconnects by itself after a restart
        self._sub = sub
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.replica_id}")
        self._monitor_task = asyncio.create_task(
            self._watch_connection(), name=f"kv-events-monitor-{self.replica_id}")

    async def stop(self) -> None:
        """Stop the task and close the sockets (the index keeps its entries)."""
        for task in (self._task, self._monitor_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._monitor_task = None
        if self._sub is not None:
            self._sub.disable_monitor()
            self._sub.close(linger=0)
            self._sub = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None
        if self._own_context:
            self._ctx.term()

    @property
    def rekeying(self) -> bool:
        """Whether this stream re-keys the replica's blocks with the gateway's settings."""
        if self._rekey is None:
            return False
        return self._rekey_mode == "always" or self.stats.key_check == "differ"

    def _forget_key_check(self) -> None:
        # A restarted replica may come back with other settings: compare its keys again.
        if self._rekey_mode == "auto":
            self.stats.key_check = None

    async def mark_stale(self) -> None:
        """Drop the replica's entries now (it failed health checks); resync on its next event."""
        async with self._lock:
            self._last_seq = None
            self._held.clear()
            await self._clear()

    async def _run(self) -> None:
        assert self._sub is not None
        # No deadline on recv: an idle replica legitimately sends nothing. Liveness is
        # judged by the gateway's health checks and stats.last_received_at.
        while True:
            frames = await self._sub.recv_multipart()
            async with self._lock:
                try:
                    await self._on_message(frames)
                except IndexUnavailable as exc:
                    # Some of the batch may be missing from the index: resync from the
                    # replay buffer on the next message, when the index may be back.
                    self.stats.index_errors += 1
                    self._last_seq = None
                    log.warning("replica %s: index unavailable, will resync: %s",
                                self.replica_id, exc)
                except Exception:
                    # One bad message must not end the subscription; the index may now
                    # disagree with the replica, so resync as after an index failure.
                    self._last_seq = None
                    log.exception("replica %s: failed to apply a KV-event message, will "
                                  "resync", self.replica_id)

    async def _watch_connection(self) -> None:
        assert self._monitor is not None
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.stats.disconnects += 1
                self._reconnected = True

    async def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.stats.decode_errors += 1
            return
        try:
            seq = parse_seq(frames[1])
        except EventDecodeError:
            self.stats.decode_errors += 1
            return
        self.stats.last_received_at = self._clock()
        batch = self._decode(frames[2])
        last = self._last_seq
        if last is None:
            await self._clear()
            self._last_seq = -1
            self._held.clear()
            if seq > 0:
                await self._recover(seq)
        elif seq <= last:
            if not self._is_restart(seq, last, batch):
                self.stats.duplicates += 1
                return
            self.stats.restarts += 1
            self._forget_key_check()
            log.info("replica %s restarted (seq %d after %d): clearing its entries",
                     self.replica_id, seq, last)
            await self._clear()
            self._last_seq = -1
            self._held.clear()
            if seq > 0:
                await self._recover(seq)
        elif seq > last + 1:
            self.stats.gaps += 1
            await self._recover(seq)
        elif self._reconnected:
            # The first batch after a reconnect: check through the replay that it follows
            # the batch we applied last (without replay, start over).
            await self._recover(seq)
        self._reconnected = False
        await self._apply(seq, batch)

    def _is_restart(self, seq: int, last: int, batch: EventBatch | None) -> bool:
        if seq == last:
            return False
        # A duplicate carries its original timestamp; a restarted replica's batch is newer
        # than anything it sent before. Without timestamps to compare, seq 0 decides.
        last_ts = self.stats.last_event_ts
        if batch is None or last_ts is None:
            return seq == 0
        return batch.ts > last_ts

    def _decode(self, payload: bytes) -> EventBatch | None:
        try:
            return decode_batch(payload)
        except EventDecodeError as exc:
            self.stats.decode_errors += 1
            log.warning("replica %s: skipping a bad KV-event payload: %s", self.replica_id, exc)
            return None

    async def _recover(self, upto: int) -> None:
        """Fill [last + 1, upto) from the replay socket, or clear and start over at upto."""
        assert self._last_seq is not None
        last = self._last_seq
        # Ask from the last batch seen, too: if the replica restarted while we were not
        # listening, its batch under that number is a different (newer) one.
        replayed = await self._replay_from(max(last, 0))
        start = last + 1
        if last >= 0 and last in replayed and self._restarted_since(last, replayed[last]):
            self.stats.restarts += 1
            self._forget_key_check()
            log.info("replica %s restarted during a gap: clearing its entries", self.replica_id)
            await self._clear()
            self._held.clear()
            self._last_seq = -1
            start = 0
            if last > 0:
                replayed = await self._replay_from(0)
        if self.replay_endpoint is None or not all(
            s in replayed for s in range(start, upto)
        ) or (last >= 0 and start > 0 and last not in replayed):
            # (Without our last batch in the replay, continuity is not established.)
            if self.replay_endpoint is not None:
                self.stats.replay_failures += 1
            # The replica's state before `upto` is unknown: forget it, follow new events.
            await self._clear()
            self._held.clear()
            self._last_seq = upto - 1
            return
        self.stats.replays += 1
        for seq in range(start, upto):
            await self._apply(seq, self._decode(replayed[seq]))

    async def _replay_from(self, start: int) -> dict[int, bytes]:
        """The replica's kept batches from `start` on, by seq ({} if replay is unavailable)."""
        if self.replay_endpoint is None:
            return {}
        try:
            return dict(await self._request_replay(start))
        except ReplayUnavailable as exc:
            log.warning("replica %s: %s", self.replica_id, exc)
            return {}

    def _restarted_since(self, seq: int, payload: bytes) -> bool:
        """Whether the replica's batch under `seq` is not the one we applied."""
        last_ts = self.stats.last_event_ts
        if last_ts is None or self._ts_seq != seq:
            return False
        try:
            return decode_batch(payload).ts != last_ts
        except EventDecodeError:
            return False

    async def _request_replay(self, start: int) -> list[tuple[int, bytes]]:
        """Every batch the replica still keeps from `start` on, as (seq, payload)."""
        assert self.replay_endpoint is not None
        # A fresh DEALER per request: a late reply to an abandoned request can then never
        # be mistaken for the answer to the next one.
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            dealer.connect(self.replay_endpoint)
            async with asyncio.timeout(self._replay_timeout_s):
                await dealer.send_multipart([b"", seq_bytes(start)])
                while True:
                    frames = await dealer.recv_multipart()
                    if len(frames) != 4:
                        raise ReplayUnavailable(f"malformed replay reply ({len(frames)} frames)")
                    _, _topic, seq_frame, payload = frames
                    if seq_frame == END_SEQ:
                        return out
                    out.append((parse_seq(seq_frame), payload))
        except TimeoutError as exc:
            raise ReplayUnavailable(
                f"replay from {self.replay_endpoint} did not finish within "
                f"{self._replay_timeout_s}s"
            ) from exc
        except (zmq.ZMQError, EventDecodeError) as exc:
            raise ReplayUnavailable(f"replay from {self.replay_endpoint} failed: {exc}") from exc
        finally:
            dealer.close(linger=0)

    async def _apply(self, seq: int, batch: EventBatch | None) -> None:
        self._last_seq = seq
        if batch is None:
            self.stats.last_seq = seq
            return
        plan = self._plan(batch)
        # One call for the whole batch: the Redis index writes it in one round trip.
        await self._index.apply(self.replica_id, plan.ops)
        self.stats.clears += sum(1 for op in plan.ops if op.kind == "clear")
        for probe in plan.probes:
            await self._index.put_probe(
                probe.salt, self.replica_id, probe.block_size, probe.keys, probe.token_ids,
                self._probe_ttl_s,
                rekeyed=self.rekeying and self._rekey is not None
                and self._rekey.block_size == probe.block_size)
        self.stats.batches += 1
        self.stats.events_applied += plan.applied
        self.stats.last_event_ts = batch.ts
        self._ts_seq = seq
        # Published last: a reader seeing this seq finds the batch's writes in the index.
        self.stats.last_seq = seq

    async def _clear(self) -> None:
        self.stats.clears += 1
        await self._index.clear_replica(self.replica_id)

    def _scope(self, lora_name: str | None) -> str:
        return self.model if not lora_name else f"{self.model}@{lora_name}"

    def _plan(self, batch: EventBatch) -> _Plan:
        """The index calls a batch's events amount to, updating the held-block map."""
        plan = _Plan()
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self._held.clear()
                self._probe_blocks.clear()
                plan.ops.append(IndexOp("clear"))
                plan.applied += 1
            elif event.medium not in self._media:
                self.stats.events_ignored += 1
            elif isinstance(event, BlockStored):
                if self._plan_stored(event, plan):
                    plan.applied += 1
            elif isinstance(event, BlockRemoved):
                self._plan_removed(event, plan)
                plan.applied += 1
        return plan

    def _plan_stored(self, event: BlockStored, plan: _Plan) -> bool:
        replica_keys = [block_key_int(h) for h in event.block_hashes]
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

    def _plan_probe(self, event: BlockStored, replica_keys: list[int], plan: _Plan) -> bool:
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
            plan.probes.append(_ProbeSeen(salt, event.block_size, tuple(replica_keys),
                                          tuple(event.token_ids)))
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

    def _plan_removed(self, event: BlockRemoved, plan: _Plan) -> None:
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
        if event.block_size != size or len(event.token_ids) < size * len(replica_keys):
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
            parent = hash_block(config, parent, event.token_ids[i * size:(i + 1) * size], extra)
            digests.append(parent)
        return digests


@dataclass(frozen=True)
class ReplicaFeed:
    """Where one replica publishes its KV events, and how to index them."""

    replica_id: str
    endpoint: str
    model: str
    replay_endpoint: str | None = None
    topic: str = ""
    rekey: HashConfig | None = None
    rekey_mode: RekeyMode = "always"
    lora_paths: tuple[tuple[str, str], ...] = ()


class EventIndexer:
    """One ReplicaEventStream per replica, following discovery as replicas come and go."""

    def __init__(
        self,
        index: PrefixIndex,
        *,
        replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
        media: frozenset[str | None] = DEFAULT_MEDIA,
    ) -> None:
        self._index = index
        self._replay_timeout_s = replay_timeout_s
        self._media = media
        self._ctx = zmq.asyncio.Context()
        self._streams: dict[str, tuple[ReplicaFeed, ReplicaEventStream]] = {}

    @property
    def streams(self) -> dict[str, ReplicaEventStream]:
        """The running streams by replica id."""
        return {rid: stream for rid, (_, stream) in self._streams.items()}

    def stats(self) -> dict[str, StreamStats]:
        """Each replica's stream counters."""
        return {rid: stream.stats for rid, (_, stream) in self._streams.items()}

    async def add_replica(self, feed: ReplicaFeed) -> ReplicaEventStream:
        """Subscribe to a replica (replacing its stream if its feed changed)."""
        current = self._streams.get(feed.replica_id)
        if current is not None:
            if current[0] == feed:
                return current[1]
            await self.remove_replica(feed.replica_id)
        stream = ReplicaEventStream(
            feed.replica_id,
            feed.endpoint,
            feed.replay_endpoint,
            self._index,
            feed.model,
            topic=feed.topic,
            rekey=feed.rekey,
            rekey_mode=feed.rekey_mode,
            lora_paths=dict(feed.lora_paths),
            media=self._media,
            replay_timeout_s=self._replay_timeout_s,
            context=self._ctx,
        )
        stream.start()
        self._streams[feed.replica_id] = (feed, stream)
        return stream

    async def remove_replica(self, replica_id: str, *, clear: bool = True) -> None:
        """Unsubscribe from a replica and, by default, drop its entries from the index."""
        entry = self._streams.pop(replica_id, None)
        if entry is None:
            return
        await entry[1].stop()
        if clear:
            await self._index.clear_replica(replica_id)

    async def sync(self, feeds: Iterable[ReplicaFeed]) -> None:
        """Make the subscriptions match a discovery result: add new, drop gone replicas."""
        wanted = {feed.replica_id: feed for feed in feeds}
        for replica_id in [r for r in self._streams if r not in wanted]:
            try:
                await self.remove_replica(replica_id)
            except IndexUnavailable as exc:
                # The stream is gone either way; its entries stay until the index is
                # back and something clears them (a gateway's mark_stale, a restart).
                log.warning("replica %s left, but its entries could not be cleared: %s",
                            replica_id, exc)
        for feed in wanted.values():
            await self.add_replica(feed)

    async def stop(self) -> None:
        """Stop every stream (keeping the index's entries) and close the ZMQ context."""
        for replica_id in list(self._streams):
            await self.remove_replica(replica_id, clear=False)
        self._ctx.term()
