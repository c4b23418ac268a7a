"""Train–inference mismatch: how far the trainer's log-probs are from the sampler's.

Every completion token carries the log-prob the sampler recorded and the policy version
that sampled it. Before an optimizer step the learner's weights may equal a published
version V; on the tokens V sampled, the trainer's log-prob (its first forward of the step)
minus the recorded one is then exactly the train–inference mismatch: kernels, dtypes,
sampling conventions (a top-p nucleus the trainer does not apply), or weights that are not
the ones the worker says it served. On any other token the difference also holds the
policy's own movement since, so those tokens are not counted, and a step with none
reports ``tokens == 0`` instead of a number.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rtrl.trainer.batch import TrainSample, alignments


# Produced by measure (one optimizer step, or one rank's rows) and merge; carried by
# trainer.step.StepMetrics to the TrainerStep record, the heartbeat and the gauges.
@dataclass(frozen=True)
class Mismatch:
    """|log π_trainer − log π_sampler| over a step's on-policy completion tokens (nats)."""

    mean: float = 0.0
    max: float = 0.0
    over_threshold_share: float = 0.0
    """Share of the measured tokens whose |Δ log p| exceeds the trainer's mismatch_threshold."""
    tokens: int = 0
    """Tokens measured; 0: none was sampled by the weights the step started from, and the
    other fields mean nothing."""


# Produced by the trainer loop for each optimizer step; consumed by rl_step and
# sharded_rl_step, which measure the mismatch on their first forward.
@dataclass(frozen=True)
class Probe:
    token_versions: torch.Tensor
    """[B, 1] (row_versions) or [B, L-1] aligned with the batch's targets: the version that
    sampled each completion token."""
    weights_version: int | None
    """The published version the learner's weights equal before the step; None once an
    optimizer step has moved them past every published version."""
    threshold: float
    """|Δ log p| above which a token counts as over (TrainerSettings.mismatch_threshold)."""

    def select(self, rows: Sequence[int], width: int) -> Probe:
        """The probe of a micro-batch: ``rows``, their targets cut to ``width`` positions."""
        versions = self.token_versions[torch.tensor(list(rows), dtype=torch.long)]
        if versions.shape[1] > 1:
            versions = versions[:, : width - 1]
        return dataclasses.replace(self, token_versions=versions)


def measure(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    token_versions: torch.Tensor,
    weights_version: int | None,
    mask: torch.Tensor,
    threshold: float,
) -> Mismatch:
    """logp, behaviour_logp, mask: [B, T]; token_versions: [B, T], or [B, 1] for one version
    per row. ``weights_version`` is the published version the model that computed ``logp``
    holds, None if it holds unpublished weights (then nothing is measured)."""
    if weights_version is None:
        return Mismatch()
    with torch.no_grad():
        measured = (mask > 0) & (token_versions == weights_version)
        tokens = int(measured.sum().item())
        if tokens == 0:
            return Mismatch()
        gap = (logp.detach().double() - behaviour_logp.double()).abs()[measured]
        return Mismatch(
            mean=gap.mean().item(),
            max=gap.max().item(),
            over_threshold_share=(gap > threshold).double().mean().item(),
            tokens=tokens,
        )


def merge(parts: Sequence[Mismatch]) -> Mismatch:
    """Several optimizer steps' (or ranks') measurements as one: means weighted by tokens."""
    tokens = sum(part.tokens for part in parts)
    if tokens == 0:
        return Mismatch()
    return Mismatch(
        mean=sum(part.mean * part.tokens for part in parts) / tokens,
        max=max(part.max for part in parts if part.tokens),
        over_threshold_share=sum(part.over_threshold_share * part.tokens for part in parts)
        / tokens,
        tokens=tokens,
    )


def token_versions(samples: Sequence[TrainSample]) -> torch.Tensor:
    """[B, L-1] aligned with collate's targets: the version that sampled each completion
    token (-1 where there is none), so a rollout that spans a swap is measured on the
    tokens the learner's version sampled."""
    rows = alignments(samples)
    versions = torch.full((len(rows), max(row.targets for row in rows)), -1, dtype=torch.long)
    for index, row in enumerate(rows):
        for run in row.runs:
            versions[index, run.start : run.end] = torch.tensor(run.segment.versions)
    return versions


def row_versions(samples: Sequence[TrainSample]) -> torch.Tensor:
    """[B, 1] the oldest version that sampled each row's completion. Training samples keep
    only that one, and no token is newer than the published version, so a row whose oldest
    version is the learner's has all its tokens from it; a rollout that spans a swap into it
    is left out whole (measured less, never wrongly)."""
    return torch.tensor([[sample.oldest_version] for sample in samples], dtype=torch.long)
