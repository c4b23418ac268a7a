"""Your own eval gate (trainer/prompt_suite.py): a JSON Lines prompt file and a checker,
chat cases rendered with the checkpoint's template; bad files and settings are refused
naming the line or the variable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from rtrl.checkpoint import Checkpoint
from rtrl.ops.tiny_model import write_tiny_checkpoint
from rtrl.trainer.config import TrainerSettings
from rtrl.trainer.evaluation import EvalGate
from rtrl.trainer.label_free import sample_answer
from rtrl.trainer.prompt_suite import CHECKER, PromptFileError, PromptFileSuite

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> Checkpoint:
    return Checkpoint.open(write_tiny_checkpoint(tmp_path_factory.mktemp("m") / "llama", "llama"))


def _cases(tmp_path: Path, lines: list[dict]) -> Path:
    path = tmp_path / "cases.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def test_your_cases_and_checker_gate_a_candidate(policy, tmp_path):
    cases = [
        {"messages": [{"role": "user", "content": f"Fix bug {i}"}]}
        if i % 2
        else {"prompt": f"def f{i}("}
        for i in range(6)
    ]
    initial = policy.load_model()
    # First, what the initial policy answers; the checker then wants exactly that back
    # (a stand-in for a real checker, e.g. running the case's tests on the completion).
    answers = PromptFileSuite(policy, _cases(tmp_path, cases), lambda case, text: True)
    expected = []
    for i, prompt in enumerate(answers.prompts):
        length, ids = sample_answer(initial, prompt, 12, policy.eos_token_ids, i)
        expected.append(policy.decode(ids[length:]))
    path = _cases(tmp_path, [{**c, "expected": e} for c, e in zip(cases, expected, strict=True)])
    suite = PromptFileSuite(
        policy, path, lambda case, text: text == case["expected"], max_new_tokens=12
    )
    control = suite.score(initial)
    assert control[CHECKER] == 1.0
    gate = EvalGate(suite, tolerance=0.1, control=control, published=control)
    wrecked = policy.load_model()
    with torch.no_grad():
        for param in wrecked.parameters():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(3)))
    assert gate.judge(initial).accepted
    verdict = gate.judge(wrecked)
    assert not verdict.accepted and verdict.candidate[CHECKER] < 0.5


def test_a_bad_prompt_file_is_refused_naming_the_line(policy, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"neither": 1}\n')
    with pytest.raises(PromptFileError, match="bad.jsonl:2"):
        PromptFileSuite(policy, bad, lambda case, text: True)
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(PromptFileError, match="bad.jsonl:2: not JSON"):
        PromptFileSuite(policy, bad, lambda case, text: True)


def test_the_settings_want_a_checker_with_a_prompt_file(tmp_path):
    path = _cases(tmp_path, [{"prompt": "x"}])
    with pytest.raises(ValidationError, match="not a plug-in spec"):
        TrainerSettings(eval_prompts=path, eval_checker="")
    with pytest.raises(ValidationError, match="not a file"):
        TrainerSettings(eval_prompts=tmp_path / "missing.jsonl", eval_checker="json:loads")
    assert TrainerSettings(eval_prompts=path, eval_checker="json:loads").eval_prompts == path
