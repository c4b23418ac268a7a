"""The default eval gate for a model of your own (trainer/label_free.py): with no labels,
it refuses an update that wrecks the model and lets a gentle one through."""

from __future__ import annotations

import pytest
import torch

from rtrl.checkpoint import Checkpoint, write_demo_checkpoint
from rtrl.ops.tiny_model import write_tiny_checkpoint
from rtrl.policy import PolicyConfig, build_model, state_dict_fp32
from rtrl.trainer.evaluation import EvalGate
from rtrl.trainer.label_free import CHECKER, LabelFreeSuite, sample_answer

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


@pytest.mark.parametrize("family", ["qwen3", "demo"])
def test_gate_answers_are_sampled_on_the_kv_cache_as_a_full_forward_would(policy, family, tmp_path):
    """sample_answer decodes on the KV cache: the same tokens, seed for seed, as a full
    forward over the whole sequence at every step, while the model sees each token once
    (prompt + answer − 1 positions in all) instead of once per later step."""
    if family == "demo":
        config = PolicyConfig()
        weights = state_dict_fp32(build_model(config))
        policy = Checkpoint.open(write_demo_checkpoint(tmp_path / "demo", weights, config))
    model = policy.load_model()
    prompt = policy.encode("def total(xs):")
    eos = policy.eos_token_ids

    def uncached(seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        ids = list(prompt)
        for _ in range(24):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)))
            if ids[-1] in eos:
                break
        return ids

    positions: list[int] = []
    hook = model.get_input_embeddings().register_forward_hook(
        lambda _module, args, _out: positions.append(args[0].shape[-1])
    )
    try:
        for seed in range(4):
            expected = uncached(seed)
            positions.clear()
            length, ids = sample_answer(model, prompt, 24, eos, seed)
            assert length == len(prompt) and ids == expected
            assert positions[0] == len(prompt) and sum(positions[1:]) == len(ids) - len(prompt) - 1
    finally:
        hook.remove()
