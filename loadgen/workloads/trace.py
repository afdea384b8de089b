"""Mooncake traces replayed: arrivals from timestamps, prompts from hash ids."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from loadgen.workloads.base import TimedRequest, segment_tokens
from loadgen.workloads.chat_text import WORD_PER_ID, Lexicon
from loadgen.workloads.independent import IndependentWorkload

TRACE_BLOCK_TOKENS = 512


def trace_block_tokens(hash_id: int) -> tuple[int, ...]:
    """The 512 tokens a Mooncake hash id stands for; the same id always gives the same tokens.

    Independent of the engine's block size: any block size dividing 512 sees equal ids
    as equal blocks. Not seeded by the run's seed, so two runs of one trace share tokens.
    """
    return segment_tokens(0, f"trace/{hash_id}", TRACE_BLOCK_TOKENS)


def expand_hash_ids(hash_ids: Sequence[int], input_length: int) -> tuple[int, ...]:
    """A prompt of input_length tokens from its hash ids (the last may be partial)."""
    if not 0 < input_length <= TRACE_BLOCK_TOKENS * len(hash_ids):
        raise ValueError(
            f"input_length {input_length} does not fit {len(hash_ids)} blocks of "
            f"{TRACE_BLOCK_TOKENS} tokens"
        )
    out: list[int] = []
    for h in hash_ids:
        out.extend(trace_block_tokens(h))
    return tuple(out[:input_length])


@dataclass(frozen=True)
class TraceRecord:
    """One line of a Mooncake trace."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: Path, limit: int | None = None) -> Iterator[TraceRecord]:
    """The records of a Mooncake-format JSONL trace, in file order."""
    with path.open() as f:
        for n, line in enumerate(f):
            if limit is not None and n >= limit:
                return
            if not line.strip():
                continue
            obj = json.loads(line)
            yield TraceRecord(
                int(obj["timestamp"]), int(obj["input_length"]), int(obj["output_length"]),
                tuple(int(h) for h in obj["hash_ids"]),
            )


class TraceWorkload(IndependentWorkload):
    """A Mooncake trace replayed: arrivals by timestamp / speedup, prompts from hash ids.

    Requests whose prompt exceeds `max_input_tokens` are skipped and counted (a replica
    with a shorter context would reject them, and a rejection is not a routing result).
    `start` skips the trace's first records (file lines) to replay a later window; its
    arrivals then count from the first replayed record's timestamp. Only prefixes seen
    inside the window can hit: the window starts with empty caches.
    """

    name = "trace"

    def __init__(
        self,
        path: Path,
        *,
        speedup: float = 1.0,
        limit: int | None = None,
        max_input_tokens: int | None = None,
        max_output_tokens: int | None = None,
        start: int = 0,
        seed: int = 0,
        chat_text: bool = False,
        lexicon: Lexicon = WORD_PER_ID,
    ) -> None:
        super().__init__(seed, chat_text, lexicon)
        if speedup <= 0:
            raise ValueError("speedup must be positive")
        if start < 0:
            raise ValueError("start must be >= 0")
        self.path = path
        self.speedup = speedup
        self.limit = limit
        self.max_input_tokens = max_input_tokens
        self.max_output_tokens = max_output_tokens
        self.start = start
        self.skipped = 0
        origin: int | None = None
        records = 0
        for n, record in enumerate(read_trace(path)):
            records = n + 1
            if n < start:
                continue
            if origin is None:
                # The window's first record is its time zero (0 for the whole trace).
                origin = record.timestamp_ms if start else 0
            if limit is not None and len(self._requests) >= limit:
                break
            if max_input_tokens is not None and record.input_length > max_input_tokens:
                self.skipped += 1
                continue
            i = len(self._requests)
            out = record.output_length
            if max_output_tokens is not None:
                out = min(out, max_output_tokens)
            self._requests.append(TimedRequest(
                index=i, request_id=f"req-{i}", conversation_id=f"trace-{i}", turn=0,
                arrival=(record.timestamp_ms - origin) / 1000.0 / speedup,
                prompt_token_ids=expand_hash_ids(record.hash_ids, record.input_length),
                max_tokens=max(out, 1),
            ))
        if not self._requests:
            # A window past the trace's end (or of prompts all too long) would run zero
            # requests and report empty tables as if it had measured something.
            where = (f"starts past its end (it has {records} records)" if start >= records
                     else f"has no prompt of at most {max_input_tokens} tokens")
            raise ValueError(f"trace {str(path)!r} from record {start} {where}")

    def describe(self) -> dict[str, object]:
        return {
            "workload": self.name, "path": str(self.path), "speedup": self.speedup,
            "start": self.start, "limit": self.limit, "max_input_tokens": self.max_input_tokens,
            "max_output_tokens": self.max_output_tokens, "requests": len(self._requests),
            "skipped_too_long": self.skipped,
        }
