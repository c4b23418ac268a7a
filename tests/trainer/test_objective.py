"""The policy-gradient objective and batch preparation on hand-computed cases."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from rtrl.trainer.batch import (
    Drop,
    SeenRollouts,
    TrainSample,
    collate,
    drop_stale,
    to_sample,
)
from rtrl.trainer.objective import leave_one_out_advantages, policy_gradient_loss
from rtrl.trajectory import Segment
from rtrl.v1 import common_pb2, reward_pb2, rollout_pb2


@pytest.mark.parametrize(
    "rewards, groups, std_normalize, expected",
    [
        # Leave-one-out within a group: 1 − mean(0, 0); 0 − mean(1, 0).
        ([1.0, 0.0, 0.0], ["a", "a", "a"], False, [1.0, -0.5, -0.5]),
        # A rollout alone in its group is compared with the rest of the batch: 0.5 − mean(1, 0, 0).
        ([1.0, 0.0, 0.0, 0.5], ["a", "a", "a", "b"], False, [1.0, -0.5, -0.5, 0.5 - 1 / 3]),
        # Degenerate group: zero advantage, and no division by its zero std.
        ([1.0, 1.0], ["a", "a"], True, [0.0, 0.0]),
        # std normalization of a non-degenerate group: LOO ±1, population std 0.5.
        ([1.0, 0.0], ["a", "a"], True, [2.0, -2.0]),
        # Two groups do not see each other's rewards.
        ([1.0, 0.0, 5.0, 5.0], ["a", "a", "b", "b"], False, [1.0, -1.0, 0.0, 0.0]),
        # A batch of one has no baseline to compare with.
        ([3.0], ["a"], False, [0.0]),
    ],
)
def test_leave_one_out_advantages(rewards, groups, std_normalize, expected):
    assert leave_one_out_advantages(rewards, groups, std_normalize=std_normalize) == pytest.approx(
        expected
    )


def _leaf(values):
    return torch.tensor([values], dtype=torch.float64, requires_grad=True)


def test_on_policy_loss_value_and_gradient_sign():
    logp = _leaf([math.log(0.5), math.log(0.25), 0.0])
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)  # third position is padding
    terms = policy_gradient_loss(logp, logp.detach(), torch.tensor([2.0]), mask)
    # −(2·ln 0.5 + 2·ln 0.25) / 2 tokens = −ln 0.125
    assert terms.loss.item() == pytest.approx(-math.log(0.125))
    assert (
        terms.tokens == 2
        and terms.ratio_mean == pytest.approx(1.0)
        and terms.clipped_fraction == 0.0
    )
    terms.loss.backward()
    # d loss / d logp_t = −w·A / N: descent raises the log-prob of well-rewarded tokens.
    assert logp.grad[0].tolist() == pytest.approx([-1.0, -1.0, 0.0])

    logp.grad = None
    policy_gradient_loss(logp, logp.detach(), torch.tensor([-2.0]), mask).loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([1.0, 1.0, 0.0])


def test_gradient_step_moves_probability_toward_rewarded_tokens():
    logits = torch.zeros(2, 3, requires_grad=True)
    tokens = torch.tensor([0, 2])
    logp = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).T  # [1, 2]
    loss = policy_gradient_loss(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 2)).loss
    loss.backward()
    assert logits.grad is not None
    with torch.no_grad():
        after = torch.softmax(logits - 0.5 * logits.grad, -1)
    assert after[0, 0] > 1 / 3 and after[1, 2] > 1 / 3


def test_importance_ratio_is_truncated_at_the_cap():
    logp = _leaf([math.log(0.6), math.log(0.2)])
    # Token 0 is 3x likelier now than when sampled (ratio 3 → capped at 2); token 1 half as likely (0.5, kept).
    behaviour = torch.tensor([[math.log(0.2), math.log(0.4)]], dtype=torch.float64)
    terms = policy_gradient_loss(
        logp, behaviour, torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.float64), is_cap=2.0
    )
    assert terms.loss.item() == pytest.approx(-(2.0 * math.log(0.6) + 0.5 * math.log(0.2)) / 2)
    assert terms.clipped_fraction == pytest.approx(0.5)
    assert terms.ratio_mean == pytest.approx((3.0 + 0.5) / 2)
    terms.loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-1.0, -0.25])


def test_kl_penalty_enters_as_a_per_token_advantage():
    logp = _leaf([math.log(0.5), math.log(0.5)])
    ref = torch.tensor([[math.log(0.25), math.log(0.5)]], dtype=torch.float64)
    terms = policy_gradient_loss(
        logp,
        logp.detach(),
        torch.tensor([1.0]),
        torch.ones(1, 2, dtype=torch.float64),
        ref_logp=ref,
        kl_coef=0.1,
    )
    assert terms.kl == pytest.approx(math.log(2) / 2)
    terms.loss.backward()
    # Token 0 drifted ln 2 from the reference: its advantage shrinks to 1 − 0.1·ln 2.
    assert logp.grad[0].tolist() == pytest.approx([-(1 - 0.1 * math.log(2)) / 2, -0.5])


def _sample(rollout_id: str, oldest: int) -> TrainSample:
    return TrainSample(rollout_id, "g", (1, 5), (7, 2), (-0.1, -0.2), 1.0, 1.0, oldest, 0)


def test_staleness_drop_counting():
    samples = [_sample("a", 10), _sample("b", 2), _sample("c", 1), _sample("d", 5)]
    fresh, dropped = drop_stale(samples, current_version=10, max_staleness=8)
    assert [s.rollout_id for s in fresh] == ["a", "b", "d"] and dropped == 1
    assert drop_stale(samples, current_version=10, max_staleness=0) == ([samples[0]], 3)


def test_staleness_is_judged_per_token():
    """A trajectory whose first turn an old version sampled and whose last a fresh one
    did: the old tokens are masked (no loss), the fresh ones train; all stale: dropped."""
    mixed = dataclasses.replace(
        _sample("mixed", 1),
        segments=(
            Segment.generated((7, 2), (-0.1, -0.2), (1, 1)),
            Segment.observed((3,), "tool"),
            Segment.generated((4, 6), (-0.3, -0.4), (9, 10)),
        ),
        completion_ids=(7, 2, 4, 6),
        behaviour_logprobs=(-0.1, -0.2, -0.3, -0.4),
        token_versions=(1, 1, 9, 10),
    )
    old = dataclasses.replace(_sample("old", 1), token_versions=(1, 1))
    fresh, dropped = drop_stale([mixed, old], current_version=10, max_staleness=2)
    assert [s.rollout_id for s in fresh] == ["mixed"] and dropped == 1
    batch = collate(fresh)
    # prompt (1, 5), then 7 2 | 3 | 4 6: targets 7 2 3 4 6, of which 4 and 6 train.
    assert batch.target_mask[0].tolist() == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]


def _record(**rollout_fields) -> reward_pb2.RewardRecord:
    fields: dict[str, Any] = dict(
        rollout_id="r1",
        arm=common_pb2.ARM_TREATMENT,
        prompt_text="@p0 say hi\n",
        prompt_token_ids=[1, 40, 41],
        completion_token_ids=[50, 51, 2],
        completion_logprobs=[-0.5, -0.25, -0.125],
        version_spans=[
            rollout_pb2.VersionSpan(policy_version=4, start=0, end=2),
            rollout_pb2.VersionSpan(policy_version=5, start=2, end=3),
        ],
        sampling=rollout_pb2.SamplingParams(temperature=1.0),
    )
    fields.update(rollout_fields)
    return reward_pb2.RewardRecord(
        rollout_id="r1",
        rollout=rollout_pb2.RolloutRecord(**fields),
        reward=0.75,
        last_event_ts_ms=123,
    )


@pytest.mark.parametrize(
    "override, expected",
    [
        (dict(arm=common_pb2.ARM_CONTROL), Drop.CONTROL_ARM),
        (dict(completion_token_ids=[], completion_logprobs=[], version_spans=[]), Drop.EMPTY),
        (dict(completion_logprobs=[-0.5]), Drop.MALFORMED),
        (dict(version_spans=[]), Drop.MALFORMED),
        (dict(sampling=rollout_pb2.SamplingParams(temperature=0.0)), Drop.GREEDY),
        (dict(prompt_token_ids=[1] * 200), Drop.TOO_LONG),
    ],
)
def test_records_that_are_not_trained_on(override, expected):
    assert to_sample(_record(**override), max_positions=128) == expected


def test_record_to_tensors_keeps_the_production_tokens():
    sample = to_sample(_record(), max_positions=128)
    assert isinstance(sample, TrainSample)
    assert sample.oldest_version == 4 and sample.group == "@p0 say hi\n" and sample.reward == 0.75
    short = TrainSample("r2", "g", (1, 9), (2,), (-1.0,), 1.0, 0.0, 5, 0)
    batch = collate([sample, short])
    assert batch.input_ids.tolist() == [[1, 40, 41, 50, 51, 2], [1, 9, 2, 0, 0, 0]]
    # Targets are input_ids[:, 1:]; completion tokens start at target index len(prompt) − 1.
    assert batch.target_mask.tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
    assert batch.behaviour_logprobs.tolist() == [[0, 0, -0.5, -0.25, -0.125], [0, -1.0, 0, 0, 0]]


def test_seen_rollouts_refuse_a_second_training():
    seen = SeenRollouts(capacity=2)
    assert seen.admit("a") and not seen.admit("a")
    assert seen.admit("b") and seen.admit("c")
    assert seen.admit("a")  # forgotten after `capacity` newer ids
