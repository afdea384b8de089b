"""Seeded generators of timed requests, the shapes routing policies are judged on.

A workload is a plan (which conversation sends which turn, and when) plus a renderer
that turns one planned request into a prompt: token ids for /v1/completions and the
in-process engine, and, with `chat_text=True`, the same prompt as chat messages (and
tools, for agents) whose words stand for its token ids (chat_text.py).

- base.py: token segments, planned and rendered requests, the Workload protocol.
- conversations.py: chat sessions and agents, which resend their history every turn.
- independent.py: llm-d's prefix groups, vLLM's prefix-repetition and random datasets.
- trace.py: Mooncake traces.
"""

from loadgen.workloads.base import (
    AGENT_LAYOUTS,
    PREAMBLE_POSITIONS,
    TOKEN_HIGH,
    TOKEN_LOW,
    ChatMessage,
    PlannedRequest,
    TimedRequest,
    Workload,
    poisson_arrivals,
    segment_tokens,
    timestamp_tokens,
)
from loadgen.workloads.chat_text import WORD_PER_ID, Lexicon, lexicon_from_tokenizer
from loadgen.workloads.conversations import AgentWorkload, ChatWorkload
from loadgen.workloads.independent import (
    GroupsWorkload,
    PrefixRepetitionWorkload,
    RandomWorkload,
)
from loadgen.workloads.trace import (
    TRACE_BLOCK_TOKENS,
    TraceRecord,
    TraceWorkload,
    expand_hash_ids,
    read_trace,
    trace_block_tokens,
)

__all__ = [
    "AGENT_LAYOUTS", "PREAMBLE_POSITIONS", "TOKEN_HIGH", "TOKEN_LOW", "TRACE_BLOCK_TOKENS",
    "WORD_PER_ID", "AgentWorkload", "ChatMessage", "ChatWorkload", "GroupsWorkload",
    "Lexicon", "PlannedRequest", "PrefixRepetitionWorkload", "RandomWorkload",
    "TimedRequest", "TraceRecord", "TraceWorkload", "Workload", "expand_hash_ids",
    "lexicon_from_tokenizer", "poisson_arrivals", "read_trace", "segment_tokens",
    "timestamp_tokens", "trace_block_tokens",
]
