"""The agentic demo's eval suite: held-out tasks played to their answer in process
(simulator/agent_play.py), judged by three checkers:

* ``well_formed``: the answer is a correct helper in some style;
* ``house_style``: a correct helper in its project's house style (p0-p3), or in the style
  its p4 user writes down (a p4 user who writes nothing down is left out: any style is a
  guess);
* ``no_broken_calls``: no call in the trajectory was broken.

The trainer loads it through RTRL_TRAINER_EVAL_SUITE (``simulator.agent_suite:agent_suite``).
"""

from __future__ import annotations

import torch

from rtrl.simulator.agent_play import held_out, play
from rtrl.simulator.agent_warmstart import AGENT_POLICY
from rtrl.simulator.tasks import MIXED_PROJECT, parse_style
from rtrl.trainer.evaluation import EvalScores

CHECKERS = ("well_formed", "house_style", "no_broken_calls")


class AgentSuite:
    """The agentic product's held-out tasks (a trainer.evaluation.Suite)."""

    checkers = CHECKERS

    def __init__(self, tasks: int = 128, seed: int = 20_261_129) -> None:
        if tasks < 1:
            raise ValueError(f"an eval suite needs at least one task, got {tasks}")
        self.cases = held_out(tasks, seed)
        self.seed = seed

    @torch.no_grad()
    def score(self, model: torch.nn.Module) -> EvalScores:
        was_training = model.training
        model.eval()
        try:
            runs = play(
                model,
                [c.task for c in self.cases],
                [c.written for c in self.cases],
                max_positions=AGENT_POLICY.max_positions,
                generator=torch.Generator().manual_seed(self.seed),
            )
        finally:
            model.train(was_training)
        pairs = list(zip(self.cases, runs, strict=True))
        parsed = [parse_style(c.task, r.final_text) for c, r in pairs]
        knowable = [c.task.project != MIXED_PROJECT or c.written is not None for c, _ in pairs]
        n = len(self.cases)
        scores = {
            "well_formed": sum(p is not None for p in parsed) / n,
            "house_style": sum(
                p == c.style for (c, _), p, k in zip(pairs, parsed, knowable, strict=True) if k
            )
            / max(sum(knowable), 1),
            "no_broken_calls": sum(r.broken == 0 for r in runs) / n,
        }
        return EvalScores(scores=scores, samples=n)


def agent_suite(tasks: int, max_new_tokens: int) -> AgentSuite:
    """The trainer's eval-suite plug-in (trainer.plugins.SuiteFactory); each turn's budget is
    the agent's own (simulator/agent.py), so ``max_new_tokens`` is not used."""
    del max_new_tokens
    return AgentSuite(tasks)
