"""`python -m replica tiny-model --out DIR`: a tiny random Llama with a real tokenizer, offline.

Tests and benchmarks need a model that real vLLM (CPU) serves in seconds and whose
tokenizer behaves like a production one where it matters for prefix caching: byte-level
BPE, a BOS token the post-processor adds to plain text (so add_special_tokens changes
the ids), chat special tokens, and a chat template with system/user/assistant/tool
messages, tool definitions and a generation prompt. The weights are random, so the
model's answers are noise; only its shapes and its tokenizer matter. Building it needs
no torch (numpy writes the weights), so the demo's `--no-vllm` setup can build it.

Shapes follow vLLM CPU's constraints: head size 64 (hidden 128 over 2 heads), and a
context of 8192 so 128k-token benchmarks can still tokenize (not serve) long prompts.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import LlamaConfig

BOS = "<s>"
EOS = "</s>"
PAD = "<pad>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
SPECIAL_TOKENS = (
    PAD, BOS, EOS, IM_START, IM_END, TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END,
)

VOCAB_SIZE = 4096
HIDDEN_SIZE = 128
NUM_HEADS = 2
NUM_LAYERS = 2
INTERMEDIATE_SIZE = 256
MAX_POSITIONS = 8192
INITIALIZER_RANGE = 0.02

# ChatML-style. Every role marker is a special token, so the rendered text splits at
# special-token boundaries between messages (router/tokenize.py's prefix cache relies
# on that). Tools are listed in the system section; an assistant's tool calls are
# rendered from their parsed `arguments` mapping, as vLLM hands them to templates.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{%- set system_message = messages[0].content -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system_message = none -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- if system_message is not none or tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if system_message is not none -%}{{- system_message -}}{%- endif -%}"
    "{%- if tools -%}"
    "{{- '\\n\\n# Tools\\nYou may call these functions:\\n' -}}"
    "{%- for tool in tools -%}"
    "{{- (tool.function if tool.function is defined else tool) | tojson -}}{{- '\\n' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if message.role == 'tool' -%}"
    "{{- '<|im_start|>tool\\n<tool_response>' + (message.content or '') + '</tool_response>' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') -}}"
    "{%- endif -%}"
    "{%- if message.role == 'assistant' and message.tool_calls -%}"
    "{%- for call in message.tool_calls -%}"
    "{{- '<tool_call>' -}}"
    "{{- {'name': call.function.name, 'arguments': call.function.arguments} | tojson -}}"
    "{{- '</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if "
    "so no will more about can said what out up them some time could into two then do first "
    "any my now such like other how its our over only these may after new most made also "
    "cache prefix block token request replica gateway route router model server latency "
    "prompt system user assistant tool call function weather city temperature date today "
    "error retry timeout queue memory throughput batch stream event index hash chain score "
    "policy tenant salt session history turn answer question summary document code python "
    "json value key list string number true false null return import class def self data"
).split()
_CODE_LINES = (
    'def handler(request):\n    return {"status": "ok", "items": [1, 2, 3]}\n',
    'import json\nprint(json.dumps({"city": "Paris", "unit": "celsius"}))\n',
    "for i in range(10):\n    total += i * 2  # accumulate\n",
    '{"name": "get_weather", "arguments": {"city": "Berlin", "days": 3}}\n',
    "SELECT id, name FROM users WHERE created_at > '2024-01-01';\n",
    "<html><body><p>Hello, world!</p></body></html>\n",
)


def training_corpus(seed: int = 0) -> list[str]:
    """A small, deterministic English/code/JSON corpus for the BPE trainer."""
    rng = random.Random(seed)
    lines: list[str] = []
    for _ in range(4000):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        sentence = " ".join(words).capitalize() + rng.choice([".", "?", "!", ",", ":"])
        if rng.random() < 0.3:
            sentence += f" {rng.randint(0, 99999)} {rng.random():.3f}"
        lines.append(sentence)
    lines.extend(_CODE_LINES * 50)
    return lines


def build_tokenizer(seed: int = 0) -> Tokenizer:
    """A byte-level BPE tokenizer with chat special tokens and a BOS post-processor."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        # Specials take the lowest ids; normalized=False and no strip so the text
        # between them is tokenized exactly as if it stood alone.
        special_tokens=[
            AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False)
            for t in SPECIAL_TOKENS
        ],
    )
    tokenizer.train_from_iterator(training_corpus(seed), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def _tokenizer_config() -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": IM_END,
        "pad_token": PAD,
        "unk_token": None,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "additional_special_tokens": [
            IM_START, TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END, EOS,
        ],
    }


def _special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    ids: dict[str, int] = {}
    for token in SPECIAL_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:  # the trainer was given every special token
            raise RuntimeError(f"special token {token!r} missing from the trained vocabulary")
        ids[token] = token_id
    return ids


def _llama_config(tokenizer: Tokenizer) -> LlamaConfig:
    from transformers import LlamaConfig

    ids = _special_ids(tokenizer)
    return LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS,
        head_dim=HIDDEN_SIZE // NUM_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=ids[BOS],
        eos_token_id=[ids[IM_END], ids[EOS]],
        pad_token_id=ids[PAD],
        tie_word_embeddings=False,
        initializer_range=INITIALIZER_RANGE,
        dtype="bfloat16",
    )


def random_weights(vocab_size: int, pad_token_id: int, seed: int = 0) -> dict[str, np.ndarray]:
    """LlamaForCausalLM's tensors (float32) for this module's shapes, as transformers inits them.

    Linear and embedding weights ~ N(0, 0.02) (LlamaConfig's initializer_range), the
    embedding's padding row zero, RMSNorm weights one. Names and shapes are those
    `save_pretrained` writes.
    """
    rng = np.random.default_rng(seed)
    hidden, inter, vocab = HIDDEN_SIZE, INTERMEDIATE_SIZE, vocab_size
    attn_out = NUM_HEADS * (HIDDEN_SIZE // NUM_HEADS)  # as many KV heads as query heads

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(0.0, INITIALIZER_RANGE, shape).astype(np.float32)

    embed = normal(vocab, hidden)
    embed[pad_token_id] = 0.0
    tensors = {"model.embed_tokens.weight": embed}
    for i in range(NUM_LAYERS):
        layer = f"model.layers.{i}"
        tensors |= {
            f"{layer}.self_attn.q_proj.weight": normal(attn_out, hidden),
            f"{layer}.self_attn.k_proj.weight": normal(attn_out, hidden),
            f"{layer}.self_attn.v_proj.weight": normal(attn_out, hidden),
            f"{layer}.self_attn.o_proj.weight": normal(hidden, attn_out),
            f"{layer}.mlp.gate_proj.weight": normal(inter, hidden),
            f"{layer}.mlp.up_proj.weight": normal(inter, hidden),
            f"{layer}.mlp.down_proj.weight": normal(hidden, inter),
            f"{layer}.input_layernorm.weight": np.ones(hidden, np.float32),
            f"{layer}.post_attention_layernorm.weight": np.ones(hidden, np.float32),
        }
    tensors["model.norm.weight"] = np.ones(hidden, np.float32)
    tensors["lm_head.weight"] = normal(vocab, hidden)
    return tensors


def bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even as torch does."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    return ((bits + rounding) >> 16).astype(np.uint16)


def write_safetensors_bf16(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Write float32 tensors as one BF16 safetensors file, as `save_pretrained` does.

    Written by hand because numpy has no bfloat16 dtype (safetensors.numpy cannot write
    BF16 without ml_dtypes). The format: an 8-byte little-endian header length, a JSON
    header (name -> dtype, shape, byte offsets; "format": "pt", which transformers
    requires), padded with spaces to 8 bytes, then the tensors back to back.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        blob = bfloat16_bits(tensors[name]).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with Path(path).open("wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for blob in blobs:
            f.write(blob)


def build_tiny_model(out: Path, *, seed: int = 0) -> Path:
    """Write a tiny random LlamaForCausalLM and its tokenizer into `out`; return `out`.

    Needs no torch: the weights come from numpy (the demo's `--no-vllm` setup installs
    no torch), in the layout, dtype (bfloat16) and config transformers writes.
    """
    from transformers import GenerationConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(seed)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(), indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": IM_END, "pad_token": PAD}, indent=2)
    )
    config = _llama_config(tokenizer)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    weights = random_weights(tokenizer.get_vocab_size(), _special_ids(tokenizer)[PAD], seed)
    write_safetensors_bf16(out / "model.safetensors", weights)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="directory to write the model into")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and corpus")


def run(args: argparse.Namespace) -> int:
    try:
        out = build_tiny_model(args.out, seed=args.seed)
    except OSError as exc:
        print(f"replica tiny-model: cannot write the model to {str(args.out)!r}: {exc}",
              file=sys.stderr)
        return 1
    print(out)
    return 0
