"""The policy's forward pass for serving: a lean Llama over a slot KV cache.

The trainer runs the policy as a `transformers` LlamaForCausalLM; serving runs the
same arithmetic here without that module tree. Each decode step is a few dozen
tensor ops over every active sequence at once. `generate()` pays Python for every
module, hook and cache object on every step, and at this model size that overhead
is most of the cost.

* ``Params`` is one immutable version of the weights, built from a state dict (the
  names `rtrl.policy.state_dict_fp32` gives) with q/k/v and gate/up fused into one
  matmul each. A swap replaces the whole object between two steps, so a step never
  sees half of one version and half of another.
* ``SlotCache`` holds keys and values for up to ``slots`` sequences. Active
  sequences live in rows 0..n-1; a finished one is replaced by the last row
  (``move``), so attention reads a contiguous view of the cache, never a gather.

Numerics match LlamaForCausalLM in float32 to ~1e-6: RMSNorm, rotary embeddings
(default rope), causal attention, SiLU-gated MLP and tied embeddings, computed
the same way (tests/inference/test_engine.py checks logits against it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rtrl.policy import PolicyConfig

ROPE_THETA = 10_000.0
RMS_EPS = 1e-6


@dataclass(frozen=True)
class Layer:
    """One decoder layer's matrices, transposed for ``x @ m`` (contiguous: a faster
    matmul than through a transposed view). Each RMSNorm's weight is folded into the
    matrix that follows it: (x_hat * w) @ W^T = x_hat @ (W * w)^T, one op fewer."""

    qkv: torch.Tensor
    """[hidden, 5 * hidden]: the q, k and v projections side by side, then q and k
    already rotated by half (the rotary embedding's rotate_half, a signed permutation
    of rows), so rope is two products and a sum; input norm and, in q, the attention
    scale folded in."""
    out: torch.Tensor
    gate_up: torch.Tensor
    """[hidden, 2 * intermediate]: gate and up projections, post-attention norm folded in."""
    down: torch.Tensor


@dataclass(frozen=True)
class Params:
    """One version of the policy's weights, ready to serve (never modified once built)."""

    config: PolicyConfig
    embed: torch.Tensor
    layers: tuple[Layer, ...]
    lm_head: torch.Tensor
    """[hidden, vocab], the final norm folded in."""
    cos: torch.Tensor
    """[max_positions, head_dim] rotary tables."""
    sin: torch.Tensor
    source: dict[str, torch.Tensor]
    """Copies of the weights as staged (what the arm serves, for inspection)."""

    @classmethod
    def from_state_dict(
        cls, weights: dict[str, torch.Tensor], config: PolicyConfig = PolicyConfig()
    ) -> Params:
        """Copies what it needs, so the caller's tensors may change afterwards."""

        def get(name: str) -> torch.Tensor:
            return weights[name].detach().to(torch.float32)

        def fold(norm: str, *matrices: torch.Tensor) -> torch.Tensor:
            """The matrices stacked, scaled by the norm weight on their input side, transposed."""
            return (torch.cat(matrices) * get(norm)[None, :]).T.contiguous()

        head_dim = config.hidden_size // config.num_heads
        half = head_dim // 2
        within = torch.arange(config.hidden_size) % head_dim
        # rotate_half(q)[j] = -q[j + half] for the first half of each head, q[j - half] after.
        source_row = torch.where(
            within < half,
            torch.arange(config.hidden_size) + half,
            torch.arange(config.hidden_size) - half,
        )
        sign = torch.where(within < half, -1.0, 1.0)[:, None]

        # The attention's 1/sqrt(head_dim) is folded into q (rope is linear, so before it is the same).
        scale = head_dim**-0.5
        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            q, k, v = (get(p + f"self_attn.{n}_proj.weight") for n in "qkv")
            layers.append(
                Layer(
                    qkv=fold(
                        p + "input_layernorm.weight",
                        q * scale,
                        k,
                        v,
                        q[source_row] * sign * scale,
                        k[source_row] * sign,
                    ),
                    out=get(p + "self_attn.o_proj.weight").T.contiguous(),
                    gate_up=fold(
                        p + "post_attention_layernorm.weight",
                        get(p + "mlp.gate_proj.weight"),
                        get(p + "mlp.up_proj.weight"),
                    ),
                    down=get(p + "mlp.down_proj.weight").T.contiguous(),
                )
            )
        # Tied embeddings: state_dict_fp32 lists the shared tensor once, under the embedding's name.
        head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
        cos, sin = rope_tables(config)
        source = {name: get(name).clone() for name in weights}
        return cls(
            config,
            source["model.embed_tokens.weight"],
            tuple(layers),
            fold("model.norm.weight", get(head)),
            cos,
            sin,
            source,
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights this version was built from, under the trainer's names (read-only)."""
        return dict(self.source)


def rope_tables(config: PolicyConfig) -> tuple[torch.Tensor, torch.Tensor]:
    head_dim = config.hidden_size // config.num_heads
    inv_freq = 1.0 / (
        ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    freqs = torch.arange(config.max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


class SlotCache:
    """Keys and values of up to ``slots`` sequences: values [layers, slots, heads,
    positions, head_dim], keys transposed [layers, slots, heads, head_dim, positions]
    so q @ k^T reads them in their own layout."""

    def __init__(self, config: PolicyConfig, slots: int) -> None:
        head_dim = config.hidden_size // config.num_heads
        self.k = torch.zeros(
            (config.num_layers, slots, config.num_heads, head_dim, config.max_positions)
        )
        self.v = torch.zeros(
            (config.num_layers, slots, config.num_heads, config.max_positions, head_dim)
        )

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy row ``src``'s first ``length`` positions into row ``dst``."""
        self.k[:, dst, :, :, :length] = self.k[:, src, :, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


def _rms(x: torch.Tensor) -> torch.Tensor:
    """RMSNorm without its weight (folded into the next matrix). Spelled out: on the
    CPU, F.rms_norm is no fused kernel and costs twice this."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True).mul_(1.0 / x.shape[-1]).add_(RMS_EPS))


def _out_and_mlp(x: torch.Tensor, attn: torch.Tensor, layer: Layer) -> torch.Tensor:
    """The rest of a layer after attention, on [tokens, hidden]: output projection and
    MLP, each added to the residual in one addmm."""
    x = torch.addmm(x, attn, layer.out)
    gate, up = torch.mm(_rms(x), layer.gate_up).chunk(2, dim=-1)
    return torch.addmm(x, F.silu(gate) * up, layer.down)


def decode_step(
    params: Params, cache: SlotCache, tokens: torch.Tensor, positions: torch.Tensor, length: int
) -> torch.Tensor:
    """Feed one token to each of rows 0..n-1 (``tokens``/``positions`` [n]); returns
    next-token logits [n, vocab]. Row i's token goes in at ``positions[i]``, after
    the cached keys/values of its earlier positions; ``length`` = max(positions) + 1."""
    cfg = params.config
    n, heads = tokens.shape[0], cfg.num_heads
    head_dim = cfg.hidden_size // heads
    rows = torch.arange(n)
    # A row attends to its own positions 0..positions[i]; later slots hold other data.
    hidden = (torch.arange(length)[None, :] > positions[:, None])[:, None, None, :]
    cos, sin = params.cos[positions][:, None, None, :], params.sin[positions][:, None, None, :]
    x = params.embed[tokens]
    for i, layer in enumerate(params.layers):
        qkv = torch.mm(_rms(x), layer.qkv).view(n, 5, heads, head_dim)
        q, k = (qkv[:, :2] * cos + qkv[:, 3:] * sin).unbind(1)
        cache.k[i, rows, :, :, positions] = k
        cache.v[i, rows, :, positions] = qkv[:, 2]
        # One query per row: a plain softmax over its keys beats the fused kernel's setup.
        scores = torch.matmul(q[:, :, None, :], cache.k[i, :n, :, :, :length])
        attn = torch.matmul(
            scores.masked_fill_(hidden, float("-inf")).softmax(-1), cache.v[i, :n, :, :length]
        )
        x = _out_and_mlp(x, attn.reshape(n, cfg.hidden_size), layer)
    return torch.mm(_rms(x), params.lm_head)


def prefill(
    params: Params, cache: SlotCache, first_row: int, sequences: list[list[int]]
) -> torch.Tensor:
    """Run whole sequences into rows first_row.. of the cache (positions 0..len-1);
    returns the logits after each sequence's last token [len(sequences), vocab]."""
    cfg = params.config
    m, heads = len(sequences), cfg.num_heads
    head_dim = cfg.hidden_size // heads
    lengths = torch.tensor([len(s) for s in sequences])
    width = int(lengths.max())
    ids = torch.zeros((m, width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq)
    positions = torch.arange(width)
    # Causal, and blind to the right padding of shorter sequences.
    mask = (positions[None, :] <= positions[:, None])[None, None] & (
        positions[None, :] < lengths[:, None]
    )[:, None, None, :]
    cos, sin = params.cos[:width][None, :, None, :], params.sin[:width][None, :, None, :]
    x = params.embed[ids]
    rows = slice(first_row, first_row + m)
    for i, layer in enumerate(params.layers):
        qkv = torch.matmul(_rms(x), layer.qkv).view(m, width, 5, heads, head_dim)
        q, k = (qkv[:, :, :2] * cos[:, :, None] + qkv[:, :, 3:] * sin[:, :, None]).unbind(2)
        k = k.transpose(1, 2)
        v = qkv[:, :, 2].transpose(1, 2)
        cache.k[i, rows, :, :, :width] = k.transpose(-1, -2)
        cache.v[i, rows, :, :width] = v
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=mask, scale=1.0
        )  # q is pre-scaled
        flat = _out_and_mlp(
            x.reshape(m * width, cfg.hidden_size),
            attn.transpose(1, 2).reshape(m * width, cfg.hidden_size),
            layer,
        )
        x = flat.view(m, width, cfg.hidden_size)
    last = x[torch.arange(m), lengths - 1]
    return torch.mm(_rms(last), params.lm_head)
