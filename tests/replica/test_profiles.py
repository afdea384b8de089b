"""The built-in sim cost profiles are their cited derivations, and sane against each other."""

from __future__ import annotations

import pytest

from replica.profiles import (
    BUILTIN,
    DEPLOYMENTS,
    H100_LLAMA_8B,
    H100_SXM,
    LLAMA_31_8B,
    Deployment,
    derive_profile,
)


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_each_coefficient_is_the_formula_of_its_cited_inputs(name: str) -> None:
    d = DEPLOYMENTS[name]
    m, g, tp = d.model, d.gpu, d.tensor_parallel
    profile = BUILTIN[name]
    assert m.source and g.source and d.assumptions
    assert profile.base_s == pytest.approx(
        m.params * m.bytes_per_value / tp / g.hbm_bytes_per_s + d.allreduce_s)
    assert profile.token_s == pytest.approx(2 * m.params / (tp * g.dense_bf16_flops * d.mfu))
    assert profile.attention_s == pytest.approx(
        4 * m.layers * m.query_heads * m.head_dim / (tp * d.attention_flops_per_gpu))
    assert profile.kv_read_s == pytest.approx(
        2 * m.layers * m.kv_heads * m.head_dim * m.bytes_per_value / tp / g.hbm_bytes_per_s)


def test_llama_8b_attention_is_its_own_derivation_not_a_thousandth_of_it() -> None:
    # Issue 13: attention_s was 4e-12, 1,000x below 4 x 32 x 4,096 / 130 TFLOPS = 4e-9.
    assert H100_LLAMA_8B.attention_s == pytest.approx(4 * 32 * 4096 / 130e12)
    # The quadratic term is now visible: at 8k tokens attention is a third or more of a
    # cold prefill's dense cost, where the old value made it 0.05%.
    n = 8192
    attention = H100_LLAMA_8B.attention_s * n * (n + 1) / 2
    dense = H100_LLAMA_8B.token_s * n
    assert 0.2 < attention / dense < 1.0


def test_derivation_scales_with_its_inputs() -> None:
    one = Deployment(LLAMA_31_8B, H100_SXM, tensor_parallel=1, mfu=0.25,
                     attention_flops_per_gpu=130e12)
    two = Deployment(LLAMA_31_8B, H100_SXM, tensor_parallel=2, mfu=0.25,
                     attention_flops_per_gpu=130e12)
    a, b = derive_profile("a", one), derive_profile("b", two)
    assert b.token_s == pytest.approx(a.token_s / 2)
    assert b.attention_s == pytest.approx(a.attention_s / 2)
    assert b.kv_read_s == pytest.approx(a.kv_read_s / 2)
    assert b.base_s == pytest.approx(a.base_s / 2)


def test_profiles_order_cold_prompts_as_the_hardware_would() -> None:
    small, big = BUILTIN["h100-llama3.1-8b"], BUILTIN["h100x2-qwen3-32b"]
    for n in (1000, 7200):
        assert big.prefill_seconds(n) > small.prefill_seconds(n)
        # A cached prefix saves most of a long prompt's first-token time.
        assert small.prefill_seconds(n, cached=n - 200) < small.prefill_seconds(n) / 3


def test_calibration_fit_recovers_a_profile_despite_one_stalled_request() -> None:
    from replica.calibrate import Sample, fit_profile

    truth = H100_LLAMA_8B
    samples = [Sample(n, truth.prefill_seconds(n), None)
               for n in (64, 256, 1024, 2048, 4096, 8192) for _ in range(3)]
    samples[4] = Sample(samples[4].prompt_tokens, samples[4].ttft + 0.5, None)  # a stall
    fitted = fit_profile(samples)
    assert fitted.token_s == pytest.approx(truth.token_s, rel=0.05)
    assert fitted.attention_s == pytest.approx(truth.attention_s, rel=0.05)
    assert fitted.base_s == pytest.approx(truth.base_s, abs=0.002)
