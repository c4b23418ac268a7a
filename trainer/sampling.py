"""A plain batched sampler for the trainer's own use: judging the warm start and
producing rollouts in the in-process learning test.

Production rollouts come from the inference workers; this loop only has to agree
with them on the conventions: the prompt is ``[BOS] + encode(prompt_text)``, the
completion ends with EOS (included, with its log-prob), and the recorded log-prob
is that of the temperature-scaled distribution the token was drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rtrl.policy import BOS, EOS, PAD, encode


def prompt_ids(prompt_text: str) -> list[int]:
    return [BOS, *encode(prompt_text)]


@dataclass(frozen=True)
class Sampled:
    completion_ids: tuple[int, ...]
    """Sampled tokens, ending with EOS unless max_new_tokens ran out."""
    logprobs: tuple[float, ...]
    """log p(token) under the distribution it was sampled from."""


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompts: list[list[int]],
    *,
    temperature: float = 1.0,
    max_new_tokens: int = 48,
    generator: torch.Generator | None = None,
    one_batch: bool = False,
) -> list[Sampled]:
    """One completion per prompt. Prompts of equal length are decoded together, so
    no padding (and no attention mask) is ever needed; with ``one_batch`` every prompt
    is left-padded into a single batch instead, a few times fewer forward passes (what
    the eval gate pays per candidate) for logits equal to float rounding."""
    if one_batch:
        return _decode(model, *_left_padded(prompts), temperature, max_new_tokens, generator)
    by_length: dict[int, list[int]] = {}
    for index, ids in enumerate(prompts):
        by_length.setdefault(len(ids), []).append(index)
    out: list[Sampled | None] = [None] * len(prompts)
    for indices in by_length.values():
        batch = torch.tensor([prompts[i] for i in indices], dtype=torch.long)
        for i, sampled in zip(
            indices,
            _decode(model, batch, None, temperature, max_new_tokens, generator),
            strict=True,
        ):
            out[i] = sampled
    return out  # type: ignore[return-value]


def _left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids in prompts)
    batch = torch.full((len(prompts), width), PAD, dtype=torch.long)
    attention_mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, ids in enumerate(prompts):
        batch[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    return batch, attention_mask


def _decode(
    model: torch.nn.Module,
    batch: torch.Tensor,
    attention_mask: torch.Tensor | None,
    temperature: float,
    max_new_tokens: int,
    generator: torch.Generator | None,
) -> list[Sampled]:
    """Sample from right-aligned prompts; attention_mask marks the left padding, if any."""
    rows = batch.shape[0]
    tokens = torch.zeros(rows, max_new_tokens, dtype=torch.long)
    logprobs = torch.zeros(rows, max_new_tokens)
    lengths = torch.full((rows,), max_new_tokens, dtype=torch.long)
    finished = torch.zeros(rows, dtype=torch.bool)
    padding = {}
    if attention_mask is not None:
        # Positions count real tokens only, so a padded prompt sees what an unpadded one does.
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        padding = {"attention_mask": attention_mask, "position_ids": positions}
    outputs = model(input_ids=batch, use_cache=True, **padding)
    for t in range(max_new_tokens):
        logp = torch.log_softmax(outputs.logits[:, -1, :].float() / temperature, dim=-1)
        next_tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
        tokens[:, t] = next_tokens
        logprobs[:, t] = logp.gather(1, next_tokens[:, None]).squeeze(1)
        newly = (next_tokens == EOS) & ~finished
        lengths[newly] = t + 1
        finished |= newly
        if bool(finished.all()):
            break
        if padding:
            attention_mask = torch.cat(
                [padding["attention_mask"], torch.ones(rows, 1, dtype=torch.long)], dim=1
            )
            padding = {
                "attention_mask": attention_mask,
                "position_ids": padding["position_ids"][:, -1:] + 1,
            }
        outputs = model(
            input_ids=next_tokens[:, None],
            past_key_values=outputs.past_key_values,
            use_cache=True,
            **padding,
        )
    return [
        Sampled(tuple(tokens[r, : lengths[r]].tolist()), tuple(logprobs[r, : lengths[r]].tolist()))
        for r in range(rows)
    ]
