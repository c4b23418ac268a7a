"""`rtrl status` tables render every state a component can report, including 'just started',
and the reward trend from the heartbeats reward_stream writes."""

import json

import pytest
from rich.console import Console

from rtrl import heartbeat
from rtrl.heartbeat import (
    InferenceBeat,
    RewardByVersion,
    RewardStreamBeat,
    TrainerBeat,
    TrainerMismatch,
)
from rtrl.ops.health import ComponentHealth
from rtrl.ops.status_view import (
    StackStatus,
    TrendPoint,
    as_json,
    fitted_change,
    pool,
    sparkline,
    trend_table,
    workers_table,
)


@pytest.mark.parametrize(
    "trainer_status, shown",
    [
        # before the first step the trainer has no reward mean yet
        (TrainerBeat(step=0, version=0, reward_mean=None, dropped_stale=0), "reward mean –"),
        (
            TrainerBeat(step=12, version=12, reward_mean=0.8125, dropped_stale=3),
            "reward mean 0.812",
        ),
        # a heartbeat without the optional fields (an older trainer's)
        (heartbeat.parse({"service": "trainer", "instance": "0", "ts": 0}).beat, "step 0"),
        # a trainer behind its traffic says how much it shed
        (
            TrainerBeat(step=5, dropped={"shed": 410, "control_arm": 900}),
            "shed 410 (behind its traffic)",
        ),
        # the train–inference mismatch the trainer last measured, and on how many tokens
        (
            TrainerBeat(step=9, mismatch=TrainerMismatch(8, 2.1e-7, 9.5e-7, 0.0125, 0.05, 412)),
            "|Δ log p| mean 2.10e-07 max 9.50e-07, 1.2 % over 0.05 (412 tokens at step 8)",
        ),
        # no step has measured it: said so, not shown as a zero
        (TrainerBeat(step=3), "train–inference mismatch not measured yet"),
        (
            heartbeat.parse({"service": "trainer", "instance": "0", "ts": 0}).beat,
            "mismatch not measured yet",
        ),
    ],
)
def test_workers_table(trainer_status, shown):
    rows = [
        ComponentHealth("trainer:0", True, "", trainer_status),
        ComponentHealth(
            "inference:0",
            True,
            "",
            InferenceBeat(versions={"control": 0, "treatment": 7}, completions=5, swaps=7),
        ),
    ]
    console = Console(record=True, width=200)
    console.print(workers_table(rows))
    text = console.export_text()
    assert shown in text
    assert "inference:0" in text and "7" in text


def test_status_json_carries_the_trainers_mismatch():
    beat = TrainerBeat(step=9, mismatch=TrainerMismatch(9, 0.02, 0.4, 0.25, 0.05, 64))
    status = StackStatus(
        healthy=True,
        components=(),
        lag=(),
        workers=(),
        trainers={"trainer:0": beat},
        trend={},
        alerts=(),
        refusals=(),
        reward_fn_version="",
        previous_broker="",
    )
    trainer = json.loads(json.dumps(as_json(status)))["trainers"]["trainer:0"]
    assert trainer["mismatch"] == {
        "step": 9,
        "mean": 0.02,
        "max": 0.4,
        "over_threshold_share": 0.25,
        "threshold": 0.05,
        "tokens": 64,
    }
    stored = heartbeat.document("trainer", "0", beat)
    assert heartbeat.parse(json.dumps(stored)).beat == beat


def rendered(renderable) -> str:
    console = Console(record=True, width=200)
    console.print(renderable)
    return console.export_text()


def arm_row(text: str, arm: str) -> str:
    """The trend table's line for ``arm`` (the header says "vs control" too)."""
    return next(line for line in text.splitlines() if line.strip("│ ").startswith(arm))


@pytest.mark.parametrize(
    "values, line",
    [
        ([0, 1, 2, 3, 4, 5, 6, 7], "▁▂▃▄▅▆▇█"),
        ([7, 6, 5, 4, 3, 2, 1, 0], "█▇▆▅▄▃▂▁"),
        # the middle of the range lands in the upper half of the eight blocks
        ([-1.0, 0.0, 1.0], "▁▅█"),
        ([0.0, 1.0, 0.5], "▁█▅"),
        # no change to scale against: mid-height, neither the floor nor the ceiling
        ([0.4, 0.4, 0.4], "▄▄▄"),
        ([0.7], "▄"),
        ([], ""),
    ],
)
def test_sparkline(values, line):
    assert sparkline(values) == line


@pytest.mark.parametrize(
    "values, change",
    [
        ([0.25, 0.5, 0.75], 0.5),
        ([0.0, 1.0, 0.0], 0.0),
        # one high end point moves the fitted line less than last minus first (1.0)
        ([0.0, 0.0, 0.0, 1.0], 0.9),
        ([0.3], 0.0),
    ],
)
def test_fitted_change(values, change):
    assert fitted_change(values) == pytest.approx(change)


@pytest.mark.parametrize(
    "totals, points",
    [
        # version -> (rollouts, reward sum); pooled from the newest back to 20 rollouts a point
        (
            {1: (10, 5.0), 2: (10, 6.0), 3: (25, 0.0), 4: (3, 3.0)},
            [TrendPoint(1, 2, 20, 0.55), TrendPoint(3, 4, 28, 3 / 28)],
        ),
        # the oldest leftover (5 rollouts) joins the oldest point instead of standing alone
        ({1: (5, 5.0), 2: (30, 0.0)}, [TrendPoint(1, 2, 35, 5 / 35)]),
        # fewer than 20 in all: one point of everything
        ({7: (3, 1.5)}, [TrendPoint(7, 7, 3, 0.5)]),
        ({}, []),
    ],
)
def test_pool(totals, points):
    assert pool(totals, min_rollouts=20) == points


def reward_stream_row(instance: int, by_version: dict[int, tuple[int, float]]) -> ComponentHealth:
    entries = tuple(RewardByVersion(v, n, mean) for v, (n, mean) in sorted(by_version.items()))
    return ComponentHealth(
        f"reward_stream:{instance}",
        True,
        "",
        RewardStreamBeat(settled=0, reward_by_version=entries),
    )


INFERENCE = ComponentHealth(
    "inference:0", True, "", InferenceBeat(versions={"control": 0, "treatment": 5})
)


def two_workers(treatment_means: list[float]) -> list[ComponentHealth]:
    """Control v0 (40 rollouts, mean 0.5) and treatment v1.. with the given means, each
    version's 20 rollouts split over two workers at mean -/+ 0.125."""
    low = {0: (20, 0.375), **{v: (10, m - 0.125) for v, m in enumerate(treatment_means, start=1)}}
    high = {0: (20, 0.625), **{v: (10, m + 0.125) for v, m in enumerate(treatment_means, start=1)}}
    return [INFERENCE, reward_stream_row(0, low), reward_stream_row(1, high)]


@pytest.mark.parametrize(
    "treatment_means, shown",
    [
        (
            [0.0, 0.25, 0.5, 0.75, 1.0],
            ["1.000", "rising +1.000", "▁▃▅▇█", "v1-v5", "100", "+0.500"],
        ),
        (
            [1.0, 0.75, 0.5, 0.25, 0.0],
            ["0.000", "falling -1.000", "█▇▅▃▁", "v1-v5", "100", "-0.500"],
        ),
        ([0.5, 0.5, 0.5, 0.5, 0.5], ["0.500", "flat +0.000", "▄▄▄▄▄", "v1-v5", "100", "+0.000"]),
        # one version: a value but no change yet
        ([0.75], ["0.750", "–", "▄", "v1", "20", "+0.250"]),
    ],
)
def test_trend_table_per_arm(treatment_means, shown):
    text = rendered(trend_table(two_workers(treatment_means)))
    treatment, control = arm_row(text, "treatment"), arm_row(text, "control")
    for cell in shown:
        assert cell in treatment, (cell, treatment)
    # control is pinned to v0: one point of both workers' 40 rollouts
    for cell in ("0.500", "▄", "v0", "40"):
        assert cell in control, (cell, control)


def test_trend_pools_the_newest_versions_few_rewards_into_the_point_before():
    rows = [
        INFERENCE,
        reward_stream_row(0, {0: (20, 0.5), 1: (20, 0.0), 2: (20, 1.0), 3: (3, 1.0)}),
    ]
    text = rendered(trend_table(rows))
    assert "▁█" in text and "v1-v3" in text and "43" in text


def test_trend_follows_the_version_inference_serves_to_control():
    rows = [
        ComponentHealth(
            "inference:0", True, "", InferenceBeat(versions={"control": 2, "treatment": 3})
        ),
        reward_stream_row(0, {2: (20, 0.25), 3: (20, 0.75)}),
    ]
    text = rendered(trend_table(rows))
    assert "v2" in arm_row(text, "control") and "0.250" in arm_row(text, "control")
    assert "v3" in arm_row(text, "treatment") and "0.750" in arm_row(text, "treatment")


@pytest.mark.parametrize(
    "rows",
    [
        [],
        [INFERENCE],
        # a reward_stream that has settled nothing, or predates the field
        [INFERENCE, reward_stream_row(0, {})],
        [INFERENCE, ComponentHealth("reward_stream:0", True, "", RewardStreamBeat(settled=0))],
    ],
)
def test_trend_before_any_reward(rows):
    assert rendered(trend_table(rows)).strip() == "reward trend: no rewards yet"


def test_trend_of_an_arm_without_rewards():
    text = rendered(trend_table([INFERENCE, reward_stream_row(0, {0: (40, 0.5)})]))
    assert "no rewards yet" in arm_row(text, "treatment")
    assert "0.500" in arm_row(text, "control") and "no rewards yet" not in arm_row(text, "control")


def test_the_joiner_heartbeat_carries_the_trend():
    # What reward_stream's heartbeat carries (through JSON, as Redis stores it) renders as the trend.
    from rtrl.reward_stream import monitors
    from rtrl.reward_stream.join import JoinConfig
    from rtrl.reward_stream.runtime import Joiner
    from rtrl.v1 import reward_pb2, rollout_pb2

    joiner = Joiner(
        JoinConfig(
            window_ms=1000, grace_ms=0, deadline_slack_ms=0, max_wait_ms=2000, settled_ttl_ms=10_000
        )
    )
    for version, reward in [(0, 0.5), (1, 0.0), (2, 0.5), (3, 1.0)]:
        for i in range(20):
            rollout = rollout_pb2.RolloutRecord(
                rollout_id=f"v{version}-{i}",
                version_spans=[rollout_pb2.VersionSpan(policy_version=version, start=0, end=1)],
            )
            record = reward_pb2.RewardRecord(
                rollout_id=rollout.rollout_id, rollout=rollout, reward=reward
            )
            joiner.monitor, _ = monitors.step(joiner.monitor, record)
    # Through Redis and back: the JSON document, parsed as the status reads it.
    status = heartbeat.parse(
        json.dumps(heartbeat.document("reward_stream", "0", joiner.status()))
    ).beat
    assert isinstance(status, RewardStreamBeat)
    assert [e.version for e in status.reward_by_version] == [0, 1, 2, 3]
    assert [e.rollouts for e in status.reward_by_version] == [20] * 4
    # the newest versions, and the oldest (the warm start control serves) however many came after it
    assert [e.version for e in monitors.reward_by_version(joiner.monitor, newest=2)] == [0, 2, 3]
    treatment = arm_row(
        rendered(trend_table([INFERENCE, ComponentHealth("reward_stream:0", True, "", status)])),
        "treatment",
    )
    assert "▁▅█" in treatment and "rising +1.000" in treatment and "v1-v3" in treatment


def test_trend_weights_each_worker_by_its_rollouts():
    # v1: 30 rollouts at 0.0 on one worker, 10 at 1.0 on the other: 0.25, not the mean of means
    rows = [
        INFERENCE,
        reward_stream_row(0, {0: (20, 0.5), 1: (30, 0.0)}),
        reward_stream_row(1, {1: (10, 1.0)}),
    ]
    assert "0.250" in arm_row(rendered(trend_table(rows)), "treatment")


@pytest.mark.parametrize(
    "rows, shown",
    [
        (two_workers([0.0, 0.25, 0.5, 0.75, 1.0]), "▁▃▅▇█"),
        ([INFERENCE], "reward trend: no rewards yet"),
    ],
)
def test_status_shows_the_trend(monkeypatch, tmp_path, rows, shown):
    from types import SimpleNamespace
    from typing import cast

    from rtrl.ops import status_view
    from rtrl.ops.stack import StackFile

    monkeypatch.setattr(status_view.health, "check", lambda stack: rows)
    monkeypatch.setattr(status_view, "lag_table", lambda stack: "consumer lag")
    # Just the two fields render reads beside the (patched) health check and lag table.
    stack = cast(StackFile, SimpleNamespace(reward_fn_version="r1", state_dir=str(tmp_path)))
    text = rendered(status_view.render(stack))
    assert shown in text and "policy versions" in text


@pytest.mark.parametrize(
    "inference",
    [
        [],
        # a worker still loading reports control -1
        [
            ComponentHealth(
                "inference:0", True, "", InferenceBeat(versions={"control": -1, "treatment": -1})
            )
        ],
    ],
)
def test_trend_takes_control_as_v0_until_inference_reports(inference):
    text = rendered(trend_table([*inference, reward_stream_row(0, {0: (20, 0.5), 1: (20, 1.0)})]))
    assert "v0" in arm_row(text, "control") and "0.500" in arm_row(text, "control")
    assert "v1" in arm_row(text, "treatment") and "+0.500" in arm_row(text, "treatment")


def test_status_says_what_the_previous_broker_took_with_it():
    from rtrl.ops.broker_record import BrokerRecord
    from rtrl.ops.status_view import broker_loss

    gone = BrokerRecord(
        "tansu-1",
        "127.0.0.1:1",
        0.0,
        unjoined_events=7,
        unjoined_rollouts=3,
        untrained_rewards=2,
        measured_ts=60.0,
        final=True,
    )
    said = broker_loss(gone)
    assert "7 accepted events and 3 rollouts were still unjoined and 2 rewards untrained" in said
    assert "after every service stopped" in said and "about" not in said
    crashed = broker_loss(
        BrokerRecord(
            "tansu-1",
            "127.0.0.1:1",
            0.0,
            unjoined_events=7,
            unjoined_rollouts=3,
            untrained_rewards=2,
            measured_ts=60.0,
        )
    )
    assert "its last reading" in crashed and "about 7 accepted events" in crashed
    assert "never measured" in broker_loss(BrokerRecord("tansu-1", "127.0.0.1:1", 0.0))
    assert broker_loss(None) == ""
