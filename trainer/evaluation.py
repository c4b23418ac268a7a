"""The eval gate: a candidate version ships only if it does not regress the held-out suite.

The suite is a plug-in (``RTRL_TRAINER_EVAL_SUITE``, see trainer/plugins.py): anything
whose ``score(model)`` samples its own held-out prompts and returns a share in [0, 1]
per checker. The demo's suite is the simulated product's task family
(simulator/suite.py). Its completions are sampled here, by the trainer, and never
enter the reward topic, so nothing trained on ever scores it.

Candidates are compared on common random numbers: the suite samples the same prompts
with the same seed every time, so the difference between two versions' scores comes
from the weights, not from sampling noise. A candidate is refused if any checker falls
more than ``tolerance`` below the currently published version or below the control
policy (the initial policy). The second reference stops a run of small regressions,
each within tolerance of its predecessor, from drifting the fleet below where it began.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rtrl.heartbeat import GateVerdict


# Produced by a Suite's score; consumed by EvalGate, the journal and the trainer's status.
@dataclass(frozen=True)
class EvalScores:
    scores: Mapping[str, float]
    """Share of the suite's samples each checker passed, by checker name."""
    samples: int

    def __getitem__(self, checker: str) -> float:
        return self.scores[checker]

    def as_dict(self) -> dict[str, float]:
        return dict(self.scores)


# Produced by EvalGate.judge; consumed by the trainer loop (journal, status, metrics).
@dataclass(frozen=True)
class Verdict:
    accepted: bool
    candidate: EvalScores
    published: EvalScores
    control: EvalScores
    regressions: tuple[str, ...] = field(default=())
    """``"checker vs reference: candidate < reference - tolerance"``, one per failed check."""

    def as_gate(self) -> GateVerdict:
        """The verdict as the trainer's heartbeat and journal carry it."""
        return GateVerdict(
            accepted=self.accepted,
            candidate=self.candidate.as_dict(),
            published=self.published.as_dict(),
            control=self.control.as_dict(),
            regressions=self.regressions,
        )

    def summary(self) -> dict[str, object]:
        """The verdict as a JSON object (the journal's refusal entries)."""
        return dataclasses.asdict(self.as_gate())


class Suite(Protocol):
    """A held-out eval suite. Produced by the RTRL_TRAINER_EVAL_SUITE plug-in; consumed
    by EvalGate. ``score`` must be deterministic for the same weights."""

    @property
    def checkers(self) -> tuple[str, ...]:
        """The names of the shares score() returns, in the order refusals list them."""
        ...

    def score(self, model: torch.nn.Module) -> EvalScores: ...


class EvalGate:
    """Judges candidates against the published version's and the control's scores."""

    def __init__(
        self, suite: Suite, tolerance: float, control: EvalScores, published: EvalScores
    ) -> None:
        if not 0 <= tolerance <= 1:
            raise ValueError(f"tolerance {tolerance} is not a share in [0, 1]")
        self.suite = suite
        self.tolerance = tolerance
        self.control = control
        self.published = published

    def judge(self, candidate_model: torch.nn.Module) -> Verdict:
        candidate = self.suite.score(candidate_model)
        regressions = tuple(
            f"{checker} vs {name}: {candidate[checker]:.3f} < {reference[checker]:.3f} - {self.tolerance}"
            for name, reference in (("published", self.published), ("control", self.control))
            for checker in self.suite.checkers
            if candidate[checker] < reference[checker] - self.tolerance
        )
        return Verdict(
            accepted=not regressions,
            candidate=candidate,
            published=self.published,
            control=self.control,
            regressions=regressions,
        )

    def accept(self, verdict: Verdict) -> None:
        """The candidate shipped: it is the reference for the next one."""
        self.published = verdict.candidate
