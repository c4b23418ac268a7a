"""The policy model shared by the trainer and the inference workers.

A Llama-architecture model built from a `transformers` config (no hub download)
with a character vocabulary: small enough to train and serve on a CPU, the same
code path a larger checkpoint would take.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import xxhash
from transformers import LlamaConfig, LlamaForCausalLM

# Printable ASCII plus newline; id 0 pads, id 1 begins, id 2 ends a completion.
PAD, BOS, EOS = 0, 1, 2
_CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
_SPECIAL = 3
VOCAB_SIZE = _SPECIAL + len(_CHARS)
_TO_ID = {ch: i + _SPECIAL for i, ch in enumerate(_CHARS)}


def encode(text: str) -> list[int]:
    try:
        return [_TO_ID[ch] for ch in text]
    except KeyError as exc:
        raise ValueError(f"character {exc.args[0]!r} is outside the policy's vocabulary") from None


def decode(token_ids: list[int]) -> str:
    return "".join(_CHARS[i - _SPECIAL] for i in token_ids if i >= _SPECIAL)


@dataclass(frozen=True)
class PolicyConfig:
    hidden_size: int = 128
    """Model width."""
    num_layers: int = 3
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads (no grouped-query attention at this size)."""
    intermediate_size: int = 384
    """MLP width."""
    max_positions: int = 128
    """Longest prompt + completion in tokens."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )

    def fingerprint(self) -> str:
        return hashlib.sha256(repr(self).encode()).hexdigest()[:12]


def build_model(config: PolicyConfig = PolicyConfig(), seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    hf_config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=config.max_positions,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        tie_word_embeddings=True,
    )
    hf_config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(hf_config)
    model.eval()
    return model


def state_dict_fp32(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached, contiguous copy of the weights, tied tensors listed once."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        out[name] = tensor.detach().to(torch.float32).contiguous().clone()
    return out


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """xxh3-128 over every tensor's name, dtype, shape and bytes, in name order: equal
    digests mean bit-identical weights."""
    digest = xxhash.xxh3_128()
    for name in sorted(weights):
        tensor = weights[name].detach().contiguous().cpu()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy weights in place (strict on names present; tied weights follow)."""
    missing = model.load_state_dict(weights, strict=False)
    unexpected = list(missing.unexpected_keys)
    if unexpected:
        raise KeyError(f"weights for unknown tensors: {unexpected[:5]}")
