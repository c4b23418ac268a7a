"""Reward functions a1 and a1h: r3's outcome terms, a broken call as a negative example, a
square effort penalty over tokens, calls, turns and tool I/O; a1h discards a rollout with a
broken call, and the trainer drops it. A configured curve settles as a version of its own.
a2 and a2h: the same, with a complaint weighed as a whole kept edit."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from rtrl.reward_stream import monitors, reward
from rtrl.reward_stream.config import RewardStreamSettings
from rtrl.reward_stream.effort import A1_EFFORT, EffortCurve
from rtrl.trainer.batch import Drop, to_sample
from rtrl.trajectory import Link, LinkReason, Segment, ToolCall, Trajectory
from rtrl.trajectory_summary import Summary
from rtrl.v1 import common_pb2, rollout_pb2
from rtrl_client.v1 import telemetry_pb2

ANSWER = "def f():\n    return 1\n"
pytestmark = pytest.mark.usefixtures("rule_dissatisfaction")


def agent_rollout(calls: list[list[str]], valid: bool = True, answer_tokens: int = 40):
    """A trajectory of ``calls`` turn by turn (each call 5 tokens, each answer 8), then the
    answer; with ``valid`` false its last call is broken."""
    segments, tool_calls = [], []
    for turn, names in enumerate(calls):
        n = 5 * len(names)
        segments.append(Segment.generated((7,) * n, (-0.1,) * n, (0,) * n))
        segments.append(Segment.observed((9,) * 8 * len(names), source="tool"))
        tool_calls += [
            ToolCall(n, "{}", True, id=f"c{turn}{i}", turn=turn) for i, n in enumerate(names)
        ]
    if not valid:
        tool_calls[-1] = ToolCall("raed", "{}", False, "no tool", id="cx", turn=len(calls) - 1)
    n = answer_tokens
    segments.append(Segment.generated((8,) * n, (-0.1,) * n, (0,) * n))
    record = rollout_pb2.RolloutRecord(
        event_id="ro", rollout_id="r1", client_ts_ms=1000, arm=common_pb2.ARM_TREATMENT
    )
    record.sampling.temperature = 1.0
    Trajectory(
        prompt_ids=(1, 2, 3),
        segments=tuple(segments),
        final_text=ANSWER,
        tool_calls=tuple(tool_calls),
        prompt_text="@p4 say hi\n",
        finish_reason="stop",
        link=Link("t1", 0, True, LinkReason.FIRST),
    ).write(record)
    return record


def kept() -> list[telemetry_pb2.TelemetryEvent]:
    snapshot = telemetry_pb2.PersistenceSnapshot(seconds_after_edit=1, region_text=ANSWER)
    return [
        telemetry_pb2.TelemetryEvent(
            event_id="s", rollout_id="r1", edit_shown=telemetry_pb2.EditShown(edit_text=ANSWER)
        ),
        telemetry_pb2.TelemetryEvent(event_id="p", rollout_id="r1", persistence=snapshot),
    ]


def test_the_effort_curve_leaves_a_direct_answer_almost_free_and_caps_a_wasteful_one():
    direct = Summary.of(agent_rollout([]))
    parallel = Summary.of(agent_rollout([["cfg", "read"]]))
    serial = Summary.of(agent_rollout([["cfg"], ["read"], ["grep"], ["lint"], ["lint"]]))
    # units: tokens / 64 + calls / 2 + turns / 2 + observed / 32
    assert A1_EFFORT.units(direct) == pytest.approx(40 / 64 + 0.5)
    assert A1_EFFORT.units(parallel) == pytest.approx(50 / 64 + 1 + 1 + 16 / 32)
    assert A1_EFFORT.penalty(direct) == pytest.approx(0.01 * (40 / 64 + 0.5) ** 2)
    assert A1_EFFORT.penalty(serial) == 0.5  # 13.9 units: capped
    assert A1_EFFORT.penalty(direct) < A1_EFFORT.penalty(parallel) < A1_EFFORT.penalty(serial)


def test_a1_scores_r3s_outcome_less_broken_calls_and_effort():
    honest = agent_rollout([["cfg", "read"]])
    parts = reward.FUNCTIONS["a1"].components(honest, kept())
    effort = A1_EFFORT.penalty(Summary.of(honest))
    assert parts.effort_penalty == pytest.approx(effort)
    assert reward.reward_a1(parts) == pytest.approx(1.0 - effort)
    broken = agent_rollout([["cfg", "read"]], valid=False)
    parts = reward.FUNCTIONS["a1"].components(broken, kept())
    assert parts.tool_call_validity == 0.5
    assert reward.reward_a1(parts) == pytest.approx(1.0 - 0.625 - parts.effort_penalty)
    # r3's rule: without an edit nothing persisted (a question, or a misspelt call as text)
    question = rollout_pb2.RolloutRecord(
        rollout_id="r1", completion_text="which indent does p4 use?", completion_token_ids=[5] * 9
    )
    assert reward.FUNCTIONS["a1"].components(question, []).persisted_fraction == 0.0


def test_a1h_discards_a_rollout_with_a_broken_call_and_the_trainer_drops_it():
    broken = agent_rollout([["cfg"]], valid=False)
    honest = agent_rollout([["cfg"]])
    for version, rollout, discarded in (
        ("a1", broken, False),
        ("a1h", broken, True),
        ("a1h", honest, False),
    ):
        record = reward.reward_record(rollout, kept(), 2000, version)
        assert record.discarded is discarded, version
        sample = to_sample(record, max_positions=4096, vocab_size=100)
        assert (sample is Drop.DISCARDED) is discarded
    a1, a1h = (reward.reward_record(broken, kept(), 2000, v) for v in ("a1", "a1h"))
    assert a1.reward == a1h.reward and a1.reward_id != a1h.reward_id


WRONG_GUESS = "def f():\n  return 1\n"
"""ANSWER in another indent: the user rewrites its second line."""


def guessed(region: str, followup: str | None) -> list[telemetry_pb2.TelemetryEvent]:
    shown = telemetry_pb2.EditShown(edit_text=WRONG_GUESS)
    snapshot = telemetry_pb2.PersistenceSnapshot(seconds_after_edit=1, region_text=region)
    events = [
        telemetry_pb2.TelemetryEvent(event_id="s", rollout_id="r1", edit_shown=shown),
        telemetry_pb2.TelemetryEvent(event_id="p", rollout_id="r1", persistence=snapshot),
    ]
    if followup is not None:
        events.append(
            telemetry_pb2.TelemetryEvent(
                event_id="f", rollout_id="r1", followup=telemetry_pb2.FollowUp(message=followup)
            )
        )
    return events


def test_a2_prices_a_complaint_so_that_guessing_where_an_edit_is_a_guess_loses_to_asking():
    """p4 without a written style: a quarter of the guesses are right and kept, the rest keep
    half their lines and draw a complaint. a1 pays the guess over the question, a2 the
    question over the guess; everything else a2 scores as a1 does."""
    guess = agent_rollout([])
    guess.completion_text = WRONG_GUESS
    question = rollout_pb2.RolloutRecord(
        rollout_id="r1", completion_text="which indent does p4 use?", completion_token_ids=[5] * 9
    )
    wrong = guessed(ANSWER, "no, use 4-space indent like the rest of the file")
    right = guessed(WRONG_GUESS, None)

    def score(version, rollout, events) -> float:
        function = reward.FUNCTIONS[version]
        return function.scalar(function.components(rollout, events))

    for version, guessing_wins in (("a1", True), ("a2", False), ("a2h", False)):
        parts = reward.FUNCTIONS[version].components(guess, wrong)
        assert (parts.persisted_fraction, parts.dissatisfied) == (0.5, 1.0)
        expected_guess = 0.25 * score(version, guess, right) + 0.75 * score(version, guess, wrong)
        assert (expected_guess > score(version, question, [])) is guessing_wins, version
    parts = reward.FUNCTIONS["a2"].components(guess, wrong)
    assert reward.reward_a2(parts) == pytest.approx(reward.reward_a1(parts) - 0.5)
    kept_parts = reward.FUNCTIONS["a2"].components(agent_rollout([["cfg"]]), kept())
    assert reward.reward_a2(kept_parts) == reward.reward_a1(kept_parts)
    broken = reward.reward_record(agent_rollout([["cfg"]], valid=False), kept(), 2000, "a2h")
    assert broken.discarded and broken.reward_fn_version == "a2h"


def test_a_configured_curve_settles_as_a_version_of_its_own(monkeypatch):
    monkeypatch.setenv("RTRL_REWARD_REWARD_FN_VERSION", "a1")
    monkeypatch.setenv("RTRL_REWARD_EFFORT_CURVE", '{"weight": 0.05, "turns": 1}')
    settings = RewardStreamSettings(_env_file=None)
    curve = EffortCurve(weight=0.05, turns=1)
    assert settings.effort_curve == curve
    version = settings.settled_version()
    assert version == f"a1@{curve.digest()}" != "a1"
    rollout = agent_rollout([["cfg"], ["read"]])
    record = reward.reward_record(rollout, kept(), 2000, version)
    assert record.components.effort_penalty == pytest.approx(curve.penalty(Summary.of(rollout)))
    assert record.reward_fn_version == version
    monkeypatch.setenv("RTRL_REWARD_REWARD_FN_VERSION", "a2h")
    a2h = RewardStreamSettings(_env_file=None).settled_version()
    assert a2h == f"a2h@{curve.digest()}"
    assert reward.function_of(a2h).scalar is reward.reward_a2
    monkeypatch.setenv("RTRL_REWARD_REWARD_FN_VERSION", "r3")
    with pytest.raises(ValueError, match=r"effort_curve shapes the agentic rewards \(a1, a1h, a2"):
        RewardStreamSettings(_env_file=None)
    monkeypatch.setenv("RTRL_REWARD_REWARD_FN_VERSION", "a1")
    monkeypatch.setenv("RTRL_REWARD_EFFORT_CURVE", '{"weight": -1}')
    with pytest.raises(ValueError, match="weight"):
        RewardStreamSettings(_env_file=None)


def test_the_joiners_behaviour_counts_of_a_trajectory():
    """What rtrl.reward.behaviour adds per settled rollout (reward_stream/monitors.py)."""
    rollout = agent_rollout([["cfg", "read"], ["lint"]], valid=False)
    record = reward.reward_record(rollout, kept(), 2000, "a1")
    assert monitors.agent_counts(record, rollout) == {
        "trajectories": 1,
        "turns": 3,
        "tool_calls": 3,
        "broken_calls": 1,
        "parallel_turns": 1,
        "clarifying_questions": 0,
        "edits": 1,
        "truncations": 0,
    }


HOSTILE_CURVES = [
    # (the curve as RTRL_REWARD_EFFORT_CURVE, the field the refusal names)
    ('{"exponent": 1e308}', "exponent"),
    ('{"exponent": 5}', "exponent"),
    ('{"exponent": Infinity}', "exponent"),
    ('{"exponent": NaN}', "exponent"),
    ('{"weight": 1e308}', "weight"),
    ('{"weight": NaN}', "weight"),
    ('{"cap": Infinity}', "cap"),
    ('{"cap": 1e308}', "cap"),
    ('{"tokens": 1e-308}', "tokens"),
    ('{"calls": Infinity}', "calls"),
    ('{"io": NaN}', "io"),
]


@pytest.mark.guarantee(7)
@pytest.mark.parametrize("curve, field", HOSTILE_CURVES, ids=[c for c, _ in HOSTILE_CURVES])
def test_a_curve_that_could_crash_or_blow_up_the_joiner_is_refused_at_start(
    monkeypatch, curve, field
):
    """L6: an effort curve with exponent 1e308 was accepted, then crash-looped the joiner
    (OverflowError on the first long trajectory): every field is finite and bounded at start,
    and the refusal names it."""
    monkeypatch.setenv("RTRL_REWARD_REWARD_FN_VERSION", "a1")
    monkeypatch.setenv("RTRL_REWARD_EFFORT_CURVE", curve)
    with pytest.raises(ValueError, match=rf"effort_curve\.{field}"):
        RewardStreamSettings(_env_file=None)


@pytest.mark.guarantee(7)
def test_the_steepest_curve_allowed_gives_a_finite_penalty_for_any_trajectory():
    """L6: at every bound at once, the largest summary a record can carry costs at most the
    cap, never an overflow or a NaN."""
    bounds = {name: field for name, field in EffortCurve.model_fields.items()}
    steepest = EffortCurve(
        tokens=_bound(bounds["tokens"], "ge"),
        calls=_bound(bounds["calls"], "ge"),
        turns=_bound(bounds["turns"], "ge"),
        io=_bound(bounds["io"], "ge"),
        weight=_bound(bounds["weight"], "le"),
        exponent=_bound(bounds["exponent"], "le"),
        cap=_bound(bounds["cap"], "le"),
    )
    most = 2**64 - 1
    huge = replace(
        Summary.of(agent_rollout([["cfg"]])),
        generated_tokens=most,
        observed_tokens=most,
        turns=most,
    )
    huge = replace(huge, tool_calls=huge.tool_calls * 1000)
    assert steepest.penalty(huge) == steepest.cap
    assert math.isfinite(steepest.penalty(huge))


def _bound(field, which: str) -> float:
    return next(getattr(m, which) for m in field.metadata if hasattr(m, which))
