"""The train–inference mismatch (trainer/mismatch.py): the pure measurement on hand-made
cases, then real trainer steps on rollouts the embedded inference engine sampled with the
trainer's own weights: near zero as they are, clearly not once the recorded log-probs are
perturbed, and not measured at all on a step that starts from weights no worker served."""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import pytest
import torch

from rtrl.inference.engine import Engine, EngineConfig, prompt_token_ids
from rtrl.inference.records import version_spans
from rtrl.policy import build_model, state_dict_fp32
from rtrl.trainer import metrics as step_metrics
from rtrl.trainer.batch import TrainSample, collate, to_sample
from rtrl.trainer.config import TrainerSettings
from rtrl.trainer.distributed import World, local_objective, shard, sharded_rl_step
from rtrl.trainer.evaluation import EvalScores, Verdict
from rtrl.trainer.kept_versions import KeptVersions
from rtrl.trainer.learner import LocalLearner
from rtrl.trainer.loop import Trainer
from rtrl.trainer.mismatch import Mismatch, Probe, measure, merge, row_versions, token_versions
from rtrl.trainer.objective import leave_one_out_advantages
from rtrl.trainer.step import StepMetrics, build_optimizer
from rtrl.v1 import common_pb2, reward_pb2, rollout_pb2
from support.moe import one_rank_group
from support.trainer import never_fetch

torch.set_num_threads(1)

THRESHOLD = 0.05
VERSION = 4
PROMPTS = ["@p0 say hi\n", "@p3 warn ready\n", "x\n", "@p2 show saved\n"] * 2


def _tensor(rows):
    return torch.tensor(rows, dtype=torch.float32)


# Two rows of two completion targets each; the trainer's log-probs are always these.
LOGP = [[-1.0, -2.0], [-0.5, -3.0]]


@pytest.mark.parametrize(
    "behaviour, versions, weights_version, mask, expected",
    [
        # every token on-policy: gaps 0.25, 0.5, 0, 0.125
        (
            [[-1.25, -1.5], [-0.5, -3.125]],
            [[4, 4], [4, 4]],
            4,
            [[1, 1], [1, 1]],
            Mismatch(mean=0.875 / 4, max=0.5, over_threshold_share=0.75, tokens=4),
        ),
        # a row sampled by an older version is left out: its gap includes the policy's movement
        (
            [[-1.25, -1.5], [-0.5, -9.0]],
            [[4, 4], [3, 3]],
            4,
            [[1, 1], [1, 1]],
            Mismatch(mean=0.375, max=0.5, over_threshold_share=1.0, tokens=2),
        ),
        # per-token versions: a rollout that spans a swap counts only its tokens from V
        (
            [[-1.25, -1.5], [-0.5, -9.0]],
            [[3, 4], [4, 3]],
            4,
            [[1, 1], [1, 1]],
            Mismatch(mean=0.25, max=0.5, over_threshold_share=0.5, tokens=2),
        ),
        # one version per row ([B, 1], row_versions) broadcasts over the row's tokens
        (
            [[-1.25, -1.5], [-0.5, -3.125]],
            [[4], [5]],
            4,
            [[1, 1], [1, 1]],
            Mismatch(mean=0.375, max=0.5, over_threshold_share=1.0, tokens=2),
        ),
        # padding and prompt positions (mask 0) never count, whatever they hold
        (
            [[-1.0, 50.0], [-0.5, -3.0]],
            [[4, 4], [4, 4]],
            4,
            [[1, 0], [1, 1]],
            Mismatch(mean=0.0, max=0.0, over_threshold_share=0.0, tokens=3),
        ),
        # a gap equal to the threshold is not over it
        (
            [[-1.05, -2.0], [-0.5, -3.0]],
            [[4, 4], [4, 4]],
            4,
            [[1, 0], [0, 0]],
            Mismatch(mean=0.05, max=0.05, over_threshold_share=0.0, tokens=1),
        ),
        # nothing sampled by the weights the step starts from: nothing measured, not a zero
        ([[-1.25, -1.5], [-0.5, -3.125]], [[3, 3], [2, 3]], 4, [[1, 1], [1, 1]], Mismatch()),
        # the learner holds unpublished weights: no worker sampled with them
        ([[-1.25, -1.5], [-0.5, -3.125]], [[4, 4], [4, 4]], None, [[1, 1], [1, 1]], Mismatch()),
    ],
)
def test_measure(behaviour, versions, weights_version, mask, expected):
    got = measure(
        _tensor(LOGP),
        _tensor(behaviour),
        torch.tensor(versions),
        weights_version,
        _tensor(mask),
        THRESHOLD,
    )
    assert got.tokens == expected.tokens
    assert (got.mean, got.max, got.over_threshold_share) == pytest.approx(
        (expected.mean, expected.max, expected.over_threshold_share), abs=1e-6
    )


@pytest.mark.parametrize(
    "parts, expected",
    [
        # token-weighted: (0.1·10 + 0.4·30) / 40; shares likewise; max over the parts
        (
            [Mismatch(0.1, 0.3, 0.0, 10), Mismatch(0.4, 0.9, 0.5, 30)],
            Mismatch(0.325, 0.9, 0.375, 40),
        ),
        # a step (or rank) that measured nothing changes nothing
        ([Mismatch(0.2, 0.5, 0.25, 8), Mismatch()], Mismatch(0.2, 0.5, 0.25, 8)),
        ([Mismatch(), Mismatch()], Mismatch()),
        ([], Mismatch()),
    ],
)
def test_merge(parts, expected):
    got = merge(parts)
    assert got.tokens == expected.tokens
    assert (got.mean, got.max, got.over_threshold_share) == pytest.approx(
        (expected.mean, expected.max, expected.over_threshold_share)
    )


# ---- real steps on rollouts the inference engine sampled --------------------------------


def _record(prompt: str, result, temperature: float) -> reward_pb2.RewardRecord:
    rollout_id = str(uuid.uuid4())
    rollout = rollout_pb2.RolloutRecord(
        rollout_id=rollout_id,
        arm=common_pb2.ARM_TREATMENT,
        prompt_text=prompt,
        prompt_group_id="g",
        prompt_token_ids=prompt_token_ids(prompt),
        completion_token_ids=result.token_ids,
        completion_logprobs=result.logprobs,
        version_spans=[
            rollout_pb2.VersionSpan(policy_version=s.version, start=s.start, end=s.end)
            for s in version_spans(result.versions)
        ],
        sampling=rollout_pb2.SamplingParams(temperature=temperature, top_p=1.0),
    )
    return reward_pb2.RewardRecord(
        rollout_id=rollout_id, rollout=rollout, reward=float(len(result.token_ids) % 3)
    )


@pytest.fixture(scope="module")
def served():
    """(weights, samples): rollouts the engine sampled from these weights, published as VERSION."""
    weights = state_dict_fp32(build_model(seed=3))
    engine = Engine(EngineConfig(batch_wait_s=0.01))
    engine.stage("control", 0, weights)
    engine.stage("treatment", VERSION, weights)
    engine.start()
    requests = [
        (prompt, temperature, seed)
        for seed, prompt in enumerate(PROMPTS)
        for temperature in (1.0, 0.7)
    ]
    try:
        futures = [
            engine.submit(
                "treatment",
                prompt_token_ids(prompt),
                max_tokens=20,
                temperature=temperature,
                seed=seed,
            )
            for prompt, temperature, seed in requests
        ]
        results = [future.result(timeout=120).result for future in futures]
    finally:
        engine.stop()
    samples = []
    for (prompt, temperature, _), result in zip(requests, results, strict=True):
        sample = to_sample(_record(prompt, result, temperature), 128)
        assert isinstance(sample, TrainSample), sample
        samples.append(sample)
    assert all(s.oldest_version == VERSION for s in samples)
    return weights, samples


def _model(weights):
    model = build_model(seed=0)
    model.load_state_dict(weights, strict=False)
    return model


def _learner(weights) -> LocalLearner:
    settings = TrainerSettings(mismatch_threshold=THRESHOLD)
    return LocalLearner(_model(weights), _model(weights), settings)


def _step(weights, samples: list[TrainSample], weights_version: int | None) -> Mismatch:
    learner = _learner(weights)
    probe = Probe(row_versions(samples), weights_version, THRESHOLD)
    return learner.step(collate(samples), probe).mismatch


def test_rollouts_sampled_with_the_trainers_own_weights_show_no_mismatch(served):
    weights, samples = served
    gap = _step(weights, samples, VERSION)
    assert gap.tokens == sum(len(s.completion_ids) for s in samples)
    assert gap.max < 1e-4 and gap.mean < 1e-4 and gap.over_threshold_share == 0.0


def test_perturbed_recorded_logprobs_show_as_mismatch(served):
    weights, samples = served
    bumped = [
        dataclasses.replace(
            s,
            behaviour_logprobs=tuple(
                lp - 0.3 if t % 2 == 0 else lp for t, lp in enumerate(s.behaviour_logprobs)
            ),
        )
        for s in samples
    ]
    tokens = sum(len(s.completion_ids) for s in samples)
    perturbed = sum((len(s.completion_ids) + 1) // 2 for s in samples)
    gap = _step(weights, bumped, VERSION)
    assert gap.tokens == tokens
    assert gap.max == pytest.approx(0.3, abs=1e-4)
    assert gap.over_threshold_share == pytest.approx(perturbed / tokens)
    assert gap.mean == pytest.approx(0.3 * perturbed / tokens, abs=1e-4)


def test_a_step_from_weights_no_worker_sampled_with_measures_nothing(served):
    weights, samples = served
    assert _step(weights, samples, VERSION + 1).tokens == 0
    assert _step(weights, samples, None).tokens == 0


def test_the_loop_measures_only_the_first_step_from_the_published_weights(served, tmp_path):
    """Two optimizer steps in one candidate: the second starts from weights the first moved,
    so only the first is measured; a refusal puts the learner back on the published version."""
    weights, samples = served
    trainer = _trainer(weights, tmp_path, kept=0)
    first, second = samples[:8], samples[8:]

    metrics, _ = trainer._train([first, second])
    assert metrics.mismatch.tokens == sum(len(s.completion_ids) for s in first)
    assert metrics.mismatch.max < 1e-4
    assert trainer.learner_version is None
    again, _ = trainer._train([second])
    assert again.mismatch.tokens == 0
    # The heartbeat keeps the last step that measured any token.
    trainer.reporter.show(trainer.progress(), metrics)
    trainer.reporter.show(trainer.progress(), again)
    shown = trainer.heartbeat().mismatch
    assert shown is not None and shown.tokens == metrics.mismatch.tokens
    assert (shown.threshold, shown.max) == (THRESHOLD, metrics.mismatch.max)

    scores = EvalScores({"ok": 0.0}, 1)
    trainer._refuse(Verdict(False, scores, scores, scores, ("ok regressed",)), len(samples))
    assert trainer.learner_version == VERSION
    back, _ = trainer._train([second])
    assert back.mismatch.tokens == sum(len(s.completion_ids) for s in second)
    assert back.mismatch.max < 1e-4


def _trainer(weights, tmp_path, *, kept: int) -> Trainer:
    trainer = Trainer(
        TrainerSettings(mismatch_threshold=THRESHOLD, mismatch_kept_versions=kept),
        Path(tmp_path),
        consumer=None,
        publishers={},
        fetch_weights=never_fetch,
    )
    trainer.learner = _learner(weights)
    trainer.learner.remember()
    trainer.version = trainer.learner_version = VERSION
    trainer.kept = KeptVersions(kept, lambda: _model(weights))
    return trainer


def test_kept_versions_measure_every_step_against_the_version_that_sampled(served, tmp_path):
    """With the published versions' weights kept, a step whose learner has moved on still
    measures its batch: under the version each token names, the gap is the serving stack's
    alone. Weights that are not the ones a worker served show, as they should."""
    weights, samples = served
    trainer = _trainer(weights, tmp_path, kept=2)
    trainer.kept.keep(VERSION, weights)
    first, second = samples[:8], samples[8:]
    metrics, _ = trainer._train([first, second])
    assert trainer.learner_version is None  # the learner moved past VERSION
    # The first step measures on its own forward (the kept forward skips the learner's
    # version), the second on the kept one: every token once.
    assert metrics.mismatch.tokens == sum(len(s.completion_ids) for s in samples)
    assert metrics.mismatch.max < 1e-4
    again, _ = trainer._train([second])
    assert again.mismatch.tokens == sum(len(s.completion_ids) for s in second)
    assert again.mismatch.max < 1e-4
    # The kept weights must be the served ones: other weights under VERSION's name show.
    other = _trainer(weights, tmp_path, kept=2)
    other.learner_version = None
    other.kept.keep(VERSION, state_dict_fp32(build_model(seed=9)))
    wrong, _ = other._train([second])
    assert wrong.mismatch.tokens > 0 and wrong.mismatch.over_threshold_share > 0.5


def test_the_step_record_and_gauges_carry_it(otel_memory):
    _, reader = otel_memory
    metrics = _stub_metrics(Mismatch(2e-7, 1e-6, 0.0, 120))
    scores = EvalScores({"ok": 1.0}, 1)
    record = step_metrics.step_record(
        lineage="warm",
        step=3,
        base_version=2,
        version=3,
        ts_ms=1,
        metrics=metrics,
        verdict=Verdict(True, scores, scores, scores),
        staleness=(0,),
        dropped={},
        timings={},
        mismatch_threshold=THRESHOLD,
    )
    assert (record.mismatch_tokens, record.mismatch_threshold) == (120, THRESHOLD)
    assert (record.mismatch_mean, record.mismatch_max) == (2e-7, 1e-6)
    step_metrics.record_instruments(record, 3)
    assert _gauges(reader) == pytest.approx(
        {
            "rtrl.trainer.mismatch_mean": 2e-7,
            "rtrl.trainer.mismatch_max": 1e-6,
            "rtrl.trainer.mismatch_over_threshold_share": 0.0,
            "rtrl.trainer.mismatch_tokens": 120,
        }
    )
    # A step that measured nothing says so and leaves the last reading.
    unmeasured = step_metrics.step_record(
        lineage="warm",
        step=4,
        base_version=3,
        version=4,
        ts_ms=2,
        metrics=_stub_metrics(Mismatch()),
        verdict=Verdict(True, scores, scores, scores),
        staleness=(1,),
        dropped={},
        timings={},
        mismatch_threshold=THRESHOLD,
    )
    step_metrics.record_instruments(unmeasured, 4)
    assert _gauges(reader)["rtrl.trainer.mismatch_tokens"] == 0
    assert _gauges(reader)["rtrl.trainer.mismatch_mean"] == pytest.approx(2e-7)


def _stub_metrics(gap: Mismatch) -> StepMetrics:
    return StepMetrics(
        loss=0.1,
        kl=0.0,
        entropy=1.0,
        grad_norm=0.5,
        reward_mean=0.5,
        advantage_abs_mean=0.2,
        clipped_fraction=0.0,
        ratio_mean=1.0,
        rollouts=4,
        tokens=120,
        mismatch=gap,
    )


def _gauges(reader) -> dict[str, float]:
    data = reader.get_metrics_data()
    return {
        metric.name: point.value
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name.startswith("rtrl.trainer.mismatch")
        for point in metric.data.data_points
    }


def test_ranks_measure_their_rows_and_merge_to_the_one_process_measurement(served):
    """The sharded step's measurement: each rank's rows (local_objective), merged the way
    sharded_rl_step merges what every rank gathered, is rl_step's."""
    weights, samples = served
    bumped = [
        dataclasses.replace(
            s, behaviour_logprobs=tuple(lp - 0.1 * i for lp in s.behaviour_logprobs)
        )
        for i, s in enumerate(samples)
    ]
    batch = collate(bumped)
    probe = Probe(row_versions(bumped), VERSION, THRESHOLD)
    expected = _learner(weights).step(batch, probe).mismatch
    model = _learner(weights).model.train()
    advantages = torch.tensor(leave_one_out_advantages(batch.rewards, batch.groups))
    ranks = [
        local_objective(model, batch, advantages, World(rank, 3), probe=probe).mismatch
        for rank in range(3)
    ]
    assert all(rank.tokens for rank in ranks)
    got = merge(ranks)
    assert got.tokens == expected.tokens
    assert (got.mean, got.max, got.over_threshold_share) == pytest.approx(
        (expected.mean, expected.max, expected.over_threshold_share), abs=1e-6
    )


def test_the_sharded_step_gathers_every_ranks_measurement(served):
    """sharded_rl_step on a one-rank gloo group (the collectives run; the rank split is the
    test above): the same measurement as rl_step."""
    weights, samples = served
    batch, probe = collate(samples), Probe(row_versions(samples), VERSION, THRESHOLD)
    expected = _learner(weights).step(batch, probe).mismatch
    with one_rank_group() as world:
        model, ref = shard(_model(weights), world), shard(_model(weights), world)
        optimizer = build_optimizer(model, 1e-4)
        got = sharded_rl_step(model, optimizer, batch, world, ref_model=ref, probe=probe).mismatch
    assert got.tokens == expected.tokens
    assert got.max < 1e-4 and got.mean == pytest.approx(expected.mean, abs=1e-6)


def test_a_rollout_spanning_a_swap_is_measured_on_the_tokens_the_learners_version_sampled(
    served,
):
    """Per-token versions (token_versions): the tokens sampled before a swap into the
    learner's version are left out, the ones after it are measured; per row (row_versions)
    the whole rollout would be left out."""
    weights, samples = served
    sample = samples[0]
    half = len(sample.completion_ids) // 2
    spanning = dataclasses.replace(
        sample,
        oldest_version=VERSION - 1,
        token_versions=(VERSION - 1,) * half + (VERSION,) * (len(sample.completion_ids) - half),
    )
    batch = collate([spanning])
    per_token = _learner(weights).step(batch, Probe(token_versions([spanning]), VERSION, THRESHOLD))
    per_row = _learner(weights).step(batch, Probe(row_versions([spanning]), VERSION, THRESHOLD))
    assert per_token.mismatch.tokens == len(sample.completion_ids) - half
    assert per_token.mismatch.max < 1e-4
    assert per_row.mismatch.tokens == 0
