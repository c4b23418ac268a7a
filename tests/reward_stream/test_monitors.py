"""Reward-hacking guards: behaviour shifts between policy versions raise alerts, stable streams do not."""

from __future__ import annotations

import random

import pytest

from rtrl.reward_stream import monitors, reward
from rtrl.v1 import reward_pb2, rollout_pb2
from rtrl_client.v1 import telemetry_pb2
from support.reward_stream import QUESTION_CASES

EDIT_TEXT = "def f():\n    return 1\n"
REJECTED = telemetry_pb2.EditOutcome(outcome=telemetry_pb2.EditOutcome.OUTCOME_REJECTED)


# r2 scores follow-ups with the rules here: these tests are about the monitor, and this
# keeps them from loading the classifier's encoder.
pytestmark = pytest.mark.usefixtures("rule_dissatisfaction")


def rollout_of(
    kind: str, i: int, version: int
) -> tuple[rollout_pb2.RolloutRecord, list[telemetry_pb2.TelemetryEvent]]:
    """Rollout i of a policy version behaving as ``kind``, with the telemetry the user sends back.

    kept / rewritten: an edit whose snapshot (two minutes on) is unchanged / rewritten;
    rejected: an edit rejected with a complaint; question: a clarifying question, no
    code; dodge: no edit, a broken tool call instead.
    """
    rollout_id = f"v{version}-{kind}-{i}"
    text = {"question": "Which file should I change?", "dodge": "Running the tests first."}.get(
        kind, EDIT_TEXT
    )
    record = rollout_pb2.RolloutRecord(
        event_id=f"{rollout_id}-r",
        rollout_id=rollout_id,
        client_ts_ms=1000,
        completion_text=text,
        completion_token_ids=[5] * 40,
        version_spans=[rollout_pb2.VersionSpan(policy_version=version, start=0, end=40)],
        tool_calls=[rollout_pb2.ToolCall(name="run", valid=False)] if kind == "dodge" else [],
    )

    def ev(suffix: str, ts: int, **payload) -> telemetry_pb2.TelemetryEvent:
        return telemetry_pb2.TelemetryEvent(
            event_id=f"{rollout_id}-{suffix}", rollout_id=rollout_id, client_ts_ms=ts, **payload
        )

    telemetry = []
    if kind in ("kept", "rewritten"):
        region = EDIT_TEXT if kind == "kept" else "x = 2\n"
        telemetry = [
            ev("s", 1010, edit_shown=telemetry_pb2.EditShown(edit_text=EDIT_TEXT)),
            ev(
                "p",
                121_010,
                persistence=telemetry_pb2.PersistenceSnapshot(
                    seconds_after_edit=120, region_text=region
                ),
            ),
        ]
    elif kind == "rejected":
        telemetry = [
            ev("s", 1010, edit_shown=telemetry_pb2.EditShown(edit_text=EDIT_TEXT)),
            ev("o", 1020, edit_outcome=REJECTED),
            ev("f", 1030, followup=telemetry_pb2.FollowUp(message="no, that broke the build")),
        ]
    return record, telemetry


def stream(
    *phases: tuple[int, int, tuple[str, ...]], version_fn: str = "r1"
) -> list[reward_pb2.RewardRecord]:
    """Reward records for (policy version, rollouts, behaviour cycle) phases, in order."""
    records = []
    for version, n, cycle in phases:
        for i in range(n):
            record, telemetry = rollout_of(cycle[i % len(cycle)], i, version)
            records.append(reward.reward_record(record, telemetry, 200_000, version_fn))
    return records


def run(
    records: list[reward_pb2.RewardRecord], config: monitors.MonitorConfig | None = None
) -> list[monitors.Alert]:
    state = monitors.MonitorState(config or monitors.MonitorConfig())
    alerts: list[monitors.Alert] = []
    for record in records:
        state, new = monitors.step(state, record)
        alerts.extend(new)
    return alerts


HONEST = ("kept", "rewritten", "rejected", "kept")
DODGING = (
    "kept",
    "rewritten",
    "dodge",
    "kept",
)  # breaks a tool call where it would have been rejected
ASKING = ("kept", "rewritten", "question", "kept")

MONITOR_CASES = {
    # Same behaviour mix in both versions, different lengths: nothing to report.
    "stable": ([(1, 100, HONEST), (2, 120, HONEST)], set()),
    # Three versions in a row, all honest.
    "stable_three_versions": ([(1, 80, HONEST), (2, 80, HONEST), (3, 80, HONEST)], set()),
    # The new version breaks tool calls instead of risking edits.
    "broken_tool_calls_to_dodge_edits": (
        [(1, 100, HONEST), (2, 100, DODGING)],
        # Under r1 the mean reward rises (0.355 -> 0.48) but too noisily to flag: only behaviour does.
        {"broken_tool_call", "edit", "dissatisfied", "mean_tool_call_validity"},
    ),
    # The new version asks instead of editing where it used to be rejected.
    "questions_instead_of_edits": (
        [(1, 100, HONEST), (2, 100, ASKING)],
        {"clarifying_question", "edit", "dissatisfied"},
    ),
    # The same hack with too few rollouts of the new version to tell.
    "too_few_samples": ([(1, 100, HONEST), (2, 40, DODGING)], set()),
    # A first version has nothing to be compared with.
    "single_version": ([(1, 200, DODGING)], set()),
}


@pytest.mark.parametrize("phases, expected", MONITOR_CASES.values(), ids=MONITOR_CASES.keys())
def test_monitor(phases, expected):
    alerts = run(stream(*phases))
    assert {a.metric for a in alerts} == expected
    assert len(alerts) == len(expected)  # each (version, metric) alerts once
    for alert in alerts:
        assert abs(alert.z_score) >= 4 and abs(alert.value - alert.previous_value) >= 0.1
        assert 0 < len(alert.examples) <= 5


def test_broken_tool_call_alert_names_the_shift_and_examples():
    alerts = run(stream((1, 100, HONEST), (2, 100, DODGING)))
    [alert] = [a for a in alerts if a.metric == "broken_tool_call"]
    assert (alert.previous_version, alert.version, alert.previous_value) == (1, 2, 0.0)
    # Raised the first time the rule holds, so the rate is the dodge share at that point.
    assert alert.value == pytest.approx(0.25, abs=0.02) and alert.z_score > 4
    assert all(rollout_id.startswith("v2-dodge-") for rollout_id in alert.examples)


def mean_reward(records: list[reward_pb2.RewardRecord]) -> float:
    return sum(r.reward for r in records) / len(records)


@pytest.mark.parametrize("version_fn, dodging_pays", [("r1", True), ("r2", False)])
def test_hackable_reward_is_caught_by_the_monitor(version_fn, dodging_pays):
    # Under r1 a broken tool call (0.5 - 0.5) beats a rejected, complained-about edit
    # (0 - 0.5), so the dodging version earns MORE reward than the honest one: reward
    # alone would call it progress. The behaviour monitor flags it whatever the reward says.
    honest = stream((1, 100, HONEST), version_fn=version_fn)
    dodging = stream((2, 100, DODGING), version_fn=version_fn)
    assert (mean_reward(dodging) > mean_reward(honest)) is dodging_pays
    metrics = {a.metric for a in run(honest + dodging)}
    assert {"broken_tool_call", "edit"} <= metrics


def ramp(
    first_version: int,
    versions: int,
    per_version: int,
    kind: str,
    start: float,
    end: float,
    rest=("kept", "rewritten"),
):
    """Phases for ``versions`` versions in a row whose share of ``kind`` goes from start to
    end in equal steps, spread evenly through each version, the rest cycling through
    ``rest``: a behaviour that grows (or fades) a little with every version, as one
    does under continuous training."""
    phases = []
    for i in range(versions):
        share = start + (end - start) * i / max(versions - 1, 1)
        k = round(share * per_version)
        cycle = tuple(
            kind if (j + 1) * k // per_version > j * k // per_version else rest[j % len(rest)]
            for j in range(per_version)
        )
        phases.append((first_version + i, per_version, cycle))
    return phases


def drift_alerts(alerts: list[monitors.Alert]) -> list[monitors.Alert]:
    return [a for a in alerts if a.kind == "drift"]


DRIFT_CASES = {
    # Questions creep from none to 40 % over 40 versions of 30 rollouts: no version is
    # big enough for a step comparison, the pooled windows see it.
    "questions_creep_in_small_versions": (
        ramp(1, 40, 30, "question", 0.0, 0.4),
        {("drift", "clarifying_question"), ("drift", "edit")},
    ),
    # The same creep in versions of 100: every step comparison runs, none sees more than
    # a 2-point change, only the drift does.
    "questions_creep_in_big_versions": (
        ramp(1, 20, 100, "question", 0.0, 0.4),
        {("drift", "clarifying_question"), ("drift", "edit")},
    ),
    # Broken tool calls creep in where edits used to be.
    "dodges_creep_in": (
        ramp(1, 40, 30, "dodge", 0.0, 0.4),
        {("drift", "broken_tool_call"), ("drift", "edit")},
    ),
    # The policy learns: kept edits go from 30 % to 90 %, rewritten and rejected ones
    # (and their complaints) fade. Persisted and reward rise, dissatisfied falls, all
    # far past any threshold: healthy learning, no alert.
    "learning_to_edit_well": (
        ramp(1, 40, 30, "kept", 0.3, 0.9, rest=("rewritten", "rejected")),
        set(),
    ),
    # Questions fade from 40 % to none (what r3 does to them): the safe direction.
    "questions_fade": (ramp(1, 40, 30, "question", 0.4, 0.0), set()),
    # Too little traffic for two windows.
    "one_window_only": (ramp(1, 20, 30, "question", 0.0, 0.4), set()),
}


@pytest.mark.parametrize("phases, expected", DRIFT_CASES.values(), ids=DRIFT_CASES.keys())
def test_drift(phases, expected):
    alerts = run(stream(*phases))
    assert {(a.kind, a.metric) for a in alerts} == expected
    for alert in drift_alerts(alerts):
        assert alert.samples >= 400 and alert.previous_samples >= 400
        assert alert.previous_version < alert.first_version <= alert.version
        assert 0 < len(alert.examples) <= 5


def test_drift_alert_shows_the_reference_the_window_and_examples():
    alerts = run(stream(*ramp(1, 40, 30, "question", 0.0, 0.4)))
    [alert] = [a for a in alerts if a.metric == "clarifying_question"]
    # The reference is the oldest 400 rollouts (v1-v14), the window the newest 400 when it alerted.
    assert (alert.previous_first_version, alert.previous_version) == (1, 14)
    assert alert.version - alert.first_version == 13 and alert.z_score >= 4
    assert alert.value - alert.previous_value >= 0.05
    assert all(
        "-question-" in rollout_id and int(rollout_id[1:].split("-")[0]) >= alert.first_version
        for rollout_id in alert.examples
    )


def test_drift_alerts_once_per_step_of_drift():
    # 15 % questions after a clean start, then 30 %, then a long plateau: two alerts, the
    # second measured against the window that raised the first, none on the plateau.
    phases = [
        (1, 420, ("kept",)),
        *ramp(2, 40, 30, "question", 0.15, 0.15),
        *ramp(42, 80, 30, "question", 0.3, 0.3),
    ]
    alerts = [a for a in run(stream(*phases)) if a.metric == "clarifying_question"]
    assert [a.kind for a in alerts] == ["drift", "drift"]
    first, second = alerts
    assert (second.previous_first_version, second.previous_version) == (
        first.first_version,
        first.version,
    )
    assert first.previous_value == 0.0 and first.value < second.value <= 0.3


def test_a_stable_noisy_rate_raises_no_drift_alert():
    # 6,000 rollouts, each a question with probability 0.1: windows wander by chance only.
    rng = random.Random(3)
    phases = [
        (v, 30, tuple("question" if rng.random() < 0.1 else "kept" for _ in range(30)))
        for v in range(1, 201)
    ]
    assert drift_alerts(run(stream(*phases))) == []


VERSION_CASES = {
    # One version: that one.
    "single": ([(3, 0, 40)], 3),
    # A swap mid-rollout: the version that sampled most tokens.
    "swap_late": ([(3, 0, 30), (4, 30, 40)], 3),
    "swap_early": ([(3, 0, 10), (4, 10, 40)], 4),
    # A tie goes to the newer version.
    "tie": ([(3, 0, 20), (4, 20, 40)], 4),
    # No spans: not attributable.
    "none": ([], None),
}


@pytest.mark.parametrize("spans, expected", VERSION_CASES.values(), ids=VERSION_CASES.keys())
def test_policy_version(spans, expected):
    rollout = rollout_pb2.RolloutRecord(
        version_spans=[
            rollout_pb2.VersionSpan(policy_version=v, start=s, end=e) for v, s, e in spans
        ]
    )
    assert monitors.policy_version(rollout) == expected


@pytest.mark.parametrize("text, expected", QUESTION_CASES.values(), ids=QUESTION_CASES.keys())
def test_is_clarifying_question(text, expected):
    assert monitors.is_clarifying_question(text) is expected


def test_unversioned_records_are_counted_not_compared():
    state = monitors.MonitorState()
    state, alerts = monitors.step(state, reward_pb2.RewardRecord(rollout_id="x"))
    assert alerts == [] and state.unversioned["records"] == 1 and state.versions == {}


@pytest.mark.parametrize(
    "bad", [{"min_samples": 1}, {"drift_window": 1}, {"drift_min_shift": -0.1}]
)
def test_config_is_validated(bad):
    with pytest.raises(ValueError):
        monitors.MonitorConfig(**bad)


def test_the_live_joiner_reports_alerts_in_its_status():
    # The runtime feeds every settled reward to the monitor: a version that starts
    # dodging with broken tool calls shows up in the heartbeat status.
    from rtrl import topics
    from rtrl.reward_stream.join import JoinConfig
    from rtrl.reward_stream.runtime import Joiner

    joiner = Joiner(
        JoinConfig(
            window_ms=1000, grace_ms=0, deadline_slack_ms=0, max_wait_ms=2000, settled_ttl_ms=10_000
        )
    )
    phases = [(1, 80, ("kept", "rewritten")), (2, 80, ("dodge",))]
    for version, n, cycle in phases:
        for i in range(n):
            record, telemetry = rollout_of(cycle[i % len(cycle)], i, version)
            joiner.feed(
                topics.ROLLOUT,
                0,
                0,
                record.rollout_id.encode(),
                record.SerializeToString(),
                now_ms=0,
            )
            for event in telemetry:
                topic = topics.BY_PAYLOAD[event.WhichOneof("payload")]
                joiner.feed(
                    topic, 0, 0, event.rollout_id.encode(), event.SerializeToString(), now_ms=0
                )
        joiner.tick(now_ms=10_000 * version)
    alerts = joiner.status().alerts
    assert "broken_tool_call" in {a.metric for a in alerts}
    broken = next(a for a in alerts if a.metric == "broken_tool_call")
    assert (broken.previous_version, broken.version) == (1, 2)
    assert all(rid.startswith("v2-dodge") for rid in broken.examples)
