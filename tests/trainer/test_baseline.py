"""The context baseline for unique prompts (trainer/baseline.py): running means per context
key, their fallbacks, groups still compared within, and RTRL_TRAINER_BASELINE wired to the step."""

from __future__ import annotations

import random

import pytest
import torch

from rtrl.policy import EOS, PolicyConfig, build_model, encode
from rtrl.simulator.tasks import PROJECT_STYLES, Task
from rtrl.trainer.baseline import (
    BASELINE_FILE,
    PRIOR_REWARDS,
    ContextBaseline,
    GroupBaseline,
    RunningContextBaseline,
    RunningMean,
    baseline_for,
)
from rtrl.trainer.batch import TrainSample, collate, to_sample
from rtrl.trainer.config import TrainerSettings
from rtrl.trainer.objective import context_baseline_advantages, leave_one_out_advantages
from rtrl.trainer.sampling import prompt_ids
from rtrl.trainer.step import build_optimizer, rl_step
from rtrl.v1 import common_pb2, reward_pb2, rollout_pb2
from support.trainer import DEMO_PLUGINS

TINY = PolicyConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
STYLE = PROJECT_STYLES[0]


@pytest.mark.parametrize(
    "rewards, groups, baselines, expected",
    [
        # Alone in its group: reward minus its baseline, whatever the rest of the batch got.
        ([1.0, 0.0, 0.5], ["a", "b", "c"], [0.25, 0.25, 0.75], [0.75, -0.25, -0.25]),
        # A group of two or more is compared within: leave-one-out, its baselines unused.
        ([1.0, 0.0, 0.5], ["a", "a", "c"], [0.9, 0.9, 0.75], [1.0, -1.0, -0.25]),
        # No baseline yet (None): the batch fallback, the mean of the others.
        ([1.0, 0.0, 0.5], ["a", "b", "c"], [None, 0.5, None], [0.75, -0.5, 0.0]),
    ],
)
def test_context_baseline_advantages(rewards, groups, baselines, expected):
    assert context_baseline_advantages(rewards, groups, baselines) == pytest.approx(expected)


def test_std_normalize_scales_groups_but_not_baselined_rollouts():
    advantages = context_baseline_advantages(
        [1.0, 0.0, 1.0], ["a", "a", "b"], [0.0, 0.0, 0.5], std_normalize=True
    )
    assert advantages == pytest.approx([2.0, -2.0, 0.5])


def test_running_mean_is_plain_until_the_window_then_exponential():
    mean = RunningMean()
    for reward in (1.0, 0.0, 0.5):
        mean.add(reward, window=4)
    assert mean.mean == pytest.approx(0.5)
    mean.add(1.0, window=4)
    assert mean.mean == pytest.approx(0.625)
    mean.add(1.0, window=4)  # past the window: 1/4 of the way to the new reward
    assert mean.mean == pytest.approx(0.625 + (1.0 - 0.625) / 4)


def test_baseline_per_key_with_fallbacks():
    baseline = ContextBaseline(window=64)
    assert baseline.of("@p0") is None  # nothing seen: the batch fallback decides
    baseline.observe(["@p0"] * 8 + ["@p1"] * 8, [1.0] * 8 + [0.0] * 8)
    overall = 0.5
    # A key's mean leans on the overall one by PRIOR_REWARDS pseudo-rewards.
    assert baseline.of("@p0") == pytest.approx((8 * 1.0 + PRIOR_REWARDS * overall) / (8 + 4))
    assert baseline.of("@p1") == pytest.approx((8 * 0.0 + PRIOR_REWARDS * overall) / (8 + 4))
    # A key never seen, and a rollout without a context, get the overall mean.
    assert baseline.of("@p7") == pytest.approx(overall)
    assert baseline.of("") == pytest.approx(overall)


def test_a_long_seen_key_tracks_its_recent_rewards():
    baseline = ContextBaseline(window=16)
    baseline.observe(["k"] * 200, [0.0] * 100 + [1.0] * 100)
    assert (after := baseline.of("k")) is not None and after > 0.9


def test_baseline_is_taken_before_the_batch_joins_the_means():
    baseline = ContextBaseline(window=64)
    baseline.observe(["k"] * 16, [0.5] * 16)
    before = baseline.of("k")
    assert before is not None
    advantages = baseline.advantages([1.0, 1.0], ["g1", "g2"], ["k", "k"])
    assert advantages == pytest.approx([1.0 - before, 1.0 - before])
    assert (after := baseline.of("k")) is not None and after > before  # and then they do


def test_no_rollout_s_own_reward_is_in_its_baseline():
    """Raising one unique-prompt rollout's reward raises its advantage by exactly as much."""
    rng = random.Random(0)
    contexts = [f"@p{rng.randrange(3)}" for _ in range(32)]
    history = [rng.random() for _ in range(64)]
    rewards = [rng.random() for _ in contexts]
    groups = [f"prompt-{i}" for i in range(len(rewards))]

    def advantages(batch_rewards: list[float]) -> list[float]:
        baseline = ContextBaseline(window=16)
        baseline.observe([f"@p{i % 3}" for i in range(64)], history)
        return baseline.advantages(batch_rewards, groups, contexts)

    base = advantages(rewards)
    for i in (0, 5, 31):
        bumped = advantages([r + 1.0 if j == i else r for j, r in enumerate(rewards)])
        assert bumped[i] - base[i] == pytest.approx(1.0)
        assert [b for j, b in enumerate(bumped) if j != i] == pytest.approx(
            [b for j, b in enumerate(base) if j != i]
        )


def test_means_survive_a_restart(tmp_path):
    settings = TrainerSettings(baseline="context", context_key=DEMO_PLUGINS["context_key"])
    before = baseline_for(settings)
    assert isinstance(before, RunningContextBaseline)
    before.collate(samples([1.0, 0.0, 1.0, 1.0], ["@p0", "@p1", "@p0", "@p0"]))
    before.save(tmp_path)
    after = baseline_for(settings)
    after.load(tmp_path)
    assert isinstance(after, RunningContextBaseline)
    assert after.means.to_json() == before.means.to_json()
    assert (tmp_path / BASELINE_FILE).exists()


def test_a_missing_file_starts_the_means_empty(tmp_path):
    baseline = baseline_for(
        TrainerSettings(baseline="context", context_key=DEMO_PLUGINS["context_key"])
    )
    baseline.load(tmp_path)
    assert isinstance(baseline, RunningContextBaseline)
    assert baseline.means.overall.count == 0


def test_a_batch_trained_again_gets_the_advantages_it_got_first():
    """After a refusal the loop trains the same batches again: the means now hold their rewards."""
    baseline = baseline_for(
        TrainerSettings(baseline="context", context_key=DEMO_PLUGINS["context_key"])
    )
    baseline.collate(samples([0.0] * 8, ["@p0"] * 8, prefix="warm"))
    batch = samples([1.0, 0.0, 1.0], ["@p0", "@p0", "@p1"])
    first = baseline.collate(batch).advantages
    assert baseline.collate(batch).advantages == first


def test_context_key_is_read_by_the_plug_in():
    baseline = baseline_for(
        TrainerSettings(baseline="context", context_key=DEMO_PLUGINS["context_key"])
    )
    assert baseline.context_of(rollout_pb2.RolloutRecord(prompt_text="@p3 log ok 01234\n")) == "@p3"
    assert baseline.context_of(rollout_pb2.RolloutRecord(prompt_text="fix the build")) == ""
    record = reward_pb2.RewardRecord(rollout=rollout(Task(2, "say", "hi", "01234")), reward=1.0)
    sample = to_sample(record, TINY.max_positions, baseline.context_of)
    assert isinstance(sample, TrainSample) and sample.context == "@p2"


@pytest.mark.parametrize(
    "context_key, prompt_text, expected",
    [
        # The key the product sent with the request wins over the plug-in's reading.
        ("repo:acme/api", "@p3 log ok 01234\n", "repo:acme/api"),
        ("task:rename", "fix the build", "task:rename"),
        # None sent: the plug-in is asked, so the demo's tagged prompts keep their contexts.
        ("", "@p3 log ok 01234\n", "@p3"),
        ("", "fix the build", ""),
    ],
)
def test_a_record_s_own_context_key_comes_before_the_plug_in(context_key, prompt_text, expected):
    baseline = baseline_for(
        TrainerSettings(baseline="context", context_key=DEMO_PLUGINS["context_key"])
    )
    record = rollout_pb2.RolloutRecord(context_key=context_key, prompt_text=prompt_text)
    assert baseline.context_of(record) == expected


def test_setting_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("RTRL_TRAINER_BASELINE", "context")
    assert isinstance(baseline_for(TrainerSettings()), RunningContextBaseline)
    monkeypatch.setenv("RTRL_TRAINER_BASELINE", "group")
    assert isinstance(baseline_for(TrainerSettings()), GroupBaseline)
    monkeypatch.setenv("RTRL_TRAINER_BASELINE", "batch")
    with pytest.raises(ValueError):
        TrainerSettings()


@pytest.mark.parametrize("mode", ["group", "context"])
def test_unique_prompts_get_context_advantages_only_with_context(mode):
    """A batch of unique prompts in two contexts whose rewards differ: ``group`` compares each
    rollout with the batch mean, ``context`` with its context's running mean, and the step
    trains on what the baseline chose."""
    baseline = baseline_for(TrainerSettings(baseline=mode, context_key=DEMO_PLUGINS["context_key"]))
    contexts = ["@p0", "@p1"] * 8
    rewards = [0.9 if c == "@p0" else 0.1 for c in contexts]
    baseline.collate(samples(rewards, contexts, prefix="earlier"))
    batch = baseline.collate(samples(rewards, contexts))
    expected = leave_one_out_advantages(batch.rewards, batch.groups)
    if mode == "group":
        assert batch.advantages is None  # left to the step: leave-one-out, batch-mean fallback
    else:
        assert batch.advantages is not None
        # Each context's reward is what its running mean expects, up to the prior's pull.
        assert max(map(abs, batch.advantages)) < 0.2 < min(map(abs, expected))
        expected = list(batch.advantages)
    torch.manual_seed(0)
    model = build_model(TINY)
    metrics = rl_step(model, build_optimizer(model, 1e-4), batch)
    assert metrics.advantage_abs_mean == pytest.approx(sum(map(abs, expected)) / len(expected))


def rollout(task: Task) -> rollout_pb2.RolloutRecord:
    completion = [*encode(task.render(STYLE)), EOS]
    return rollout_pb2.RolloutRecord(
        rollout_id=f"rollout-{task.serial}",
        arm=common_pb2.ARM_TREATMENT,
        prompt_text=task.prompt,
        prompt_token_ids=prompt_ids(task.prompt),
        completion_token_ids=completion,
        completion_logprobs=[-1.0] * len(completion),
        version_spans=[rollout_pb2.VersionSpan(policy_version=0, start=0, end=len(completion))],
        sampling=rollout_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_tokens=64),
    )


def samples(rewards: list[float], contexts: list[str], prefix: str = "r") -> list[TrainSample]:
    """Unique-prompt samples: every prompt differs, so no group holds two."""
    out = []
    for i, (reward, context) in enumerate(zip(rewards, contexts, strict=True)):
        task = Task(int(context.removeprefix("@p")), "say", "hi", f"{i:05d}")
        prompt = prompt_ids(task.prompt)
        completion = (*encode(task.render(STYLE)), EOS)
        out.append(
            TrainSample(
                rollout_id=f"{prefix}-{i}",
                group=f"{prefix}-{task.prompt}",
                prompt_ids=tuple(prompt),
                completion_ids=completion,
                behaviour_logprobs=(-1.0,) * len(completion),
                temperature=1.0,
                reward=reward,
                oldest_version=0,
                last_event_ts_ms=0,
                context=context,
            )
        )
    return out


def test_collate_leaves_advantages_to_the_step_by_default():
    assert collate(samples([1.0], ["@p0"])).advantages is None
