"""The policy model shared by the trainer and the inference workers.

A Llama-architecture model built from a `transformers` config (no hub download)
with a character vocabulary: small enough to train and serve on a CPU, the same
code path a larger checkpoint would take.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig

# Printable ASCII plus newline; id 0 pads, id 1 begins, id 2 ends a completion.
PAD, BOS, EOS = 0, 1, 2
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
_SPECIAL = 3
VOCAB_SIZE = _SPECIAL + len(CHARS)
_TO_ID = {ch: i + _SPECIAL for i, ch in enumerate(CHARS)}


def encode(text: str) -> list[int]:
    try:
        return [_TO_ID[ch] for ch in text]
    except KeyError as exc:
        raise ValueError(f"character {exc.args[0]!r} is outside the policy's vocabulary") from None


def decode(token_ids: list[int]) -> str:
    return "".join(CHARS[i - _SPECIAL] for i in token_ids if i >= _SPECIAL)


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


LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""Architectures the embedded engine serves on its fast path (inference/model.py): a
decoder of RMSNorm, rotary attention with grouped-query heads (optional q/k/v bias,
optional per-head q/k norm) and a SiLU-gated MLP. Any other causal LM is served through
its transformers forward."""


@dataclass(frozen=True)
class ModelSpec:
    """What serving and training need to know of a checkpoint's architecture, read from
    its config.json (``from_hf_config``): the one description both sides share."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_positions: int
    """Longest prompt + completion in tokens (the checkpoint's max_position_embeddings)."""
    rope_theta: float = 10_000.0
    rms_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    """q, k and v projections carry a bias (Qwen2; Llama's attention_bias)."""
    o_bias: bool = False
    qk_norm: bool = False
    """A per-head RMSNorm on queries and keys before rope (Qwen3)."""
    num_experts: int = 0
    """Experts per MoE layer (0: a dense model)."""
    experts_per_token: int = 0
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    fast_path_refusal: str = ""
    """Why the engine's fast path cannot serve this checkpoint ("" when it can)."""

    @property
    def fast_path(self) -> bool:
        return not self.fast_path_refusal

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig) -> ModelSpec:
        c: Any = config
        text = c.get_text_config() if hasattr(c, "get_text_config") else c
        heads = int(_attr(text, "num_attention_heads", "n_head", default=1))
        hidden = int(_attr(text, "hidden_size", "n_embd", default=0))
        rope = getattr(text, "rope_parameters", None) or {}
        eos = getattr(text, "eos_token_id", None)
        if eos is None:
            eos = getattr(c, "eos_token_id", None)
        model_type = str(getattr(text, "model_type", c.model_type))
        spec = cls(
            model_type=model_type,
            vocab_size=int(text.vocab_size),
            hidden_size=hidden,
            num_layers=int(_attr(text, "num_hidden_layers", "n_layer", default=0)),
            num_heads=heads,
            num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(text, "head_dim", None) or hidden // max(heads, 1)),
            intermediate_size=int(_attr(text, "intermediate_size", "n_inner", default=0) or 0),
            max_positions=int(
                _attr(text, "max_position_embeddings", "n_positions", "n_ctx", default=2048)
            ),
            rope_theta=float(rope.get("rope_theta", getattr(text, "rope_theta", 10_000.0))),
            rms_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(getattr(text, "attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(getattr(text, "attention_bias", False)),
            qk_norm=model_type == "qwen3",
            num_experts=int(_attr(text, "num_experts", "num_local_experts", default=0) or 0),
            experts_per_token=int(getattr(text, "num_experts_per_tok", 0) or 0),
            eos_token_ids=tuple(eos)
            if isinstance(eos, list | tuple)
            else (() if eos is None else (int(eos),)),
            pad_token_id=getattr(text, "pad_token_id", None),
        )
        return dataclasses.replace(spec, fast_path_refusal=_fast_path_refusal(text, spec))


def _attr(config: Any, *names: str, default: Any) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _fast_path_refusal(config: Any, spec: ModelSpec) -> str:
    """Why the fast path would compute something else than transformers for ``config``."""
    if spec.model_type not in LLAMA_FAMILY:
        return f"architecture {spec.model_type!r} is outside the Llama family"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        return f"rope scaling {rope.get('rope_type')!r}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if getattr(config, "mlp_bias", False):
        return "MLP bias"
    window = getattr(config, "sliding_window", None)
    if window is not None and (
        getattr(config, "use_sliding_window", True) and window < spec.max_positions
    ):
        return f"sliding window {window} < {spec.max_positions} positions"
    if spec.num_heads % spec.num_kv_heads:
        return f"{spec.num_heads} heads over {spec.num_kv_heads} key/value heads"
    return ""


def demo_hf_config(config: PolicyConfig = PolicyConfig()) -> LlamaConfig:
    """The built-in demo policy's transformers config (see build_model)."""
    return LlamaConfig(
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


DEMO_SPEC = ModelSpec.from_hf_config(demo_hf_config())
"""The built-in demo policy's architecture (PolicyConfig's defaults)."""


def build_model(config: PolicyConfig = PolicyConfig(), seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    hf_config = demo_hf_config(config)
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
