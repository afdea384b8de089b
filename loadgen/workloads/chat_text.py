"""Token-id prompts rendered as the chat a real client sends: messages, tools, words.

The workloads plan prompts as token ids (segments shared exactly where the workload means
them to be). A chat run sends the same prompts as /v1/chat/completions bodies instead:
each token id becomes one word of a `Lexicon`, so two prompts that share a token prefix
share a text prefix, and once the gateway and the replica render the chat template and
tokenize it, the same prefix structure reappears in their token ids.

With a lexicon of words that the served tokenizer keeps as single tokens
(`lexicon_from_tokenizer`), a segment of n ids renders to n tokens, so chat prompts are
as long as their token-id twins (plus the template's role markers and the tools' JSON).
Without one, ids become "w<id>" words: the prefix structure holds, but a real tokenizer
splits each word into a few tokens.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# A word the tokenizer keeps whole: lower-case letters after byte-level BPE's space mark.
_WORD_PIECE = re.compile(r"Ġ([a-z]{2,})")


@dataclass(frozen=True)
class Lexicon:
    """Token id -> word; `words` empty means the "w<id>" fallback."""

    words: tuple[str, ...] = ()

    def text(self, tokens: Sequence[int]) -> str:
        """The words standing for `tokens`, space-separated (one word per id)."""
        if not self.words:
            return " ".join(f"w{t}" for t in tokens)
        n = len(self.words)
        # Distinct ids may share a word (n is small); random segments still diverge at
        # their first differing id with probability 1 - 1/n, which keeps prefixes apart.
        return " ".join(self.words[t % n] for t in tokens)

    def describe(self) -> str:
        """For reports: what a chat word is."""
        if not self.words:
            return "one 'w<id>' word per token id (a few tokens each once tokenized)"
        return f"one single-token word per token id ({len(self.words)} words)"


WORD_PER_ID = Lexicon()


def lexicon_from_tokenizer(path: Path) -> Lexicon:
    """The words of a tokenizer.json (a HF fast tokenizer) that encode as one token each."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
    candidates = sorted(m.group(1) for piece in tokenizer.get_vocab()
                        if (m := _WORD_PIECE.fullmatch(piece)))
    words = tuple(w for w in candidates
                  if len(tokenizer.encode(" " + w, add_special_tokens=False).ids) == 1)
    if len(words) < 16:
        raise ValueError(f"{path}: only {len(words)} single-token words; too few to render "
                         "chat prompts from token ids")
    return Lexicon(words)


def tool_definition(k: int, description: str) -> dict[str, object]:
    """Tool k as an OpenAI `tools` entry; its description carries the tool's tokens."""
    return {
        "type": "function",
        "function": {
            "name": f"tool_{k}",
            "description": description,
            "parameters": {"type": "object", "properties": {}},
        },
    }

