"""The tiny model: built offline, deterministic, loadable by transformers."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from replica.tiny_model import CHAT_TEMPLATE, build_tokenizer


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
