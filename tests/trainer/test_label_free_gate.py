"""The default eval gate for a model of your own (trainer/label_free.py): with no labels,
it refuses an update that wrecks the model and lets a gentle one through."""

from __future__ import annotations

import pytest
import torch

from rtrl.checkpoint import Checkpoint
from rtrl.ops.tiny_model import write_tiny_checkpoint
from trainer.evaluation import EvalGate
from trainer.label_free import CHECKER, LabelFreeSuite

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> Checkpoint:
    return Checkpoint.open(write_tiny_checkpoint(tmp_path_factory.mktemp("m") / "qwen3", "qwen3"))


def _moved(policy: Checkpoint, scale: float) -> torch.nn.Module:
    model = policy.load_model()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    return model


def test_the_label_free_gate_refuses_a_wrecked_update_and_passes_a_gentle_one(policy):
    initial = policy.load_model()
    suite = LabelFreeSuite(policy, initial, samples=8, max_new_tokens=16)
    control = suite.score(initial)
    assert control[CHECKER] == pytest.approx(1.0)
    gate = EvalGate(suite, tolerance=0.1, control=control, published=control)

    gentle = gate.judge(_moved(policy, 1e-4))
    wrecked = gate.judge(_moved(policy, 0.5))
    assert gentle.accepted, gentle.regressions
    assert gentle.candidate[CHECKER] > 0.99
    assert not wrecked.accepted
    assert wrecked.candidate[CHECKER] < 0.5
    assert any("kl_to_initial vs control" in r for r in wrecked.regressions)
    # Deterministic for the same weights, as every suite must be.
    assert suite.score(initial) == control
