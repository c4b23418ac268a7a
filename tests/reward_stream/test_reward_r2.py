"""Reward function r2: age-weighted persistence, tool-call validity, nonlinear effort, latency."""

from __future__ import annotations

import math

import pytest

from rtrl.reward_stream import reward, reward_wire
from rtrl.reward_stream.config import RewardStreamSettings
from rtrl.v1 import reward_pb2, rollout_pb2
from rtrl_client.v1 import telemetry_pb2

AGENT = "def f():\n    return 1\n"
KEPT = telemetry_pb2.PersistenceSnapshot
REJECTED = telemetry_pb2.EditOutcome(outcome=telemetry_pb2.EditOutcome.OUTCOME_REJECTED)


def rollout(tool_calls=(), tokens=40, latency_s=0.2) -> rollout_pb2.RolloutRecord:
    return rollout_pb2.RolloutRecord(
        event_id="ro",
        rollout_id="r1",
        client_ts_ms=1000,
        completion_text=AGENT,
        completion_token_ids=[5] * tokens,
        tool_calls=[rollout_pb2.ToolCall(name="t", valid=v) for v in tool_calls],
        latency_s=latency_s,
    )


def ev(event_id: str, ts: int, **payload) -> telemetry_pb2.TelemetryEvent:
    return telemetry_pb2.TelemetryEvent(
        event_id=event_id, rollout_id="r1", client_ts_ms=ts, **payload
    )


def shown(ts: int = 1000) -> telemetry_pb2.TelemetryEvent:
    return ev("s", ts, edit_shown=telemetry_pb2.EditShown(edit_text=AGENT))


# Follow-ups scored with the rules (1.0 / 0.0) so the table below is computable by hand;
# test_r2_dissatisfied_is_the_classifiers_highest_probability covers the classifier path.
pytestmark = pytest.mark.usefixtures("rule_dissatisfaction")


# (rollout, telemetry, persisted_fraction, effort_penalty, reward), all by hand.
R2_CASES = {
    # Nothing observed: neutral 0.5, within every budget.
    "defaults": (rollout(), [], 0.5, 0.0, 0.5),
    # Kept, snapshot a minute after the edit: trust 1 - e^-1 = 0.63212.
    "kept_after_60s": (
        rollout(),
        [shown(), ev("p", 61_000, persistence=KEPT(seconds_after_edit=60, region_text=AGENT))],
        0.5 + 0.5 * 0.6321206,
        0.0,
        0.8160603,
    ),
    # Kept, snapshot 5 s after the edit: trust 1 - e^(-1/12) = 0.07996, barely above neutral.
    "kept_after_5s": (
        rollout(),
        [shown(), ev("p", 6_000, persistence=KEPT(seconds_after_edit=5, region_text=AGENT))],
        0.5399778,
        0.0,
        0.5399778,
    ),
    # Rewritten; seconds_after_edit unset, so the age is event time since edit_shown: 180 s, trust 0.95021.
    "rewritten_after_180s_event_time": (
        rollout(),
        [shown(1000), ev("p", 181_000, persistence=KEPT(region_text="x = 2\n"))],
        0.5 * 0.0497871,
        0.0,
        0.0248935,
    ),
    # Rejected right away, no snapshot: nothing persisted.
    "rejected": (rollout(), [ev("o", 1100, edit_outcome=REJECTED)], 0.0, 0.0, 0.0),
    # Annoyed follow-up: -0.5.
    "dissatisfied": (
        rollout(),
        [ev("f", 1200, followup=telemetry_pb2.FollowUp(message="no, revert it"))],
        0.5,
        0.0,
        0.0,
    ),
    # Every tool call broken: 0.5 - 1.25, clearly below no tool calls at all (0.5).
    "all_tool_calls_invalid": (rollout(tool_calls=(False, False)), [], 0.5, 0.0, -0.75),
    # Half broken: 0.5 - 1.25 * 0.5.
    "half_tool_calls_invalid": (rollout(tool_calls=(True, False)), [], 0.5, 0.0, -0.125),
    # Exactly at the token budget: no penalty.
    "tokens_at_budget": (rollout(tokens=512), [], 0.5, 0.0, 0.5),
    # 1.5x the budget: 0.2 * 0.5^2 = 0.05.
    "tokens_1.5x_budget": (rollout(tokens=768), [], 0.5, 0.05, 0.45),
    # 2x the budget: 0.2 * 1^2 = 0.2 (four times the 1.5x penalty for twice the excess).
    "tokens_2x_budget": (rollout(tokens=1024), [], 0.5, 0.2, 0.3),
    # Runaway generation: capped at 0.5.
    "tokens_runaway": (rollout(tokens=10_000), [], 0.5, 0.5, 0.0),
    # 16 valid tool calls, twice the budget of 8: 0.2.
    "tool_calls_2x_budget": (rollout(tool_calls=(True,) * 16, tokens=0), [], 0.5, 0.2, 0.3),
    # Both over budget: excess 0.5 + 1.0, 0.2 * 1.5^2 = 0.45.
    "tokens_and_calls_over_budget": (
        rollout(tool_calls=(True,) * 16, tokens=768),
        [],
        0.5,
        0.45,
        0.05,
    ),
    # 4 s latency: 0.05 * (4 - 2) = 0.1.
    "latency_4s": (rollout(latency_s=4.0), [], 0.5, 0.0, 0.4),
    # 20 s latency: capped at 0.25.
    "latency_capped": (rollout(latency_s=20.0), [], 0.5, 0.0, 0.25),
}


@pytest.mark.parametrize(
    "record, telemetry, persisted, effort, expected", R2_CASES.values(), ids=R2_CASES.keys()
)
def test_r2(record, telemetry, persisted, effort, expected):
    out = reward.reward_record(record, telemetry, settled_ts_ms=9999, version="r2")
    assert out.components.persisted_fraction == pytest.approx(persisted, abs=1e-6)
    assert out.components.effort_penalty == pytest.approx(effort)
    assert out.components.latency_s == record.latency_s
    assert out.reward == pytest.approx(expected, abs=1e-6)
    assert out.reward_fn_version == "r2"
    assert out.reward_id == reward_wire.reward_id("r1", list(out.event_ids), "r2")
    assert out.reward_id != reward.reward_record(record, telemetry, settled_ts_ms=9999).reward_id


TRUST_CASES = {
    # (age_s, trust): 0 s says nothing, a minute is 1 - 1/e, three minutes nearly everything.
    "at_edit": (0.0, 0.0),
    "negative_clock_skew": (-3.0, 0.0),
    "one_minute": (60.0, 1 - math.exp(-1)),
    "three_minutes": (180.0, 1 - math.exp(-3)),
}


@pytest.mark.parametrize("age_s, trust", TRUST_CASES.values(), ids=TRUST_CASES.keys())
def test_persistence_trust(age_s, trust):
    assert reward.persistence_trust(age_s) == pytest.approx(trust)


def worst_honest_edit() -> tuple[rollout_pb2.RolloutRecord, list]:
    """An edit the user rejected and complained about: the risk a policy takes by editing."""
    return rollout(), [
        ev("o", 1100, edit_outcome=REJECTED),
        ev("f", 1200, followup=telemetry_pb2.FollowUp(message="wrong")),
    ]


@pytest.mark.parametrize("version, hackable", [("r1", True), ("r2", False)])
def test_broken_tool_call_as_an_escape_from_a_risky_edit(version, hackable):
    # r1 scores a lone broken tool call (no edit shown) 0.0 and a rejected, complained-about
    # edit -0.5, so a policy learns to break tool calls instead of risking edits; r2 does not.
    dodge = reward.reward_record(rollout(tool_calls=(False,)), [], 9999, version).reward
    honest = reward.reward_record(*worst_honest_edit(), 9999, version).reward
    assert (dodge > honest) is hackable


def test_r3_is_the_service_default_and_unknown_versions_fail():
    assert reward.REWARD_FN_VERSION == "r3" == RewardStreamSettings().reward_fn_version
    assert sorted(reward.FUNCTIONS) == ["a1", "a1h", "a2", "a2h", "r1", "r2", "r3"]
    with pytest.raises(KeyError):
        reward.reward_record(rollout(), [], 9999, "r9")


def test_r2_scalar_is_a_function_of_the_components_alone():
    c = reward_pb2.RewardComponents(
        persisted_fraction=0.8,
        dissatisfied=1.0,
        tool_call_validity=0.5,
        effort_penalty=0.1,
        latency_s=3.0,
    )
    assert reward.reward_r2(c) == pytest.approx(0.8 - 0.5 - 0.625 - 0.1 - 0.05)


def test_r2_dissatisfied_is_the_classifiers_highest_probability(monkeypatch):
    seen = []

    def scores(messages):
        seen.append(list(messages))
        return [0.3, 0.8]

    monkeypatch.setattr(reward, "dissatisfaction", scores)
    telemetry = [
        ev("f1", 1200, followup=telemetry_pb2.FollowUp(message="hm")),
        ev("f2", 1300, followup=telemetry_pb2.FollowUp(message="not quite")),
    ]
    out = reward.reward_record(rollout(), telemetry, 9999, "r2")
    assert seen == [["hm", "not quite"]]  # one batch per rollout
    assert out.components.dissatisfied == 0.8 and out.reward == pytest.approx(0.5 - 0.4)
    # r1 keeps its rules: the same follow-ups are not a complaint to it.
    assert reward.reward_record(rollout(), telemetry, 9999, "r1").components.dissatisfied == 0.0
