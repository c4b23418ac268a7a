"""When is a version live on every worker: the bench's definition, as cases."""

import pytest

from rtrl.bench.loop_latency import (
    Intake,
    StepTimes,
    VersionLatency,
    live_times,
    phase_breakdown,
    phases,
    summarize,
    trend,
)


@pytest.mark.parametrize(
    "applied, expected",
    [
        # both workers apply every version: live when the slower one does
        ({1: {"a": 100, "b": 150}, 2: {"a": 200, "b": 210}}, {1: 150, 2: 210}),
        # worker b skips v1 and goes straight to v2: v1 is live on b from then on
        ({1: {"a": 100}, 2: {"a": 200, "b": 180}}, {1: 180, 2: 200}),
        # v3 only on one worker so far: not live on every worker
        ({2: {"a": 200, "b": 210}, 3: {"a": 300}}, {2: 210}),
    ],
)
def test_live_times(applied, expected):
    assert live_times(applied) == expected


def test_summary_quantiles_and_ratio():
    rows = [VersionLatency(v, 1000, 2000, 1000 + 1000 * v) for v in range(1, 11)]
    result = summarize(rows, versions_published=12, reward_window_s=2.0)
    assert result.p50_event_to_live_s == 5.5
    assert result.p95_event_to_live_s == 10.0
    assert result.versions_published == 12
    assert result.versions_live_on_every_worker == 10
    assert result.p50_event_to_live_vs_reward_window == 2.75


def _row(version: int, event_ms: int, published_ms: int, live_ms: int) -> VersionLatency:
    return VersionLatency(version, event_ms, published_ms, live_ms)


def _step(
    version: int,
    reward_ms: int,
    read_ms: int,
    started_ms: int,
    step_s=0.5,
    eval_s=0.3,
    publish_s=0.1,
    gate_wait_s=0.0,
):
    return StepTimes(
        version,
        reward_ms,
        read_ms,
        started_ms,
        step_s,
        eval_s,
        publish_s,
        rollouts=64,
        optimizer_steps=1,
        gate_wait_s=gate_wait_s,
    )


@pytest.mark.parametrize(
    "rows, steps, expected_p50",
    [
        # one version: each instant of its newest rollout becomes a phase; live runs from the manifest
        (
            [_row(1, 0, 3_900, 4_100)],
            [_step(1, reward_ms=2_000, read_ms=2_500, started_ms=3_000)],
            {
                "reward": 2.0,
                "queue": 0.5,
                "batch_wait": 0.5,
                "step": 0.5,
                "gate_wait": 0.0,
                "eval": 0.3,
                "publish": 0.1,
                "live": 0.2,
                "unaccounted": 0.0,
            },
        ),
        # a trainer behind its traffic: the reward waits in Kafka (queue) and for the previous verdict (gate_wait)
        (
            [
                _row(1, 0, 13_000, 13_200),
                _row(2, 1_000, 20_000, 20_300),
                _row(3, 2_000, 27_000, 27_100),
            ],
            [
                _step(1, 2_000, 11_000, 11_500, step_s=1.0, gate_wait_s=0.2),
                _step(2, 3_000, 18_000, 18_400, step_s=1.0, gate_wait_s=0.3),
                _step(3, 4_000, 25_000, 25_600, step_s=1.0, gate_wait_s=0.1),
            ],
            {
                "reward": 2.0,
                "queue": 15.0,
                "batch_wait": 0.5,
                "step": 1.0,
                "gate_wait": 0.2,
                "eval": 0.3,
                "publish": 0.1,
                "live": 0.2,
            },
        ),
        # versions without a step record, or from a trainer that records no instants, are left out
        ([_row(1, 0, 3_900, 4_100), _row(2, 0, 5_000, 5_100)], [_step(2, 0, 0, 0)], {}),
    ],
)
def test_phase_breakdown(rows, steps, expected_p50):
    breakdown = phase_breakdown(rows, steps)
    assert {
        name: stats.p50 for name, stats in breakdown.items() if name in expected_p50
    } == pytest.approx(expected_p50, abs=1e-3)
    if breakdown:
        # the phases add up to event -> live, whatever the spread
        for row, step in zip(rows, steps, strict=True):
            assert sum(phases(row, step).values()) == pytest.approx(row.event_to_live_s)


def _series(latencies_s: list[float], every_s: float = 10.0) -> list[VersionLatency]:
    """One version every every_s, its event -> live as given."""
    return [
        _row(
            v, int(v * every_s * 1000 - s * 1000), int(v * every_s * 1000), int(v * every_s * 1000)
        )
        for v, s in enumerate(latencies_s, 1)
    ]


@pytest.mark.parametrize(
    "latencies_s, rising, slope",
    [
        # flat: the trainer keeps pace
        ([4.0] * 18, False, 0.0),
        # noisy but flat: no trend
        ([3.0, 5.0] * 9, False, None),
        # falling behind: +1 s per version every 10 s, 6 s per minute
        ([2.0 + i for i in range(18)], True, 6.0),
        # a small rise within RISE_TOLERANCE_S over the run is not a trend
        ([4.0 + 0.05 * i for i in range(18)], False, 0.3),
        # draining a start-up backlog: falling
        ([20.0 - i for i in range(18)], False, -6.0),
    ],
)
def test_trend(latencies_s, rising, slope):
    result = trend(_series(latencies_s))
    assert result is not None
    assert result.rising is rising
    if slope is not None:
        assert result.slope_s_per_min == pytest.approx(slope, abs=1e-3)
    assert len(result.p50_per_bucket_s) == 3  # 170 s of publishes in 60 s buckets


def test_trend_needs_three_versions():
    assert trend(_series([4.0, 5.0])) is None


def test_intake_counts_every_candidate_and_the_share_of_treatment_trained():
    from rtrl.bench.loop_latency import intake
    from rtrl.v1 import trainer_pb2

    records = [
        trainer_pb2.TrainerStep(
            published=True, rollouts=32, dropped={"control_arm": 40, "shed": 10}
        ),
        trainer_pb2.TrainerStep(published=False, rollouts=32, dropped={"shed": 22, "duplicate": 1}),
        trainer_pb2.TrainerStep(
            published=True,
            rollouts=16,
            token_staleness=[
                trainer_pb2.TokenStaleness(staleness=0, tokens=30),
                trainer_pb2.TokenStaleness(staleness=2, tokens=10),
            ],
        ),
        trainer_pb2.TrainerStep(
            published=True, token_staleness=[trainer_pb2.TokenStaleness(staleness=2, tokens=60)]
        ),
    ]
    assert intake(records) == Intake(
        rollouts_trained=80,
        dropped={"control_arm": 40, "duplicate": 1, "shed": 32},
        trained_share_of_treatment=round(
            80 / 113, 3
        ),  # control's rollouts are not the trainer's to take
        token_staleness={0: 30, 2: 70},
        newest_token_share=0.3,
    )
    assert intake([]).trained_share_of_treatment is None
