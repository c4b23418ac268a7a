"""One optimizer step on a batch of production rollouts (no I/O: the loop and the
in-process learning test both drive it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rtrl.trainer.batch import TrainBatch, micro_batches
from rtrl.trainer.mismatch import Mismatch, Probe, measure, merge
from rtrl.trainer.objective import LossTerms, leave_one_out_advantages, policy_gradient_loss
from rtrl.trainer.router_replay import replaying


def token_logprobs(model: torch.nn.Module, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of every next token at the batch's sampling temperatures, and the
    entropy of each predictive distribution (detached); both [B, L-1].

    One forward over right-padded sequences: causal attention means a real token
    never sees the padding after it, so no attention mask is needed.
    """
    logits = model(input_ids=batch.input_ids).logits[:, :-1].float()
    logits = logits / batch.temperature[:, None, None]
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@dataclass(frozen=True)
class StepMetrics:
    loss: float
    kl: float
    """Token mean of log π − log π_ref (k1), π_ref being the warm start."""
    entropy: float
    """Token mean entropy of the current policy on the batch's completions (nats)."""
    grad_norm: float
    """Before clipping."""
    reward_mean: float
    advantage_abs_mean: float
    clipped_fraction: float
    ratio_mean: float
    rollouts: int
    tokens: int
    mismatch: Mismatch
    """Train–inference mismatch on the tokens sampled by the weights a step started from."""


def combine(steps: Sequence[StepMetrics]) -> StepMetrics:
    """One candidate's metrics over its optimizer steps: counts summed, the largest
    gradient norm (a spike in any step is the one to see), every other value the mean
    weighted by what it averages over (tokens for token means, rollouts otherwise)."""
    if len(steps) == 1:
        return steps[0]
    rollouts = sum(s.rollouts for s in steps)
    tokens = sum(s.tokens for s in steps)

    def by_tokens(name: str) -> float:
        return sum(getattr(s, name) * s.tokens for s in steps) / tokens

    def by_rollouts(name: str) -> float:
        return sum(getattr(s, name) * s.rollouts for s in steps) / rollouts

    return StepMetrics(
        loss=by_rollouts("loss"),
        kl=by_tokens("kl"),
        entropy=by_tokens("entropy"),
        grad_norm=max(s.grad_norm for s in steps),
        reward_mean=by_rollouts("reward_mean"),
        advantage_abs_mean=by_rollouts("advantage_abs_mean"),
        clipped_fraction=by_tokens("clipped_fraction"),
        ratio_mean=by_tokens("ratio_mean"),
        rollouts=rollouts,
        tokens=tokens,
        mismatch=merge([s.mismatch for s in steps]),
    )


def rl_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    *,
    ref_model: torch.nn.Module | None = None,
    is_cap: float = 2.0,
    kl_coef: float = 0.0,
    grad_clip: float = 1.0,
    std_normalize: bool = False,
    probe: Probe | None = None,
    token_budget: int | None = None,
    router_replay: bool = True,
) -> StepMetrics:
    """One optimizer step on the batch, its gradient accumulated over micro-batches of at
    most ``token_budget`` padded positions each (micro_batches; None: one forward over the
    whole batch). Each micro-batch's loss is its share of the whole batch's token sum, so
    the step is the same whatever the budget. probe: the versions that sampled the batch
    and the one the model holds; without it no mismatch is measured. router_replay: a MoE
    policy's forwards take the experts its sampler chose (trainer/router_replay.py)."""
    advantages = torch.tensor(
        leave_one_out_advantages(batch.rewards, batch.groups, std_normalize=std_normalize)
        if batch.advantages is None
        else batch.advantages
    )
    total = batch.target_mask.sum().item()
    if total == 0:
        raise ValueError("no completion tokens in the batch")
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss, sums, gaps = _accumulate(
        model,
        batch,
        advantages,
        ref_model,
        probe,
        token_budget or batch.input_ids.numel(),
        is_cap=is_cap,
        kl_coef=kl_coef,
        router_replay=router_replay,
    )
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    model.eval()
    kl, clipped, ratio, entropy = sums.tolist()
    return StepMetrics(
        loss=loss,
        kl=kl,
        entropy=entropy,
        grad_norm=float(grad_norm),
        reward_mean=sum(batch.rewards) / len(batch.rewards),
        advantage_abs_mean=advantages.abs().mean().item(),
        clipped_fraction=clipped,
        ratio_mean=ratio,
        rollouts=len(batch.rewards),
        tokens=int(total),
        mismatch=merge(gaps),
    )


def _accumulate(
    model: torch.nn.Module,
    batch: TrainBatch,
    advantages: torch.Tensor,
    ref_model: torch.nn.Module | None,
    probe: Probe | None,
    budget: int,
    *,
    is_cap: float,
    kl_coef: float,
    router_replay: bool,
) -> tuple[float, torch.Tensor, list[Mismatch]]:
    """Each micro-batch's forward and backward, its loss scaled to its share of the batch's
    tokens: (the batch's loss; its token means of kl, clipped share, ratio and entropy; each
    micro-batch's mismatch)."""
    total = batch.target_mask.sum().item()
    sums = torch.zeros(4, dtype=torch.float64)
    loss, gaps = 0.0, []
    for rows, width in micro_batches(batch, budget):
        part = batch.select(rows, width)
        share = part.target_mask.sum().item() / total
        if share == 0:
            continue
        with replaying(part, (model, ref_model), enabled=router_replay):
            terms, entropy, logp = _micro_objective(
                model, part, advantages[rows], ref_model, is_cap=is_cap, kl_coef=kl_coef
            )
            (terms.loss * share).backward()
        loss += terms.loss.item() * share
        means = [terms.kl, terms.clipped_fraction, terms.ratio_mean, entropy]
        sums += torch.tensor(means, dtype=torch.float64) * share
        gaps.append(measure_probe(logp, part, None if probe is None else probe.select(rows, width)))
    return loss, sums, gaps


def _micro_objective(
    model: torch.nn.Module,
    part: TrainBatch,
    advantages: torch.Tensor,
    ref_model: torch.nn.Module | None,
    *,
    is_cap: float,
    kl_coef: float,
) -> tuple[LossTerms, float, torch.Tensor]:
    """A micro-batch's loss terms (its own token mean), its token-mean entropy, its log-probs."""
    ref_logp = None
    if ref_model is not None:
        with torch.no_grad():
            ref_logp, _ = token_logprobs(ref_model, part)
    logp, entropy = token_logprobs(model, part)
    terms = policy_gradient_loss(
        logp,
        part.behaviour_logprobs,
        advantages,
        part.target_mask,
        ref_logp=ref_logp,
        is_cap=is_cap,
        kl_coef=kl_coef,
    )
    mask = part.target_mask
    return terms, ((entropy * mask).sum() / mask.sum()).item(), logp


def measure_probe(logp: torch.Tensor, batch: TrainBatch, probe: Probe | None) -> Mismatch:
    """The mismatch of the step's first forward (before the optimizer moves the weights)."""
    if probe is None:
        return Mismatch()
    return measure(
        logp,
        batch.behaviour_logprobs,
        probe.token_versions.to(logp.device),
        probe.weights_version,
        batch.target_mask,
        probe.threshold,
    )


def build_optimizer(
    model: torch.nn.Module, lr: float, weight_decay: float = 0.0
) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
