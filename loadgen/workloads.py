"""Seeded generators of timed requests, the shapes routing policies are judged on.

A workload is a plan (which conversation sends which turn, and when) plus a renderer
that turns one planned request into a prompt. Rendering is lazy because a conversation
resends its whole history every turn, answers included, and the answer is only known
once the previous turn finished: the driver records it with `record_answer` before it
renders the conversation's next turn.

Prompts are token ids (for /v1/completions and the in-process engine), so no tokenizer
is needed; `chat_text=True` also renders chat messages whose words stand for tokens one
to one (approximate token counts once a real tokenizer renders them).

Every token comes from `segment_tokens(seed, label, n)`: the same label always gives
the same tokens, so two prompts share exactly the segments the workload means them to
share, and a run is repeatable from its seed.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
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


def _rng(seed: int, label: str) -> np.random.Generator:
    digest = hashlib.sha256(f"{seed}\x00{label}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "big"))


def segment_tokens(seed: int, label: str, n: int) -> tuple[int, ...]:
    """n deterministic token ids for a named segment; equal (seed, label) -> equal tokens."""
    if n <= 0:
        return ()
    ids = _rng(seed, label).integers(TOKEN_LOW, TOKEN_HIGH, size=n)
    return tuple(int(t) for t in ids)


def timestamp_tokens(at: float) -> tuple[int, ...]:
    """A timestamp to the second, `at` seconds after the fixed epoch, as character ids."""
    import datetime as _dt

    moment = _dt.datetime.fromtimestamp(TIMESTAMP_EPOCH + int(at), tz=_dt.UTC)
    return tuple(ord(c) for c in moment.strftime("%Y-%m-%d %H:%M:%S"))


def tokens_to_words(tokens: Sequence[int]) -> str:
    """Text standing for token ids one word per token (for chat-text runs)."""
    return " ".join(f"w{t}" for t in tokens)


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
    messages: tuple[ChatMessage, ...] | None = None
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


@dataclass
class _History:
    """One conversation's resent history: its questions and answers, no preambles."""

    tokens: list[int] = field(default_factory=list)
    # (question, answer token ids, answer text as the server sent it, if it did)
    turns: list[tuple[tuple[int, ...], tuple[int, ...], str | None]] = field(
        default_factory=list)

    @property
    def turns_done(self) -> int:
        return len(self.turns)


class _ConversationBase:
    """Shared bookkeeping for workloads whose conversations resend their history."""

    name = "base"

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._histories: dict[str, _History] = {}
        # The question each rendered turn asked, so record_answer appends it with the
        # answer (the question is part of the resent history; the preamble is not).
        self._asked: dict[tuple[str, int], tuple[int, ...]] = {}

    def _history(self, conversation_id: str, turn: int) -> _History:
        history = self._histories.setdefault(conversation_id, _History())
        if history.turns_done != turn:
            raise RuntimeError(
                f"{conversation_id} turn {turn} rendered before turn {history.turns_done} "
                "finished: a conversation's turns must run one after another"
            )
        return history

    def record_answer(self, planned: PlannedRequest, answer: Sequence[int],
                      text: str | None = None) -> None:
        """Append the turn's question and answer to the conversation's history."""
        history = self._history(planned.conversation_id, planned.turn)
        question = self._asked.pop((planned.conversation_id, planned.turn))
        kept = tuple(int(t) for t in answer)
        history.tokens.extend(question)
        history.tokens.extend(kept)
        history.turns.append((question, kept, text))


class ChatWorkload(_ConversationBase):
    """C conversations in flight, each resending its whole history every turn.

    Prompt layout by preamble position (P = the request's own K-token preamble, rendered
    once per request and never resent; H = earlier questions and answers; q = the new
    question):

        first:        P + system + H + q
        after-system: system + P + H + q
        last:         system + H + P + q
    """

    name = "chat"

    def __init__(
        self,
        *,
        requests: int,
        conversations: int,
        shared_prefix_tokens: int = 1000,
        preamble_tokens: int = 0,
        preamble_position: PreamblePosition = "after-system",
        question_tokens: int = 50,
        answer_tokens: int = 50,
        salt: SaltMode = "none",
        seed: int = 0,
        chat_text: bool = False,
    ) -> None:
        super().__init__(seed)
        if requests < 1 or conversations < 1:
            raise ValueError("requests and conversations must be at least 1")
        if preamble_position not in PREAMBLE_POSITIONS:
            raise ValueError(f"preamble position must be one of {PREAMBLE_POSITIONS}")
        self.requests = requests
        self.conversations = min(conversations, requests)
        self.shared_prefix_tokens = shared_prefix_tokens
        self.preamble_tokens = preamble_tokens
        self.preamble_position = preamble_position
        self.question_tokens = question_tokens
        self.answer_tokens = answer_tokens
        self.salt = salt
        self.chat_text = chat_text
        self.system = segment_tokens(seed, "chat/system", shared_prefix_tokens)

    def plan(self) -> list[PlannedRequest]:
        """Requests dealt round the conversations: request i is turn i // C of conversation i % C."""
        c = self.conversations
        return [
            PlannedRequest(index=i, conversation_id=f"conv-{i % c}", turn=i // c)
            for i in range(self.requests)
        ]

    def render(self, planned: PlannedRequest, at: float = 0.0) -> TimedRequest:
        history = self._history(planned.conversation_id, planned.turn)
        rid = f"req-{planned.index}"
        preamble = segment_tokens(self.seed, f"chat/preamble/{rid}", self.preamble_tokens)
        question = segment_tokens(
            self.seed, f"chat/question/{planned.conversation_id}/{planned.turn}",
            self.question_tokens,
        )
        self._asked[(planned.conversation_id, planned.turn)] = question
        past = tuple(history.tokens)
        if self.preamble_position == "first":
            prompt = preamble + self.system + past + question
        elif self.preamble_position == "after-system":
            prompt = self.system + preamble + past + question
        else:
            prompt = self.system + past + preamble + question
        messages = None
        if self.chat_text:
            messages = self._messages(preamble, history, question)
        return TimedRequest(
            index=planned.index,
            request_id=rid,
            conversation_id=planned.conversation_id,
            turn=planned.turn,
            arrival=planned.arrival,
            prompt_token_ids=prompt,
            max_tokens=self.answer_tokens,
            messages=messages,
            cache_salt=planned.conversation_id if self.salt == "conversation" else None,
            fallback_answer=segment_tokens(
                self.seed, f"chat/answer/{planned.conversation_id}/{planned.turn}",
                self.answer_tokens,
            ),
        )

    def _messages(
        self, preamble: tuple[int, ...], history: _History, question: tuple[int, ...]
    ) -> tuple[ChatMessage, ...]:
        system = tokens_to_words(self.system)
        pre = tokens_to_words(preamble)
        if preamble and self.preamble_position == "first":
            system = f"{pre}\n{system}"
        elif preamble and self.preamble_position == "after-system":
            system = f"{system}\n{pre}"
        messages = [ChatMessage("system", system)]
        for asked, answered, text in history.turns:
            messages.append(ChatMessage("user", tokens_to_words(asked)))
            # The answer's own text: only the exact text re-renders to the cached tokens.
            reply = text if text is not None else tokens_to_words(answered)
            messages.append(ChatMessage("assistant", reply))
        last = tokens_to_words(question)
        if preamble and self.preamble_position == "last":
            last = f"{pre}\n{last}"
        messages.append(ChatMessage("user", last))
        return tuple(messages)

    def describe(self) -> dict[str, object]:
        return {
            "workload": self.name, "requests": self.requests,
            "conversations": self.conversations,
            "shared_prefix_tokens": self.shared_prefix_tokens,
            "preamble_tokens": self.preamble_tokens,
            "preamble_position": self.preamble_position,
            "question_tokens": self.question_tokens, "answer_tokens": self.answer_tokens,
            "salt": self.salt, "seed": self.seed,
        }


class AgentWorkload(_ConversationBase):
    """Agent sessions: instructions plus N tool definitions, whole history resent.

    Layouts: `stable` (the same prefix every request), `timestamp` (a timestamp to the
    second as the first line, so the prefix changes every second), `shuffle` (the tool
    list shuffled on every request: tokens change from the first moved tool on).
    """

    name = "agent"

    def __init__(
        self,
        *,
        conversations: int = 8,
        turns: int = 8,
        instruction_tokens: int = 480,
        tools: int = 24,
        tool_tokens: int = 180,
        question_tokens: int = 60,
        answer_tokens: int = 80,
        layout: AgentLayout = "stable",
        seed: int = 0,
    ) -> None:
        super().__init__(seed)
        if not 0 <= tools <= MAX_TOOLS:
            raise ValueError(f"tools must be between 0 and {MAX_TOOLS}")
        if tools and tool_tokens < 1:
            raise ValueError("tool_tokens must be at least 1")
        if layout not in AGENT_LAYOUTS:
            raise ValueError(f"layout must be one of {AGENT_LAYOUTS}")
        self.conversations = conversations
        self.turns = turns
        self.instruction_tokens = instruction_tokens
        self.num_tools = tools
        self.tool_tokens = tool_tokens
        self.question_tokens = question_tokens
        self.answer_tokens = answer_tokens
        self.layout = layout
        self.instructions = segment_tokens(seed, "agent/instructions", instruction_tokens)
        self.tools = [
            (TOOL_HEADER + k, *segment_tokens(seed, f"agent/tool/{k}", tool_tokens - 1))
            for k in range(tools)
        ]

    @property
    def prefix_tokens(self) -> int:
        """Instructions plus tool definitions, in tokens."""
        return self.instruction_tokens + self.num_tools * self.tool_tokens

    def plan(self) -> list[PlannedRequest]:
        """Sessions interleaved turn by turn, in a seeded order that changes every turn.

        A fixed order would let round robin over N replicas send each session to the
        same replica every turn whenever N divides the session count: an accidental
        affinity no real traffic has.
        """
        out: list[PlannedRequest] = []
        for t in range(self.turns):
            order = list(range(self.conversations))
            _rng(self.seed, f"agent/turn-order/{t}").shuffle(order)
            base = len(out)
            out.extend(PlannedRequest(index=base + i, conversation_id=f"agent-{c}", turn=t)
                       for i, c in enumerate(order))
        return out

    def tool_order(self, request_index: int) -> list[int]:
        """The tool order a request lists (identity unless the layout shuffles)."""
        order = list(range(self.num_tools))
        if self.layout == "shuffle":
            _rng(self.seed, f"agent/shuffle/{request_index}").shuffle(order)
        return order

    def render(self, planned: PlannedRequest, at: float = 0.0) -> TimedRequest:
        history = self._history(planned.conversation_id, planned.turn)
        question = segment_tokens(
            self.seed, f"agent/question/{planned.conversation_id}/{planned.turn}",
            self.question_tokens,
        )
        self._asked[(planned.conversation_id, planned.turn)] = question
        head = (*timestamp_tokens(at), ord("\n")) if self.layout == "timestamp" else ()
        tools = tuple(t for k in self.tool_order(planned.index) for t in self.tools[k])
        prompt = head + self.instructions + tools + tuple(history.tokens) + question
        return TimedRequest(
            index=planned.index,
            request_id=f"req-{planned.index}",
            conversation_id=planned.conversation_id,
            turn=planned.turn,
            arrival=planned.arrival,
            prompt_token_ids=prompt,
            max_tokens=self.answer_tokens,
            fallback_answer=segment_tokens(
                self.seed, f"agent/answer/{planned.conversation_id}/{planned.turn}",
                self.answer_tokens,
            ),
        )

    def describe(self) -> dict[str, object]:
        return {
            "workload": self.name, "conversations": self.conversations, "turns": self.turns,
            "instruction_tokens": self.instruction_tokens, "tools": self.num_tools,
            "tool_tokens": self.tool_tokens, "prefix_tokens": self.prefix_tokens,
            "question_tokens": self.question_tokens, "answer_tokens": self.answer_tokens,
            "layout": self.layout, "seed": self.seed,
        }


class _StatelessBase:
    """Workloads of independent requests: nothing is resent, answers are not kept."""

    name = "stateless"

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._requests: list[TimedRequest] = []

    def plan(self) -> list[PlannedRequest]:
        return [
            PlannedRequest(r.index, r.conversation_id, r.turn, r.arrival) for r in self._requests
        ]

    def render(self, planned: PlannedRequest, at: float = 0.0) -> TimedRequest:
        return self._requests[planned.index]

    def record_answer(self, planned: PlannedRequest, answer: Sequence[int],
                      text: str | None = None) -> None:
        """Independent requests: nothing to continue."""

    @property
    def rendered(self) -> list[TimedRequest]:
        """Every request, rendered (they do not depend on answers)."""
        return list(self._requests)


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


class TraceWorkload(_StatelessBase):
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
    ) -> None:
        super().__init__(seed)
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
        for n, record in enumerate(read_trace(path)):
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

    def describe(self) -> dict[str, object]:
        return {
            "workload": self.name, "path": str(self.path), "speedup": self.speedup,
            "start": self.start, "limit": self.limit, "max_input_tokens": self.max_input_tokens,
            "max_output_tokens": self.max_output_tokens, "requests": len(self._requests),
            "skipped_too_long": self.skipped,
        }


def poisson_arrivals(
    seed: int, label: str, rates: Sequence[float], stage_seconds: float, count: int
) -> list[float]:
    """Arrival offsets of a Poisson process whose rate steps up stage by stage.

    The last stage's rate continues until `count` arrivals exist.
    """
    if not rates or any(r <= 0 for r in rates):
        raise ValueError("rates must be positive")
    rng = _rng(seed, f"arrivals/{label}")
    out: list[float] = []
    t = 0.0
    while len(out) < count:
        stage = min(int(t // stage_seconds), len(rates) - 1) if stage_seconds > 0 else -1
        t += float(rng.exponential(1.0 / rates[stage]))
        out.append(t)
    return out


class GroupsWorkload(_StatelessBase):
    """llm-d's prefix-group benchmark: G groups x U users, group prefix + user question.

    Each of the G*U users has one fixed prompt (its group's S-token prefix, then its own
    Q-token question); requests pick a user uniformly at random and arrive by a Poisson
    process whose rate steps up (`rates`, `stage_seconds`).
    """

    name = "groups"

    def __init__(
        self,
        *,
        groups: int = 150,
        users: int = 5,
        prefix_tokens: int = 6000,
        question_tokens: int = 1200,
        output_tokens: int = 1000,
        requests: int = 1000,
        rates: Sequence[float] = (5.0,),
        stage_seconds: float = 60.0,
        seed: int = 0,
    ) -> None:
        super().__init__(seed)
        self.groups, self.users = groups, users
        self.prefix_tokens, self.question_tokens = prefix_tokens, question_tokens
        self.output_tokens = output_tokens
        self.rates, self.stage_seconds = tuple(rates), stage_seconds
        arrivals = poisson_arrivals(seed, "groups", rates, stage_seconds, requests)
        picks = _rng(seed, "groups/pick").integers(0, groups * users, size=requests)
        for i, (pick, at) in enumerate(zip(picks, arrivals, strict=True)):
            g, u = divmod(int(pick), users)
            prompt = segment_tokens(seed, f"groups/prefix/{g}", prefix_tokens) + segment_tokens(
                seed, f"groups/question/{g}/{u}", question_tokens
            )
            self._requests.append(TimedRequest(
                index=i, request_id=f"req-{i}", conversation_id=f"group-{g}-user-{u}", turn=0,
                arrival=at, prompt_token_ids=prompt, max_tokens=output_tokens,
            ))

    def describe(self) -> dict[str, object]:
        return {
            "workload": self.name, "groups": self.groups, "users": self.users,
            "prefix_tokens": self.prefix_tokens, "question_tokens": self.question_tokens,
            "output_tokens": self.output_tokens, "requests": len(self._requests),
            "rates": list(self.rates), "stage_seconds": self.stage_seconds, "seed": self.seed,
        }


class PrefixRepetitionWorkload(_StatelessBase):
    """vLLM's prefix_repetition dataset: P prefixes, each request one of them + a fresh suffix."""

    name = "prefix-repetition"

    def __init__(
        self,
        *,
        requests: int = 100,
        num_prefixes: int = 10,
        prefix_tokens: int = 256,
        suffix_tokens: int = 256,
        output_tokens: int = 128,
        seed: int = 0,
    ) -> None:
        super().__init__(seed)
        self.num_prefixes, self.prefix_tokens = num_prefixes, prefix_tokens
        self.suffix_tokens, self.output_tokens = suffix_tokens, output_tokens
        picks = _rng(seed, "prefix-repetition/pick").integers(0, num_prefixes, size=requests)
        for i, p in enumerate(picks):
            prompt = segment_tokens(seed, f"prefix-repetition/prefix/{int(p)}", prefix_tokens)
            prompt += segment_tokens(seed, f"prefix-repetition/suffix/{i}", suffix_tokens)
            self._requests.append(TimedRequest(
                index=i, request_id=f"req-{i}", conversation_id=f"prefix-{int(p)}", turn=0,
                arrival=None, prompt_token_ids=prompt, max_tokens=output_tokens,
            ))

    def describe(self) -> dict[str, object]:
        return {
            "workload": self.name, "requests": len(self._requests),
            "num_prefixes": self.num_prefixes, "prefix_tokens": self.prefix_tokens,
            "suffix_tokens": self.suffix_tokens, "output_tokens": self.output_tokens,
            "seed": self.seed,
        }


class RandomWorkload(_StatelessBase):
    """vLLM's random dataset: lengths uniform in [len*(1-r), len*(1+r)], optional shared prefix."""

    name = "random"

    def __init__(
        self,
        *,
        requests: int = 100,
        input_tokens: int = 1024,
        output_tokens: int = 128,
        range_ratio: float = 0.0,
        prefix_tokens: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(seed)
        if not 0.0 <= range_ratio < 1.0:
            raise ValueError("range_ratio must be in [0, 1)")
        self.input_tokens, self.output_tokens = input_tokens, output_tokens
        self.range_ratio, self.prefix_tokens = range_ratio, prefix_tokens
        rng = _rng(seed, "random/lengths")
        shared = segment_tokens(seed, "random/prefix", prefix_tokens)
        for i in range(requests):
            n_in = int(rng.integers(
                math.floor(input_tokens * (1 - range_ratio)),
                math.ceil(input_tokens * (1 + range_ratio)) + 1,
            ))
            n_out = int(rng.integers(
                max(1, math.floor(output_tokens * (1 - range_ratio))),
                math.ceil(output_tokens * (1 + range_ratio)) + 1,
            ))
            self._requests.append(TimedRequest(
                index=i, request_id=f"req-{i}", conversation_id=f"random-{i}", turn=0,
                arrival=None,
                prompt_token_ids=shared + segment_tokens(seed, f"random/{i}", n_in),
                max_tokens=n_out,
            ))

    def describe(self) -> dict[str, object]:
        return {
            "workload": self.name, "requests": len(self._requests),
            "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
            "range_ratio": self.range_ratio, "prefix_tokens": self.prefix_tokens,
            "seed": self.seed,
        }


def with_arrivals(plan: Iterable[PlannedRequest], arrivals: Sequence[float]) -> list[PlannedRequest]:
    """The plan with arrival offsets set (a Poisson rate given on the command line)."""
    return [
        PlannedRequest(p.index, p.conversation_id, p.turn, at)
        for p, at in zip(plan, arrivals, strict=False)
    ]
