"""The per-request routing pipeline, as plain functions over plain data.

    raw body -> ParsedRequest -> prompt tokens -> block keys (per hash group)
             -> index lookup (one round trip, with a deadline) -> ReplicaState snapshots
             -> policy.decide -> Route

Nothing here touches the web request or writes a response; the app calls
`router.request.parse_request` then `RoutingPipeline.route` and hands the Route to the proxy.

Replicas of one model normally share one HashConfig (block size, algorithm, seed); a
fleet that mixes them forms several hash groups, each keyed and looked up separately
(concurrently, under the same deadline), and each replica is matched only against its
own group's chain.
"""

from __future__ import annotations

import asyncio
import itertools
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import xxhash

from router.arrival_order import NO_TURN, TurnLike
from router.hashing import (
    HashConfig,
    continue_keys,
    event_key,
    max_cacheable_blocks,
    plain_chain_keys,
)
from router.index import IndexUnavailable, PrefixIndex
from router.native import pack_ids
from router.outstanding import WorkView, fleet_bias, toward_fleet
from router.pending import PendingChains, merge_matches
from router.policy.cost import (
    least_work,
    peer_gate_s,
    queue_ahead,
    seconds_to_room,
    step_gate_s,
    step_s,
)
from router.policy.pipeline import NoReplicasError
from router.policy.types import PolicyConfig, ReplicaState, RoutingDecision, RoutingRequest
from router.prefill_hold import PrefillHold
from router.prefill_hold import Turn as HoldTurn
from router.replicas import Replica
from router.request import ParsedRequest
from router.shared_segments import SharedSegments
from router.shared_work import NO_PEER_WORK, PeerWork, SharedWork, joined_wait
from router.tokenize import DeferredIds, PromptTokenizer
from router.vllm_rules import skips_prefix_cache


class Tokenizer(Protocol):
    def request_tokens(self, body: dict[str, Any], endpoint: Any) -> list[int]: ...

    def prompt_ids(self, token_ids: Sequence[int], body: dict[str, Any]) -> Sequence[int]: ...


@dataclass(frozen=True)
class KnownTokens:
    """A Tokenizer that answers with ids obtained elsewhere (a replica's /tokenize)."""

    tokens: tuple[int, ...]

    def request_tokens(self, body: dict[str, Any], endpoint: Any) -> list[int]:
        return list(self.tokens)

    def prompt_ids(self, token_ids: Sequence[int], body: dict[str, Any]) -> Sequence[int]:
        return token_ids


@dataclass
class _Chain:
    """One remembered chain: its vLLM block keys (`width` bytes each, end to end), their
    event forms, and the fingerprints through which the memo leads to it (at its first
    PRINT_STRIDE blocks, every PRINT_STRIDE-th after, and the lengths it was asked for).

    None of it a list, because the garbage collector walks every element of a list:
    with the keys and digests as lists of bytes and ints, a full collection of a serving
    gateway visited each of them (17-44 ms with a couple of thousand chains remembered;
    router/collector.py), more as the cache fills. The digests and fingerprints are
    flat bytearrays, which hold no objects; the event keys a tuple of ints, which the
    collector stops tracking the first time it sees one (a tuple of untracked objects),
    and which a request's keys are sliced from without making an int anew."""

    serial: int
    width: int
    digests: bytearray
    event_keys: tuple[int, ...]
    prints: bytearray = field(default_factory=bytearray)

    def __len__(self) -> int:
        return len(self.event_keys)

    def digest(self, i: int) -> bytes:
        """Block i's key."""
        return bytes(self.digests[i * self.width:(i + 1) * self.width])


# A fingerprint's size (xxh3-128): a chain's prints are kept end to end in this many bytes.
_PRINT_BYTES = 16


def _event_keys(digests: list[bytes]) -> list[int]:
    """router.hashing.event_key of each digest (its last 8 bytes, big-endian), in C."""
    width = len(digests[0]) if digests else 0
    if not width or width % 8 or any(len(d) != width for d in digests):
        return [event_key(d) for d in digests]
    words = width // 8
    return list(struct.unpack(f">{words * len(digests)}Q", b"".join(digests))[words - 1::words])


# A chain's prefixes are fingerprinted at each of its first this many blocks (short
# prompts, a conversation's first turns), then every this many blocks, and at the
# lengths requests asked for (a conversation's turns, a resent prompt). Every block's
# (the previous scheme) cost three Python calls a block after each new prompt was sent:
# 512 of them for a cold 8k-token prompt, ~9% of a serving gateway's CPU on such
# prompts (py-spy); now 48. Between two fingerprints a request past the last one it
# matches is keyed in C from there (at most PRINT_STRIDE - 1 blocks, ~0.25 us each) and
# compared with the chain's keys, so a prefix of a remembered chain makes no new chain.
PRINT_STRIDE = 16


def _print_at(i: int) -> int:
    """The i-th (1-based) prefix length a chain may have a fingerprint at: 1, 2, ...,
    PRINT_STRIDE, then 2 x PRINT_STRIDE, 3 x PRINT_STRIDE, ..."""
    return i if i <= PRINT_STRIDE else PRINT_STRIDE * (i - PRINT_STRIDE + 1)


def _prints_upto(n: int) -> int:
    """How many of those lengths are at most n."""
    return n if n <= PRINT_STRIDE else PRINT_STRIDE + n // PRINT_STRIDE - 1


class ChainCache:
    """Remembers block keys by a cheap fingerprint of the tokens they cover.

    A conversation resends its whole history each turn, and many users share system
    prompts. The fingerprint of a k-block prefix is xxh3-128 over (hash settings, salt)
    and the token bytes of blocks 0..k-1: far cheaper than vLLM's pickle+sha256 key, and
    computed in C. A chain remembers the fingerprints of its first PRINT_STRIDE
    prefixes, then of every PRINT_STRIDE-th, and of its requested lengths, each pointing
    at the chain. A request first looks for its whole prompt (a resend, a conversation's
    previous turn asked again), then finds its longest remembered one of those by binary
    search (about log2(n / PRINT_STRIDE) fingerprints, not n), then tries the found chain's
    end beyond it (a conversation that grew a turn). It takes that chain's keys up to
    there and computes real keys only for the blocks after it (router.hashing.
    continue_keys, from the last remembered key: the history is not read again); where
    those first keys are the found chain's own, the request follows that chain further
    (a shorter prefix of it: no new chain). A conversation growing a turn extends its
    chain in place.

    Eviction is LRU by chain, bounded in the blocks the chains hold. A chain's
    fingerprints are remembered and forgotten together, so presence is monotone along
    those lengths of a chain, which the binary search relies on; where a
    branch's shared prefix went with the chain that owned it, the search finds a
    shorter prefix and the request hashes more: slower, never wrong.
    Thread-safe (called from the tokenizer pool).
    """

    def __init__(self, capacity_blocks: int = 500_000) -> None:
        self.capacity_blocks = capacity_blocks
        # prefix fingerprint -> the serial of the chain holding it. Serials, not the
        # chains: a dict of bytes and ints only is one the garbage collector never walks.
        self._memo: dict[bytes, int] = {}
        self._chains: OrderedDict[int, _Chain] = OrderedDict()  # serial -> chain, oldest first
        self._serials = itertools.count()
        self._lock = threading.Lock()
        self.blocks = 0  # keys held by the chains (a branch counts its shared prefix too)
        self.hashed_blocks = 0
        self.reused_blocks = 0

    def event_keys(self, config: HashConfig, tokens: Sequence[int],
                   cache_salt: str | None, probe: int | None = None) -> list[int]:
        """The 64-bit event keys of every full block of `tokens` (Python ints, as every
        caller has them) under config and salt.

        With `probe`, a prompt with more than twice `probe` blocks past its longest
        remembered prefix gets keys only through `probe` of them: enough to tell whether
        any replica holds past what this gateway has seen (RoutingPipeline.route). A
        later call without it hashes only the rest: the probe's keys are remembered."""
        size = config.block_size
        n = len(tokens) // size
        if n == 0:
            return []
        # A list (a tokenizer's ids, checked ones from the request) or a memoryview of
        # int64 (router.native.prompt_ids): both are hashed as they are, neither copied.
        ids = tokens if isinstance(tokens, list | memoryview) else list(tokens)
        data = memoryview(pack_ids(ids, n * size))
        step = size * 8
        head = repr((config.algo, size, config.resolved_seed(), cache_salt)).encode()

        def fingerprint(blocks: int) -> bytes:
            fp = xxhash.xxh3_128(head)
            fp.update(data[: blocks * step])
            return fp.digest()

        found: _Chain | None = None
        reused = 0
        with self._lock:
            whole = self._chain_at(fingerprint(n))
            if whole is not None:
                self._chains.move_to_end(whole.serial)
                self.reused_blocks += n
                return list(whole.event_keys[:n])
            lo, hi = 0, _prints_upto(n)  # the longest remembered of those lengths
            while lo < hi:
                mid = (lo + hi + 1) // 2
                owner = self._chain_at(fingerprint(_print_at(mid)))
                if owner is None:
                    hi = mid - 1
                else:
                    found, lo = owner, mid
            reused = _print_at(lo) if lo else 0
            if found is not None and reused < len(found) < n:
                end = len(found)  # the turn before, for a conversation that grew
                owner = self._chain_at(fingerprint(end))
                if owner is not None:
                    found, reused = owner, end
            # The request may follow the found chain past `reused` for up to a stride
            # (known once keyed): the probe counts from there.
            slack = 0 if found is None else min(PRINT_STRIDE - 1, len(found) - reused)
            if probe is not None and n - reused > 2 * probe + slack:
                n = reused + slack + probe
        # Python ints already (msgspec checked a request's ids; a tokenizer's are ints).
        # A remembered prefix is continued from its last key: the history before it is
        # neither copied nor read (a growing conversation's every turn).
        if found is None:
            added = plain_chain_keys(config, ids, n * size, cache_salt)
        else:
            added = continue_keys(config, found.digest(reused - 1), ids, reused * size,
                                  n * size)
        self.hashed_blocks += len(added)
        # How far the new keys are the found chain's own (a prefix of it, or its end
        # reached between two fingerprints).
        follow = 0
        if found is not None:
            limit = min(len(added), len(found) - reused)
            while follow < limit and added[follow] == found.digest(reused + follow):
                follow += 1
        with self._lock:
            alive = found is not None and found.serial in self._chains
            if found is not None and alive and follow == len(added):
                # All of it is the found chain's: remember this length too.
                owner, first = found, n
            elif found is not None and alive and reused + follow == len(found):
                # The conversation grew a turn: extend its chain (its prefixes stay valid).
                owner, first = found, len(found) + 1
                grown = added[follow:]
                owner.digests += b"".join(grown)
                owner.event_keys += tuple(_event_keys(grown))
                self.blocks += len(grown)
            else:
                # A new chain, or a branch off a remembered one: it takes that one's keys up
                # to the branch (a chain's buffers only ever grow, so this prefix is as read).
                width = found.width if found is not None else len(added[0]) if added else 0
                owner = _Chain(
                    serial=next(self._serials), width=width,
                    digests=(found.digests[:reused * width] if found is not None
                             else bytearray()) + b"".join(added),
                    event_keys=(found.event_keys[:reused] if found is not None else ())
                    + tuple(_event_keys(added)))
                self._chains[owner.serial] = owner
                first = reused + 1
                self.blocks += n
            prints = self._prints(head, data, step, first, n)
            self._memo.update(dict.fromkeys(prints, owner.serial))
            owner.prints += b"".join(prints)
            self._chains.move_to_end(owner.serial)
            while self.blocks > self.capacity_blocks and len(self._chains) > 1:
                self._evict(self._chains.popitem(last=False)[1])
            keys = list(owner.event_keys[:n])
        self.reused_blocks += reused
        return keys

    def _chain_at(self, fingerprint: bytes) -> _Chain | None:
        """The chain the memo leads to from `fingerprint`, if any."""
        serial = self._memo.get(fingerprint)
        return None if serial is None else self._chains.get(serial)

    @staticmethod
    def _prints(head: bytes, data: memoryview, step: int, first: int, n: int) -> list[bytes]:
        """The fingerprints of the prefixes of first..n blocks that a chain remembers:
        those at the lengths _print_at gives, and n."""
        ends = [_print_at(i) for i in range(_prints_upto(first - 1) + 1, _prints_upto(n) + 1)]
        if not ends or ends[-1] != n:
            ends.append(n)
        fp = xxhash.xxh3_128(head)
        done = 0
        prints = []
        for end in ends:
            fp.update(data[done * step: end * step])
            prints.append(fp.digest())
            done = end
        return prints

    def _evict(self, chain: _Chain) -> None:
        prints = chain.prints
        for at in range(0, len(prints), _PRINT_BYTES):
            p = bytes(prints[at:at + _PRINT_BYTES])
            if self._memo.get(p) == chain.serial:
                del self._memo[p]
        self.blocks -= len(chain)


@dataclass(frozen=True)
class PreparedPrompt:
    """The CPU-bound part of routing: token count and keys for each hash group.

    `complete` False: the keys stop at a probe (ChainCache.event_keys), and `completed`
    gives the prompt with all of them. A chat decided before its newest text was encoded
    (`rest` set: tokens_off_the_loop_when_long's deferral) is not complete either: its
    `tokens` are the ids before that text, all keyed, `num_tokens` is an estimate and
    `at_most` a bound, and `completed` encodes the rest."""

    num_tokens: int
    tokens: Sequence[int] | None  # as the request gave them: a list or packed (not copied)
    keys: Mapping[HashConfig, tuple[int, ...]]
    seconds: float
    complete: bool = True
    rest: Callable[[], Sequence[int]] | None = None
    at_most: int = 0

    def completed(self, chains: ChainCache, cache_salt: str | None) -> PreparedPrompt:
        if self.complete or self.tokens is None:
            return self
        tokens = self.tokens if self.rest is None else self.rest()
        keys = {config: tuple(chains.event_keys(config, tokens, cache_salt))
                for config in self.keys}
        return replace(self, tokens=tokens, num_tokens=len(tokens), keys=keys, complete=True,
                       rest=None, at_most=len(tokens))


def prepare_prompt(tokenizer: Tokenizer | None, chains: ChainCache, parsed: ParsedRequest,
                   groups: Iterable[HashConfig], cache_salt: str | None,
                   probe: int | None = None) -> PreparedPrompt:
    """Render + tokenize the prompt as the replica will and key it per hash group
    (through `probe`: see key_prompt).

    Synchronous and thread-safe. Without a tokenizer only token-id prompts can be keyed;
    others route on load alone (num_tokens 0, no keys).
    """
    started = time.perf_counter()
    return key_prompt(prompt_tokens(tokenizer, parsed), chains, groups, cache_salt, started,
                      probe)


# Past this many characters of text the tokenizer has not seen (about 2,000 tokens, 2-3
# ms of encoding here), the encode goes to the tokenizer threads: it runs in Rust with
# the GIL released, so the event loop relays streams meanwhile.
ENCODE_OFFLOAD_CHARS = 8 * 1024


# A chat's newest text (the last piece of it the segment cache lacks: a new question, a
# tool's result) of at least this many characters, and at most ENCODE_OFFLOAD_CHARS, is
# encoded after the request goes upstream (tokens_off_the_loop_when_long `defer`): some
# 100 tokens and up, 0.1 ms and more of encoding in front of every such request, where no
# replica can hold any of it.
DEFER_NEW_TEXT_CHARS = 512


async def tokens_off_the_loop_when_long(tokenizer: Tokenizer | None, parsed: ParsedRequest,
                                        executor: Executor,
                                        segments: SharedSegments | None = None,
                                        turn: TurnLike = NO_TURN, defer: bool = False,
                                        ) -> Sequence[int] | DeferredIds | None:
    """prompt_tokens, with only the Rust tokenizer's encoding of long text it has not
    seen leaving the event loop.

    Rendering a chat template, checking and truncating ids and hashing blocks hold the
    GIL: in a thread they stall the loop all the same, and the hand-offs (a thread wake-
    up, then GIL switches at the interpreter's 5 ms interval) made bursts slower. Sixteen
    agent chats at once (24 tools, 30 KB each) on one core: routing decisions took 42 ms
    on average with the whole preparation in threads, 20 ms with only this.

    With `segments` (a Redis index shared by several gateways), a chat's long pieces the
    segment cache lacks are asked of Redis first, and those encoded here are reported
    after (router/shared_segments.py).

    `turn` is the request's place in the arrival order (router/arrival_order.py): let go
    of while Redis or the tokenizer threads work.

    `defer`: a chat whose newest text (DEFER_NEW_TEXT_CHARS to ENCODE_OFFLOAD_CHARS) this
    gateway's segment cache lacks comes back as DeferredIds, the ids before that text, to be decided
    on and finished once the request is on its way. Nothing a replica holds is missed:
    holding is a run of blocks from token 0, and a replica can hold blocks of that text
    only if the same prompt was routed before, which would have encoded it (in this
    gateway's segment cache, and then pending or indexed as full keys). The case it can
    miss: the same prompt sent again through another gateway (a client's retry), whose
    replica holds the text too; decided on its prefix, it still goes where that prefix
    is, most often the same replica. Older pieces the cache lacks (a conversation that
    moved between gateways) are encoded before deciding, as without deferral.
    """
    if parsed.token_ids is not None or not isinstance(tokenizer, PromptTokenizer):
        return prompt_tokens(tokenizer, parsed)
    loop = asyncio.get_running_loop()
    if parsed.endpoint == "chat":
        text, special = tokenizer.chat_text(parsed.body)
        missing: list[str] = []
        if segments is not None and not special:
            missing = tokenizer.long_uncached_pieces(text, segments.min_chars)
            if missing:
                async with turn.away():
                    fetched = await segments.fetch(tokenizer.identity, missing,
                                                   tokenizer.vocab_size)
                tokenizer.adopt(fetched)
                missing = [p for p in missing if p not in fetched]
        uncached = tokenizer.uncached_chars(text, special)
        if defer and DEFER_NEW_TEXT_CHARS <= uncached <= ENCODE_OFFLOAD_CHARS:
            deferred = tokenizer.chat_ids_deferred(text, special, parsed.body,
                                                   DEFER_NEW_TEXT_CHARS)
            if deferred is not None:
                _report_segments(tokenizer, segments, missing)  # those encoded by now
                return deferred
        if uncached > ENCODE_OFFLOAD_CHARS:
            async with turn.away():
                ids = await loop.run_in_executor(executor, tokenizer.chat_ids, text, special,
                                                 parsed.body)
        else:
            ids = tokenizer.chat_ids(text, special, parsed.body)
        _report_segments(tokenizer, segments, missing)
        return ids
    prompt = parsed.body.get("prompt")
    texts = [prompt] if isinstance(prompt, str) else \
        [p for p in prompt if isinstance(p, str)] if isinstance(prompt, list) else []
    if sum(map(len, texts)) > ENCODE_OFFLOAD_CHARS:
        async with turn.away():
            return await loop.run_in_executor(executor, prompt_tokens, tokenizer, parsed)
    return prompt_tokens(tokenizer, parsed)


def _report_segments(tokenizer: PromptTokenizer, segments: SharedSegments | None,
                     missing: list[str]) -> None:
    """Tell the other gateways which of the long pieces Redis lacked this one encoded."""
    if segments is not None and missing:
        segments.report(tokenizer.identity, [(p, cached) for p in missing
                                             if (cached := tokenizer.cached_ids(p)) is not None])


def key_prompt(tokens: Sequence[int] | None, chains: ChainCache, groups: Iterable[HashConfig],
               cache_salt: str | None, started: float,
               probe: int | None = None) -> PreparedPrompt:
    """A prompt's ids keyed per hash group; `started` is when its preparation began.
    `probe`: keys only through that many blocks past what `chains` remembers, where
    more follow (ChainCache.event_keys); the prompt is then not `complete`."""
    keys: dict[HashConfig, tuple[int, ...]] = {}
    complete = True
    if tokens:
        for config in groups:
            keys[config] = tuple(chains.event_keys(config, tokens, cache_salt, probe))
            complete = complete and len(keys[config]) == len(tokens) // config.block_size
    return PreparedPrompt(num_tokens=len(tokens) if tokens else 0, tokens=tokens if tokens else None,
                          keys=keys, seconds=time.perf_counter() - started, complete=complete)


def deferred_prompt(ids: DeferredIds, chains: ChainCache, groups: Iterable[HashConfig],
                    cache_salt: str | None, started: float) -> PreparedPrompt:
    """A chat keyed through the ids before its newest text (all of them: no probe), not
    complete until `completed` encodes that text."""
    keys = {config: tuple(chains.event_keys(config, ids.known, cache_salt)) for config in groups}
    return PreparedPrompt(num_tokens=ids.estimate, tokens=ids.known, keys=keys,
                          seconds=time.perf_counter() - started, complete=False,
                          rest=ids.finish, at_most=ids.at_most)


def prompt_tokens(tokenizer: Tokenizer | None, parsed: ParsedRequest) -> Sequence[int] | None:
    """The prompt's token ids as the replica will see them; None without a tokenizer for
    a prompt given as text. Raises router.request.ClientError for a body the replica
    would refuse too."""
    if parsed.token_ids is not None:
        # Checked at the edge already; the tokenizer only applies truncate_prompt_tokens.
        return parsed.token_ids if tokenizer is None else \
            tokenizer.prompt_ids(parsed.token_ids, parsed.body)
    if tokenizer is None:
        return None
    return tokenizer.request_tokens(parsed.body, parsed.endpoint)


@dataclass(frozen=True)
class LookupResult:
    """Leading blocks held per replica id, or why the index was not consulted."""

    matches: Mapping[str, int]
    fallback: str | None  # None, "deadline", "index_down"
    seconds: float


def _collect(task: asyncio.Future[Any]) -> None:
    """Mark a lookup's outcome as seen (lookup_matches reads what it needs)."""
    if not task.cancelled():
        task.exception()


# How many loop iterations a lookup past its deadline gets to deliver a reply that has
# already arrived (a redis-py reply wakes its waiter through a chain of callbacks).
_LATE_REPLY_YIELDS = 4


async def lookup_matches(index: PrefixIndex, model: str,
                         keys: Mapping[HashConfig, tuple[int, ...]],
                         members: Mapping[HashConfig, set[str]],
                         deadline_s: float, turn: TurnLike = NO_TURN) -> LookupResult:
    """Ask the index once per hash group (usually one), all under one deadline.

    Past the deadline or with the index down the request routes on load alone: a slow
    index must never hold a request (it would cost more than the cache saves). `turn`
    (router/arrival_order.py) is let go of while Redis answers.
    """
    started = time.perf_counter()
    groups = [(config, chain) for config, chain in keys.items() if chain]
    if not groups:
        return LookupResult({}, None, 0.0)
    if getattr(index, "in_process", False):
        # Dicts in this process: nothing to wait for, so no task, timer or turn hand-off
        # (each costs loop iterations: 0.78x the routed req/s with arrival order on).
        return _merge(groups, [await index.lookup(model, chain) for _, chain in groups],
                      members, time.perf_counter() - started)
    # The index's own timeout is only a backstop (twice ours): this deadline decides.
    # One task per group, not a gather: every outcome is collected here, so nothing is
    # left for asyncio to report as "exception was never retrieved" when one fails or is
    # cancelled at the deadline.
    lookups = [asyncio.ensure_future(index.lookup(model, chain, deadline_s=2 * deadline_s))
               for _, chain in groups]
    for task in lookups:
        task.add_done_callback(_collect)
    try:
        async with turn.away():
            await asyncio.wait(lookups, timeout=deadline_s)
        # On a busy loop the timer and the index's reply can become ready in the same
        # iteration, and the timer runs first: a lookup that already answered would be
        # thrown away. A few yields let an answer that is already here finish; one still
        # in flight is not waited for.
        for _ in range(_LATE_REPLY_YIELDS):
            if all(task.done() for task in lookups):
                break
            await asyncio.sleep(0)
    finally:
        late = [task for task in lookups if not task.done()]
        for task in late:
            task.cancel()  # also when this request itself is cancelled
    if late:
        return LookupResult({}, "deadline", time.perf_counter() - started)
    if any(isinstance(task.exception(), IndexUnavailable | OSError) for task in lookups):
        return LookupResult({}, "index_down", time.perf_counter() - started)
    return _merge(groups, [task.result() for task in lookups], members,
                  time.perf_counter() - started)


def _merge(groups: list[tuple[HashConfig, tuple[int, ...]]], answers: list[dict[str, int]],
           members: Mapping[HashConfig, set[str]], seconds: float) -> LookupResult:
    """Each group's answer, for that group's replicas only, as one LookupResult."""
    matches: dict[str, int] = {}
    for (config, _), answer in zip(groups, answers, strict=True):
        allowed = members.get(config, set())
        for replica_id, blocks in answer.items():
            if replica_id in allowed:
                matches[replica_id] = max(matches.get(replica_id, 0), blocks)
    return LookupResult(matches, None, seconds)


async def _peer_work(read: asyncio.Future[dict[str, PeerWork]] | None,
                     left_s: float, turn: TurnLike = NO_TURN) -> Mapping[str, PeerWork]:
    """The shared read's answer if it arrives within what is left of the lookup's
    deadline; else none (this gateway's own view, as without sharing)."""
    if read is None:
        return {}
    if not read.done():
        async with turn.away():
            await asyncio.wait([read], timeout=max(left_s, 0.0))
    if not read.done():
        return {}  # not cancelled: other requests may be waiting on the same read
    if read.cancelled() or read.exception() is not None:
        return {}
    return read.result()


def predicted_cached_tokens(matched_blocks: int, num_prompt_tokens: int, block_size: int) -> int:
    """Tokens a replica holding `matched_blocks` leading blocks will serve from cache."""
    return min(matched_blocks, max_cacheable_blocks(num_prompt_tokens, block_size)) * block_size


def snapshot(replica: Replica, matched_blocks: int, now: float,
             work: WorkView | None = None, peers: PeerWork = NO_PEER_WORK) -> ReplicaState:
    """A frozen ReplicaState of one replica for one decision (see Replica.outstanding);
    `peers` is other gateways' work there (router/shared_work.py)."""
    t = replica.target
    running, waiting = replica.outstanding()
    work = replica.work.view(now) if work is None else work
    external_running, external_waiting = replica.external()
    return ReplicaState(
        replica_id=replica.replica_id, healthy=replica.healthy and not replica.removed,
        # Requests routed here but not yet attempted (a burst's decisions all precede
        # its forwarding) count as in flight already: else a burst of one hot prefix
        # all sees the holder idle and the hot-spot guard never fires.
        verified=replica.verified, inflight=max(replica.inflight, work.pending + work.decoding),
        running=running,
        waiting=waiting, kv_usage=replica.kv_usage, matched_blocks=matched_blocks,
        block_size=t.hash_config.block_size, profile=t.prefill,
        models=t.models or None, ejected=replica.ejected(now),
        capacity=t.max_concurrency, queued_prefill_s=work.wait_s, pending=work.pending,
        decoding=work.decoding,
        external_running=external_running, external_waiting=external_waiting,
        mean_prefill_s=work.mean_prefill_s, bias=work.bias,
        scrape_age_s=max(0.0, now - replica.scraped_at) if replica.scraped_at else 0.0,
        # Theirs is what their queue adds to ours, the two joined into one line.
        peer_wait_s=max(0.0, joined_wait(work, peers) - work.wait_s),
        peer_pending=peers.pending, peer_decoding=peers.decoding,
    )


class Policy(Protocol):
    config: PolicyConfig

    def decide(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> RoutingDecision: ...


@dataclass
class Route:
    """A routing decision with everything the proxy and the recorder need."""

    parsed: ParsedRequest
    prompt: PreparedPrompt
    decision: RoutingDecision
    candidates: list[Replica]  # decision.ranked, as Replica objects
    matches: Mapping[str, int]
    lookup: LookupResult
    decision_seconds: float
    cache_salt: str | None
    # replica id -> cached tokens the INDEX predicts: what verification and the prediction
    # metrics compare with the replica's report (decision.predicted_cached also counts
    # pending chains, a guess that must not doubt a replica's keys). Replicas holding
    # none of the prompt are left out: predicted_for reads them as 0.
    predicted: dict[str, int] = field(default_factory=dict)
    # The chain entered as pending on the chosen replica (router/pending.py), to drop if
    # the request does not end up served there.
    pending_handle: int | None = None
    # replica id -> outstanding-work entry reserved at decision (`route(reserve=True)`):
    # the proxy's attempt there takes it over; `release` ends one never attempted.
    reserved: dict[str, int] = field(default_factory=dict)
    # Set when the request goes upstream: a request refused after routing (context
    # length, overload) never reaches its replica, so its pending chain must not stay.
    sent: bool = False
    # Seconds it was held at the gateway before its decision (router/prefill_hold.py),
    # and after it for the queue ahead on its replica (RoutingPipeline.gate): two
    # figures, since the two wait for different things and one is tuned apart from the
    # other (Server-Timing's hold and gate).
    held_s: float = 0.0
    gated_s: float = 0.0
    # The longest it may wait for that queue before going upstream (policy.step_gate;
    # 0: send it now), and of that, how long other gateways' queue there was predicted
    # to last at the decision (their first bytes are not seen here: waited out by time).
    gate_s: float = 0.0
    peer_gate_s: float = 0.0

    def predicted_for(self, replica_id: str) -> int:
        return self.predicted.get(replica_id, 0)

    def drop_pending(self, pending: PendingChains | None) -> None:
        """Forget the chain entered as pending on the chosen replica: the request was
        refused, failed, or was served elsewhere, so that replica will not cache it (for
        the pending TTL, followers of the prefix would be sent to a replica without it)."""
        if pending is not None and self.pending_handle is not None:
            pending.drop(self.pending_handle)
            self.pending_handle = None

    def settle_pending(self, pending: PendingChains | None, served_by: str | None,
                       status: int) -> None:
        """Keep the pending chain only if the chosen replica answered the request (200)."""
        if status != 200 or served_by != self.decision.replica_id:
            self.drop_pending(pending)

    def finish_keys(self, chains: ChainCache, pending: PendingChains | None) -> None:
        """Key the blocks a deferred decision left unkeyed (RoutingPipeline.route's
        `defer_keys`) and add them to the chain pending on the chosen replica. Called once
        the request is on its way; a no-op when every key is there already."""
        if self.prompt.complete:
            return
        probed = self.prompt.keys
        self.prompt = self.prompt.completed(chains, self.cache_salt)
        chosen = next((r for r in self.candidates if r.replica_id == self.decision.replica_id),
                      None)
        if pending is not None and self.pending_handle is not None and chosen is not None:
            config = chosen.target.hash_config
            pending.extend(self.pending_handle,
                           self.prompt.keys.get(config, ())[len(probed.get(config, ())):])

    def release(self, now: float) -> None:
        """End the reservations no attempt took over (refused, failed over, never sent)."""
        by_id = {r.replica_id: r for r in self.candidates}
        for rid, token in self.reserved.items():
            if rid in by_id:
                by_id[rid].work.end(token, now)
        self.reserved.clear()


@dataclass
class RoutingPipeline:
    """Runs one request through prepare -> lookup -> snapshot -> decide.

    Holds what a decision needs (tokenizers per model, the chain cache, the index, the
    policy) but no per-request state; `route` is the whole pipeline.
    """

    tokenizers: Mapping[str, Tokenizer]
    chains: ChainCache
    index: PrefixIndex
    policy: Policy
    index_deadline_s: float
    executor: Executor | None = None
    pending: PendingChains | None = None
    clock: Callable[[], float] = time.monotonic
    shared: SharedWork | None = None
    segments: SharedSegments | None = None
    # Requests held while every replica's prefill queue is full (policy.hold_cap).
    hold: PrefillHold | None = None
    # Told each claim's outcome (policy.claim): "kept", "stayed", "moved" or "failed".
    claim_listeners: list[Callable[[str], None]] = field(default_factory=list)

    def _states(self, replicas: Sequence[Replica], matches: Mapping[str, int], now: float,
                peers: Mapping[str, PeerWork]) -> list[ReplicaState]:
        """Every replica's state for one decision, its learned TTFT bias drawn toward
        its fleet's by its own evidence."""
        views = {r.replica_id: r.work.view(now) for r in replicas}
        fleet = fleet_bias(views.values())
        return [snapshot(r, matches.get(r.replica_id, 0), now,
                         toward_fleet(views[r.replica_id], fleet),
                         peers.get(r.replica_id, NO_PEER_WORK)) for r in replicas]

    def _hold_turn(self, request: RoutingRequest, replicas: Sequence[Replica],
                   states: Sequence[ReplicaState], peers: Mapping[str, PeerWork],
                   now: float) -> HoldTurn | None:
        """The request's turn in the hold (None where the policy holds nothing): by its
        arrival plus hold_cap of the least prefill it could cost (its best match's)."""
        config = self.policy.config
        # cache_aware's alone: the simple policies stay what their names say (baselines).
        if self.hold is None or config.hold_cap is None or config.name != "cache_aware":
            return None
        # The replicas the policy may choose (those given serve the model already).
        eligible = [s for s in states if s.healthy and not s.ejected] or list(states)
        if self.hold.quiet(request.model) and any(
                queue_ahead(request, s, config) < step_s(s, config) for s in eligible):
            return None  # the common case: some replica has room, and no one is held
        deadline = now + config.hold_cap * least_work(request, eligible, config)
        room_now = seconds_to_room(request, eligible, config)
        ids = {s.replica_id for s in eligible}
        shared = self.shared

        def room(t: float) -> float:
            # Other gateways' work as followed now, where it is (else as read for it).
            followed = shared.followed() if shared is not None else None
            live = [snapshot(r, 0, t, None, (followed or peers).get(r.replica_id,
                                                                    NO_PEER_WORK))
                    for r in replicas if r.replica_id in ids]
            return seconds_to_room(request, live, config)

        return self.hold.turn(request.model, deadline, room, room_now)

    def _with_pending(self, model: str, readable: Mapping[HashConfig, tuple[int, ...]],
                      members: Mapping[HashConfig, set[str]], lookup: LookupResult,
                      now: float) -> Mapping[str, int]:
        """The index's matches, lengthened by prefixes routed moments ago whose replica
        has not announced them yet."""
        matches: Mapping[str, int] = lookup.matches
        if self.pending is not None:
            for config, chain in readable.items():
                matches = merge_matches(matches, self.pending.matches(
                    model, chain, members.get(config, ()), now, lookup.matches))
        return matches

    async def route(self, parsed: ParsedRequest, replicas: Sequence[Replica], now: float,
                    tenant: str | None, cache_salt: str | None,
                    session_key: str | None = None, offload: bool = True,
                    tokenizer: Tokenizer | None = None, reserve: bool = False,
                    turn: TurnLike = NO_TURN, defer_keys: bool = False) -> Route:
        """Decide where `parsed` goes among `replicas` (all those serving its model).

        `reserve` enters the request in the chosen replica's outstanding work at once
        (`Route.reserved`): the caller then forwards it, or calls `Route.release`.

        `offload` lets the tokenizer's encoding of long unseen text run in the executor
        (tokens_off_the_loop_when_long); the rest of the preparation stays on the loop.
        `tokenizer` overrides the model's local one (remote tokenization). `turn`: the
        request's place in the arrival order, let go of around the lookup.

        `defer_keys`: a prompt with many blocks this gateway has never hashed (a cold
        8k-token prompt: 512 blocks, ~1 ms) is keyed only through PROBE_BLOCKS of them
        before deciding. Holding is a contiguous run from block 0, so where no replica
        (indexed or pending) holds the last probed block, none holds anything past it and
        the decision is the one all keys would give; the caller finishes the keys once
        the request is on its way (Route.finish_keys), while the replica prefills. Where
        some replica does hold it (a prefix routed by another gateway, or before a
        restart), the rest is keyed and looked up before deciding, as without deferral.
        """
        if not replicas:
            raise NoReplicasError(f"no replica serves {parsed.model!r}")
        started = time.perf_counter()
        members: dict[HashConfig, set[str]] = {}
        for r in replicas:
            members.setdefault(r.target.hash_config, set()).add(r.replica_id)
        tokenizer = tokenizer or self.tokenizers.get(parsed.model)
        probe = PROBE_BLOCKS if defer_keys else None
        if offload and self.executor is not None:
            prepared = time.perf_counter()
            # Segment ids are shared only while another gateway is live (as far as the
            # shared work shows): alone, a fetch could only find what it encoded itself.
            alone = self.shared is not None and self.shared.alone
            tokens = await tokens_off_the_loop_when_long(
                tokenizer, parsed, self.executor, None if alone else self.segments, turn,
                defer_keys)
            if isinstance(tokens, DeferredIds):
                prompt = deferred_prompt(tokens, self.chains, list(members), cache_salt,
                                         prepared)
            else:
                prompt = key_prompt(tokens, self.chains, list(members), cache_salt, prepared,
                                    probe)
        else:
            prompt = prepare_prompt(tokenizer, self.chains, parsed, list(members), cache_salt,
                                    probe)
        # vLLM does not read its prefix cache for this request: no replica gets credit.
        skips = skips_prefix_cache(parsed.body, parsed.endpoint == "chat")
        readable: Mapping[HashConfig, tuple[int, ...]] = {} if skips else prompt.keys
        # Other gateways' work: from the gateway's followed copy of the shared hash, or
        # where it is not followed (the change feed is down), read beside the lookup and
        # under the same deadline. While the last read found no other gateway, the
        # heartbeat's re-check runs without holding this request (router/shared_work.py).
        peers_read = None
        followed = None
        if self.shared is not None:
            followed = self.shared.followed()
            if followed is None:
                peers_read = self.shared.refresh(2 * self.index_deadline_s)
                if self.shared.alone:
                    peers_read = None
        lookup = await lookup_matches(self.index, parsed.model, readable, members,
                                      self.index_deadline_s, turn)
        peers = followed if followed is not None else await _peer_work(
            peers_read, self.index_deadline_s - lookup.seconds, turn)
        # Tokenizing and the lookup took time (a burst is prepared one request after
        # another): the outstanding work is read as of now, not as of the request's arrival.
        now = self.clock()
        matches = self._with_pending(parsed.model, readable, members, lookup, now)
        # A request routed moments ago on a probe of the same new prefix: its whole chain
        # must be pending before this one is decided (else a burst scatters).
        overlapping = self.pending is not None and any([
            self.pending.finish_overlapping(chain) for chain in readable.values()])
        if not prompt.complete and (overlapping or (
                prompt.rest is None and _probe_held(readable, members, matches))):
            # Some replica holds (or will) the whole probe: the rest decides how much. (A
            # deferred chat's rest is text no replica holds; but a request sharing its
            # prefix is in flight, maybe the same prompt: keyed whole, as that one.)
            prompt = prompt.completed(self.chains, cache_salt)
            readable = {} if skips else prompt.keys
            lookup = await lookup_matches(self.index, parsed.model, readable, members,
                                          self.index_deadline_s, turn)
            now = self.clock()
            matches = self._with_pending(parsed.model, readable, members, lookup, now)
        elif overlapping:
            matches = self._with_pending(parsed.model, readable, members, lookup, now)
        primary = max(prompt.keys.items(), key=lambda kv: len(members[kv[0]]),
                      default=(None, ()))[1]
        lane, lanes = self.shared.lane if self.shared is not None else (0, 1)
        request = RoutingRequest(model=parsed.model, keys=primary,
                                 num_prompt_tokens=prompt.num_tokens, tenant=tenant,
                                 session_key=session_key, lane=lane, lanes=lanes)
        states = self._states(replicas, matches, now, peers)
        hold_turn = self._hold_turn(request, replicas, states, peers, now)
        held_s = 0.0
        try:
            if hold_turn is not None and not hold_turn.go_now():
                waited = time.perf_counter()
                async with turn.away():
                    await hold_turn.wait()
                # The time held is not the decision's (route.held_s says it).
                held_s = time.perf_counter() - waited
                started += held_s
                # Decided when let go, on the index, the queues and the pending chains as
                # they are now: held up to hold_cap of a prefill, other prompts' blocks may
                # have been stored since (an in-process index answers at once; Redis is
                # one more round trip, for a request held far longer).
                lookup = await lookup_matches(self.index, parsed.model, readable, members,
                                              self.index_deadline_s, turn)
                now = self.clock()
                if self.shared is not None and (followed := self.shared.followed()):
                    peers = followed
                matches = self._with_pending(parsed.model, readable, members, lookup, now)
                states = self._states(replicas, matches, now, peers)
            route = self._decide(parsed, prompt, request, states, replicas, lookup, matches,
                                 now, started, cache_salt, reserve)
            if (self.policy.config.claim and self.shared is not None and not self.shared.alone
                    and route.decision.replica_id in route.reserved):
                if hold_turn is not None:
                    # Counted on its replica here already: the hold's next request need
                    # not wait for this one's round trip (only other gateways do).
                    hold_turn.done()
                async with turn.away():
                    route = await self._claimed(route, parsed, prompt, request, replicas,
                                                lookup, matches, peers, started, cache_salt)
            route.held_s = held_s
            return route
        finally:
            if hold_turn is not None:
                hold_turn.done()

    async def _claimed(self, route: Route, parsed: ParsedRequest, prompt: PreparedPrompt,
                       request: RoutingRequest, replicas: Sequence[Replica],
                       lookup: LookupResult, matches: Mapping[str, int],
                       peers: Mapping[str, PeerWork], started: float,
                       cache_salt: str | None) -> Route:
        """`route` once its replica is claimed (policy.claim), or decided again where
        another gateway's request reached that replica unseen.

        Other gateways' changes reach this one through the feed, and in a burst on busy
        cores they came 8 ms late at the median and 20 at p90: two gateways deciding
        inside that gap from the same snapshot took one replica, and the second request
        queued behind the first's prefill (with 4 gateways on 8 sims, 21-32 requests a
        run came 300 ms or more after their prediction that way, 2026-12-07). The claim
        writes this request's work and reads the other live gateways' work on that
        replica in one Redis transaction, so of
        two claims on one replica the later one's read holds the earlier one's request,
        whatever the feeds do. Where it shows more of other gateways' requests pending
        there than the decision saw, the reservation is ended and the request decided
        again on the read: it may stay (the replica is still the best) or move. Once
        only: a second claim could meet a third gateway, and each costs a round trip.
        A failed or late claim (the index deadline) keeps the decision, as before. Off
        by default: with Redis beside 8 sims on this 2-core machine the round trip cost
        about what it saved (docs/POLICY.md)."""
        assert self.shared is not None
        rid = route.decision.replica_id
        chosen = next(r for r in replicas if r.replica_id == rid)
        try:
            fresh = await self.shared.claim(rid, chosen.work.view(self.clock()),
                                            self.index_deadline_s)
        except BaseException:
            # Cancelled (the client went away): the caller never sees this route, so its
            # reservation and pending chain end here.
            route.release(self.clock())
            route.drop_pending(self.pending)
            raise
        if fresh is None:
            outcome = "failed"
        elif fresh.pending <= peers.get(rid, NO_PEER_WORK).pending:
            outcome = "kept"
        else:
            now = self.clock()
            route.release(now)
            route.drop_pending(self.pending)
            states = self._states(replicas, matches, now, {**peers, rid: fresh})
            route = self._decide(parsed, prompt, request, states, replicas, lookup, matches,
                                 now, started, cache_salt, True)
            outcome = "stayed" if route.decision.replica_id == rid else "moved"
        for listener in self.claim_listeners:
            listener(outcome)
        return route

    def _decide(self, parsed: ParsedRequest, prompt: PreparedPrompt, request: RoutingRequest,
                states: Sequence[ReplicaState], replicas: Sequence[Replica],
                lookup: LookupResult, matches: Mapping[str, int], now: float, started: float,
                cache_salt: str | None, reserve: bool) -> Route:
        """The policy's decision on `states`, its work reserved and its chain pending."""
        decision = self.policy.decide(request, states)
        by_id = {r.replica_id: r for r in replicas}
        reserved: dict[str, int] = {}
        chosen = by_id.get(decision.replica_id)
        if reserve and chosen is not None:
            # Enter the request in its replica's outstanding work now, not when the proxy
            # gets to it: a burst's decisions are made before any of them is forwarded,
            # and each must see the ones before it (else the whole burst herds).
            work_s, ttft_s = decision.predicted_work.get(chosen.replica_id, (0.0, 0.0))
            reserved[chosen.replica_id] = chosen.work.begin(
                now, work_s, ttft_s, parsed.stream,
                decision.predicted_cached.get(chosen.replica_id))
        ranked = [by_id[rid] for rid in decision.ranked if rid in by_id]
        if decision.replica_id in by_id and (not ranked or ranked[0].replica_id != decision.replica_id):
            ranked.insert(0, by_id[decision.replica_id])
        # Only the replicas holding some of it: the rest read 0 (Route.predicted_for).
        predicted = {
            rid: predicted_cached_tokens(matched, prompt.num_tokens,
                                         by_id[rid].target.hash_config.block_size)
            for rid, matched in lookup.matches.items() if rid in by_id}
        route = Route(parsed=parsed, prompt=prompt, decision=decision, candidates=ranked,
                      matches=lookup.matches, lookup=lookup,
                      decision_seconds=time.perf_counter() - started, cache_salt=cache_salt,
                      predicted=predicted, reserved=reserved)
        config = self.policy.config
        if reserved and config.step_gate and config.name == "cache_aware":
            state = next(s for s in states if s.replica_id == decision.replica_id)
            cached = decision.predicted_cached.get(decision.replica_id, 0)
            route.gate_s = step_gate_s(request.num_prompt_tokens - cached, state, config)
            route.peer_gate_s = min(route.gate_s, peer_gate_s(state))
        if self.pending is not None and chosen is not None:
            # Only the blocks past what the replica is known (or pending) to hold: the
            # rest is already where a lookup finds it.
            known = matches.get(chosen.replica_id, 0)
            pending, chains = self.pending, self.chains
            route.pending_handle = pending.add(
                parsed.model, chosen.replica_id,
                prompt.keys.get(chosen.target.hash_config, ())[known:], now,
                None if prompt.complete else lambda: route.finish_keys(chains, pending))
        return route

    async def gate(self, route: Route, turn: TurnLike = NO_TURN) -> float:
        """Wait, up to `route.gate_s`, until this gateway's requests queued ahead of
        `route` on its replica have their first bytes and other gateways' queue there
        has had its predicted time, `route.peer_gate_s` (policy.step_gate,
        router/policy/cost.py step_gate_s); returns the seconds waited. The caller owns
        the route's reservation throughout (it ends it however this ends)."""
        rid = route.decision.replica_id
        token = route.reserved.get(rid)
        replica = next((r for r in route.candidates if r.replica_id == rid), None)
        if route.gate_s <= 0.0 or token is None or replica is None:
            return 0.0
        work = replica.work
        if not work.ahead(token, self.clock()) and route.peer_gate_s <= 0.0:
            return 0.0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + route.gate_s
        peers_done = loop.time() + route.peer_gate_s
        changed = asyncio.Event()

        def look_again(now: float) -> None:
            changed.set()

        waited = time.perf_counter()
        work.listeners.append(look_again)
        try:
            async with turn.away():
                # A first byte or an end there wakes it; a non-streamed request ahead,
                # whose first byte is its last, stops counting at its predicted prefill
                # without a change, so the deadline also bounds the wait for those.
                while work.ahead(token, self.clock()):
                    left = deadline - loop.time()
                    if left <= 0.0:
                        break
                    changed.clear()
                    try:
                        await asyncio.wait_for(changed.wait(), left)
                    except TimeoutError:
                        break
                # Other gateways' queue: by the clock (no change here marks its end).
                if (left := min(deadline, peers_done) - loop.time()) > 0.0:
                    await asyncio.sleep(left)
        finally:
            work.listeners.remove(look_again)
        return time.perf_counter() - waited


# Blocks keyed past what the gateway remembers before a deferred decision (route's
# `defer_keys`): 512 tokens at vLLM's GPU block size, a typical new question or answer,
# ~0.1 ms of hashing. A prompt whose new part is at most twice this is keyed whole.
PROBE_BLOCKS = 32


def _probe_held(readable: Mapping[HashConfig, tuple[int, ...]],
                members: Mapping[HashConfig, set[str]], matches: Mapping[str, int]) -> bool:
    """Whether some replica holds every probed block of its group's chain."""
    return any(chain and matches.get(rid, 0) >= len(chain)
               for config, chain in readable.items() for rid in members.get(config, ()))


def completion_keys(chains: ChainCache, config: HashConfig, prompt_tokens: Sequence[int],
                    output_token_ids: Sequence[int], cache_salt: str | None) -> list[int]:
    """The keys of the blocks a replica caches for prompt + generated tokens.

    vLLM hashes generated tokens as decode fills blocks, so the answer's blocks are
    cached too (and a follow-up turn that resends the answer can hit them, as far as the
    chat template reproduces the same ids).
    """
    return chains.event_keys(config, [*prompt_tokens, *output_token_ids], cache_salt)
