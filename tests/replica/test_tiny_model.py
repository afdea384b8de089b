"""The tiny model: built offline, deterministic, loadable by transformers."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import safetensors

from replica.tiny_model import CHAT_TEMPLATE, bfloat16_bits, build_tokenizer

REPO = Path(__file__).resolve().parents[2]


def test_loads_with_transformers_and_generates(tiny_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    config = model.config
    assert config.hidden_size // config.num_attention_heads == 64  # vLLM CPU's head size
    assert config.num_hidden_layers == 2
    assert config.max_position_embeddings == 8192
    assert 2000 <= len(tokenizer) <= 8192
    assert config.vocab_size == len(tokenizer)

    ids = tokenizer("Hello world", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config.vocab_size)


def test_bos_added_only_with_special_tokens(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    plain = tokenizer.encode("The cache works.", add_special_tokens=False)
    with_bos = tokenizer.encode("The cache works.")
    assert with_bos == [tokenizer.bos_token_id, *plain]
    assert tokenizer.decode(plain) == "The cache works."


def test_chat_template_renders_roles_tools_and_generation_prompt(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "-3 C"},
    ]
    tools: list[Any] = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=True)
    assert text == (
        "<s><|im_start|>system\nBe brief.\n\n# Tools\nYou may call these functions:\n"
        '{"name": "weather", "parameters": {}}\n<|im_end|>\n'
        "<|im_start|>user\nWeather?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}'
        "</tool_call><|im_end|>\n"
        "<|im_start|>tool\n<tool_response>-3 C</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) == 5  # role markers are single special tokens
    closed = tokenizer.apply_chat_template(messages[:2], tokenize=False)
    assert isinstance(closed, str) and closed.endswith("<|im_end|>\n")


def test_config_declares_template_and_specials(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    assert config["bos_token"] == "<s>"
    assert (tiny_model_dir / "model.safetensors").stat().st_size > 100_000


def test_tokenizer_is_deterministic() -> None:
    def digest(seed: int) -> str:
        return hashlib.sha256(build_tokenizer(seed).to_str().encode()).hexdigest()

    assert digest(0) == digest(0)
    assert digest(0) != digest(1)


def _weights(model_dir: Path) -> dict[str, tuple[str, list[int], np.ndarray]]:
    """name -> (dtype, shape, values as float32), read by safetensors itself."""
    tensors = safetensors.deserialize((model_dir / "model.safetensors").read_bytes())
    out = {}
    for name, spec in tensors:
        bits = np.frombuffer(bytes(spec["data"]), dtype="<u2").astype(np.uint32) << 16
        out[name] = (spec["dtype"], spec["shape"], bits.view(np.float32).reshape(spec["shape"]))
    return out


def test_weights_have_llamas_names_shapes_and_bfloat16(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"
    vocab, hidden, inter = config["vocab_size"], config["hidden_size"], 256
    per_layer = {
        "self_attn.q_proj.weight": [hidden, hidden], "self_attn.k_proj.weight": [hidden, hidden],
        "self_attn.v_proj.weight": [hidden, hidden], "self_attn.o_proj.weight": [hidden, hidden],
        "mlp.gate_proj.weight": [inter, hidden], "mlp.up_proj.weight": [inter, hidden],
        "mlp.down_proj.weight": [hidden, inter], "input_layernorm.weight": [hidden],
        "post_attention_layernorm.weight": [hidden],
    }
    expected = {"model.embed_tokens.weight": [vocab, hidden], "lm_head.weight": [vocab, hidden],
                "model.norm.weight": [hidden]}
    for i in range(config["num_hidden_layers"]):
        expected |= {f"model.layers.{i}.{k}": v for k, v in per_layer.items()}
    weights = _weights(tiny_model_dir)
    assert {name: shape for name, (_, shape, _) in weights.items()} == expected
    assert {dtype for dtype, _, _ in weights.values()} == {"BF16"}
    # Initialised as transformers does: N(0, 0.02), padding row zero, norms one.
    assert 0.019 < float(weights["lm_head.weight"][2].std()) < 0.021
    assert not weights["model.embed_tokens.weight"][2][config["pad_token_id"]].any()
    assert (weights["model.norm.weight"][2] == 1.0).all()


def test_builds_without_torch(tmp_path: Path) -> None:
    # The demo's --no-vllm setup installs no torch: a None entry in sys.modules makes
    # any `import torch` (ours or a library's) raise ImportError.
    code = ("import sys; sys.modules['torch'] = None; "
            "from replica.tiny_model import build_tiny_model; "
            f"build_tiny_model({str(tmp_path)!r})")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    assert (tmp_path / "model.safetensors").stat().st_size > 100_000
    assert json.loads((tmp_path / "generation_config.json").read_text())["pad_token_id"] == 0


def test_weights_are_deterministic() -> None:
    from replica.tiny_model import random_weights

    first, again, other = (random_weights(3000, 0, seed) for seed in (0, 0, 1))
    assert all(np.array_equal(first[k], again[k]) for k in first)
    assert not np.array_equal(first["lm_head.weight"], other["lm_head.weight"])


def test_bfloat16_rounds_to_nearest_even() -> None:
    values = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-7, -2.0], dtype=np.float32)
    # 1 + 2^-8 and 1 + 3*2^-8 lie halfway between two bfloat16 values: ties go to even.
    assert bfloat16_bits(values).tolist() == [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0xC000]
