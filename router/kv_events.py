"""vLLM 0.32's KV-cache event wire format: one encoder and one strict decoder.

The simulated replica publishes with `encode_batch`; the indexer decodes real vLLM's
and the sim's batches with the same `decode_batch`, so a format drift shows up as a
decode error in a test rather than as silently missing index entries.

On the wire (ZMQ PUB) a message is three frames: [topic, seq as 8 bytes big-endian,
payload]. The payload is a msgpack array [ts, [events...], data_parallel_rank] (the
rank is omitted when None); each event is a msgpack map whose "type" key names it.
Fields left at their default are omitted, as vLLM's msgspec structs do.

Replay (ZMQ ROUTER on the publisher, DEALER on the subscriber): the request is
[b"", start_seq as 8 bytes]; the reply is one [b"", topic, seq, payload] per kept batch
with seq >= start_seq, then the end marker [b"", b"", END_SEQ, b""].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

# vLLM sends (-1).to_bytes(8, "big", signed=True) to end a replay.
END_SEQ = b"\xff" * 8
MEDIUM_GPU = "GPU"


class BlockStored(
    msgspec.Struct, tag=True, omit_defaults=True, forbid_unknown_fields=False, gc=False
):
    """Consecutive full blocks entered the prefix cache (oldest first)."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    # The blocks' token ids as they came, msgpack-encoded: only the hash handshake and
    # re-keying read them (stored_token_ids), and decoding them for every event was a
    # Python int per token, ~75-100 us of the gateway's loop for each cold 8k-token
    # prompt's event. Build one with encoded_ids.
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Cached blocks were evicted for reuse (vLLM evicts leaf-first)."""

    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """The replica's whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The events of one engine step."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class EventDecodeError(ValueError):
    """A payload that is not a well-formed vLLM KV-event batch."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EventBatch)
_ids_decoder = msgspec.msgpack.Decoder(list[int])


def encoded_ids(token_ids: Sequence[int]) -> msgspec.Raw:
    """A BlockStored's token_ids from a list of ids."""
    return msgspec.Raw(_encoder.encode(list(token_ids)))


def stored_token_ids(event: BlockStored) -> list[int]:
    """A stored event's token ids; EventDecodeError where they are not a list of ints."""
    try:
        return _ids_decoder.decode(event.token_ids)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise EventDecodeError(f"bad KV-event token_ids: {exc}") from exc


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack payload vLLM publishes for one batch."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one payload, checking every field's type; raise EventDecodeError otherwise."""
    try:
        return _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise EventDecodeError(f"bad KV-event payload: {exc}") from exc


def seq_bytes(seq: int) -> bytes:
    """A sequence number as the 8-byte big-endian frame vLLM sends."""
    return seq.to_bytes(8, "big")


def parse_seq(frame: bytes) -> int:
    """The sequence number in an 8-byte frame (raises EventDecodeError if malformed)."""
    if len(frame) != 8:
        raise EventDecodeError(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def block_key_int(value: int | bytes) -> int:
    """A block key from an event as the 64-bit integer form, whichever form vLLM sent.

    With VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 the replica sends raw digests; the index
    always stores the 64-bit form, which is the digest's last 8 bytes.
    """
    if isinstance(value, bytes):
        return int.from_bytes(value, "big") & ((1 << 64) - 1)
    return value
