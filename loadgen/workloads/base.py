"""What every workload is made of: seeded token segments, planned and rendered requests.

Every token comes from `segment_tokens(seed, label, n)`: the same label always gives
the same tokens, so two prompts share exactly the segments the workload means them to
share, and a run is repeatable from its seed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

# Ids below TOKEN_LOW are left alone: real tokenizers put special tokens there. vLLM
# refuses ids beyond the tokenizer's vocabulary ("Token id N is out of vocabulary"), and
# the tiny test model's tokenizer has 3,389 ids, so every id stays below TOKEN_HIGH.
TOKEN_LOW = 256
TOKEN_HIGH = 3000
# Tool k's definition starts with token TOOL_HEADER + k, so two different tools never
# share a first token and a shuffled list diverges exactly at the first moved tool.
TOOL_HEADER = 100
MAX_TOOLS = 100
# Timestamp characters map to ids 32..126 (their code points): equal strings give equal
# tokens, and a timestamp diverges at its first changed character, as text would.
TIMESTAMP_EPOCH = 1_767_225_600  # 2026-01-01T00:00:00Z: fixed so runs repeat

PreamblePosition = Literal["first", "after-system", "last"]
PREAMBLE_POSITIONS: tuple[PreamblePosition, ...] = ("first", "after-system", "last")
AgentLayout = Literal["stable", "timestamp", "shuffle"]
AGENT_LAYOUTS: tuple[AgentLayout, ...] = ("stable", "timestamp", "shuffle")
SaltMode = Literal["none", "conversation"]


def seeded_rng(seed: int, label: str) -> np.random.Generator:
    """A generator seeded by (seed, label): independent streams per named purpose."""
    digest = hashlib.sha256(f"{seed}\x00{label}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "big"))


def segment_tokens(seed: int, label: str, n: int) -> tuple[int, ...]:
    """n deterministic token ids for a named segment; equal (seed, label) -> equal tokens."""
    if n <= 0:
        return ()
    ids = seeded_rng(seed, label).integers(TOKEN_LOW, TOKEN_HIGH, size=n)
    return tuple(int(t) for t in ids)


def timestamp_text(at: float) -> str:
    """A timestamp to the second, `at` seconds after the fixed epoch."""
    import datetime as _dt

    moment = _dt.datetime.fromtimestamp(TIMESTAMP_EPOCH + int(at), tz=_dt.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S")


def timestamp_tokens(at: float) -> tuple[int, ...]:
    """timestamp_text(at) as character ids."""
    return tuple(ord(c) for c in timestamp_text(at))


@dataclass(frozen=True)
class ChatMessage:
    """One OpenAI chat message."""

    role: str
    content: str


@dataclass(frozen=True)
class PlannedRequest:
    """A request's place in the stream: who sends it, which turn, and when."""

    index: int
    conversation_id: str
    turn: int
    # Seconds from the start of the run, or None when the driver paces (closed loop or
    # a Poisson rate).
    arrival: float | None = None


@dataclass(frozen=True)
class TimedRequest:
    """A rendered request, ready for the engine or an OpenAI-compatible server."""

    index: int
    request_id: str
    conversation_id: str
    turn: int
    arrival: float | None
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    # The same prompt as a chat client sends it (chat_text workloads), with the
    # OpenAI `tools` entries an agent lists.
    messages: tuple[ChatMessage, ...] | None = None
    tools: tuple[dict[str, object], ...] = ()
    cache_salt: str | None = None
    # What the workload appends to the history when the server does not return the
    # answer's token ids (the driver counts such substitutions: they cost hits).
    fallback_answer: tuple[int, ...] = ()


class Workload(Protocol):
    """A seeded request stream: a fixed plan, rendered one request at a time."""

    name: str

    def plan(self) -> list[PlannedRequest]:
        """Every request of the run, in the order the stream deals them."""
        ...

    def render(self, planned: PlannedRequest, at: float = 0.0) -> TimedRequest:
        """The request's prompt; `at` is when it is sent (seconds from the start)."""
        ...

    def record_answer(self, planned: PlannedRequest, answer: Sequence[int],
                      text: str | None = None) -> None:
        """Feed a finished turn's answer (token ids, and its text if known) back."""
        ...

    def describe(self) -> dict[str, object]:
        """The parameters that define the workload, for reports."""
        ...


def poisson_arrivals(
    seed: int, label: str, rates: Sequence[float], stage_seconds: float, count: int
) -> list[float]:
    """Arrival offsets of a Poisson process whose rate steps up stage by stage.

    The last stage's rate continues until `count` arrivals exist.
    """
    if not rates or any(r <= 0 for r in rates):
        raise ValueError("rates must be positive")
    rng = seeded_rng(seed, f"arrivals/{label}")
    out: list[float] = []
    t = 0.0
    while len(out) < count:
        stage = min(int(t // stage_seconds), len(rates) - 1) if stage_seconds > 0 else -1
        t += float(rng.exponential(1.0 / rates[stage]))
        out.append(t)
    return out
