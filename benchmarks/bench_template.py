"""Rendering a chat template with and without router/template_lookup.py's shortcut and memo.

    .venv/bin/python benchmarks/bench_template.py [--rounds 5] [--renders 200]
        [--model-dir DIR] [--turns 12] [--tools 24]

Two bodies, rendered as the gateway renders them (PromptTokenizer.render_chat): a
conversation of `--turns` question/answer pairs after a system prompt (a chat's next
turn), and an agent's first turn with `--tools` tool definitions. Each round renders
each body `--renders` times three ways: the sandbox's own attribute lookup and
transformers' tojson; the shortcut; the shortcut and the memoised tojson (each way first
in turn by round), checks the text is the same, and prints the median per render over
rounds with its spread and the ratios to the sandbox's. On a noisy machine
only the side-by-side ratio means much.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router.tokenize import PromptTokenizer

WORDS = "the quick brown fox jumps over a lazy dog near five old wells "


def bodies(turns: int, tools: int) -> dict[str, dict[str, Any]]:
    conversation: list[dict[str, str]] = [{"role": "system", "content": "Be brief. " * 20}]
    for i in range(turns):
        conversation += [{"role": "user", "content": f"{i}: {WORDS * 8}"},
                         {"role": "assistant", "content": f"{i}: {WORDS * 8}"}]
    conversation.append({"role": "user", "content": "and then?"})
    tool_defs = [{"type": "function", "function": {
        "name": f"tool_{k}", "description": f"Tool {k}. " + WORDS * 15,
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
        for k in range(tools)]
    return {
        f"chat, {2 * turns + 2} messages": {"messages": conversation},
        f"agent turn 1, {tools} tools": {"tools": tool_defs, "messages": [
            {"role": "system", "content": "You are an agent. " * 40},
            {"role": "user", "content": "task: " + WORDS}]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--renders", type=int, default=200)
    parser.add_argument("--model-dir", help="a model directory (python -m replica tiny-model)")
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--tools", type=int, default=24)
    args = parser.parse_args(argv)
    for name in ("rounds", "renders", "turns", "tools"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    from transformers.utils.chat_template_utils import _compile_jinja_template

    model_dir = args.model_dir
    if model_dir is None:
        model_dir = str(Path(tempfile.mkdtemp(prefix="bench-template-")) / "tiny")
        subprocess.run([sys.executable, "-m", "replica", "tiny-model", "--out", model_dir],
                       check=True, capture_output=True)
    tok = PromptTokenizer.from_dir(model_dir)
    print(f"{args.rounds} rounds x {args.renders} renders of each body, each way; "
          "ms per render, median over rounds [min..max]")
    for label, body in bodies(args.turns, args.tools).items():
        fast_text = tok.render_chat(body)  # installs the shortcut in the template's env
        template = tok._chat_template or tok._hf.get_chat_template(None, tools=body.get("tools"))
        env = _compile_jinja_template(template).environment
        fast, memo = env.getattr, env.filters["tojson"]
        sandbox, plain = type(env).getattr.__get__(env), memo.__wrapped__
        ways = {"sandbox": (sandbox, plain), "shortcut": (fast, plain), "+memo": (fast, memo)}
        times: dict[str, list[float]] = {way: [] for way in ways}
        for round_ in range(args.rounds):
            order = list(ways)
            order = order[round_ % 3:] + order[:round_ % 3]  # each way first in turn
            for way in order:
                env.getattr, env.filters["tojson"] = ways[way]
                started = time.perf_counter()
                for _ in range(args.renders):
                    text = tok.render_chat(body)
                times[way].append((time.perf_counter() - started) / args.renders)
                if text != fast_text:
                    raise SystemExit(f"{label}: the {way} way rendered different text")
        env.getattr, env.filters["tojson"] = fast, memo
        med = {way: statistics.median(v) for way, v in times.items()}
        spread = {way: f"[{min(v) * 1e3:.3f}..{max(v) * 1e3:.3f}]" for way, v in times.items()}
        print(f"{label:<24} sandbox {med['sandbox'] * 1e3:.3f} {spread['sandbox']}  "
              f"shortcut {med['shortcut'] * 1e3:.3f} {spread['shortcut']} "
              f"{med['shortcut'] / med['sandbox']:.2f}x  +memo {med['+memo'] * 1e3:.3f} "
              f"{spread['+memo']} {med['+memo'] / med['sandbox']:.2f}x  (same text)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
