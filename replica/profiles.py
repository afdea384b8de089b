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
class SimCostProfile:
    """A simulated replica's per-step cost coefficients, in seconds.

    Not the gateway's router.policy.types.PrefillProfile, which predicts one request's
    prefill from fewer coefficients (loadgen's gateway config converts one to the other).
    """

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


INSTANT = SimCostProfile("instant")


# ------------------------------------------------------------------ cited inputs
# Every built-in profile below is derived, not typed in: each coefficient is a formula
# (derive_profile) over a model's shape, an accelerator's datasheet figures and a few
# efficiency assumptions, each with its source or stated as an assumption. None of them
# was measured here; `python -m replica calibrate` against a real replica replaces them.


@dataclass(frozen=True)
class ModelShape:
    """The model dimensions a cost model needs, as its model card and config.json give them."""

    name: str
    params: float
    layers: int
    query_heads: int
    kv_heads: int
    head_dim: int
    bytes_per_value: int  # 2 for bf16 weights and KV cache
    source: str


@dataclass(frozen=True)
class Accelerator:
    """One GPU's peak dense bf16 throughput and HBM bandwidth, from its vendor datasheet."""

    name: str
    dense_bf16_flops: float
    hbm_bytes_per_s: float
    source: str


@dataclass(frozen=True)
class Deployment:
    """A model served on `tensor_parallel` GPUs, with the efficiencies we assume for it."""

    model: ModelShape
    gpu: Accelerator
    tensor_parallel: int
    # Assumption: the fraction of peak dense FLOPs the linear layers reach in prefill.
    mfu: float
    # Assumption: FLOP/s the attention kernels reach per GPU on paged, variable-length
    # prefill (far below dense matmuls: FlashAttention-3 reports up to ~75% of peak on
    # long fixed-length sequences, arXiv:2407.08608; serving batches are short and ragged).
    attention_flops_per_gpu: float
    # Assumption: tensor-parallel all-reduces (two per layer) per forward pass.
    allreduce_s: float = 0.0
    assumptions: str = ""


def derive_profile(name: str, d: Deployment) -> SimCostProfile:
    """The step-cost coefficients of a deployment, each from its cited inputs.

    - base_s: every weight is read from HBM once per forward pass (weights split over
      the tensor-parallel GPUs), plus the all-reduces.
    - token_s: a token costs 2 FLOPs per parameter in the dense layers.
    - attention_s: one (query token, context token) pair costs 4 FLOPs per query-head
      dimension per layer (2 for q.k, 2 for the weighted sum of v).
    - kv_read_s: a decode streams each context token's K and V of every layer from HBM.
    """
    m, g, tp = d.model, d.gpu, d.tensor_parallel
    weight_bytes = m.params * m.bytes_per_value
    kv_bytes_per_token = 2 * m.layers * m.kv_heads * m.head_dim * m.bytes_per_value
    return SimCostProfile(
        name,
        base_s=weight_bytes / tp / g.hbm_bytes_per_s + d.allreduce_s,
        token_s=2 * m.params / (tp * g.dense_bf16_flops * d.mfu),
        attention_s=4 * m.layers * m.query_heads * m.head_dim
        / (tp * d.attention_flops_per_gpu),
        kv_read_s=kv_bytes_per_token / tp / g.hbm_bytes_per_s,
    )


H100_SXM = Accelerator(
    "NVIDIA H100 SXM", dense_bf16_flops=989e12, hbm_bytes_per_s=3.35e12,
    # The datasheet lists BF16 Tensor Core 1,979 TFLOPS "with sparsity": half is dense.
    source="NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column "
           "(nvidia.com/en-us/data-center/h100): BF16 1,979 TFLOPS with sparsity "
           "(989 dense), GPU memory bandwidth 3.35 TB/s",
)

LLAMA_31_8B = ModelShape(
    "Llama-3.1-8B", params=8.03e9, layers=32, query_heads=32, kv_heads=8, head_dim=128,
    bytes_per_value=2,
    source="huggingface.co/meta-llama/Llama-3.1-8B: model card (8.03B parameters) and "
           "config.json (num_hidden_layers 32, hidden_size 4096, num_attention_heads 32, "
           "num_key_value_heads 8, so head_dim 4096 / 32 = 128; torch_dtype bfloat16)",
)

QWEN3_32B = ModelShape(
    "Qwen3-32B", params=32.8e9, layers=64, query_heads=64, kv_heads=8, head_dim=128,
    bytes_per_value=2,
    source="huggingface.co/Qwen/Qwen3-32B: model card (32.8B parameters, 64 layers, 64 "
           "query heads and 8 KV heads) and config.json (head_dim 128, hidden_size 5120, "
           "torch_dtype bfloat16)",
)

# Llama-3.1-8B (bf16) on one H100 SXM. Cold 1,000-token prompt: ~70 ms to its first
# token. Order-of-magnitude check of token_s: third-party vLLM benchmarks report ~12,500
# tokens/s total throughput for this model on one H100 (Azure HPC blog "Performance of
# Llama 3.1 8B AI Inference using vLLM on ND-H100-v5", Aug 2025).
H100_LLAMA_8B_DEPLOYMENT = Deployment(
    LLAMA_31_8B, H100_SXM, tensor_parallel=1, mfu=0.25, attention_flops_per_gpu=130e12,
    assumptions="25% MFU in the dense layers; attention kernels at 130 TFLOPS (13% of "
                "peak); no all-reduce (one GPU)",
)
H100_LLAMA_8B = derive_profile("h100-llama3.1-8b", H100_LLAMA_8B_DEPLOYMENT)

# Qwen3-32B (bf16) on one pod of two H100 SXM GPUs, tensor parallel 2: the pod llm-d's
# precise-prefix-cache benchmark ran eight of (llm-d.ai/blog/kvcache-wins-you-can-see; its
# guide guides/precise-prefix-cache-aware deploys 8 replicas x 2 GPUs). A cold
# 7,200-token prompt (llm-d's 6,000 + 1,200) takes ~1.25 s to its first token and one with
# its 6,000-token prefix cached ~0.25 s. The one public figure we found is slower: a cold
# 10,000-token prompt on Qwen3-32B at 4.3 s (a Red Hat Summit 2026 llm-d talk, as
# summarised at lucaberton.com/blog/llmd-kv-cache-routing-summit-2026; hardware not
# stated), against ~1.9 s here: treat absolute times as optimistic; the cold/cached ratio
# (~5x) is what routing acts on. Its KV cache: 2 x 80 GB x 0.9 (vLLM's
# gpu_memory_utilization) - 65.6 GB of weights - ~8 GB of activations leaves ~70 GB, about
# 267,000 tokens per pod.
H100X2_QWEN3_32B_DEPLOYMENT = Deployment(
    QWEN3_32B, H100_SXM, tensor_parallel=2, mfu=0.23, attention_flops_per_gpu=130e12,
    allreduce_s=0.002,
    assumptions="23% MFU (a little under the 8B's, for the all-reduces); attention "
                "kernels at 130 TFLOPS per GPU; 2 ms of all-reduces per forward pass",
)
H100X2_QWEN3_32B = derive_profile("h100x2-qwen3-32b", H100X2_QWEN3_32B_DEPLOYMENT)

DEPLOYMENTS: dict[str, Deployment] = {
    H100_LLAMA_8B.name: H100_LLAMA_8B_DEPLOYMENT,
    H100X2_QWEN3_32B.name: H100X2_QWEN3_32B_DEPLOYMENT,
}

# Not a hardware model: round numbers for tests that check times by hand, 1 ms per step
# and 1 ms per token.
UNIT = SimCostProfile("unit", base_s=0.001, token_s=0.001)

BUILTIN: dict[str, SimCostProfile] = {
    p.name: p for p in (INSTANT, H100_LLAMA_8B, H100X2_QWEN3_32B, UNIT)
}
DEFAULT_PROFILE = H100_LLAMA_8B.name


def load_profile(name_or_path: str) -> SimCostProfile:
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
    profile = SimCostProfile(**data)
    if min(profile.base_s, profile.token_s, profile.attention_s, profile.kv_read_s) < 0:
        raise ValueError(f"{path}: profile coefficients must be >= 0")
    return profile
