"""`python -m router diagnose diverge A B`: where two prompts stop sharing cached blocks.

Prefix caching reuses only the leading blocks two prompts share exactly; one changed
token (a timestamp in the system prompt, a request id, tool JSON in another key order)
and every later block misses. This command shows the first differing token, how many
blocks are still reusable, and the text on both sides of the break, so the cause is
visible. `explain_divergence` is pure and reused by the gateway's prompt-hygiene code.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router.hashing import first_divergence

Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True)
class Divergence:
    """Where two token sequences part, in tokens and in blocks, with the text around it.

    `index` is the first position whose ids differ, or None when one sequence is a
    prefix of the other (or they are equal). `shared_tokens` leading tokens are equal;
    `reusable_blocks` = shared_tokens // block_size full blocks can be reused.
    `common_text` is the decoded shared context just before the split; `text_a` and
    `text_b` are the decoded tokens from the split on, on each side.
    """

    len_a: int
    len_b: int
    block_size: int
    index: int | None
    shared_tokens: int
    reusable_blocks: int
    common_text: str
    text_a: str
    text_b: str

    @property
    def identical(self) -> bool:
        return self.index is None and self.len_a == self.len_b

    @property
    def recomputed_tokens_b(self) -> int:
        """Tokens of B that miss a cache holding A's blocks."""
        return self.len_b - self.reusable_blocks * self.block_size

    def summary(self) -> str:
        """A few lines for a person: the split point, what is reusable, the text around it."""
        lines = [f"A: {self.len_a} tokens, B: {self.len_b} tokens, block size {self.block_size}"]
        if self.identical:
            lines.append("identical: every full block is reusable")
        elif self.index is None:
            longer = "B" if self.len_b > self.len_a else "A"
            lines.append(f"no differing token: {longer} extends the other after token {self.shared_tokens}")
        else:
            lines.append(
                f"first difference at token {self.index} "
                f"(block {self.index // self.block_size}, offset {self.index % self.block_size})"
            )
        lines.append(
            f"reusable: {self.reusable_blocks} blocks ({self.reusable_blocks * self.block_size} "
            f"tokens); B recomputes {self.recomputed_tokens_b} tokens"
        )
        if not self.identical:
            lines.append(f"common: ...{_show(self.common_text)}")
            lines.append(f"A then: {_show(self.text_a)}...")
            lines.append(f"B then: {_show(self.text_b)}...")
        return "\n".join(lines)


def _show(text: str) -> str:
    # repr-style escapes make a changed newline or space visible; drop repr's quotes.
    return repr(text)[1:-1]


def explain_divergence(
    ids_a: Sequence[int], ids_b: Sequence[int], block_size: int, decode: Decode,
    *, context_tokens: int = 24,
) -> Divergence:
    """Compare two token sequences: first differing token, reusable blocks, text around it."""
    if block_size <= 0:
        raise ValueError(f"block size must be positive, got {block_size}")
    shared = first_divergence(ids_a, ids_b)
    differs = shared < min(len(ids_a), len(ids_b))
    start = max(0, shared - context_tokens)
    return Divergence(
        len_a=len(ids_a),
        len_b=len(ids_b),
        block_size=block_size,
        index=shared if differs else None,
        shared_tokens=shared,
        reusable_blocks=shared // block_size,
        common_text=decode(list(ids_a[start:shared])),
        text_a=decode(list(ids_a[shared:shared + context_tokens])),
        text_b=decode(list(ids_b[shared:shared + context_tokens])),
    )


class DiagnoseError(ValueError):
    """A problem with the inputs, named for the user."""


def load_prompt_ids(path: Path, tokenizer: Any | None, *, add_special_tokens: bool) -> list[int]:
    """Token ids from a request JSON file, a JSON list of ids, or rendered prompt text."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise DiagnoseError(f"cannot read {str(path)!r}: {exc.strerror}") from exc
    body: Any = None
    if text.lstrip().startswith(("{", "[")):
        try:
            body = json.loads(text)
        except json.JSONDecodeError:
            body = None  # rendered text that happens to start with a bracket
    if isinstance(body, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in body):
        return list(body)
    if tokenizer is None:
        raise DiagnoseError(f"{str(path)!r} needs tokenizing: pass --model DIR")
    from router.request import ClientError
    from router.tokenize import endpoint_of

    if isinstance(body, dict):
        try:
            return list(tokenizer.request_tokens(body, endpoint_of(body)))
        except ClientError as exc:
            raise DiagnoseError(f"{str(path)!r}: {exc.message}") from exc
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="what", required=True, metavar="WHAT")
    diverge = sub.add_parser("diverge", help="where prompts A and B stop sharing blocks")
    diverge.add_argument("a", type=Path, help="request JSON, JSON list of ids, or rendered prompt text")
    diverge.add_argument("b", type=Path, help="the same kinds as A")
    diverge.add_argument("--model", type=Path, default=None,
                         help="model directory whose tokenizer renders A and B")
    diverge.add_argument("--block-size", type=int, default=16)
    diverge.add_argument("--context", type=int, default=24,
                         help="tokens of text to show on each side of the split")
    diverge.add_argument("--add-special-tokens", action="store_true",
                         help="for plain-text files that are completion prompts (adds BOS)")


def run(args: argparse.Namespace) -> int:
    tokenizer = None
    try:
        if args.block_size <= 0:
            raise DiagnoseError(f"--block-size must be positive, got {args.block_size}")
        if args.model is not None:
            from router.tokenize import PromptTokenizer

            tokenizer = PromptTokenizer.from_dir(args.model)
        ids_a = load_prompt_ids(args.a, tokenizer, add_special_tokens=args.add_special_tokens)
        ids_b = load_prompt_ids(args.b, tokenizer, add_special_tokens=args.add_special_tokens)
    except (DiagnoseError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def decode(ids: Sequence[int]) -> str:
        if tokenizer is not None:
            return str(tokenizer.decode(ids))
        return " ".join(str(t) for t in ids)  # no tokenizer: show the ids themselves

    print(explain_divergence(ids_a, ids_b, args.block_size, decode, context_tokens=args.context)
          .summary())
    return 0
