"""Tiny random Hugging Face checkpoints, built on the spot (no model hub): a real
``save_pretrained`` directory (config.json, model.safetensors) with a byte-level BPE
tokenizer trained here and a ChatML chat template. Loadable by transformers, by rtrl
(``rtrl up --model DIR``) and by SGLang; ``rtrl model tiny DIR --family qwen3`` writes one.

The weights are random, so the model says nothing useful; what it exercises is every
path a real checkpoint takes: its architecture, its tokenizer, its template, its names.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedTokenizerFast,
)

CHATML = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The chat template every tiny checkpoint carries (Qwen's ChatML)."""

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_ID, IM_START_ID, EOS_ID = 0, 1, 2
"""The special tokens' ids: the tokenizer's trainer puts them first, in this order."""

_CORPUS = (
    "def add(a, b):\n    return a + b\n",
    "def greet(name):\n    print('hello, ' + name)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "Please rename the variable and keep the tests passing.",
    "Why did you change the indentation? Use two spaces here.",
    "for i in range(10):\n  total += values[i]\n",
    'import json\nwith open("data.json") as f:\n    data = json.load(f)\n',
    "The quick brown fox jumps over the lazy dog. Ünïcödé text: ß, é, 你好, 🙂.",
)

FAMILIES: dict[str, dict[str, object]] = {
    "llama": {"num_key_value_heads": 2},
    "mistral": {"num_key_value_heads": 2, "sliding_window": None},
    "qwen2": {"num_key_value_heads": 2},
    "qwen3": {"num_key_value_heads": 2, "head_dim": 16},
    "qwen3_moe": {
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
    "mixtral": {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2},
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256},
}
"""Architectures a tiny checkpoint can have (transformers model_type), with what sets each
apart from the shared shape below. gpt2 is the non-Llama one: learned positions,
LayerNorm, GELU, a fused c_attn."""


def bpe_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a few lines of code and prose (any text
    encodes: bytes outside the merges fall back to single-byte tokens), with ChatML."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(_CORPUS) * 8, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML
    return fast


def tiny_config(family: str, vocab_size: int, max_positions: int = 256) -> PretrainedConfig:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {sorted(FAMILIES)}")
    shape: dict[str, object] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": IM_START_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    }
    if family == "gpt2":
        shape = {
            k: v for k, v in shape.items() if k in ("vocab_size", "bos_token_id", "eos_token_id")
        }
        shape["pad_token_id"] = PAD_ID
    return AutoConfig.for_model(family, **{**shape, **FAMILIES[family]})


def write_tiny_checkpoint(
    out_dir: Path, family: str = "qwen3", *, seed: int = 0, max_positions: int = 256
) -> Path:
    """Save a random ``family`` model with a BPE tokenizer and chat template to ``out_dir``."""
    tokenizer = bpe_tokenizer()
    config = tiny_config(family, len(tokenizer), max_positions)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # the default init is ~0.02: make the distributions far from uniform
        for name, param in model.named_parameters():
            if param.dim() >= 2 and "norm" not in name:
                param.normal_(0.0, 0.15)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
