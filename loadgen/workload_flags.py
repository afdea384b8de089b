"""The workload flags of `compare` (and the demo), and the seeded workload they describe."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from loadgen.workloads import (
    AGENT_LAYOUTS,
    PREAMBLE_POSITIONS,
    WORD_PER_ID,
    AgentWorkload,
    ChatWorkload,
    GroupsWorkload,
    Lexicon,
    PrefixRepetitionWorkload,
    RandomWorkload,
    TraceWorkload,
    Workload,
    lexicon_from_tokenizer,
)

DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "mooncake_conversation.jsonl"
WORKLOADS = ("chat", "agent", "trace", "groups", "prefix-repetition", "random")
# Room for the chat template's role markers around a trace prompt sent as chat.
CHAT_TEMPLATE_TOKENS = 32


@functools.lru_cache(maxsize=4)
def _lexicon(model_dir: Path) -> Lexicon:
    return lexicon_from_tokenizer(model_dir)


def chat_lexicon(args: argparse.Namespace) -> Lexicon:
    """The words chat prompts are written in: single tokens of the served tokenizer."""
    model_dir = Path(getattr(args, "model_dir", "") or "")
    if (model_dir / "tokenizer.json").exists():
        return _lexicon(model_dir)
    return WORD_PER_ID


def _trace_file(text: str) -> Path:
    """--trace: a file that exists (else argparse names the flag, before any fleet starts)."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such trace file: {text!r}")
    return path


def _start(text: str) -> int:
    """--trace-start: a record count, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _rates(text: str) -> list[float]:
    """--rates: comma-separated positive request rates."""
    rates = []
    for item in text.split(","):
        try:
            rate = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"want comma-separated numbers (req/s), got {item!r} in {text!r}") from None
        if not rate > 0:
            raise argparse.ArgumentTypeError(f"rates must be above 0, got {item!r} in {text!r}")
        rates.append(rate)
    return rates


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """Workload flags shared by compare and demo (unused ones are ignored per workload)."""
    w = parser.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="chat")
    w.add_argument("--requests", type=int, default=None,
                   help="requests (chat, groups, prefix-repetition, random); trace: the limit")
    w.add_argument("--conversations", type=int, default=8, help="chat/agent conversations")
    w.add_argument("--turns", type=int, default=8, help="agent turns per conversation")
    w.add_argument("--shared-prefix-tokens", type=int, default=None,
                   help="chat system prompt / groups and prefix-repetition prefix / random "
                        "common prefix")
    w.add_argument("--preamble-tokens", type=int, default=0)
    w.add_argument("--preamble-position", choices=PREAMBLE_POSITIONS, default="after-system")
    w.add_argument("--question-tokens", type=int, default=None,
                   help="chat/agent/groups question; prefix-repetition suffix; random input")
    w.add_argument("--answer-tokens", type=int, default=None, help="output tokens per request")
    w.add_argument("--salt", choices=("none", "conversation"), default="none")
    w.add_argument("--instruction-tokens", type=int, default=480, help="agent instructions")
    w.add_argument("--tools", type=int, default=24, help="agent tool definitions")
    w.add_argument("--tool-tokens", type=int, default=180, help="tokens per agent tool")
    w.add_argument("--layout", choices=AGENT_LAYOUTS, default="stable", help="agent layout")
    w.add_argument("--trace", type=_trace_file, default=DEFAULT_TRACE,
                   help="Mooncake JSONL trace")
    w.add_argument("--trace-start", type=_start, default=0,
                   help="trace: skip this many records first (replay a later window)")
    w.add_argument("--groups", type=int, default=150)
    w.add_argument("--users", type=int, default=5)
    w.add_argument("--rates", type=_rates, default=[5.0],
                   help="groups: comma-separated Poisson rates (req/s), stepped up")
    w.add_argument("--stage-seconds", type=float, default=60.0)
    w.add_argument("--num-prefixes", type=int, default=10)
    w.add_argument("--range-ratio", type=float, default=0.0)


def build_workload(args: argparse.Namespace) -> Workload:
    """The seeded workload the flags describe (defaults per workload where a flag is unset)."""
    def pick(value: int | None, default: int) -> int:
        return default if value is None else value

    seed = args.seed
    chat = getattr(args, "api", "tokens") == "chat"
    lexicon = chat_lexicon(args) if chat else WORD_PER_ID
    if args.workload == "chat":
        return ChatWorkload(
            requests=pick(args.requests, 64), conversations=args.conversations,
            shared_prefix_tokens=pick(args.shared_prefix_tokens, 1000),
            preamble_tokens=args.preamble_tokens, preamble_position=args.preamble_position,
            question_tokens=pick(args.question_tokens, 50),
            answer_tokens=pick(args.answer_tokens, 50), salt=args.salt, seed=seed, chat_text=chat, lexicon=lexicon)
    if args.workload == "agent":
        return AgentWorkload(
            conversations=args.conversations, turns=args.turns,
            instruction_tokens=args.instruction_tokens, tools=args.tools,
            tool_tokens=args.tool_tokens, question_tokens=pick(args.question_tokens, 60),
            answer_tokens=pick(args.answer_tokens, 80), layout=args.layout, seed=seed,
            chat_text=chat, lexicon=lexicon)
    if args.workload == "trace":
        return TraceWorkload(
            args.trace, speedup=args.speedup, limit=pick(args.requests, 200),
            max_input_tokens=args.max_model_len - 1 - pick(args.answer_tokens, 64)
            - (CHAT_TEMPLATE_TOKENS if chat else 0),
            max_output_tokens=pick(args.answer_tokens, 64),
            start=getattr(args, "trace_start", 0), seed=seed, chat_text=chat, lexicon=lexicon)
    if args.workload == "groups":
        return GroupsWorkload(
            groups=args.groups, users=args.users,
            prefix_tokens=pick(args.shared_prefix_tokens, 6000),
            question_tokens=pick(args.question_tokens, 1200),
            output_tokens=pick(args.answer_tokens, 1000), requests=pick(args.requests, 200),
            rates=args.rates, stage_seconds=args.stage_seconds,
            seed=seed, chat_text=chat, lexicon=lexicon)
    if args.workload == "prefix-repetition":
        return PrefixRepetitionWorkload(
            requests=pick(args.requests, 100), num_prefixes=args.num_prefixes,
            prefix_tokens=pick(args.shared_prefix_tokens, 256),
            suffix_tokens=pick(args.question_tokens, 256),
            output_tokens=pick(args.answer_tokens, 128), seed=seed, chat_text=chat, lexicon=lexicon)
    return RandomWorkload(
        requests=pick(args.requests, 100), input_tokens=pick(args.question_tokens, 1024),
        output_tokens=pick(args.answer_tokens, 128), range_ratio=args.range_ratio,
        prefix_tokens=pick(args.shared_prefix_tokens, 0), seed=seed, chat_text=chat, lexicon=lexicon)
