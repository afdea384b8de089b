"""Conversations that resend their whole history every turn: chat sessions and agents.

Rendering is lazy because a conversation resends its answers too, and an answer is only
known once its turn finished: the driver records it with `record_answer` before it
renders the conversation's next turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from loadgen.workloads.base import (
    AGENT_LAYOUTS,
    MAX_TOOLS,
    PREAMBLE_POSITIONS,
    TOOL_HEADER,
    AgentLayout,
    ChatMessage,
    PlannedRequest,
    PreamblePosition,
    SaltMode,
    TimedRequest,
    seeded_rng,
    segment_tokens,
    timestamp_text,
    timestamp_tokens,
)
from loadgen.workloads.chat_text import WORD_PER_ID, Lexicon, tool_definition


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
        lexicon: Lexicon = WORD_PER_ID,
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
        self.lexicon = lexicon
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
        system = self.lexicon.text(self.system)
        pre = self.lexicon.text(preamble)
        if preamble and self.preamble_position == "first":
            system = f"{pre}\n{system}"
        elif preamble and self.preamble_position == "after-system":
            system = f"{system}\n{pre}"
        messages = [ChatMessage("system", system)]
        for asked, answered, text in history.turns:
            messages.append(ChatMessage("user", self.lexicon.text(asked)))
            # The answer's own text: only the exact text re-renders to the cached tokens.
            reply = text if text is not None else self.lexicon.text(answered)
            messages.append(ChatMessage("assistant", reply))
        last = self.lexicon.text(question)
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
        chat_text: bool = False,
        lexicon: Lexicon = WORD_PER_ID,
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
        self.chat_text = chat_text
        self.lexicon = lexicon
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
            seeded_rng(self.seed, f"agent/turn-order/{t}").shuffle(order)
            base = len(out)
            out.extend(PlannedRequest(index=base + i, conversation_id=f"agent-{c}", turn=t)
                       for i, c in enumerate(order))
        return out

    def tool_order(self, request_index: int) -> list[int]:
        """The tool order a request lists (identity unless the layout shuffles)."""
        order = list(range(self.num_tools))
        if self.layout == "shuffle":
            seeded_rng(self.seed, f"agent/shuffle/{request_index}").shuffle(order)
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
        messages: tuple[ChatMessage, ...] | None = None
        tool_defs: tuple[dict[str, object], ...] = ()
        if self.chat_text:
            messages, tool_defs = self._chat(planned, at, history, question)
        return TimedRequest(
            index=planned.index,
            request_id=f"req-{planned.index}",
            conversation_id=planned.conversation_id,
            turn=planned.turn,
            arrival=planned.arrival,
            prompt_token_ids=prompt,
            max_tokens=self.answer_tokens,
            messages=messages,
            tools=tool_defs,
            fallback_answer=segment_tokens(
                self.seed, f"agent/answer/{planned.conversation_id}/{planned.turn}",
                self.answer_tokens,
            ),
        )

    def _chat(self, planned: PlannedRequest, at: float, history: _History,
              question: tuple[int, ...]
              ) -> tuple[tuple[ChatMessage, ...], tuple[dict[str, object], ...]]:
        """The turn as an agent sends it: system instructions, tools, the whole history.

        The chat template renders the tools inside the system section, after the
        instructions, so the rendered prompt keeps the token layout's order:
        [timestamp] instructions, tools, history, question.
        """
        system = self.lexicon.text(self.instructions)
        if self.layout == "timestamp":
            system = f"{timestamp_text(at)}\n{system}"
        tools = tuple(tool_definition(k, self.lexicon.text(self.tools[k][1:]))
                      for k in self.tool_order(planned.index))
        messages = [ChatMessage("system", system)]
        for asked, answered, text in history.turns:
            messages.append(ChatMessage("user", self.lexicon.text(asked)))
            # The answer's own text: only the exact text re-renders to the cached tokens.
            messages.append(ChatMessage(
                "assistant", text if text is not None else self.lexicon.text(answered)))
        messages.append(ChatMessage("user", self.lexicon.text(question)))
        return tuple(messages), tools

    def describe(self) -> dict[str, object]:
        return {
            "workload": self.name, "conversations": self.conversations, "turns": self.turns,
            "instruction_tokens": self.instruction_tokens, "tools": self.num_tools,
            "tool_tokens": self.tool_tokens, "prefix_tokens": self.prefix_tokens,
            "question_tokens": self.question_tokens, "answer_tokens": self.answer_tokens,
            "layout": self.layout, "seed": self.seed,
        }
