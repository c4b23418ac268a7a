"""The policy's forward pass for serving: a lean Llama over a slot KV cache, and
transformers' own forward for any other architecture.

The trainer runs the policy as a `transformers` model; serving runs the same
arithmetic here without that module tree when the architecture is in the Llama family
(llama, mistral, qwen2, qwen3: `rtrl.policy.ModelSpec.fast_path`). Each decode step is
a few dozen tensor ops over every active sequence at once. `generate()` pays Python
for every module, hook and cache object on every step, and at small model sizes that
overhead is most of the cost.

* ``Params`` is one immutable version of the weights, built from a state dict (the
  names `rtrl.policy.state_dict_fp32` gives) with q/k/v and gate/up fused into one
  matmul each. A swap replaces the whole object between two steps, so a step never
  sees half of one version and half of another.
* ``SlotCache`` holds keys and values for up to ``slots`` sequences. Active
  sequences live in rows 0..n-1; a finished one is replaced by the last row
  (``move``), so attention reads a contiguous view of the cache, never a gather.
* ``HFParams`` and ``TransformersCache`` are the same two roles for architectures
  outside the fast path (GPT-2, mixture-of-experts, ...): the checkpoint's transformers
  module over each row's own transformers key/value cache, one row at a time. Slower,
  and exactly transformers. For a MoE model it records the experts routed to at every
  position (``Routes``), for the trainer to replay.

Numerics match transformers in float32 to ~1e-6: RMSNorm, rotary embeddings (default
rope), grouped-query causal attention with optional q/k/v bias and per-head q/k norm,
SiLU-gated MLP, tied or untied output layer, computed the same way
(tests/inference/test_model_families.py checks logits against it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Cache, PretrainedConfig, PreTrainedModel

from rtrl.moe import record_routes, routers
from rtrl.policy import DEMO_SPEC, ModelSpec, load_weights


@dataclass(frozen=True)
class Layer:
    """One decoder layer's matrices, transposed for ``x @ m`` (contiguous: a faster
    matmul than through a transposed view). Each RMSNorm's weight is folded into the
    matrix that follows it: (x_hat * w) @ W^T = x_hat @ (W * w)^T, one op fewer."""

    qkv: torch.Tensor
    """[hidden, columns]: the q and k projections (every head of q, then of k), the
    same again rotated by half (rotate_half is a signed permutation of rows, so rope is
    two products and a sum), then v; input norm and, in q, the attention scale folded
    in. With a q/k norm (Qwen3) the norm sits between projection and rope, so there are
    no rotated rows: q, k, v."""
    qkv_bias: torch.Tensor | None
    """The q/k/v biases in the columns' layout (Qwen2), None without."""
    qk_norm: torch.Tensor | None
    """[heads + kv_heads, head_dim]: the per-head RMSNorm weights of q (attention scale
    folded in) and k (Qwen3), None without."""
    out: torch.Tensor
    out_bias: torch.Tensor | None
    gate_up: torch.Tensor
    """[hidden, 2 * intermediate]: gate and up projections, post-attention norm folded in."""
    down: torch.Tensor


@dataclass(frozen=True)
class Params:
    """One version of a Llama-family model's weights, ready to serve (never modified once built)."""

    spec: ModelSpec
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
        cls, weights: dict[str, torch.Tensor], spec: ModelSpec = DEMO_SPEC
    ) -> Params:
        """Copies what it needs, so the caller's tensors may change afterwards."""
        if not spec.fast_path:
            raise ValueError(f"the lean forward cannot serve this model: {spec.fast_path_refusal}")
        source = {name: t.detach().to(torch.float32).clone() for name, t in weights.items()}
        # Tied embeddings: state_dict_fp32 lists the shared tensor once, under the embedding's name.
        head = "lm_head.weight" if "lm_head.weight" in source else "model.embed_tokens.weight"
        cos, sin = rope_tables(spec)
        return cls(
            spec,
            source["model.embed_tokens.weight"],
            tuple(_layer(source, spec, f"model.layers.{i}.") for i in range(spec.num_layers)),
            _fold(source[head], source["model.norm.weight"]),
            cos,
            sin,
            source,
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights this version was built from, under the trainer's names (read-only)."""
        return dict(self.source)


def _fold(matrix: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """``matrix`` scaled by the norm weight on its input side, transposed."""
    return (matrix * norm[None, :]).T.contiguous()


def _layer(source: dict[str, torch.Tensor], spec: ModelSpec, prefix: str) -> Layer:
    def get(name: str) -> torch.Tensor:
        return source[prefix + name]

    attn = "self_attn."
    q, k, v = (get(f"{attn}{n}_proj.weight") for n in "qkv")
    qkv_bias = None
    if spec.qkv_bias:
        bq, bk, bv = (get(f"{attn}{n}_proj.bias") for n in "qkv")
        qkv_bias = _qkv_rows(bq, bk, bv, spec)
    qk_norm = None
    if spec.qk_norm:
        scale = spec.head_dim**-0.5
        qk_norm = torch.cat(
            [
                get(attn + "q_norm.weight").expand(spec.num_heads, -1) * scale,
                get(attn + "k_norm.weight").expand(spec.num_kv_heads, -1),
            ]
        )
    return Layer(
        qkv=_fold(_qkv_rows(q, k, v, spec), get("input_layernorm.weight")),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        out=get(attn + "o_proj.weight").T.contiguous(),
        out_bias=get(attn + "o_proj.bias") if spec.o_bias else None,
        gate_up=_fold(
            torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")]),
            get("post_attention_layernorm.weight"),
        ),
        down=get("mlp.down_proj.weight").T.contiguous(),
    )


def _qkv_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """q, k and v (weights or biases: rows along dim 0) stacked in Layer.qkv's layout.
    The attention's 1/sqrt(head_dim) goes into q here (rope is linear, so before it is
    the same), unless a q norm follows, which takes it instead."""
    if spec.qk_norm:
        return torch.cat([q, k, v])
    q = q * spec.head_dim**-0.5
    return torch.cat([q, k, _rotate_rows(q, spec.head_dim), _rotate_rows(k, spec.head_dim), v])


def _rotate_rows(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """rotate_half over each head's rows: the rows whose product is rotate_half(x @ W^T)."""
    first, second = rows.unflatten(0, (-1, head_dim)).chunk(2, dim=1)
    return torch.cat([-second, first], dim=1).flatten(0, 1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def rope_tables(spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = torch.arange(spec.max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


class SlotCache:
    """Keys and values of up to ``slots`` sequences, per key/value head: values [layers,
    slots, kv_heads, positions, head_dim], keys transposed [layers, slots, kv_heads,
    head_dim, positions] so q @ k^T reads them in their own layout."""

    def __init__(self, spec: ModelSpec, slots: int) -> None:
        shape = (spec.num_layers, slots, spec.num_kv_heads)
        self.k = torch.zeros((*shape, spec.head_dim, spec.max_positions))
        self.v = torch.zeros((*shape, spec.max_positions, spec.head_dim))

    def prefill(
        self, params: Weights, first_row: int, sequences: list[list[int]], start: int = 0
    ) -> torch.Tensor:
        return prefill(_lean(params), self, first_row, sequences, start)

    def decode(self, params: Weights, tokens: list[int], positions: list[int]) -> torch.Tensor:
        return decode_step(
            _lean(params), self, torch.tensor(tokens), torch.tensor(positions), max(positions) + 1
        )

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy row ``src``'s first ``length`` positions into row ``dst``."""
        self.k[:, dst, :, :, :length] = self.k[:, src, :, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def routes(self, row: int) -> Routes | None:
        """None: the lean forward serves dense models only."""
        return None


def _lean(params: Weights) -> Params:
    if not isinstance(params, Params):
        raise TypeError("a SlotCache runs the lean forward's Params, not transformers'")
    return params


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without its weight (folded into the next matrix). Spelled out: on the
    CPU, F.rms_norm is no fused kernel and costs twice this."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True).mul_(1.0 / x.shape[-1]).add_(eps))


def _attention_inputs(
    params: Params, layer: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [..., heads, head_dim], k and v [..., kv_heads, head_dim] of the residual
    stream ``x`` [..., hidden], rope applied (``cos``/``sin`` broadcast over heads)."""
    spec = params.spec
    heads, kv_heads = spec.num_heads, spec.num_kv_heads
    y = torch.matmul(_rms(x, spec.rms_eps), layer.qkv)
    if layer.qkv_bias is not None:
        y += layer.qkv_bias
    # split_with_sizes, not Tensor.split: that one is Python, and this runs per layer per step.
    rows = y.unflatten(-1, (-1, spec.head_dim))
    if layer.qk_norm is None:
        qk, rotated, v = rows.split_with_sizes([heads + kv_heads, heads + kv_heads, kv_heads], -2)
        roped = qk * cos + rotated * sin
    else:
        qk, v = rows.split_with_sizes([heads + kv_heads, kv_heads], -2)
        qk = _rms(qk, spec.rms_eps) * layer.qk_norm
        roped = qk * cos + _rotate_half(qk) * sin
    q, k = roped.split_with_sizes([heads, kv_heads], -2)
    return q, k, v


def _out_and_mlp(x: torch.Tensor, attn: torch.Tensor, layer: Layer, eps: float) -> torch.Tensor:
    """The rest of a layer after attention, on [tokens, hidden]: output projection and
    MLP, each added to the residual in one addmm."""
    x = torch.addmm(x, attn, layer.out)
    if layer.out_bias is not None:
        x += layer.out_bias
    gate, up = torch.mm(_rms(x, eps), layer.gate_up).chunk(2, dim=-1)
    return torch.addmm(x, F.silu(gate) * up, layer.down)


def decode_step(
    params: Params, cache: SlotCache, tokens: torch.Tensor, positions: torch.Tensor, length: int
) -> torch.Tensor:
    """Feed one token to each of rows 0..n-1 (``tokens``/``positions`` [n]); returns
    next-token logits [n, vocab]. Row i's token goes in at ``positions[i]``, after
    the cached keys/values of its earlier positions; ``length`` = max(positions) + 1."""
    spec = params.spec
    n, kv_heads = tokens.shape[0], spec.num_kv_heads
    rows = torch.arange(n)
    # A row attends to its own positions 0..positions[i]; later slots hold other data.
    hidden = (torch.arange(length)[None, :] > positions[:, None])[:, None, None, :]
    cos, sin = params.cos[positions][:, None, :], params.sin[positions][:, None, :]
    x = params.embed[tokens]
    for i, layer in enumerate(params.layers):
        q, k, v = _attention_inputs(params, layer, x, cos, sin)
        cache.k[i, rows, :, :, positions] = k
        cache.v[i, rows, :, positions] = v
        # One query per row: a plain softmax over its keys beats the fused kernel's setup.
        # Query heads sharing a key/value head are one matmul: [n, kv_heads, group, head_dim].
        scores = torch.matmul(
            q.reshape(n, kv_heads, -1, spec.head_dim), cache.k[i, :n, :, :, :length]
        )
        attn = torch.matmul(
            scores.masked_fill_(hidden, float("-inf")).softmax(-1), cache.v[i, :n, :, :length]
        )
        x = _out_and_mlp(x, attn.reshape(n, -1), layer, spec.rms_eps)
    return torch.mm(_rms(x, spec.rms_eps), params.lm_head)


def prefill(
    params: Params, cache: SlotCache, first_row: int, sequences: list[list[int]], start: int = 0
) -> torch.Tensor:
    """Run whole sequences into rows first_row.. of the cache (positions start..); returns
    the logits after each sequence's last token [len(sequences), vocab]. With ``start``,
    the rows' first ``start`` positions already hold keys and values (a session's earlier
    turns) and the sequences attend to them."""
    spec = params.spec
    m = len(sequences)
    lengths = torch.tensor([len(s) for s in sequences])
    width = int(lengths.max())
    ids = torch.zeros((m, width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq)
    positions = torch.arange(start, start + width)
    keys = torch.arange(start + width)
    # Causal, and blind to the right padding of shorter sequences.
    mask = (keys[None, :] <= positions[:, None])[None, None] & (
        keys[None, :] < start + lengths[:, None]
    )[:, None, None, :]
    cos, sin = params.cos[positions][None, :, None, :], params.sin[positions][None, :, None, :]
    x = params.embed[ids]
    rows = slice(first_row, first_row + m)
    end = start + width
    for i, layer in enumerate(params.layers):
        q, k, v = (t.transpose(1, 2) for t in _attention_inputs(params, layer, x, cos, sin))
        cache.k[i, rows, :, :, start:end] = k.transpose(-1, -2)
        cache.v[i, rows, :, start:end] = v
        if start:
            k, v = cache.k[i, rows, :, :, :end].transpose(-1, -2), cache.v[i, rows, :, :end]
        attn = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            scale=1.0,  # q is pre-scaled
            enable_gqa=spec.num_kv_heads != spec.num_heads,
        )
        flat = _out_and_mlp(
            x.reshape(m * width, spec.hidden_size),
            attn.transpose(1, 2).reshape(m * width, -1),
            layer,
            spec.rms_eps,
        )
        x = flat.view(m, width, spec.hidden_size)
    last = x[torch.arange(m), lengths - 1]
    return torch.mm(_rms(last, spec.rms_eps), params.lm_head)


@dataclass(frozen=True)
class HFParams:
    """One version of a model outside the fast path, served through its transformers
    module (built from the checkpoint's config, float32; never modified once built)."""

    spec: ModelSpec
    model: PreTrainedModel
    names: frozenset[str]
    """The names the version was staged under (tied tensors once)."""
    num_experts: int
    """Experts per MoE layer (rtrl.moe.routers), 0 for a dense model: with routers, every
    forward records the experts they chose."""

    @classmethod
    def from_state_dict(
        cls, weights: dict[str, torch.Tensor], config: PretrainedConfig
    ) -> HFParams:
        """Copies the weights into a new module, so the caller's tensors may change afterwards."""
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        load_weights(model, {name: t.detach().to(torch.float32) for name, t in weights.items()})
        found = routers(model)
        experts = found[0].num_experts if found else 0
        return cls(ModelSpec.from_hf_config(config), model.eval(), frozenset(weights), experts)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights this version serves, under the trainer's names (read-only views)."""
        return {n: t for n, t in self.model.state_dict().items() if n in self.names}


@dataclass(frozen=True)
class Routes:
    """The experts a MoE model's routers chose at each position a row ran, in position
    order: the prompt, then every sampled token but the last (never fed back). The
    trainer replays them (rtrl.moe.replay_routes) to score the row as it was sampled."""

    expert_ids: torch.Tensor
    """[positions, layers, top_k] int64."""
    num_experts: int


@dataclass(frozen=True)
class RowStep:
    """What one transformers forward of one row gives back."""

    logits: torch.Tensor
    """[1, vocab]: next-token logits after the row's last token."""
    past: Cache
    """The row's keys and values, the new positions' included."""
    routes: torch.Tensor | None
    """[new positions, layers, top_k]: the experts routed to, None for a dense model."""


def transformers_step(params: HFParams, token_ids: Sequence[int], past: Cache | None) -> RowStep:
    """One forward of the transformers module over one row's new ``token_ids`` (the
    whole prompt on a prefill, one token on a decode step) after its cached ``past``
    (None: positions from 0). Unpadded, batch of one: exactly transformers' forward."""
    ids = torch.tensor([list(token_ids)])
    if not params.num_experts:
        out = params.model(input_ids=ids, past_key_values=past, use_cache=True, logits_to_keep=1)
        return RowStep(out.logits[0, -1:], out.past_key_values, None)
    with record_routes(params.model) as log:
        out = params.model(input_ids=ids, past_key_values=past, use_cache=True, logits_to_keep=1)
    return RowStep(out.logits[0, -1:], out.past_key_values, log.stacked())


class TransformersCache:
    """The fallback's cache: per row, transformers' own key/value cache, each row run
    on its own (batch of one). A prefill runs a row's tokens once; a decode step feeds
    each row its one new token over its cache. So every position is run, and with a MoE
    model routed, exactly once per prefill; under the "keep" swap policy the keys and
    values of the old weights stay, as in SlotCache, and "recompute" prefills again.

    With a MoE model it also keeps each row's routes (``routes``): those of the latest
    forward over each position, so after a "recompute" the prefix's are the new
    weights' (those the tokens sampled after it saw)."""

    def __init__(self, slots: int) -> None:
        self.past: list[Cache | None] = [None] * slots
        self.route_steps: list[list[torch.Tensor]] = [[] for _ in range(slots)]
        """Per row, per forward over it: [new positions, layers, top_k]."""
        self.num_experts = 0

    def prefill(self, params: Weights, first_row: int, sequences: list[list[int]]) -> torch.Tensor:
        hf = _transformers(params)
        return torch.cat(
            [self._run(hf, row, seq, None) for row, seq in enumerate(sequences, first_row)]
        )

    def decode(self, params: Weights, tokens: list[int], positions: list[int]) -> torch.Tensor:
        hf = _transformers(params)
        logits = []
        for row, (token, position) in enumerate(zip(tokens, positions, strict=True)):
            past = self.past[row]
            if past is None or past.get_seq_length() != position:
                raise ValueError(f"row {row} has no cache of {position} positions to decode after")
            logits.append(self._run(hf, row, [token], past))
        return torch.cat(logits)

    def move(self, src: int, dst: int, length: int) -> None:
        """Hand row ``src``'s cache (its ``length`` positions) to row ``dst``; ``src``
        is left empty (its sequence now lives in ``dst``)."""
        past = self.past[src]
        if past is None or past.get_seq_length() != length:
            raise ValueError(f"row {src} has no cache of {length} positions to move")
        self.past[dst], self.route_steps[dst] = past, self.route_steps[src]
        self.past[src], self.route_steps[src] = None, []

    def routes(self, row: int) -> Routes | None:
        """The experts chosen at each position ``row`` holds; None for a dense model."""
        steps = self.route_steps[row]
        if not self.num_experts or not steps:
            return None
        return Routes(torch.cat(steps), self.num_experts)

    def _run(
        self, params: HFParams, row: int, token_ids: list[int], past: Cache | None
    ) -> torch.Tensor:
        """Run ``token_ids`` into ``row`` after ``past`` (None: a new sequence)."""
        step = transformers_step(params, token_ids, past)
        self.past[row] = step.past
        self.num_experts = params.num_experts
        if past is None:
            self.route_steps[row] = []
        if step.routes is not None:
            self.route_steps[row].append(step.routes)
        return step.logits


def _transformers(params: Weights) -> HFParams:
    if not isinstance(params, HFParams):
        raise TypeError(
            "a TransformersCache runs transformers' forward (HFParams), not the lean one"
        )
    return params


Weights = Params | HFParams
"""One servable version: the lean forward's, or transformers' for other architectures."""


def new_cache(spec: ModelSpec, slots: int) -> SlotCache | TransformersCache:
    """The cache of a batch of ``slots`` rows of the ``spec`` model, for its forward."""
    return SlotCache(spec, slots) if spec.fast_path else TransformersCache(slots)


def servable(
    weights: dict[str, torch.Tensor], config: PretrainedConfig, spec: ModelSpec
) -> Weights:
    """One version of ``weights`` for the forward that serves ``spec`` (new_cache's)."""
    if spec.fast_path:
        return Params.from_state_dict(weights, spec)
    return HFParams.from_state_dict(weights, config)
