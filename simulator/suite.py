"""The demo's eval suite: the simulated product's task family, drawn once from a seed
of its own, judged by two automatic checkers:

* ``well_formed``: ends with EOS and is either a correct helper in some style or one
  of the clarifying questions (what the product can show at all);
* ``house_style``: a correct helper in its project's house style (projects p0-p3;
  p4 has none), what users keep.

The trainer loads it through RTRL_TRAINER_EVAL_SUITE (``simulator.suite:demo_suite``;
``simulator.suite:unique_prompt_suite`` for the unique-prompts demo, whose tasks carry serials).
"""

from __future__ import annotations

import random

import torch

from rtrl.policy import EOS, decode
from rtrl.simulator.tasks import (
    MIXED_PROJECT,
    PROJECT_STYLES,
    QUESTION_TOPICS,
    UNIQUE_MAX_TOKENS,
    Task,
    parse_style,
    random_task,
    with_random_serial,
)
from rtrl.trainer.evaluation import EvalScores
from rtrl.trainer.sampling import prompt_ids, sample

CHECKERS = ("well_formed", "house_style")


class DemoSuite:
    """The simulated product's held-out tasks (a trainer.evaluation.Suite)."""

    checkers = CHECKERS

    def __init__(
        self,
        tasks: int = 128,
        seed: int = 20_261_124,
        max_new_tokens: int = 48,
        unique_prompts: bool = False,
    ) -> None:
        if tasks < 1:
            raise ValueError(f"an eval suite needs at least one task, got {tasks}")
        rng = random.Random(seed)
        drawn = [random_task(rng) for _ in range(tasks)]
        if unique_prompts:
            drawn = [with_random_serial(task, rng) for task in drawn]
        self.tasks: tuple[Task, ...] = tuple(drawn)
        self.seed = seed
        self.max_new_tokens = max_new_tokens
        self._prompts = [prompt_ids(task.prompt) for task in self.tasks]

    @torch.no_grad()
    def score(self, model: torch.nn.Module) -> EvalScores:
        was_training = model.training
        model.eval()
        try:
            completions = sample(
                model,
                self._prompts,
                temperature=1.0,
                max_new_tokens=self.max_new_tokens,
                generator=torch.Generator().manual_seed(self.seed),
                one_batch=True,
            )
        finally:
            model.train(was_training)
        well_formed = house_style = styled_tasks = 0
        for task, completion in zip(self.tasks, completions, strict=True):
            ids = completion.completion_ids
            if not ids or ids[-1] != EOS:
                continue
            text = decode(list(ids))
            style = parse_style(task, text)
            well_formed += style is not None or text in {
                task.question(topic) for topic in QUESTION_TOPICS
            }
            if task.project != MIXED_PROJECT:
                house_style += style == PROJECT_STYLES[task.project]
        styled_tasks = sum(task.project != MIXED_PROJECT for task in self.tasks)
        scores = {
            "well_formed": well_formed / len(self.tasks),
            "house_style": house_style / max(styled_tasks, 1),
        }
        return EvalScores(scores=scores, samples=len(self.tasks))


def demo_suite(tasks: int, max_new_tokens: int) -> DemoSuite:
    """The trainer's eval-suite plug-in (trainer.plugins.SuiteFactory)."""
    return DemoSuite(tasks, max_new_tokens=max_new_tokens)


def unique_prompt_suite(tasks: int, max_new_tokens: int) -> DemoSuite:
    """The eval suite of the unique-prompts demo: its tasks carry serials, and the longest
    helper needs UNIQUE_MAX_TOKENS."""
    return DemoSuite(
        tasks, max_new_tokens=max(max_new_tokens, UNIQUE_MAX_TOKENS), unique_prompts=True
    )
