"""An eval gate of your own: a prompt file and a checker you point at.

``RTRL_TRAINER_EVAL_PROMPTS`` names a JSON Lines file, one held-out case per line, either
``{"messages": [{"role": "user", "content": "..."}], ...}`` (rendered with the
checkpoint's chat template) or ``{"prompt": "..."}``; any other keys are the case's own
(an expected answer, tests to run...). ``RTRL_TRAINER_EVAL_CHECKER`` names a
``module:callable`` taking ``(case: dict, completion: str) -> bool``. A candidate's score
is the share of cases whose completion passes; the gate refuses one that falls more than
the tolerance below the published version or the initial policy.

Completions are sampled with a fixed seed per case (common random numbers), so two
versions' scores differ only by their weights.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import torch

from rtrl import plugins
from rtrl.checkpoint import Checkpoint
from rtrl.trainer.evaluation import EvalScores
from rtrl.trainer.label_free import sample_answer

Checker = Callable[[Mapping[str, Any], str], bool]

CHECKER = "passed"


class PromptFileError(ValueError):
    """The prompt file is unreadable or a line is not a case; the message names the line."""


def read_cases(path: Path) -> list[dict[str, Any]]:
    cases = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            case = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"{path}:{number}: not JSON: {exc}") from None
        if not isinstance(case, dict) or ("messages" in case) == ("prompt" in case):
            raise PromptFileError(f"{path}:{number}: a case has either messages or a prompt")
        cases.append(case)
    if not cases:
        raise PromptFileError(f"{path} holds no cases")
    return cases


class PromptFileSuite:
    """A trainer.evaluation.Suite over the user's cases, judged by the user's checker."""

    checkers = (CHECKER,)

    def __init__(
        self,
        policy: Checkpoint,
        cases_path: Path,
        checker: str | Checker,
        *,
        max_new_tokens: int = 48,
        seed: int = 0,
    ) -> None:
        self.policy = policy
        self.cases = read_cases(cases_path)
        self.check = cast(Checker, plugins.load(checker)) if isinstance(checker, str) else checker
        self.prompts = [self._prompt_ids(case, i) for i, case in enumerate(self.cases)]
        self.max_new_tokens = max_new_tokens
        self.seed = seed

    @torch.no_grad()
    def score(self, model: torch.nn.Module) -> EvalScores:
        was_training = model.training
        model.eval()
        passed = 0
        for i, (case, prompt) in enumerate(zip(self.cases, self.prompts, strict=True)):
            length, ids = sample_answer(
                model, prompt, self.max_new_tokens, self.policy.eos_token_ids, self.seed + i
            )
            passed += bool(self.check(case, self.policy.decode(ids[length:])))
        model.train(was_training)
        return EvalScores({CHECKER: passed / len(self.cases)}, samples=len(self.cases))

    def _prompt_ids(self, case: Mapping[str, Any], index: int) -> list[int]:
        try:
            if "messages" in case:
                return self.policy.render_chat(case["messages"])
            return self.policy.encode(case["prompt"])
        except ValueError as exc:
            raise PromptFileError(f"case {index + 1}: {exc}") from None
