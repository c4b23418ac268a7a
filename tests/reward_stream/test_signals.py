"""Reward signals and the r1 reward: persistence, dissatisfaction, components, ids."""

from __future__ import annotations

import pytest

from rtrl.reward_stream import reward, reward_wire
from rtrl.reward_stream.signals import has_code, is_dissatisfied, persisted_fraction
from rtrl.simulator.tasks import Style, Task
from rtrl.simulator.users import ANNOYED, ANSWERS, CONTENT
from rtrl.v1 import rollout_pb2
from rtrl_client.v1 import telemetry_pb2

TASK = Task(project=0, verb="say", word="hi")
AGENT = TASK.render(Style(2, "'"))  # def say_hi():\n  print('hi')\n

PERSISTENCE_CASES = {
    # Untouched edit: every line kept.
    "kept": (AGENT, AGENT, 1.0),
    # The user re-indented the body (house style is 4): the def line survives.
    "indent_rewritten": (AGENT, TASK.render(Style(4, "'")), 0.5),
    # Quote style changed: exact matching sees the body line as rewritten.
    "quote_rewritten": (AGENT, TASK.render(Style(2, '"')), 0.5),
    # Code the user added around the edit does not dilute it.
    "surrounded_by_user_code": (
        AGENT,
        "import log\n\n" + AGENT + "\n\ndef other():\n  pass\n",
        1.0,
    ),
    # Blank lines are ignored on both sides.
    "blank_lines_ignored": ("\n" + AGENT + "\n\n", AGENT.replace("\n", "\n\n"), 1.0),
    # The region was deleted.
    "deleted": (AGENT, "", 0.0),
    # An empty edit persisted nothing.
    "empty_agent_text": ("\n  \n", AGENT, 0.0),
    # Three of four lines kept; the changed one in the middle.
    "partial": ("a\nb\nc\nd\n", "a\nB\nc\nd\n", 0.75),
}


@pytest.mark.parametrize(
    "agent, region, expected", PERSISTENCE_CASES.values(), ids=PERSISTENCE_CASES.keys()
)
def test_persisted_fraction(agent, region, expected):
    assert persisted_fraction(agent, region) == pytest.approx(expected)


DISSATISFIED = [
    "no, that broke the build",
    "No. Wrong indentation",
    "this is wrong",
    "it doesn't work",
    "revert that please",
    "undo",
    "that's not what i asked for",
    "Not what I meant",
    "use double quotes instead",
    "why did you delete my function?",
    "stop changing the indent",
    "ugh, still broken",
]
NEUTRAL = [
    "thanks",
    "now add tests",
    "great, now do the same for log_ok",
    "nice",
    "can you also know about the other file",
    "looks good, ship it",
    "",
]


@pytest.mark.parametrize("message", DISSATISFIED)
def test_dissatisfied_followups(message):
    assert is_dissatisfied(message)


@pytest.mark.parametrize("message", NEUTRAL)
def test_neutral_followups(message):
    assert not is_dissatisfied(message)


def test_classifier_agrees_with_the_simulated_users():
    annoyed = [
        t.format(indent=n, quote_name=q)
        for ts in ANNOYED.values()
        for t in ts
        for n in (2, 4)
        for q in ("single", "double")
    ]
    answers = [
        t.format(indent=n, quote_name=q)
        for t in ANSWERS
        for n in (2, 4)
        for q in ("single", "double")
    ]
    assert all(is_dissatisfied(m) for m in annoyed)
    assert not any(is_dissatisfied(m) for m in CONTENT)
    assert not any(is_dissatisfied(m) for m in answers)


CODE_CASES = {
    "two_space_helper": (AGENT, True),
    "four_space_body": ("def f():\n    return 1\n", True),
    "tab_body": ("def f():\n\treturn 1\n", True),
    "fenced": ("Like this:\n```\nx = 1\n```", True),
    "question": (TASK.question("indent"), False),
    "prose": ("I would rather not touch this file.\nShall I run the tests?", False),
    # A one-line statement has no indented line: not recognisably code.
    "one_liner": ("x = 1", False),
}


@pytest.mark.parametrize("text, expected", CODE_CASES.values(), ids=CODE_CASES.keys())
def test_has_code(text, expected):
    assert has_code(text) is expected


def test_reward_id_is_deterministic():
    a = reward_wire.reward_id("r1", ["e2", "e1", "e3"], "r3")
    assert a == reward_wire.reward_id("r1", ["e1", "e3", "e2"], "r3")
    assert a != reward_wire.reward_id("r1", ["e1", "e2"], "r3")
    assert a != reward_wire.reward_id("r2", ["e1", "e2", "e3"], "r3")
    assert a != reward_wire.reward_id("r1", ["e1", "e2", "e3"], version="r2")


def rollout(tool_calls=(), tokens=40) -> rollout_pb2.RolloutRecord:
    return rollout_pb2.RolloutRecord(
        event_id="ro",
        rollout_id="r1",
        client_ts_ms=1000,
        completion_text=AGENT,
        completion_token_ids=[5] * tokens,
        tool_calls=[rollout_pb2.ToolCall(name="t", valid=v) for v in tool_calls],
        latency_s=0.2,
    )


def ev(event_id: str, ts: int, **payload) -> telemetry_pb2.TelemetryEvent:
    return telemetry_pb2.TelemetryEvent(
        event_id=event_id, rollout_id="r1", client_ts_ms=ts, **payload
    )


REJECTED = telemetry_pb2.EditOutcome(outcome=telemetry_pb2.EditOutcome.OUTCOME_REJECTED)
REWARD_CASES = {
    # Nothing observed: neutral persistence, no dissatisfaction, defaulted.
    "defaults": (rollout(), [], (0.5, False, 0.0, False, 1.0), True),
    # Rejected with no snapshot: nothing can have persisted.
    "rejected_without_snapshot": (
        rollout(),
        [ev("o", 1100, edit_outcome=REJECTED)],
        (0.0, False, 0.0, False, 1.0),
        False,
    ),
    # The newest snapshot wins, measured against the shown edit text.
    "newest_snapshot": (
        rollout(),
        [
            ev("s", 1050, edit_shown=telemetry_pb2.EditShown(edit_text=AGENT)),
            ev("p2", 3000, persistence=telemetry_pb2.PersistenceSnapshot(region_text=AGENT)),
            ev("p1", 2000, persistence=telemetry_pb2.PersistenceSnapshot(region_text="")),
        ],
        (1.0, True, 0.0, False, 1.0),
        False,
    ),
    # Any annoyed follow-up counts; half the tool calls were invalid.
    "dissatisfied_and_bad_tools": (
        rollout(tool_calls=(True, False)),
        [
            ev("f1", 1200, followup=telemetry_pb2.FollowUp(message="thanks")),
            ev("f2", 1300, followup=telemetry_pb2.FollowUp(message="no, revert it")),
        ],
        (0.5, False, 1.0, True, 0.5),
        False,
    ),
}


@pytest.mark.parametrize(
    "record, telemetry, expected, defaulted", REWARD_CASES.values(), ids=REWARD_CASES.keys()
)
def test_reward_record(record, telemetry, expected, defaulted):
    out = reward.reward_record(record, telemetry, settled_ts_ms=9999, version="r1")
    c = out.components
    persisted, observed, dissatisfied, followup, validity = expected
    assert (c.persisted_fraction, c.persistence_observed, c.dissatisfied, c.followup_observed) == (
        persisted,
        observed,
        dissatisfied,
        followup,
    )
    assert c.tool_call_validity == validity
    assert c.effort_penalty == pytest.approx(0.02)  # 40 tokens x 0.0005
    assert out.reward == pytest.approx(persisted - 0.5 * dissatisfied - 0.5 * (1 - validity) - 0.02)
    assert out.defaulted == defaulted
    assert out.rollout == record and out.reward_fn_version == "r1" and out.settled_ts_ms == 9999
    assert list(out.event_ids) == sorted(["ro", *(e.event_id for e in telemetry)])
    assert out.last_event_ts_ms == max([1000, *(e.client_ts_ms for e in telemetry)])
    assert out.reward_id == reward_wire.reward_id("r1", list(reversed(out.event_ids)), "r1")


def test_effort_penalty_is_capped():
    assert reward.components(rollout(tokens=10_000), []).effort_penalty == reward.EFFORT_CAP
