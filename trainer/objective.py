"""The policy-gradient objective, as pure functions over tensors.

Advantages: REINFORCE with a leave-one-out baseline. A rollout's baseline is the
mean reward of the *other* rollouts in its comparison group (same
``prompt_group_id``, else same prompt text). A rollout alone in its group falls
back to the mean of the other rollouts in the batch, which keeps the estimator
unbiased (the baseline never includes the rollout's own reward). Real traffic has
unique prompts, so almost every rollout falls back; with the ``context`` baseline
(RTRL_TRAINER_BASELINE, trainer/baseline.py) such a rollout is compared with a
running mean of earlier rewards in its context instead (context_baseline_advantages).

Loss, per completion token t of rollout i, summed over the batch and divided by
the batch's total completion tokens (no per-sequence length normalization, so a
long completion is not down-weighted per token):

    w_t   = min(exp(logp_t − behaviour_t), is_cap)              (detached)
    adv_t = A_i − kl_coef · (logp_t − ref_t)                    (detached)
    loss  = −Σ w_t · adv_t · logp_t / Σ tokens

The KL term is the k1 estimator of KL(π‖π_ref), ``logp − ref``. Added to the loss
as a differentiable term its expected gradient under samples from π is zero
(E_π[∇ log π] = 0), so it would do nothing; folded into the per-token advantage
it gives the score-function gradient of the per-token KL, which is what the
penalty is for. The reported ``kl`` is the plain token mean of ``logp − ref``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def leave_one_out_advantages(
    rewards: Sequence[float], groups: Sequence[str], *, std_normalize: bool = False
) -> list[float]:
    """Reward minus the mean of the other rollouts in the same group.

    With ``std_normalize``, a group's advantages are divided by its reward std
    (population); a degenerate group (zero std) and rollouts that fell back to the
    batch baseline are left unscaled.
    """
    if len(rewards) != len(groups):
        raise ValueError(f"{len(rewards)} rewards for {len(groups)} groups")
    n = len(rewards)
    members: dict[str, list[int]] = {}
    for index, group in enumerate(groups):
        members.setdefault(group, []).append(index)
    total = float(sum(rewards))
    advantages = [0.0] * n
    for indices in members.values():
        if len(indices) == 1:
            i = indices[0]
            advantages[i] = float(rewards[i]) - (total - rewards[i]) / (n - 1) if n > 1 else 0.0
            continue
        group_sum = sum(rewards[i] for i in indices)
        k = len(indices)
        for i in indices:
            advantages[i] = float(rewards[i]) - (group_sum - rewards[i]) / (k - 1)
        if std_normalize:
            mean = group_sum / k
            std = (sum((rewards[i] - mean) ** 2 for i in indices) / k) ** 0.5
            if std > 0:
                for i in indices:
                    advantages[i] /= std
    return advantages


def context_baseline_advantages(
    rewards: Sequence[float],
    groups: Sequence[str],
    baselines: Sequence[float | None],
    *,
    std_normalize: bool = False,
) -> list[float]:
    """Leave-one-out within comparison groups of two or more; a rollout alone in its group
    gets its reward minus ``baselines[i]`` (trainer/baseline.py: a running mean over earlier
    rewards, so never its own), or leave_one_out_advantages' batch fallback where that is None.

    ``std_normalize`` scales the groups as leave_one_out_advantages does; a baselined
    rollout is left unscaled.
    """
    if len(baselines) != len(rewards):
        raise ValueError(f"{len(rewards)} rewards for {len(baselines)} baselines")
    advantages = leave_one_out_advantages(rewards, groups, std_normalize=std_normalize)
    sizes = Counter(groups)
    return [
        float(reward) - baseline if sizes[group] == 1 and baseline is not None else advantage
        for reward, group, baseline, advantage in zip(
            rewards, groups, baselines, advantages, strict=True
        )
    ]


@dataclass(frozen=True)
class LossTerms:
    loss: torch.Tensor
    """Scalar to backpropagate."""
    kl: float
    """Token mean of logp − ref (k1); 0.0 without a reference."""
    clipped_fraction: float
    """Share of tokens whose importance ratio hit is_cap."""
    ratio_mean: float
    """Token mean of the untruncated importance ratio (1.0 when on-policy)."""
    tokens: int


def policy_gradient_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logp: torch.Tensor | None = None,
    is_cap: float = 2.0,
    kl_coef: float = 0.0,
) -> LossTerms:
    """logp (with grad), behaviour_logp, mask, ref_logp: [B, T]; advantages: [B].

    Padding positions must have mask 0; their log-probs may be anything finite.
    """
    if is_cap < 1.0:
        raise ValueError(f"is_cap {is_cap} < 1 would down-weight on-policy tokens")
    mask = mask.to(logp.dtype)
    tokens = mask.sum()
    if tokens.item() == 0:
        raise ValueError("no completion tokens in the batch")
    with torch.no_grad():
        ratio = torch.exp((logp - behaviour_logp) * mask)
        weight = ratio.clamp(max=is_cap)
        token_adv = advantages.to(logp.dtype)[:, None].expand_as(logp)
        kl = 0.0
        if ref_logp is not None:
            log_ratio_ref = (logp - ref_logp) * mask
            kl = (log_ratio_ref.sum() / tokens).item()
            token_adv = token_adv - kl_coef * log_ratio_ref
        elif kl_coef:
            raise ValueError("kl_coef > 0 needs ref_logp")
        clipped = ((ratio > is_cap).to(logp.dtype) * mask).sum() / tokens
        ratio_mean = (ratio * mask).sum() / tokens
    loss = -(weight * token_adv * logp * mask).sum() / tokens
    return LossTerms(
        loss=loss,
        kl=kl,
        clipped_fraction=clipped.item(),
        ratio_mean=ratio_mean.item(),
        tokens=int(tokens.item()),
    )
