"""Micro-batches by a token budget: one step's gradient accumulated over forwards of at
most RTRL_TRAINER_MICRO_BATCH_TOKENS padded positions is the step one forward takes, so
a batch of long trajectories trains in the memory of its longest one."""

from __future__ import annotations

import pytest
import torch

from rtrl.policy import PAD, VOCAB_SIZE, build_model
from rtrl.trainer.batch import TrainBatch, micro_batches
from rtrl.trainer.mismatch import Probe
from rtrl.trainer.step import rl_step

torch.set_num_threads(1)

LENGTHS = (40, 9, 70, 23, 55, 12)
"""Each row's prompt + completion: rows of very different widths, right-padded."""
PROMPT = 5


def batch() -> TrainBatch:
    generator = torch.Generator().manual_seed(3)
    width = max(LENGTHS)
    input_ids = torch.full((len(LENGTHS), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(LENGTHS), width - 1)
    for row, length in enumerate(LENGTHS):
        input_ids[row, :length] = torch.randint(3, VOCAB_SIZE, (length,), generator=generator)
        mask[row, PROMPT - 1 : length - 1] = 1.0
    mask[2, 60:] = 0.0  # the widest row's last tokens too stale to train: no need to run them
    behaviour = -torch.rand(mask.shape, generator=generator) * 4 * mask
    return TrainBatch(
        input_ids=input_ids,
        target_mask=mask,
        behaviour_logprobs=behaviour,
        temperature=torch.tensor([1.0, 0.8, 1.0, 1.2, 1.0, 0.9]),
        rewards=(1.0, 0.0, 0.5, 0.25, 1.0, 0.0),
        groups=("a", "a", "b", "b", "c", "d"),
    )


def test_rows_group_by_budget_longest_first_and_a_wide_row_goes_alone():
    groups = micro_batches(batch(), 100)
    assert groups == [([2], 61), ([4], 55), ([0, 3], 40), ([1, 5], 12)]
    assert micro_batches(batch(), 10_000) == [([0, 1, 2, 3, 4, 5], 61)]
    assert all(len(rows) == 1 for rows, _ in micro_batches(batch(), 1))


@pytest.mark.parametrize("budget", [100, 1])
def test_a_step_in_micro_batches_is_the_step_of_one_forward(budget):
    ref = build_model(seed=2)
    steps = {}
    for name, token_budget in (("whole", None), ("micro", budget)):
        model = build_model(seed=1)
        probe = Probe(torch.zeros(len(LENGTHS), max(LENGTHS) - 1, dtype=torch.long), 0, 0.1)
        metrics = rl_step(
            model,
            torch.optim.SGD(model.parameters(), lr=1.0),  # the parameters move by the gradient
            batch(),
            ref_model=ref,
            kl_coef=0.1,
            probe=probe,
            token_budget=token_budget,
        )
        steps[name] = (metrics, dict(model.named_parameters()))
    (whole, after), (micro, micro_after) = steps["whole"], steps["micro"]
    for name, parameter in after.items():
        torch.testing.assert_close(micro_after[name], parameter, rtol=0, atol=1e-5)
    for field in ("loss", "kl", "entropy", "grad_norm", "clipped_fraction", "ratio_mean"):
        assert getattr(micro, field) == pytest.approx(getattr(whole, field), rel=1e-5, abs=1e-7)
    assert micro.tokens == whole.tokens == int(batch().target_mask.sum())
    assert micro.mismatch.tokens == whole.mismatch.tokens > 0
    assert micro.mismatch.mean == pytest.approx(whole.mismatch.mean, rel=1e-5)


def test_the_step_record_counts_tokens_by_the_versions_behind_that_sampled_them():
    """trainer.metrics.token_staleness: a trajectory's own swaps split its tokens."""
    from rtrl.trainer.batch import TrainSample
    from rtrl.trainer.metrics import token_staleness

    def sample(versions):
        n = len(versions)
        return TrainSample(
            rollout_id="r", group="g", prompt_ids=(1,), completion_ids=(2,) * n,
            behaviour_logprobs=(-0.1,) * n, temperature=1.0, reward=1.0,
            oldest_version=min(versions), last_event_ts_ms=0, token_versions=tuple(versions),
        )  # fmt: skip

    buckets = token_staleness([sample((4, 4, 5)), sample((5, 5))], base_version=5)
    assert [(b.staleness, b.tokens) for b in buckets] == [(0, 3), (1, 2)]
