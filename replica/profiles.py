"""How long one engine step takes: the simulated replica's cost model.

A step is one forward pass over a batch: prefill chunks (new tokens attending to their
context) and decodes (one token each, reading its whole KV). Its cost is

    step_s = base_s                                  # weights read once per pass
           + token_s * (all new tokens in the step)  # dense matmuls, linear in tokens
           + attention_s * sum(new * (context + (new + 1) / 2))  # prefill attention
           + kv_read_s * sum(decode contexts)        # decodes stream their KV
    (0 when the batch is empty)

so a cached prefix saves its token_s share and shrinks nothing else: exactly the saving
a cache-aware router is after.

Profiles are built in by name or loaded from a JSON file holding these fields (what
`python -m replica calibrate` writes).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class PrefillProfile:
    """Per-step cost coefficients, in seconds."""

    name: str
    base_s: float = 0.0
    token_s: float = 0.0
    attention_s: float = 0.0
    kv_read_s: float = 0.0

    def step_cost(self, prefills: Sequence[tuple[int, int]], decode_contexts: Sequence[int]) -> float:
        """Seconds for one step: `prefills` as (new tokens, tokens already computed) pairs,
        `decode_contexts` as each decoding sequence's current length."""
        if not prefills and not decode_contexts:
            return 0.0
        new_tokens = sum(n for n, _ in prefills) + len(decode_contexts)
        # Token j of a chunk attends to context + j + 1 positions; summed over the chunk.
        pairs = sum(n * ctx + n * (n + 1) / 2 for n, ctx in prefills)
        return (
            self.base_s
            + self.token_s * new_tokens
            + self.attention_s * pairs
            + self.kv_read_s * sum(decode_contexts)
        )

    def prefill_seconds(self, num_tokens: int, cached: int = 0) -> float:
        """TTFT of a lone request: one step prefilling `num_tokens - cached` tokens."""
        return self.step_cost([(num_tokens - cached, cached)], [])

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


INSTANT = PrefillProfile("instant")

# Llama-3.1-8B (bf16) on one H100 SXM: an estimate derived from the hardware and the
# model, not measured here; replace it with `python -m replica calibrate` output when a
# real replica is at hand. Inputs: the H100 SXM datasheet (989 TFLOPS dense bf16,
# 3.35 TB/s HBM3) and the model config (8.0e9 params, 32 layers, 8 KV heads x 128 dims).
# - base_s 5 ms: streaming 16 GB of weights at ~3.3 TB/s once per forward pass.
# - token_s 1/15,000 s: 2 x 8e9 FLOPs per token at ~240 TFLOPS achieved (~25% MFU), so a
#   1,000-token cold prompt takes ~75 ms to its first token. Order-of-magnitude check:
#   third-party vLLM benchmarks report ~12,500 tokens/s total throughput for this model on
#   one H100 (morphllm.com/vllm-benchmarks; Azure HPC blog "Performance of Llama 3.1 8B
#   AI Inference using vLLM on ND-H100-v5", Aug 2025).
# - attention_s 4e-12 s per (new token, context token) pair: 4 x 32 layers x 4096 FLOPs
#   per pair at ~130 TFLOPS achieved by the attention kernels.
# - kv_read_s 40 ns per context token per decode: 128 KiB of K/V per token at 3.3 TB/s.
H100_LLAMA_8B = PrefillProfile(
    "h100-llama3.1-8b", base_s=0.005, token_s=1 / 15_000, attention_s=4e-12, kv_read_s=4e-8,
)

# Round numbers for tests that check times by hand: 1 ms per step, 1 ms per token.
UNIT = PrefillProfile("unit", base_s=0.001, token_s=0.001)

BUILTIN: dict[str, PrefillProfile] = {p.name: p for p in (INSTANT, H100_LLAMA_8B, UNIT)}
DEFAULT_PROFILE = H100_LLAMA_8B.name


def load_profile(name_or_path: str) -> PrefillProfile:
    """A built-in profile by name, or one read from a JSON file."""
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(
            f"unknown prefill profile {name_or_path!r}: not a built-in "
            f"({', '.join(BUILTIN)}) nor a JSON file"
        )
    data = json.loads(path.read_text())
    fields = {"name", "base_s", "token_s", "attention_s", "kv_read_s"}
    unknown = set(data) - fields
    if unknown:
        raise ValueError(f"{path}: unknown profile fields {sorted(unknown)}")
    data.setdefault("name", path.stem)
    profile = PrefillProfile(**data)
    if min(profile.base_s, profile.token_s, profile.attention_s, profile.kv_read_s) < 0:
        raise ValueError(f"{path}: profile coefficients must be >= 0")
    return profile
