"""The RL step learns a house style from reward alone (in-process, no Kafka).

A scripted user keeps an edit only when it is a correct helper in project 0's quote
style (single quotes). Rollouts are sampled from the policy, wrapped in the same
RewardRecords production sends, and go through to_sample → collate → rl_step.
Success is compared with the same policy before RL, measured the same way.
"""

from __future__ import annotations

import random

import pytest
import torch

from rtrl.policy import PolicyConfig, decode
from rtrl.simulator.tasks import PROJECT_STYLES, parse_style, random_task
from rtrl.simulator.warmstart import WarmStartRecipe, train
from rtrl.trainer.batch import TrainSample, collate, drop_stale, to_sample
from rtrl.trainer.sampling import prompt_ids, sample
from rtrl.trainer.step import build_optimizer, rl_step
from rtrl.v1 import common_pb2, reward_pb2, rollout_pb2

pytestmark = pytest.mark.slow

SMALL = PolicyConfig(
    hidden_size=64, num_layers=2, num_heads=4, intermediate_size=192, max_positions=64
)
PROJECT = 0
PROMPTS_PER_STEP, GROUP_SIZE, RL_STEPS = 8, 8, 25


def user_keeps(task, completion_text: str) -> float:
    style = parse_style(task, completion_text)
    return float(style is not None and style.quote == PROJECT_STYLES[PROJECT].quote)


def success_rate(
    model, rng: random.Random, generator: torch.Generator, samples: int = 256
) -> float:
    tasks = [random_task(rng, PROJECT) for _ in range(samples)]
    out = sample(model, [prompt_ids(t.prompt) for t in tasks], generator=generator)
    return (
        sum(user_keeps(t, decode(list(o.completion_ids))) for t, o in zip(tasks, out, strict=True))
        / samples
    )


def reward_records(
    model, rng: random.Random, generator: torch.Generator, version: int
) -> list[reward_pb2.RewardRecord]:
    tasks = [random_task(rng, PROJECT) for _ in range(PROMPTS_PER_STEP) for _ in range(GROUP_SIZE)]
    out = sample(model, [prompt_ids(t.prompt) for t in tasks], generator=generator)
    records = []
    for index, (task, completion) in enumerate(zip(tasks, out, strict=True)):
        rollout = rollout_pb2.RolloutRecord(
            rollout_id=f"v{version}-{index}",
            arm=common_pb2.ARM_TREATMENT,
            prompt_group_id=f"v{version}-g{index // GROUP_SIZE}",
            prompt_text=task.prompt,
            prompt_token_ids=prompt_ids(task.prompt),
            completion_token_ids=completion.completion_ids,
            completion_logprobs=completion.logprobs,
            version_spans=[
                rollout_pb2.VersionSpan(
                    policy_version=version, start=0, end=len(completion.completion_ids)
                )
            ],
            sampling=rollout_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_tokens=48),
        )
        reward = user_keeps(task, decode(list(completion.completion_ids)))
        records.append(
            reward_pb2.RewardRecord(rollout_id=rollout.rollout_id, rollout=rollout, reward=reward)
        )
    return records


def test_rl_step_raises_the_kept_rate():
    torch.manual_seed(0)
    model, _ = train(SMALL, WarmStartRecipe(min_steps=250, max_steps=250, lr=3e-3, seed=0))
    eval_seed = 123
    before = success_rate(model, random.Random(eval_seed), torch.Generator().manual_seed(eval_seed))

    optimizer = build_optimizer(model, lr=3e-4)
    rng, generator = random.Random(7), torch.Generator().manual_seed(7)
    curve = []
    for version in range(RL_STEPS):
        samples: list[TrainSample] = []
        for r in reward_records(model, rng, generator, version):
            converted = to_sample(r, SMALL.max_positions)
            assert isinstance(converted, TrainSample), converted  # none dropped on the way in
            samples.append(converted)
        fresh, stale = drop_stale(samples, current_version=version, max_staleness=8)
        assert stale == 0 and len(fresh) == PROMPTS_PER_STEP * GROUP_SIZE
        metrics = rl_step(model, optimizer, collate(fresh), is_cap=2.0, grad_clip=1.0)
        curve.append(round(metrics.reward_mean, 3))
    after = success_rate(model, random.Random(eval_seed), torch.Generator().manual_seed(eval_seed))

    print(f"kept rate before {before:.3f} after {after:.3f}; batch reward curve {curve}")
    assert after >= before + 0.25, (before, after, curve)
