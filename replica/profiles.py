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

# Qwen3-32B (bf16) on one pod of two H100 SXM GPUs, tensor parallel 2: the pod llm-d's
# precise-prefix-cache benchmark ran eight of (llm-d.ai/blog/kvcache-wins-you-can-see; its
# guide guides/precise-prefix-cache-aware deploys 8 replicas x 2 GPUs). An estimate from
# the hardware and the model, made the same way as the 8B profile above, not measured
# here. Inputs: the H100 SXM datasheet (989 TFLOPS dense bf16, 3.35 TB/s HBM3 per GPU)
# and Qwen3-32B's config (32.8e9 params, 64 layers, 64 query heads and 8 KV heads of 128).
# - base_s 12 ms: 65.6 GB of weights, half per GPU, read at ~3.3 TB/s (~10 ms), plus ~2 ms
#   of tensor-parallel all-reduces (two per layer) per forward pass.
# - token_s 1/7,000 s: 2 x 32.8e9 FLOPs per token at ~2 x 230 TFLOPS achieved (~23% MFU,
#   a little under the 8B's for the all-reduces), so a cold 7,200-token prompt (llm-d's
#   6,000 + 1,200) takes ~1.25 s to its first token and one with its 6,000-token prefix
#   cached ~0.25 s. The one public figure we found is slower: a cold 10,000-token prompt
#   on Qwen3-32B at 4.3 s (a Red Hat Summit 2026 llm-d talk, as summarised at
#   lucaberton.com/blog/llmd-kv-cache-routing-summit-2026; hardware not stated), against
#   1.8 s here (~2.3x faster): treat absolute times as optimistic; the cold/cached ratio
#   (~5x) is what routing acts on.
# - attention_s 8e-9 s per (new token, context token) pair: 4 x 64 layers x 64 heads x
#   128 dims = 2.1e6 FLOPs per pair at ~2 x 130 TFLOPS achieved by the attention kernels
#   (0.2 s of the cold 7,200-token prompt above, 0.06 s of the cached one).
# - kv_read_s 40 ns per context token per decode: 256 KiB of K/V per token (64 layers x
#   8 KV heads x 128 dims x K and V x 2 bytes), half per GPU, at ~3.3 TB/s each.
# Its KV cache: 2 x 80 GB x 0.9 (vLLM's gpu_memory_utilization) - 65.6 GB of weights -
# ~8 GB of activations leaves ~70 GB, about 267,000 tokens per pod.
H100X2_QWEN3_32B = PrefillProfile(
    "h100x2-qwen3-32b", base_s=0.012, token_s=1 / 7_000, attention_s=8e-9, kv_read_s=4e-8,
)

# Round numbers for tests that check times by hand: 1 ms per step, 1 ms per token.
UNIT = PrefillProfile("unit", base_s=0.001, token_s=0.001)

BUILTIN: dict[str, PrefillProfile] = {
    p.name: p for p in (INSTANT, H100_LLAMA_8B, H100X2_QWEN3_32B, UNIT)
}
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
