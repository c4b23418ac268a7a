"""Sampling one token per row from a batch of logits, with its behaviour log-prob.

Randomness is counter-based: the uniform that picks token ``t`` of a request is a
hash of (request seed, t). A rollout is therefore reproducible from its seed and
the weights alone, whatever batch it happened to share, and padding or batching
never changes what a request samples.
"""

from __future__ import annotations

import torch

# Greedy (temperature 0) is the limit of a very low temperature: the softmax
# saturates to a one-hot in float32, so no separate code path is needed.
MIN_TEMPERATURE = 1e-4


_M32 = 0xFFFFFFFF


def _fmix32(x: int) -> int:
    """MurmurHash3's finalizer: a bijection on 32-bit values with full avalanche."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def counter_uniform(seeds: torch.Tensor, counter: int | torch.Tensor) -> torch.Tensor:
    """A uniform in [0, 1) per row, a pure function of (seed, counter); float64.

    On Python ints, row by row: for the few rows of a decode step that is ~3x
    cheaper than the same few dozen integer ops as tensor (or numpy) calls, and it
    runs on every step."""
    seed_list = seeds.tolist()
    counters = (
        counter.tolist()
        if isinstance(counter, torch.Tensor) and counter.dim()
        else [int(counter)] * len(seed_list)
    )
    out = []
    for seed, count in zip(seed_list, counters, strict=True):
        x = _fmix32((seed & _M32) ^ _fmix32((count & _M32) ^ 0x9E3779B9))
        x = _fmix32(x ^ ((seed >> 32) & _M32) ^ 0x7F4A7C15)
        y = _fmix32(x ^ 0x632BE5AB)
        # 53 random bits: 32 from x, 21 from y.
        out.append(((x << 21) | (y >> 11)) / 9007199254740992.0)
    return torch.tensor(out, dtype=torch.float64)


def sampling_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Log-probs of the distribution actually sampled from: temperature-scaled
    log-softmax, then restricted to the top-p nucleus and renormalized (rows with
    top_p >= 1 are left whole). logits [B, V], temperature/top_p [B]."""
    scaled = logits.float() / temperature.clamp_min(MIN_TEMPERATURE).unsqueeze(-1)
    logp = torch.log_softmax(scaled, dim=-1)
    if bool((top_p < 1).any()):
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        mass_before = sorted_logp.exp().cumsum(dim=-1) - sorted_logp.exp()
        # A token stays if the mass strictly before it is below top_p; the top token always stays.
        drop_sorted = mass_before >= top_p.unsqueeze(-1)
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logp = torch.log_softmax(scaled.masked_fill(drop, float("-inf")), dim=-1)
    return logp


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    counter: int | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row by inverse CDF; returns (token ids [B], log-probs [B]).
    ``counter`` is the index of the token being sampled, one for all rows or one per row."""
    logp = sampling_logprobs(logits, temperature, top_p)
    cdf = logp.double().exp().cumsum(dim=-1)
    target = counter_uniform(seeds, counter) * cdf[:, -1]
    tokens = torch.searchsorted(cdf, target.unsqueeze(-1), right=True).squeeze(-1)
    tokens = tokens.clamp_max(logits.shape[-1] - 1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
