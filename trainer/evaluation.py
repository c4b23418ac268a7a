"""The eval gate: a candidate version ships only if it does not regress the held-out suite.

The suite is the product's task family (simulator.tasks) drawn once from a seed of
its own: its completions are sampled here, by the trainer, and never enter the
reward topic, so nothing trained on ever scores it. Automatic checkers judge each
sampled completion:

* ``well_formed``: ends with EOS and is either a correct helper in some style or one
  of the clarifying questions (what the product can show at all);
* ``house_style``: a correct helper in its project's house style (projects p0–p3;
  p4 has none), what users keep.

Candidates are compared on common random numbers: the same tasks, the same sampling
seed, so the difference between two versions' scores comes from the weights, not
from sampling noise. A candidate is refused if any checker falls more than
``tolerance`` below the currently published version or below the control policy
(the warm start). The second reference stops a run of small regressions, each
within tolerance of its predecessor, from drifting the fleet below where it began.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from rtrl.policy import EOS, decode
from simulator.tasks import MIXED_PROJECT, PROJECT_STYLES, QUESTION_TOPICS, Task, parse_style, random_task
from trainer.sampling import prompt_ids, sample

CHECKERS = ("well_formed", "house_style")


@dataclass(frozen=True)
class EvalScores:
    well_formed: float
    house_style: float
    samples: int

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in CHECKERS}


# Produced by EvalGate.judge; consumed by the trainer loop (journal, status, metrics).
@dataclass(frozen=True)
class Verdict:
    accepted: bool
    candidate: EvalScores
    published: EvalScores
    control: EvalScores
    regressions: tuple[str, ...] = field(default=())
    """``"checker vs reference: candidate < reference - tolerance"``, one per failed check."""

    def summary(self) -> dict[str, object]:
        return {
            "accepted": self.accepted,
            "candidate": self.candidate.as_dict(),
            "published": self.published.as_dict(),
            "control": self.control.as_dict(),
            "regressions": list(self.regressions),
        }


class EvalSuite:
    def __init__(self, tasks: int = 128, seed: int = 20_261_124, max_new_tokens: int = 48) -> None:
        if tasks < 1:
            raise ValueError(f"an eval suite needs at least one task, got {tasks}")
        rng = random.Random(seed)
        self.tasks: tuple[Task, ...] = tuple(random_task(rng) for _ in range(tasks))
        self.seed = seed
        self.max_new_tokens = max_new_tokens
        self._prompts = [prompt_ids(task.prompt) for task in self.tasks]

    @torch.no_grad()
    def score(self, model: torch.nn.Module) -> EvalScores:
        was_training = model.training
        model.eval()
        try:
            completions = sample(
                model, self._prompts, temperature=1.0, max_new_tokens=self.max_new_tokens,
                generator=torch.Generator().manual_seed(self.seed), one_batch=True,
            )
        finally:
            model.train(was_training)
        well_formed = house_style = styled_tasks = 0
        for task, completion in zip(self.tasks, completions):
            ids = completion.completion_ids
            if not ids or ids[-1] != EOS:
                continue
            text = decode(list(ids))
            style = parse_style(task, text)
            well_formed += style is not None or text in {task.question(topic) for topic in QUESTION_TOPICS}
            if task.project != MIXED_PROJECT:
                house_style += style == PROJECT_STYLES[task.project]
        styled_tasks = sum(task.project != MIXED_PROJECT for task in self.tasks)
        return EvalScores(
            well_formed=well_formed / len(self.tasks),
            house_style=house_style / max(styled_tasks, 1),
            samples=len(self.tasks),
        )


class EvalGate:
    """Judges candidates against the published version's and the control's scores."""

    def __init__(self, suite: EvalSuite, tolerance: float, control: EvalScores, published: EvalScores) -> None:
        if not 0 <= tolerance <= 1:
            raise ValueError(f"tolerance {tolerance} is not a share in [0, 1]")
        self.suite = suite
        self.tolerance = tolerance
        self.control = control
        self.published = published

    def judge(self, candidate_model: torch.nn.Module) -> Verdict:
        candidate = self.suite.score(candidate_model)
        regressions = tuple(
            f"{checker} vs {name}: {getattr(candidate, checker):.3f} < {getattr(reference, checker):.3f} - {self.tolerance}"
            for name, reference in (("published", self.published), ("control", self.control))
            for checker in CHECKERS
            if getattr(candidate, checker) < getattr(reference, checker) - self.tolerance
        )
        return Verdict(
            accepted=not regressions, candidate=candidate, published=self.published, control=self.control, regressions=regressions
        )

    def accept(self, verdict: Verdict) -> None:
        """The candidate shipped: it is the reference for the next one."""
        self.published = verdict.candidate
